"""Grouped compare over seeds: paired statistics from run files with known curves, through the
``dynamics`` command as a user runs it, and its refusals."""

from __future__ import annotations

import json
import shutil

import h5py
import numpy as np
import pytest
import yaml

from dynamics.analysis.measures.seed_groups import compare_groups, load_groups
from dynamics.analysis.output import PLANE_GRID_SCHEMA
from dynamics.store import RunWriter, SeriesSpec, open_run
from tests.conftest import TINY_EXPERIMENT

STEPS = np.arange(200)
EVAL = STEPS[::10]
SEEDS = (0, 1, 2)
#: Per seed: the shifted run's held-out loss offset and its λ1 ratio to the unshifted one.
OFFSET = {0: 0.0, 1: 0.01, 2: 0.02}
RATIO = {0: 0.1, 1: 0.2, 2: 0.4}
# Flat 1, rise to 2, flat top, fall to 1.5, flat plateau (see test_overshoot_magnitude).
HUMP = np.interp(STEPS, [0, 20, 60, 80, 120, 199], [1.0, 1.0, 2.0, 2.0, 1.5, 1.5])

SERIES = {
    "loss": {"train": SeriesSpec()},
    "validation": {"val_loss": SeriesSpec()},
    "hidden_norms": {"norm": SeriesSpec((2,), columns=("block0", "block1"))},
    "hessian": {"eigenvalues": SeriesSpec((2,))},
}


def heldout(variant: str, seed: int, t: np.ndarray) -> np.ndarray:
    """Unshifted: 1 throughout. Shifted: starts higher and falls through it at step
    100 + 1000 · offset, ending 0.09 − offset lower."""
    if variant == "unshifted":
        return np.ones(len(t))
    return 1.1 + OFFSET[seed] - 0.001 * t


def write_run(path, variant: str, seed: int) -> None:
    config = {
        "variant": variant,
        "seed": seed,
        "variants": {"unshifted": "none", "shifted": "expected"},
    }
    writer = RunWriter.create(path, SERIES, {}, {"config": config})
    scale = 1.0 if variant == "unshifted" else 0.5
    lam = 10.0 * (1.0 if variant == "unshifted" else RATIO[seed])
    for t in STEPS:
        writer.append("loss", int(t), {"train": float(heldout(variant, seed, np.array([t]))[0])})
        norm = 1 + scale * (HUMP[t] - 1)
        writer.append("hidden_norms", int(t), {"norm": np.array([norm, norm], dtype=np.float32)})
        if t % 10 == 0:
            writer.append(
                "validation", int(t), {"val_loss": float(heldout(variant, seed, np.array([t]))[0])}
            )
            writer.append("hessian", int(t), {"eigenvalues": np.array([lam, 1.0])})
    writer.close()


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    """``DIR/<variant>/seed<k>.h5`` for both variants and three seeds."""
    root = tmp_path_factory.mktemp("groups")
    for variant in ("shifted", "unshifted"):
        (root / variant).mkdir()
        for seed in SEEDS:
            write_run(root / variant / f"seed{seed}.h5", variant, seed)
    return root


def statistics(layout) -> dict[str, object]:
    groups = load_groups([("unshifted", layout / "unshifted"), ("shifted", layout / "shifted")])
    (comparison,) = compare_groups(groups)
    return {stat.measure: stat for stat in comparison.statistics}


def test_paired_statistics_match_the_scripted_runs(layout):
    stats = statistics(layout)
    final = stats["final held-out loss, shifted − unshifted"]
    assert final.values == pytest.approx([-0.09, -0.08, -0.07])
    assert final.centre == pytest.approx(-0.08)
    assert (final.low, final.high) == pytest.approx((-0.09, -0.07))
    assert final.p_value == pytest.approx(0.25) and final.agree == 3
    assert "range of 3 seeds" in final.method
    best = stats["best held-out loss, shifted − unshifted"]
    assert best.values == pytest.approx([-0.09, -0.08, -0.07])
    # Held-out records 10 steps apart: the title says the step is interpolated between them.
    crossover = stats[
        "step shifted overtakes unshifted (interpolated between loss records up to 10 steps apart)"
    ]
    assert crossover.values == pytest.approx([100, 110, 120])
    assert crossover.p_value is None
    ratio = stats["λ1 ratio, shifted / unshifted"]
    assert ratio.values == pytest.approx([0.1, 0.2, 0.4])
    assert ratio.centre == pytest.approx(0.2)
    plateau = stats["overshoot peak / plateau at block0, shifted − unshifted"]
    assert plateau.values == pytest.approx([1.5 / 1.25 - 2 / 1.5] * 3)
    start = stats["overshoot peak / start at block1, shifted − unshifted"]
    assert start.values == pytest.approx([-0.5] * 3)
    area = stats["overshoot isotonic residual area at block0, shifted − unshifted"]
    assert all(v < 0 for v in area.values) and area.agree == 3


