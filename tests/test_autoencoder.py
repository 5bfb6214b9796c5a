"""The ``autoencoder`` experiment from the command line, as a user runs it, and its decoded-image
grids in the report and the comparison (drawn in a real browser where Chromium is installed)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from dynamics.analysis.measures.bias_audit import recorded_audit
from dynamics.bias.activations import ShiftedActivation
from dynamics.experiments.autoencoder.model import conv_autoencoder
from dynamics.experiments.autoencoder.module import AutoencoderModule
from dynamics.store import names, open_run
from tests.conftest import assert_one_line_error, run_dynamics

CONFIG = Path(__file__).parents[1] / "configs" / "autoencoder.yaml"
TINY = {
    "steps": 12,
    "eval_every": 6,
    "model": {"width": 4},
    "record": {
        "bias_every_n_steps": 3,
        "hessian_every_n_steps": 6,
        "image_rows": 4,
        "split_every_n_steps": 6,
    },
}


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    """The shipped config with tiny overrides, run, reported and compared by the CLI."""
    folder = tmp_path_factory.mktemp("autoencoder")
    config = yaml.safe_load(CONFIG.read_text())
    for key, value in TINY.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    (folder / "tiny.yaml").write_text(yaml.safe_dump(config))
    result = run_dynamics("run", folder / "tiny.yaml", "--out", folder / "runs", "--no-progress")
    assert result.returncode == 0, result.stderr
    runs = [folder / "runs" / "unshifted.h5", folder / "runs" / "shifted.h5"]
    for command, page in (("report", "report.html"), ("compare", "compare.html")):
        result = run_dynamics(command, *runs, "-o", folder / page)
        assert result.returncode == 0, result.stderr
    return folder, runs


def test_run_records_bias_component_with_images_and_the_usual_probes(pages):
    _, runs = pages
    unshifted, shifted = (open_run(path) for path in runs)
    assert unshifted.shares_theta0(shifted)
    for run in (unshifted, shifted):
        bias = run.series(names.BIAS_COMPONENT)
        assert list(bias.step) == [0, 3, 6, 9]
        assert bias.columns["bias_corr_target"] == ("encoder.3", "encoder.8", "decoder.4")
        images = run.series(names.BIAS_COMPONENT_IMAGES)
        assert images[names.BIAS_COMPONENT_DECODES].shape == (len(images), 3, 3, 4, 1, 8, 8)
        assert images.step[0] == 0 and images.step[-1] == 9
        for group in (names.LOSS, names.HIDDEN_NORMS, names.DISPLACEMENT, names.HESSIAN):
            assert run.recorded(group) is not None, group
        assert run.heldout_loss() is not None
        assert list(run.series(names.LOSS_CHANGE).step) == [0, 6]
        # The bias audit at θ0, against a direct count: 4 + 4 + 8 + 8 + 4 + 4 + 1 at width 4.
        audit = recorded_audit(run)
        assert (audit.bias_parameters, audit.total_parameters) == (33, run.layout.size)
    # One probe batch for both variants: the same target images.
    targets = [run.vector(names.BIAS_COMPONENT_TARGET) for run in (unshifted, shifted)]
    np.testing.assert_array_equal(*targets)
    # The variants differ in their shift only: same θ0, different step-0 decodes.
    steps0 = [run.series(names.BIAS_COMPONENT)["full_loss"][0] for run in (unshifted, shifted)]
    assert steps0[0] != steps0[1]


def test_shifted_variant_is_the_same_network_with_shifted_relus():
    plain, shifted = AutoencoderModule(width=4), AutoencoderModule(width=4, shift="expected")
    for (name, a), b in zip(plain.state_dict().items(), shifted.state_dict().values()):
        assert a.equal(b), name
    kinds = [type(m) for m in shifted.modules()]
    assert kinds.count(ShiftedActivation) == 6
    assert ShiftedActivation not in [type(m) for m in plain.modules()]
    assert len(conv_autoencoder(4)) == 2


def test_report_and_compare_draw_the_decoded_images(pages):
    folder, _ = pages
    report = (folder / "report.html").read_text()
    assert report.count("Decoded examples: full, bias-only and remainder-only") == 2
    compare = (folder / "compare.html").read_text()
    for layer in ("encoder.3", "encoder.8", "decoder.4"):
        assert f"Decoded examples at {layer}" in compare
    assert "Bias-only: corr. with target" in compare


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("model", {"init": "xavier"}, "model.init must be one of kaiming, pytorch"),
        ("record", {"layers": []}, "record.layers must be a list of module names"),
        ("data", {"heldout_size": 1790}, "must be at most the 1797 digits"),
    ],
)
def test_bad_config_values_are_one_line_errors(tmp_path, key, value, message):
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"experiment": "autoencoder", key: value}))
    result = run_dynamics("run", tmp_path / "bad.yaml", "--out", tmp_path / "out")
    assert_one_line_error(result)
    assert message in result.stderr
    assert not (tmp_path / "out").exists()


#: Per figure: its title and how many heatmaps it declares and drew as images with data.
HEATMAPS = """JSON.stringify([...document.querySelectorAll('.plotly-graph-div')]
  .filter(d => (d._fullData || []).some(t => t.type === 'heatmap'))
  .map(d => ({
    title: d.layout.title.text,
    heatmaps: d._fullData.filter(t => t.type === 'heatmap').length,
    drawn: [...d.querySelectorAll('.heatmaplayer image')]
      .filter(i => (i.getAttribute('href') || '').startsWith('data:image')).length,
  })))"""


@pytest.mark.parametrize(("page", "figures", "panels"), [("report", 2, 3), ("compare", 3, 2)])
def test_image_grids_render_in_a_browser(pages, page, figures, panels):
    browser = pytest.importorskip("tests.test_browser")
    if pytest.importorskip("tests.devtools").CHROMIUM is None:
        pytest.skip("no Chromium found (apt-get install chromium; CI installs it)")
    folder, _ = pages
    devtools = browser.DevTools(folder / f"profile-{page}")
    try:
        session = devtools.open((folder / f"{page}.html").resolve().as_uri())
        deadline = time.monotonic() + 30
        grids = json.loads(devtools.evaluate(HEATMAPS, session))
        while any(g["drawn"] < g["heatmaps"] for g in grids) and time.monotonic() < deadline:
            time.sleep(0.2)
            grids = json.loads(devtools.evaluate(HEATMAPS, session))
        errors = devtools.errors(session)
    finally:
        devtools.close()
    assert errors == []
    grids = [g for g in grids if g["title"].startswith("Decoded examples")]
    assert len(grids) == figures
    assert all(g["heatmaps"] == g["drawn"] == panels for g in grids), grids
