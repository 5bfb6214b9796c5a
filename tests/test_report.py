"""HTML reports and comparisons: figures, decimation, crossover, comparability, bad input."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from plotly.offline import get_plotlyjs

from dynamics.analysis import figures
from dynamics.analysis.figures import decimate
from dynamics.analysis.measures import run_comparison as comparison
from dynamics.analysis.measures.run_comparison import config_differences, crossover
from dynamics.analysis.pages import page
from dynamics.analysis.pages import run_report as report
from dynamics.analysis.pages.run_comparison import write_comparison
from dynamics.analysis.pages.run_report import write_report
from dynamics.errors import DynamicsError
from dynamics.store import RunWriter, SeriesSpec, open_run

DYNAMICS = str(Path(sys.executable).with_name("dynamics"))
LAYERS = ("blocks.0", "blocks.1", "blocks.2")
ALL_GROUPS = (
    "loss",
    "validation",
    "hidden_norms",
    "activation_bias",
    "displacement",
    "hessian",
    "plane",
)


def descending(t, start=1.0, slope=5e-4):
    return start - slope * t


def write_run(
    path,
    *,
    steps=400,
    groups=ALL_GROUPS,
    train=None,
    heldout=None,
    eigen_scale=1.0,
    theta0="0" * 64,
    config=None,
    name=None,
):
    """A run file written through the real RunWriter, with series whose answers are known.

    Layer blocks.0 overshoots (rises to a peak at step 120 and settles lower); the other layers
    rise monotonically. Held-out loss is recorded every 50 steps, Hessian rows every 20.
    """
    t = np.arange(steps)
    train = train if train is not None else np.exp(-t / 80) + 0.1
    heldout = heldout if heldout is not None else (lambda s: np.exp(-s / 80) + 0.12)
    norms = np.stack(
        [10 + 2 * (1 - np.exp(-t / 30)) + 3 * np.exp(-(((t - 120) / 40) ** 2))]
        + [10 + k * (1 - np.exp(-t / 100)) for k in (1, 2)],
        axis=1,
    )
    rows = {
        "loss": (t, {"train": train}),
        "validation": (t[::50], {"val_loss": heldout(t[::50])}),
        "hidden_norms": (t, {"norm": norms}),
        "activation_bias": (t, {"mean": np.stack([0.4 - 0.1 * t / steps] * 3, axis=1)}),
        "displacement": (
            t,
            {"total": np.sqrt(t), "per_tensor": np.stack([t, t], 1) / 2, "update": 1 / (1 + t)},
        ),
        "hessian": (t[::20], {"eigenvalues": eigen_scale * np.outer(1 + t[::20] / 400, [9, 4, 1])}),
        "plane": (t, {"a": t / 400, "b": 0.1 * np.sin(t / 100), "r": 0.05 * t / 400}),
    }
    specs = {
        "loss": {"train": SeriesSpec()},
        "validation": {"val_loss": SeriesSpec()},
        "hidden_norms": {"norm": SeriesSpec((3,), columns=LAYERS)},
        "activation_bias": {"mean": SeriesSpec((3,), columns=tuple(f"{x}.act" for x in LAYERS))},
        "displacement": {
            "total": SeriesSpec(),
            "per_tensor": SeriesSpec((2,), columns=("w", "b")),
            "update": SeriesSpec(),
        },
        "hessian": {"eigenvalues": SeriesSpec((3,), columns=("lambda_1", "lambda_2", "lambda_3"))},
        "plane": {"a": SeriesSpec(), "b": SeriesSpec(), "r": SeriesSpec()},
        "snapshots": {"theta": SeriesSpec((4,))},
    }
    attrs = {
        "config": config or {"variant": "a", "optimizer": {"lr": 1e-3}, "data": {"seed": 2}},
        "theta0_sha256": theta0,
        "run_name": name or Path(path).stem,
    }
    writer = RunWriter.create(path, {g: specs[g] for g in groups}, {}, attrs, block_rows=4096)
    for group in groups:
        if group == "snapshots":
            continue
        steps_of, values = rows[group]
        for i, step in enumerate(steps_of):
            writer.append(group, int(step), {k: v[i] for k, v in values.items()})
    writer.close()
    return Path(path)


def test_decimate_keeps_every_bucket_extreme():
    rng = np.random.default_rng(0)
    values = np.cumsum(rng.normal(size=100_000))
    values[31_337] = values.max() + 50  # a one-record spike must survive
    values[77_000] = values.min() - 50
    steps = np.arange(100_000) * 3
    reduced = decimate(steps, values, budget=2000)
    assert reduced.decimated and len(reduced.step) <= 2000 and reduced.original == 100_000
    assert np.all(np.diff(reduced.step) > 0)
    assert 31_337 * 3 in reduced.step and 77_000 * 3 in reduced.step
    assert reduced.values.max() == values.max() and reduced.values.min() == values.min()
    # every bucket's own extremes are kept, so the envelope is exact at bucket resolution
    buckets = values[: len(values) // reduced.bucket * reduced.bucket].reshape(-1, reduced.bucket)
    kept = set(reduced.values.tolist())
    assert all(b.max() in kept and b.min() in kept for b in buckets)


def test_decimate_leaves_short_series_alone_and_keeps_nan_gaps():
    short = decimate(np.arange(10), np.arange(10.0), budget=20)
    assert not short.decimated and len(short.step) == 10
    values = np.arange(1000.0)
    values[400:600] = np.nan
    reduced = decimate(np.arange(1000), values, budget=100)
    assert np.isnan(reduced.values).any()  # the gap stays visible
    assert np.nanmax(reduced.values) == 999 and np.nanmin(reduced.values) == 0


def test_figures_say_when_they_are_decimated():
    t = np.arange(10_000)
    curves = [figures.Curve("a", t, t), figures.Curve("b", t, -t)]
    long = figures.line_figure(curves, title="x", y_title="y")
    assert "decimated for display" in long.layout.title.subtitle.text
    assert all(len(trace.x) <= figures.DISPLAY_BUDGET for trace in long.data)
    short = figures.line_figure([figures.Curve("a", t[:50], t[:50])], title="x", y_title="y")
    assert not short.layout.title.subtitle.text


def test_report_is_self_contained_with_one_copy_of_plotly(tmp_path):
    full = write_run(tmp_path / "full.h5")
    partial = write_run(tmp_path / "partial.h5", groups=("loss", "hidden_norms"))
    out = tmp_path / "report.html"
    written = write_report([full, partial], out)
    page = out.read_text()
    assert written.path == out and written.size_bytes == out.stat().st_size
    assert page.count(get_plotlyjs()) == 1
    rest = page.replace(get_plotlyjs(), "")
    assert not re.search(r"<script[^>]+src=", rest) and "https://" not in rest
    # full: loss, norms, bias, displacement, hessian, plane path, plane share; partial: 2
    assert written.figures == 9 and page.count("Plotly.newPlot(") == 9
    assert "Not recorded: validation, activation_bias, displacement, hessian, plane." in page
    assert page.count("<section id='run-") == 2
    verdicts = report.run_overshoot(open_run(full))
    assert [layer.overshoot for layer in verdicts.layers] == [True, False, False]
    assert "rises" in page and "fastest loss descent" in page
    assert "&quot;lr&quot;: 0.001" in page  # the config, escaped


def test_crossover_on_known_curves():
    t = np.arange(0, 1001, 100)  # 11 held-out evaluations: too few to smooth
    result = crossover(t, 1.0 - 5e-4 * t, t, 1.1 - 7e-4 * t, ("a", "b"), "held-out")
    assert result.first_leader == "a" and result.winner == "b"
    assert result.step == pytest.approx(500.0)
    assert result.final_gap == pytest.approx(0.1)
    assert result.final_gap_relative == pytest.approx(0.1 / 0.5)
    # noisy training losses: smoothing keeps the crossover near the true step
    rng = np.random.default_rng(1)
    dense = np.arange(2000)
    noisy = crossover(
        dense,
        1.0 - 2.5e-4 * dense + rng.normal(0, 0.01, dense.size),
        dense,
        1.1 - 3.5e-4 * dense + rng.normal(0, 0.01, dense.size),
    )
    assert noisy.winner == "b" and abs(noisy.step - 1000) < 40
    ahead = crossover(t, 1.0 - 5e-4 * t, t, 0.9 - 5e-4 * t, ("a", "b"))
    assert ahead.winner == ahead.first_leader == "b" and ahead.step is None
    assert crossover(t[:1], [1.0], t[:1], [2.0]) is None


def test_comparison_summary_crossover_ratio_and_no_warning(tmp_path):
    # b starts worse and overtakes a at step 500 on the held-out loss; its curvature is 10x lower.
    a = write_run(
        tmp_path / "a.h5", heldout=lambda s: 1.0 - 5e-4 * s, steps=1001, config={"variant": "a"}
    )
    b = write_run(
        tmp_path / "b.h5",
        heldout=lambda s: 1.1 - 7e-4 * s,
        eigen_scale=0.1,
        steps=1001,
        config={"variant": "b"},
    )
    written = write_comparison([a, b], tmp_path / "compare.html")
    page = written.path.read_text()
    row = re.search(r"<td>b vs a</td>(.*?)</tr>", page).group(1)
    cells = re.findall(r"<td>(.*?)</td>", row)
    assert cells[:5] == ["held-out loss (val_loss)", "a", "500", "b", "0.1 (20.0%)"]
    assert cells[5].startswith("0.1 (step 0)") and cells[6] == "0.1"
    assert "class='warning'" not in page
    assert page.count(get_plotlyjs()) == 1
    assert "b overtakes at 500" in page


def test_warning_rows_when_theta0_data_or_config_differ(tmp_path):
    base = {"variant": "a", "optimizer": {"lr": 1e-3}, "data": {"seed": 2}}
    a = write_run(tmp_path / "a.h5", config=base)
    other = {"variant": "b", "optimizer": {"lr": 3e-3}, "data": {"seed": 5}}
    b = write_run(tmp_path / "b.h5", config=other, theta0="1" * 64)
    page = write_comparison([a, b], tmp_path / "compare.html").path.read_text()
    warnings = re.findall(r"<tr class='warning'><td>(.*?)</td>", page)
    assert "⚠ θ0 differs: b vs a" in warnings
    assert "⚠ data differs: b vs a" in warnings
    assert "⚠ config differs: b vs a" in warnings
    assert "optimizer.lr: 0.003 vs 0.001" in page  # b vs a: b's value first
    assert (
        config_differences({"variant": "a", "m": {"shift": 0}}, {"variant": "b", "m": {"shift": 1}})
        == {}
    )
    assert config_differences({"x": 1}, {"x": 1, "y": {"z": 2}}) == {"y.z": (None, 2)}


def test_static_export_is_skipped_with_a_reason(tmp_path, monkeypatch):
    run = write_run(tmp_path / "run.h5", groups=("loss",))
    monkeypatch.setattr(page, "find_spec", lambda name: None)
    written = write_report([run], tmp_path / "r.html", static_dir=tmp_path / "png")
    assert written.static_skipped.startswith("static export skipped: kaleido is not installed")
    assert written.path.exists() and written.static_files == ()


def test_smoothing_keeps_monotone_series_monotone():
    x = np.cumsum(np.random.default_rng(2).random(500))
    assert np.all(np.diff(comparison.smooth(x)) >= 0)


TINY = {
    "steps": 40,
    "eval_every": 10,
    "model": {"width": 8, "expansion": 2, "depth": 2},
    "data": {"batch_size": 16, "heldout_size": 64},
    "record": {"snapshot_budget_mb": 1},
}


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    from dynamics.experiments.config_files import load_config
    from dynamics.experiments.runner import run_experiment

    folder = tmp_path_factory.mktemp("tiny")
    (folder / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    results = run_experiment(*load_config(folder / "tiny.yaml"), folder, progress=False)
    return [r.path for r in results]


def test_report_and_comparison_of_a_tiny_real_run(tiny_runs, tmp_path):
    written = write_report(tiny_runs, tmp_path / "report.html")
    page = written.path.read_text()
    assert "unshifted" in page and "shifted" in page and written.figures >= 8
    compared, verdicts, text = dynamics_all(
        ["compare", *tiny_runs, "-o", tmp_path / "compare.html"],
        ["overshoot", tiny_runs[0], "--json"],
        ["overshoot", tiny_runs[0]],
    )
    assert compared.returncode == 0, compared.stderr
    assert "wrote" in compared.stdout and (tmp_path / "compare.html").stat().st_size > 1e6
    # the designed pair differs in the shift alone, and the page says so without a warning
    page = (tmp_path / "compare.html").read_text()
    assert "differs only in the variant: init args (shift: &quot;expected&quot; vs" in page
    assert "class='warning'" not in page
    layers = json.loads(verdicts.stdout)["layers"]
    assert [layer["name"] for layer in layers] == ["student.blocks.0", "student.blocks.1"]
    assert text.returncode == 0 and "student.blocks.1" in text.stdout


def test_offline_commands_never_import_torch_or_lightning(tmp_path):
    run = write_run(tmp_path / "run.h5")
    commands = [
        ["report", str(run), "-o", str(tmp_path / "r.html")],
        ["compare", str(run), str(run), "-o", str(tmp_path / "c.html")],
        ["overshoot", str(run), "--json"],
    ]
    script = f"from dynamics.cli import main\nfor argv in {commands!r}:\n    assert main(argv) == 0"
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", script], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    heavy = re.findall(
        r"\|\s+(torch|pytorch_lightning|lightning|lightning_fabric)$", result.stderr, re.M
    )
    assert heavy == []
    assert re.search(r"\|\s+plotly$", result.stderr, re.M)  # the check does see imports


def dynamics_all(*commands):
    """Run ``dynamics`` commands concurrently (each pays the interpreter's start-up)."""
    processes = [
        subprocess.Popen(
            [DYNAMICS, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for args in commands
    ]
    results = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=120)
        results.append(
            subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
        )
    return results


@pytest.fixture(scope="module")
def bad_input_results(tmp_path_factory):
    """Every bad-input command, run at once."""
    folder = tmp_path_factory.mktemp("bad")
    run = write_run(folder / "run.h5")
    empty = write_run(folder / "empty.h5", groups=("snapshots",))
    no_norms = write_run(folder / "no_norms.h5", groups=("loss",))
    no_loss = write_run(folder / "no_loss.h5", groups=("hidden_norms",))
    (folder / "notes.txt").write_text("not a run file")
    (folder / "existing.html").write_text("keep me")
    unwritable = folder / "locked"
    unwritable.mkdir()
    unwritable.chmod(0o500)
    # root writes through permission bits; /proc refuses new files whoever asks
    locked = Path("/proc") if os.geteuid() == 0 else unwritable
    out = folder / "out.html"
    cases = {
        "not a run file": (["report", folder / "notes.txt", "-o", out], "not a readable run"),
        "no series to report": (["report", empty, "-o", out], "no series to report"),
        "no loss to compare": (["compare", run, no_loss, "-o", out], "no training or held-out"),
        "no norms for overshoot": (["overshoot", no_norms], "no hidden_norms series"),
        "missing folder": (["report", run, "-o", folder / "nope" / "r.html"], "does not exist"),
        "unwritable folder": (["report", run, "-o", locked / "r.html"], "cannot write"),
        "existing output": (["compare", run, run, "-o", folder / "existing.html"], "exists"),
        "output is an input": (["report", run, "-o", run, "--overwrite"], "one of the input files"),
        "one run to compare": (["compare", run, "-o", out], "required"),
    }
    before = {p: p.read_bytes() for p in (run, folder / "existing.html")}
    finished = dynamics_all(*(args for args, _ in cases.values()))
    results = {
        case: (result.returncode, result.stderr, expected)
        for (case, (_, expected)), result in zip(cases.items(), finished)
    }
    unwritable.chmod(0o700)
    after = {p: p.read_bytes() for p in before}
    return results, before, after, folder


@pytest.mark.parametrize(
    "case",
    [
        "not a run file",
        "no series to report",
        "no loss to compare",
        "no norms for overshoot",
        "missing folder",
        "unwritable folder",
        "existing output",
        "output is an input",
        "one run to compare",
    ],
)
def test_bad_input_exits_2_with_one_line_and_overwrites_nothing(bad_input_results, case):
    results, before, after, folder = bad_input_results
    code, stderr, expected = results[case]
    assert code == 2, stderr
    assert stderr.count("\n") == 1 and stderr.startswith("dynamics"), stderr
    assert expected in stderr and "Traceback" not in stderr
    assert after == before
    assert not (folder / "out.html").exists()
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no temporary left


def test_writing_a_report_is_atomic(tmp_path, monkeypatch):
    run = write_run(tmp_path / "run.h5", groups=("loss",))
    out = tmp_path / "r.html"
    out.write_text("old")

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report.os, "replace", broken)
    with pytest.raises(DynamicsError, match="No space left on device"):
        write_report([run], out, overwrite=True)
    assert out.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html", "run.h5"]