def test_cli_directory_layout_prints_the_table_and_writes_the_page(layout, dynamics, tmp_path):
    out = tmp_path / "groups.html"
    result = dynamics("compare", layout, "-o", out)
    assert result.returncode == 0, result.stderr
    # The reference is the baseline (its variant's setting is none), not the first by name.
    assert result.stdout.splitlines()[0] == "unshifted: seeds 0, 1, 2"
    assert "final held-out loss, shifted − unshifted" in result.stdout
    assert "range of 3 seeds" in result.stdout
    page = out.read_text()
    assert "Paired statistics across seeds" in page
    assert "min–max over seeds" in page
    for row in result.stdout.splitlines():
        if row.startswith("shifted vs unshifted"):
            measure = row.split("  ")[1]
            assert measure in page  # the same table on the page


def test_cli_groups_and_json(layout, dynamics):
    result = dynamics(
        "compare",
        "--group",
        f"unshifted={layout / 'unshifted'}",
        "--group",
        f"shifted={layout / 'shifted' / 'seed*.h5'}",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["reference"] == "unshifted"
    assert sorted(data["groups"]["shifted"]) == ["0", "1", "2"]
    stats = {s["measure"]: s for s in data["comparisons"][0]["statistics"]}
    assert stats["final held-out loss, shifted − unshifted"]["centre"] == pytest.approx(-0.08)


def test_a_plane_grid_beside_a_groups_runs_is_not_taken_for_a_run(layout, dynamics, tmp_path):
    for variant in ("shifted", "unshifted"):
        shutil.copytree(layout / variant, tmp_path / variant)
        with h5py.File(tmp_path / variant / "plane.plane.h5", "w") as grid:
            grid.attrs["schema"] = PLANE_GRID_SCHEMA  # what `dynamics plane -o plane.html` writes
    groups = [f"unshifted={tmp_path / 'unshifted'}", f"shifted={tmp_path / 'shifted' / '*.h5'}"]
    result = dynamics("compare", "--group", groups[0], "--group", groups[1], "--json")
    assert result.returncode == 0, result.stderr
    assert sorted(json.loads(result.stdout)["groups"]["shifted"]) == ["0", "1", "2"]


def test_reference_option_swaps_the_sign(layout, dynamics):
    result = dynamics("compare", layout, "--reference", "shifted", "--json")
    assert result.returncode == 0, result.stderr
    stats = {s["measure"]: s for s in json.loads(result.stdout)["comparisons"][0]["statistics"]}
    assert stats["final held-out loss, unshifted − shifted"]["centre"] == pytest.approx(0.08)


def test_bad_groups_are_one_line_errors(layout, dynamics, one_line_error, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    unpaired = tmp_path / "unpaired"
    unpaired.mkdir()
    shutil.copy(layout / "shifted" / "seed0.h5", unpaired / "seed0.h5")
    shutil.copy(layout / "shifted" / "seed1.h5", unpaired / "seed5.h5")
    a, b = f"a={layout / 'unshifted'}", f"b={empty}"
    cases = {
        "no runs": (["--group", a, "--group", b, "--json"], "group b: no run files"),
        "unpaired": (
            ["--group", a, "--group", f"b={unpaired}", "--json"],
            "seed 2 (not in b), seed 5 (not in a)",
        ),
        "one group": (["--group", a, "--json"], "at least two groups"),
        "no name": (["--group", str(layout / "unshifted"), "--json"], "NAME="),
        "no output, empty group": (["--group", a, "--group", b], "group b: no run files"),
        "unknown reference": ([str(layout), "--reference", "nope", "--json"], "no such group"),
        "runs and groups": ([str(layout), "--group", a, "--json"], "not both"),
        "barrier options": (
            [str(layout), "--barrier-points", "5", "--model", "m:M", "--json"],
            "--barrier-points, --model: only with run files",
        ),
        "held-out barrier batch": (
            [str(layout), "--barrier-batch", "held.pt", "--json"],
            "--barrier-batch: only with run files",
        ),
    }
    for args, message in cases.values():
        result = dynamics("compare", *args)
        one_line_error(result)
        assert message in result.stderr, result.stderr


def test_grouped_compare_of_real_runs(dynamics, tmp_path):
    """``dynamics run`` for two seeds, files moved into ``<variant>/seed<k>.h5``, compared; the
    final-loss differences are the runs' own recorded final held-out losses."""
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({**TINY_EXPERIMENT, "steps": 20}))
    layout = tmp_path / "layout"
    for seed in (0, 1):
        out = tmp_path / f"out{seed}"
        result = dynamics("run", config, "--out", out, "--seed", seed, "--no-progress")
        assert result.returncode == 0, result.stderr
        for variant in ("unshifted", "shifted"):
            (layout / variant).mkdir(parents=True, exist_ok=True)
            (out / f"{variant}.h5").rename(layout / variant / f"seed{seed}.h5")
    result = dynamics("compare", layout, "--json", "-o", tmp_path / "real.html")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["reference"] == "unshifted"
    stats = {s["measure"]: s for s in data["comparisons"][0]["statistics"]}
    final = stats["final held-out loss, shifted − unshifted"]
    expected = [
        open_run(layout / "shifted" / f"seed{seed}.h5").heldout_loss().values[-1]
        - open_run(layout / "unshifted" / f"seed{seed}.h5").heldout_loss().values[-1]
        for seed in (0, 1)
    ]
    assert final["seeds"] == [0, 1]
    assert final["values"] == pytest.approx(expected)
    assert "range of 2 seeds" in final["method"]
    assert (tmp_path / "real.html").exists()
