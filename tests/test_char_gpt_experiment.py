"""The ``char_gpt`` experiment (the scale-up's language model in miniature) from the command line,
as a user runs it: shared θ0, Eq. 9 on the MLP activations, the residual stream per block, the
held-out bits per character, and the report of the result."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from dynamics.bias.activations import ShiftedActivation
from dynamics.callbacks import HiddenStateNorms
from dynamics.experiments.char_gpt import CharGPTModule, StdlibTextData
from dynamics.experiments.scaleup import RESIDUAL_STREAM
from dynamics.experiments.vit_digits import ViTDigitsModule
from dynamics.model.rebuild import rebuild_module
from dynamics.store import names, open_run
from tests.conftest import assert_one_line_error, run_dynamics

CONFIGS = Path(__file__).parents[1] / "configs"
TINY = {
    "eval_every": 2,
    "model": {"context": 16, "width": 16, "heads": 2},
    "data": {"batch_size": 4, "train_bytes": 50_000, "heldout_windows": 8},
    "record": {"every_n_steps": 1, "hessian_every_n_steps": 2, "snapshot_budget_mb": 1},
}


def run_tiny(config: str, overrides: dict, folder: Path, steps: int = 3) -> tuple:
    """The shipped ``configs/<config>.yaml`` with ``overrides`` merged in, run by the CLI for
    ``steps`` steps and reported; returns (CLI result, {variant: run file}, report page)."""
    data = yaml.safe_load((CONFIGS / f"{config}.yaml").read_text())
    for key, value in overrides.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) else value
    (folder / "tiny.yaml").write_text(yaml.safe_dump(data))
    out = folder / "runs"
    args = ("run", folder / "tiny.yaml", "--steps", steps, "--out", out, "--no-progress")
    result = run_dynamics(*args)
    assert result.returncode == 0, result.stderr
    runs = {variant: out / f"{variant}.h5" for variant in data["variants"]}
    report = run_dynamics("report", *runs.values(), "-o", folder / "report.html")
    assert report.returncode == 0, report.stderr
    return result, runs, folder / "report.html"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return run_tiny("char_gpt", TINY, tmp_path_factory.mktemp("char_gpt"))


def residual_stream_norms(module: torch.nn.Module, tokens: torch.Tensor) -> list[float]:
    """Mean L2 norm over features of each block's output, by direct evaluation."""
    outputs = []
    handles = [
        b.register_forward_hook(lambda m, a, o: outputs.append(o)) for b in module.model.blocks
    ]
    with torch.no_grad():
        module(tokens)
    for handle in handles:
        handle.remove()
    return [o.norm(dim=-1).mean().item() for o in outputs]


