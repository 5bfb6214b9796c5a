"""``dynamics reproduce``: the paper's experiments over seeds, compared, and one report of its
claims whose verdicts follow the criteria written on the page."""

from __future__ import annotations

import html
import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml

from dynamics.experiments.paper.claims import (
    EARLY_FRACTION,
    MIN_SEEDS,
    NOT_MEASURED,
    NOT_REPRODUCED,
    NOT_RUN,
    ORTHOGONAL_COSINE,
    PARTLY,
    REPRODUCED,
    TRANSIENT_FALL,
    TRANSIENT_PEAK,
    VERDICT_RULE,
    Sample,
    verdict,
)
from tests.conftest import TINY_EXPERIMENT, run_dynamics
from tests.test_user_input import files_under, refused_in_process

SEEDS = (0, 1)
#: The autoencoder at a size a test trains in seconds, recording the bias decode every 2 steps.
TINY_AUTOENCODER = {
    "experiment": "autoencoder",
    "model": {"width": 4},
    "data": {"batch_size": 16, "heldout_size": 32},
    "record": {
        "every_n_steps": 2,
        "bias_every_n_steps": 2,
        "hessian_top_k": 0,
        "image_rows": 2,
        "snapshot_budget_mb": 1,
    },
}
ONLY = "teacher_student,autoencoder"
STEPS = 10


@pytest.fixture(scope="module")
def reproduced(tmp_path_factory):
    """A tiny reproduction (two experiments, two seeds, a few steps): folder, process."""
    folder = tmp_path_factory.mktemp("reproduce")
    configs = folder / "configs"
    configs.mkdir()
    (configs / "teacher_student.yaml").write_text(yaml.safe_dump(TINY_EXPERIMENT))
    (configs / "autoencoder.yaml").write_text(yaml.safe_dump(TINY_AUTOENCODER))
    result = run_dynamics(
        "reproduce",
        "--configs",
        configs,
        "--out",
        folder / "out",
        "--only",
        ONLY,
        "--steps",
        STEPS,
        "--seeds",
        "0-1",
        "--jobs",
        "1",
        "--no-progress",
    )
    assert result.returncode == 0, result.stderr
    return folder, result


def claims(folder: Path) -> dict[str, dict]:
    data = json.loads((folder / "out" / "reproduce.json").read_text())
    return {claim["key"]: claim for claim in data["claims"]}


def rule(holds: list[bool]) -> str:
    """The page's rule, written out again for every seed measured."""
    if all(holds):
        return REPRODUCED if len(holds) >= MIN_SEEDS else PARTLY
    return PARTLY if 2 * sum(holds) > len(holds) else NOT_REPRODUCED


def run_file(folder: Path, experiment: str, variant: str, seed: int) -> h5py.File:
    return h5py.File(folder / "out" / experiment / variant / f"seed{seed}.h5", "r")


def test_every_run_comparison_and_report_is_written(reproduced):
    folder, result = reproduced
    out = folder / "out"
    for experiment, variants in [
        ("teacher_student", ("unshifted", "shifted")),
        ("autoencoder", ("unshifted", "shifted")),
    ]:
        for variant in variants:
            assert sorted(p.name for p in (out / experiment / variant).iterdir()) == [
                "seed0.h5",
                "seed1.h5",
            ]
        assert (out / experiment / "compare.html").is_file()
        assert (out / experiment / "summary.json").is_file()
    page = (out / "reproduce.html").read_text()
    # The criteria come before any measured number.
    assert page.index(html.escape(VERDICT_RULE)) < page.index("Claims, measured")
    assert "href='teacher_student/compare.html'" in page
    assert "wall time" in page and "wall time" in result.stdout
    for key in claims(folder):
        assert key in result.stdout


