"""``--set KEY=VALUE`` on ``run`` and ``reproduce``, through the ``dynamics`` executable: the
overrides are checked as the file's keys, recorded in each run's config, shown by info/compare."""

from __future__ import annotations

import json

import pytest
import yaml

from dynamics.store import open_run
from tests.conftest import TINY_EXPERIMENT, assert_one_line_error, run_dynamics

SETS = ["--set", "optimizer.lr=1e-2", "--set", "model.activation=gelu"]


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A one-seed group of the tiny config, trained with --set and --steps."""
    folder = tmp_path_factory.mktemp("overrides")
    (folder / "tiny.yaml").write_text(yaml.safe_dump({**TINY_EXPERIMENT, "eval_every": 25}))
    out = folder / "runs"
    args = ["run", folder / "tiny.yaml", "--out", out, "--no-progress", "--steps", "20"]
    result = run_dynamics(*args, "--seeds", "0", *SETS, "--set", "eval_every=10")
    assert result.returncode == 0, result.stderr
    return out


def test_the_applied_overrides_are_the_runs_config(group):
    config = open_run(group / "shifted" / "seed0.h5").config
    assert config["optimizer"]["lr"] == 0.01 and config["model"]["activation"] == "gelu"
    assert (config["steps"], config["eval_every"]) == (20, 10)
    assert config["overrides"] == {
        "steps": 20,
        "optimizer.lr": 0.01,
        "model.activation": "gelu",
        "eval_every": 10,
    }
    summary = json.loads((group / "summary.json").read_text())
    assert summary["config"]["overrides"] == config["overrides"]


def test_info_and_compare_show_the_overrides(group, tmp_path):
    # the run file stores its config as JSON with sorted keys
    shown = "overrides: eval_every=10, model.activation=gelu, optimizer.lr=0.01, steps=20"
    info = run_dynamics("info", group / "shifted" / "seed0.h5")
    assert info.returncode == 0, info.stderr
    assert f"  {shown}\n" in info.stdout
    compare = run_dynamics(
        "compare",
        group / "unshifted" / "seed0.h5",
        group / "shifted" / "seed0.h5",
        "-o",
        tmp_path / "compare.html",
        "--barrier-points",
        "0",
    )
    assert compare.returncode == 0, compare.stderr
    assert f"seed0.h5: {shown}\n" in compare.stdout


BAD = [
    (["model.colour=red"], "unknown config key 'model.colour'"),
    (["optimizer.lr=fast"], "config key 'optimizer.lr' must be a number, got 'fast'"),
    (["optimizer.lr=1e-2", "optimizer.lr=1e-3"], "--set optimizer.lr is given twice"),
    (["overrides.steps=5"], "config key 'overrides' is what a run records"),
    (["optimizer.momentum=0.9"], "optimizer.momentum is SGD's"),
    (["optimizer.lr"], "--set must be KEY=VALUE"),
]
RUN = ["run", "teacher_student", "--steps", "20", "--set", "eval_every=10"]


def _sets(texts: list[str]) -> list[str]:
    return [arg for text in texts for arg in ("--set", text)]


@pytest.mark.parametrize(("sets", "message"), BAD[:2], ids=["key", "value"])
def test_a_bad_override_is_one_line_and_writes_nothing(tmp_path, sets, message):
    out = tmp_path / "runs"
    result = run_dynamics(*RUN, "--out", out, *_sets(sets))
    assert_one_line_error(result)
    assert message in result.stderr
    assert not out.exists()


def test_every_bad_override_is_one_line(tmp_path, capsys):
    # in this process: the executable's own answers are tested above, these are many
    from dynamics.cli import main

    for sets, message in BAD:
        capsys.readouterr()
        assert main([*RUN, "--out", str(tmp_path / "runs"), *_sets(sets)]) == 2, sets
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and message in error, (sets, error)
    # a key given by its own flag too, and a file that claims overrides it did not get
    assert main([*RUN, "--out", str(tmp_path / "runs"), "--lr", "0.1", "--set", "optimizer.lr=1"])
    assert "--set optimizer.lr is also given by its own flag" in capsys.readouterr().err
    (tmp_path / "lying.yaml").write_text("overrides: {optimizer.lr: 0.01}\n")
    assert main(["run", str(tmp_path / "lying.yaml"), "--out", str(tmp_path / "runs")]) == 2
    assert "config key 'overrides' is what a run records" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_fewer_steps_than_eval_every_suggests_set(tmp_path):
    result = run_dynamics("run", "teacher_student", "--out", tmp_path / "runs", "--steps", "30")
    assert_one_line_error(result)
    assert "--set eval_every=N" in result.stderr


def test_reproduce_applies_set_to_every_stage(tmp_path):
    out = tmp_path / "reproduce"
    args = ["reproduce", "--only", "teacher_student", "--steps", "20", "--seeds", "0"]
    result = run_dynamics(
        *args,
        "--out",
        out,
        "--no-progress",
        "--set",
        "model.width=8",
        "--set",
        "data.batch_size=16",
    )
    assert result.returncode == 0, result.stderr
    config = open_run(out / "teacher_student" / "shifted" / "seed0.h5").config
    assert config["model"]["width"] == 8
    assert config["overrides"]["model.width"] == 8 and config["overrides"]["data.batch_size"] == 16


def test_reproduce_names_the_stage_that_lacks_a_key(tmp_path):
    out = tmp_path / "reproduce"
    args = ["reproduce", "--steps", "20", "--seeds", "0", "--out", out]
    result = run_dynamics(*args, "--set", "model.expansion=2")
    assert_one_line_error(result)
    assert "--set on autoencoder: unknown config key 'model.expansion'" in result.stderr
    assert not out.exists()