def mlp_activation_means(module: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Each block's MLP post-activation mean over the hidden features, per token, in float64."""
    means = []
    acts = [block.act for block in module.model.blocks]
    handles = [a.register_forward_hook(lambda m, a, o: means.append(o.mean(dim=-1))) for a in acts]
    with torch.no_grad():
        module.double()(tokens)
    for handle in handles:
        handle.remove()
    return torch.stack(means)


def test_both_variants_train_from_one_theta0_and_the_summary_says_so(tiny):
    result, runs, _ = tiny
    unshifted, adaptive = open_run(runs["unshifted"]), open_run(runs["adaptive"])
    assert unshifted.shares_theta0(adaptive)
    assert "all variants share θ0" in result.stdout
    assert adaptive.config["variants"] == {"unshifted": "none", "adaptive": "adaptive"}
    assert list(adaptive.series(names.LOSS).step) == [0, 1, 2]
    # The final held-out loss of the summary is the run's own last val_loss.
    heldout = adaptive.series(names.VALIDATION)
    row = next(line for line in result.stdout.splitlines() if line.startswith("adaptive "))
    assert f"{heldout[names.VAL_LOSS][-1]:.5g}" in row.split()


def test_heldout_bits_per_character_are_recorded_with_the_loss(tiny):
    _, runs, _ = tiny
    for path in runs.values():
        heldout = open_run(path).series(names.VALIDATION)
        assert list(heldout.step) == [2]
        bpc, loss = heldout["val_bpc"], heldout[names.VAL_LOSS]
        np.testing.assert_allclose(bpc, loss / math.log(2), rtol=1e-6)
        assert 0 < loss[-1] < math.log(256)


def test_the_adaptive_variant_is_the_same_model_with_eq9_on_every_mlp_activation(tiny):
    _, runs, _ = tiny
    tokens = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    unshifted, adaptive = (rebuild_module(open_run(runs[v])) for v in ("unshifted", "adaptive"))
    acts = [block.act for block in adaptive.model.blocks]
    assert all(isinstance(a, ShiftedActivation) and a.shift == "adaptive" for a in acts)
    assert not any(isinstance(m, ShiftedActivation) for m in unshifted.modules())
    # Exactly zero up to float64 rounding, where the unshifted GELU's mean is far from it.
    assert mlp_activation_means(adaptive, tokens).abs().max() < 1e-15
    assert mlp_activation_means(unshifted, tokens).abs().mean() > 1e-3


def test_residual_stream_norms_per_block_match_direct_evaluation(tiny):
    _, runs, _ = tiny
    run = open_run(runs["adaptive"])
    norms = run.series(names.HIDDEN_NORMS)
    assert norms.columns[names.HIDDEN_NORM] == ("model.blocks.0", "model.blocks.1")
    # Step 0 saw θ0 and the data stream's first batch.
    data = StdlibTextData(context=16, batch_size=4, train_bytes=50_000, heldout_windows=8)
    data.setup("fit")
    tokens, _ = next(iter(data.train_dataloader()))
    expected = residual_stream_norms(rebuild_module(run), tokens)
    np.testing.assert_allclose(norms[names.HIDDEN_NORM][0], expected, rtol=1e-5)
    # The recorded activation bias of the shifted MLP activations is zero; their φ's is not.
    bias = run.series(names.ACTIVATION_BIAS)
    columns = bias.columns[names.ACTIVATION_MEAN]
    means = dict(zip(columns, np.asarray(bias[names.ACTIVATION_MEAN]).T, strict=True))
    assert np.abs(means["model.blocks.0.act"]).max() < 1e-6
    assert np.abs(means["model.blocks.0.act.phi"]).min() > 1e-4


def test_top_hessian_eigenvalues_at_the_coarse_interval(tiny):
    _, runs, _ = tiny
    for path in runs.values():
        hessian = open_run(path).series(names.HESSIAN)
        assert list(hessian.step) == [0, 2]
        eigenvalues = np.asarray(hessian[names.HESSIAN_EIGENVALUES])
        assert eigenvalues.shape == (2, 3) and (np.diff(eigenvalues, axis=1) <= 0).all()


def test_the_report_shows_bits_per_character(tiny):
    _, _, report = tiny
    page = report.read_text()
    assert "Validation: val_bpc" in page and "hidden_norms" in page.lower().replace(" ", "_")


def test_module_applies_the_shift_by_surgery_keeping_theta0():
    plain, shifted = (
        CharGPTModule(context=8, width=16),
        CharGPTModule(context=8, width=16, shift="adaptive"),
    )
    for (name, a), b in zip(plain.state_dict().items(), shifted.state_dict().values(), strict=True):
        assert a.equal(b), name


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model": {"width": 10, "heads": 4}}, "model.heads (4) must divide model.width (10)"),
        ({"model": {"activation": "softmax"}}, "model.activation must be one of relu"),
        ({"data": {"train_bytes": 10}}, "data.train_bytes must exceed model.context + 1"),
        ({"variants": {"a": "sideways"}}, "variants.a: shift must be one of"),
    ],
)
def test_bad_config_values_are_one_line_errors(tmp_path, config, message):
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"experiment": "char_gpt", **config}))
    result = run_dynamics("run", tmp_path / "bad.yaml", "--out", tmp_path / "out")
    assert_one_line_error(result)
    assert message in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("module", [CharGPTModule(width=16), ViTDigitsModule(width=16, depth=2)])
def test_the_recorded_blocks_are_what_hidden_state_norms_picks_by_default(module):
    chosen = []
    for probe in (HiddenStateNorms(), HiddenStateNorms(modules=[RESIDUAL_STREAM])):
        probe.setup(None, module, None)
        chosen.append(probe.layers)
        probe.teardown()
    assert chosen[0] == chosen[1] == tuple(f"model.blocks.{i}" for i in range(2))