def test_the_cosine_of_the_displacements_and_its_verdict(reproduced):
    folder, _ = reproduced
    cosines = []
    for seed in SEEDS:
        moves = []
        for variant in ("unshifted", "shifted"):
            with run_file(folder, "teacher_student", variant, seed) as file:
                moves.append(file["vectors/theta_final"][()] - file["vectors/theta0"][()])
        cosines.append(moves[0] @ moves[1] / np.linalg.norm(moves[0]) / np.linalg.norm(moves[1]))
    claim = claims(folder)["orthogonal"]
    np.testing.assert_allclose(claim["statistic"]["values"], cosines, rtol=1e-6)
    assert claim["statistic"]["seeds"] == list(SEEDS)
    holds = [abs(c) < ORTHOGONAL_COSINE for c in cosines]
    assert claim["seeds_meeting_criterion"] == sum(holds)
    assert claim["verdict"] == rule(holds)
    assert claim["statistic"]["low"] == pytest.approx(min(cosines))
    assert claim["statistic"]["high"] == pytest.approx(max(cosines))


def test_the_early_gap_and_its_verdict(reproduced):
    folder, _ = reproduced
    gaps = []
    for seed in SEEDS:
        losses = []
        for variant in ("unshifted", "shifted"):
            with run_file(folder, "teacher_student", variant, seed) as file:
                step, train = file["series/loss/step"][()], file["series/loss/train"][()]
            losses.append(train[step <= step[0] + EARLY_FRACTION * (step[-1] - step[0])])
        gaps.append(float(np.mean(losses[1] - losses[0])))
    claim = claims(folder)["early-lead"]
    np.testing.assert_allclose(claim["statistic"]["values"], gaps, rtol=1e-9)
    assert claim["verdict"] == rule([g > 0 for g in gaps])


def test_the_late_win_is_the_grouped_compares_final_gap(reproduced, tmp_path):
    folder, _ = reproduced
    compared = run_dynamics("compare", folder / "out" / "teacher_student", "--json")
    assert compared.returncode == 0, compared.stderr
    statistics = json.loads(compared.stdout)["comparisons"][0]["statistics"]
    final = next(s for s in statistics if s["measure"].startswith("final "))
    claim = claims(folder)["late-win"]
    assert claim["statistic"]["values"] == final["values"]
    assert claim["verdict"] == rule([v < 0 for v in final["values"]])


def test_claims_of_experiments_left_out_are_not_run(reproduced):
    folder, result = reproduced
    for key, claim in claims(folder).items():
        if claim["experiment"] in ("char_gpt", "vit_digits"):
            assert claim["verdict"] == NOT_RUN and claim["statistic"] is None, key
            assert claim["reason"] == "left out by --only"
        else:
            assert claim["verdict"] != NOT_RUN, key
    assert not (folder / "out" / "char_gpt").exists()
    experiments = json.loads((folder / "out" / "reproduce.json").read_text())["experiments"]
    left_out = {e["key"]: e for e in experiments if e["status"].startswith("not run")}
    assert sorted(left_out) == ["char_gpt", "vit_digits"]
    assert all(e["steps"] is None and e["comparison"] is None for e in left_out.values())
    line = next(x for x in result.stdout.splitlines() if x.startswith("gpt-bpc"))
    assert "not run (left out by --only)" in line


def test_the_report_renders_in_a_browser(reproduced):
    browser = pytest.importorskip("tests.test_browser")
    if pytest.importorskip("tests.devtools").CHROMIUM is None:
        pytest.skip("no Chromium found (apt-get install chromium; CI installs it)")
    folder, _ = reproduced
    devtools = browser.DevTools(folder / "profile")
    try:
        plots, errors, external = browser.rendered(devtools, folder / "out" / "reproduce.html")
    finally:
        devtools.close()
    assert errors == [] and external == []
    assert [p["id"] for p in plots] == ["figure-0", "figure-1"]  # the claims, the sensitivity
    for plot in plots:
        assert plot["svg"] and plot["traces"] > 0
        assert plot["drawn"] == plot["with_data"] == plot["traces"], plots


def test_the_verdict_rule():
    yes, no = Sample(1.0, True), Sample(-1.0, False)
    assert verdict({0: yes, 1: yes, 2: yes}) == (REPRODUCED, 3)
    assert verdict({0: yes, 1: yes}) == (PARTLY, 2)  # too few seeds to be sure
    assert verdict({0: yes, 1: yes, 2: no}) == (PARTLY, 2)
    assert verdict({0: yes, 1: no}) == (NOT_REPRODUCED, 1)
    assert verdict({0: yes, 1: yes, 2: "λ1 not recorded"}) == (PARTLY, 2)
    assert verdict({0: yes, 1: "no loss", 2: "no loss"}) == (NOT_REPRODUCED, 1)
    weak = Sample(0.5, False, weak=True)
    assert verdict({0: weak, 1: weak, 2: weak}) == (PARTLY, 0)
    assert verdict({0: "no loss"}) == (NOT_MEASURED, 0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--only", "nope"], "--only names no experiment 'nope'"),
        (["--only", ","], "--only needs at least one experiment name"),
        (["--steps", "0"], "--steps must be a number from 1"),
        (["--jobs", "0"], "--jobs must be from 1 to"),
        (["--seeds", "2-1"], "--seeds: the range 2-1 runs backwards"),
        ([], "reproduce.html exists; pass --overwrite"),
        (["--configs", "missing"], "no such file"),
    ],
)
def test_bad_input_gets_one_line_and_changes_nothing(reproduced, capsys, options, message):
    folder, _ = reproduced
    before = files_under(folder / "out")
    configs = folder / "configs"
    argv = ["reproduce", "--configs", configs, "--out", folder / "out", "--only", ONLY]
    argv += ["--steps", STEPS, "--seeds", "0-1", *options]
    refused_in_process(argv, capsys, message)
    assert files_under(folder / "out") == before


def test_an_existing_run_is_refused_before_anything_trains(tmp_path, capsys):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "teacher_student.yaml").write_text(yaml.safe_dump(TINY_EXPERIMENT))
    (tmp_path / "configs" / "autoencoder.yaml").write_text(yaml.safe_dump(TINY_AUTOENCODER))
    existing = tmp_path / "out" / "autoencoder" / "shifted" / "seed1.h5"
    existing.parent.mkdir(parents=True)
    existing.write_bytes(b"mine")
    argv = ["reproduce", "--configs", tmp_path / "configs", "--out", tmp_path / "out"]
    argv += ["--only", ONLY, "--steps", "2", "--seeds", "0-1"]
    refused_in_process(argv, capsys, "seed1.h5 exists; pass --overwrite")
    assert files_under(tmp_path / "out") == {"autoencoder/shifted/seed1.h5": b"mine"}


def test_the_transient_use_of_the_bias_component_and_its_verdict(reproduced):
    folder, _ = reproduced
    falls, holds = [], []
    for seed in SEEDS:
        with run_file(folder, "autoencoder", "unshifted", seed) as file:
            corr = file["series/bias_component/bias_corr_target"][()][:, 0]
        peak, final = corr.max(), corr[-1]
        falls.append(peak - final)
        holds.append(peak >= TRANSIENT_PEAK and final <= TRANSIENT_FALL * peak)
    claim = claims(folder)["transient-use"]
    np.testing.assert_allclose(claim["statistic"]["values"], falls, rtol=1e-6)
    assert claim["verdict"] == rule(holds)
    assert claim["details"]["0"].startswith("peak ")


def _config(folder: Path, setup: str, variant: str, seed: int) -> dict:
    with run_file(folder, f"sensitivity/{setup}", variant, seed) as file:
        return json.loads(file.attrs["config"])


def _sensitivity(folder: Path) -> dict[str, dict]:
    data = json.loads((folder / "out" / "reproduce.json").read_text())["sensitivity"]
    return {setup["key"]: setup for setup in data["setups"]}


def test_each_sensitivity_setup_trains_what_its_overrides_say(reproduced):
    folder, result = reproduced
    out = folder / "out"
    # The default setup is the controlled experiment's own runs: no second copy.
    setups = _sensitivity(folder)
    assert sorted(p.name for p in (out / "sensitivity").iterdir()) == [
        "adam-lr1e-2",
        "null-shift-0.01",
        "sgd-lr1e-1",
        "sgd-lr1e-2",
    ]
    sgd = _config(folder, "sgd-lr1e-1", "shifted", 1)["optimizer"]
    assert (sgd["name"], sgd["lr"]) == ("sgd", 0.1)
    assert _config(folder, "adam-lr1e-2", "unshifted", 0)["optimizer"]["lr"] == 0.01
    null = _config(folder, "null-shift-0.01", "shifted", 0)
    assert null["variants"] == {"unshifted": "none", "shifted": 0.01}
    assert (null["optimizer"]["name"], null["optimizer"]["lr"]) == ("adam", 0.001)
    assert setups["sgd-lr1e-1"]["trained"] == "sgd, lr 0.1"
    assert list(setups) == [
        "adam-default",
        "adam-lr1e-2",
        "sgd-lr1e-2",
        "sgd-lr1e-1",
        "null-shift-0.01",
    ]
    # The default setup's verdicts are the report's own, from the same groups.
    ours = {c["key"]: c["verdict"] for c in setups["adam-default"]["claims"]}
    assert ours == {k: c["verdict"] for k, c in claims(folder).items() if k in ours}
    page = (out / "reproduce.html").read_text()
    assert "id='sensitivity'" in page
    for setup in setups:
        link = "teacher_student" if setup == "adam-default" else f"sensitivity/{setup}"
        assert f"href='{link}/compare.html'" in page
        assert (out / link / "compare.html").is_file()
    assert "SGD, lr 1e-1: θt − θ0 of the two students:" in result.stdout


def test_the_three_orthogonality_readings_are_the_run_files_geometry(reproduced):
    """Every reading at θT against the files' vectors, the in-plane paths found by least
    squares on the two unit gradients (no orthonormal basis, no closed-form change of
    coordinates: not the code's route)."""
    folder, _ = reproduced
    readings = _sensitivity(folder)["sgd-lr1e-1"]["readings"]
    for seed in SEEDS:
        moves, units = [], []
        for variant in ("unshifted", "shifted"):
            with run_file(folder, "sensitivity/sgd-lr1e-1", variant, seed) as file:
                theta0 = file["vectors/theta0"][()].astype(np.float64)
                moves.append(file["vectors/theta_final"][()] - theta0)
                g0 = file["vectors/g0"][()].astype(np.float64)
                units.append(g0 / np.linalg.norm(g0))
        basis = np.stack(units, axis=1)
        oblique = [np.linalg.lstsq(basis, move, rcond=None)[0] for move in moves]
        in_plane = [basis @ coefficients for coefficients in oblique]

        def cos(x, y):
            return x @ y / np.linalg.norm(x) / np.linalg.norm(y)

        expected = {
            "displacement": cos(*moves),
            "path": cos(*in_plane),  # the plane's own (Euclidean) angle between the paths
            "oblique": cos(*oblique),
            "gradients": cos(*units),
        }
        for key, value in expected.items():
            got = readings[key]["cosine_per_seed"][str(seed)][-1]
            np.testing.assert_allclose(got, value, rtol=1e-4, atol=1e-6, err_msg=key)
    holding = sum(
        abs(readings["oblique"]["cosine_per_seed"][str(s)][-1]) < ORTHOGONAL_COSINE for s in SEEDS
    )
    assert readings["oblique"]["seeds_holding_at_end"] == holding


def test_no_sensitivity_leaves_the_setups_out(tmp_path):
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "teacher_student.yaml").write_text(yaml.safe_dump(TINY_EXPERIMENT))
    out = tmp_path / "out"
    result = run_dynamics(
        "reproduce",
        "--configs",
        configs,
        "--out",
        out,
        "--only",
        "teacher_student",
        "--steps",
        4,
        "--seeds",
        "0",
        "--jobs",
        "1",
        "--no-progress",
        "--no-sensitivity",
    )
    assert result.returncode == 0, result.stderr
    assert not (out / "sensitivity").exists()
    data = json.loads((out / "reproduce.json").read_text())["sensitivity"]
    assert data == {
        "setups": [],
        "statements": [],
        "not_measured": ["left out by --no-sensitivity"],
    }
