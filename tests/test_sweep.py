"""``dynamics sweep``: a config over a grid of overrides, every cell a group of seeds trained by
the seed runner, compared, and measured by the reproduction's claims; complete cells are reused,
a failed cell is one line, bad input is refused before anything is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from dynamics.cli import main
from dynamics.experiments import sweep as sweep_module
from dynamics.experiments.paper.claims import CLAIMS, NOT_RUN
from dynamics.experiments.sweep import Cell, grid_cells, run_cells
from dynamics.store import open_run
from tests.conftest import TINY_EXPERIMENT, assert_one_line_error, run_dynamics
from tests.test_seeds import recorded
from tests.test_user_input import files_under, refused_in_process

LRS = (0.001, 0.01)
CELLS = [f"optimizer.lr={lr}" for lr in LRS]
TEACHER_STUDENT = [c.key for c in CLAIMS if c.experiment == "teacher_student"]


def sweep_argv(folder: Path, *extra) -> list:
    return [
        "sweep",
        folder / "tiny.yaml",
        "--grid",
        "optimizer.lr=1e-3,1e-2",
        "--seeds",
        "0-1",
        "--steps",
        "20",
        "--jobs",
        "1",
        "--out",
        folder / "out",
        *extra,
    ]


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """A two-cell sweep (two learning rates, two seeds, 20 steps): folder, process."""
    folder = tmp_path_factory.mktemp("sweep")
    (folder / "tiny.yaml").write_text(yaml.safe_dump(TINY_EXPERIMENT))
    result = run_dynamics(*sweep_argv(folder))
    assert result.returncode == 0, result.stderr
    return folder, result


def sweep_json(folder: Path) -> dict:
    return json.loads((folder / "out" / "sweep.json").read_text())


def test_cells_are_named_by_their_overrides_in_grid_order():
    cells = grid_cells({"optimizer.lr": [1e-3, 1e-2], "optimizer.name": ["adam", "sgd"]})
    assert [c.name for c in cells] == [
        "optimizer.lr=0.001,optimizer.name=adam",
        "optimizer.lr=0.001,optimizer.name=sgd",
        "optimizer.lr=0.01,optimizer.name=adam",
        "optimizer.lr=0.01,optimizer.name=sgd",
    ]
    assert cells[3].overrides == {"optimizer.lr": 0.01, "optimizer.name": "sgd"}
    assert Cell({"optimizer.betas": [0.9, 0.99]}).name == "optimizer.betas=_0.9,_0.99_"
    assert Cell({"x": 1}, name="mine").name == "mine"


def test_every_cell_is_a_group_with_its_comparison(swept):
    folder, result = swept
    out = folder / "out"
    assert sorted(p.name for p in (out / "cells").iterdir()) == CELLS
    for cell, lr in zip(CELLS, LRS):
        for variant in ("unshifted", "shifted"):
            files = sorted(p.name for p in (out / "cells" / cell / variant).iterdir())
            assert files == ["seed0.h5", "seed1.h5"]
            run = open_run(out / "cells" / cell / variant / "seed1.h5")
            assert run.config["optimizer"]["lr"] == lr and run.config["steps"] == 20
        assert (out / "cells" / cell / "compare.html").is_file()
        assert (out / "cells" / cell / "summary.json").is_file()
    assert f"wrote {out / 'sweep.html'}" in result.stdout
    for key in TEACHER_STUDENT:
        assert f"\n{key}: " in "\n" + result.stdout
    table = result.stdout.split("late-win: ")[1].split("\n\n")[0].splitlines()
    assert table[1].split()[:3] == ["cell", "status", "centre"]
    assert [line.split()[0] for line in table[2:]] == CELLS


def test_the_summary_holds_each_cells_claims_and_paired_statistics(swept):
    folder, _ = swept
    data = sweep_json(folder)
    assert data["schema"] == "dynamics-sweep"
    assert data["grid"] == {"optimizer.lr": list(LRS)}
    assert data["seeds"] == [0, 1] and data["base_overrides"] == {"steps": 20}
    assert data["command"].startswith("dynamics sweep ") and data["wall_s"] > 0
    assert [c["key"] for c in data["claims"]] == TEACHER_STUDENT
    assert data["failed"] == []
    for cell, name in zip(data["cells"], CELLS):
        assert cell["name"] == name and cell["status"] in ("trained", "reused")
        assert cell["comparison"] == f"cells/{name}/compare.html"
        claims = {c["key"]: c for c in cell["claims"]}
        assert list(claims) == TEACHER_STUDENT
        assert all(c["verdict"] != NOT_RUN for c in claims.values())
        # The late-win figure is the grouped compare's final held-out gap, seed by seed.
        paired = cell["paired_statistics"]
        assert (paired["reference"], paired["other"]) == ("unshifted", "shifted")
        final = next(s for s in paired["statistics"] if s["measure"].startswith("final "))
        assert claims["late-win"]["statistic"]["values"] == final["values"]
        assert claims["late-win"]["statistic"]["seeds"] == [0, 1]
        summary = json.loads((folder / "out" / cell["folder"] / "summary.json").read_text())
        assert cell["figures"]["shifted"] == summary["variants"]["shifted"]["figures"]


def test_the_page_links_every_cell_and_shows_each_claim(swept):
    folder, _ = swept
    page = (folder / "out" / "sweep.html").read_text()
    for name in CELLS:
        assert f"<a href='cells/{name}/compare.html'>" in page
    for key in TEACHER_STUDENT:
        assert f"id='{key}'" in page
    assert page.count("class='figure'") == len(TEACHER_STUDENT)  # a bar chart per claim


def test_a_changed_cell_is_refused_not_overwritten(swept, capsys):
    folder, _ = swept
    before = files_under(folder / "out")
    argv = sweep_argv(folder)
    argv[argv.index("--steps") + 1] = "30"  # another config: the cells are no longer complete
    refused_in_process(
        argv, capsys, "seed0.h5 finished with another config (steps: 20 there, 30 now)"
    )
    assert files_under(folder / "out") == before


def test_a_rerun_trains_nothing(swept):
    folder, _ = swept
    out = folder / "out"
    kept = [*out.glob("cells/*/*/*.h5"), *out.glob("cells/*/*.json"), *out.glob("cells/*/*.html")]
    assert len(kept) == 2 * 4 + 2 + 2
    before = {p: p.stat().st_mtime_ns for p in kept}
    result = run_dynamics(*sweep_argv(folder))
    assert result.returncode == 0, result.stderr
    assert {p: p.stat().st_mtime_ns for p in kept} == before
    assert "seed 0" not in result.stderr  # the seed runner's line per trained run
    assert [c["status"] for c in sweep_json(folder)["cells"]] == ["reused", "reused"]
    assert result.stderr.count(": reused, ") == 2


def test_a_crashed_cell_is_one_line_and_the_others_finish(tmp_path, monkeypatch, capsys):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY_EXPERIMENT))
    train = sweep_module._run_group

    def crash_at_high_lr(experiment, config, *args):
        if config.optimizer.lr > 0.005:
            raise RuntimeError("CUDA error: out of memory\n  (a second line)")
        return train(experiment, config, *args)

    monkeypatch.setattr(sweep_module, "_run_group", crash_at_high_lr)
    argv = sweep_argv(tmp_path)
    argv[argv.index("0-1")] = "0"
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.splitlines()
    failed = [line for line in err if "failed" in line]
    assert failed == [
        "dynamics: cell optimizer.lr=0.01 failed: RuntimeError: CUDA error: out of memory",
        "dynamics: error: 1 of 2 cells failed (one line each above); the other cells are complete",
    ]
    data = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert [c["status"] for c in data["cells"]] == ["trained", "failed"]
    assert data["failed"] == ["optimizer.lr=0.01"] and data["cells"][1]["claims"] == []
    assert (tmp_path / "out" / "cells" / CELLS[0] / "compare.html").is_file()
    assert (
        "RuntimeError: CUDA error: out of memory" in (tmp_path / "out" / "sweep.html").read_text()
    )


def test_explicit_cells_through_the_library(tmp_path):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY_EXPERIMENT))
    cells = [Cell({"optimizer.name": "sgd", "optimizer.lr": 0.05}, name="sgd")]
    with pytest.raises(Exception, match="steps is both a cell's key"):
        run_cells(tmp_path / "tiny.yaml", [Cell({"steps": 10})], tmp_path, seeds=[0],
                  base_overrides={"steps": 20})  # fmt: skip
    with pytest.raises(Exception, match="two cells are named 'sgd'"):
        run_cells(tmp_path / "tiny.yaml", cells * 2, tmp_path, seeds=[0])
    assert not (tmp_path / "cells").exists()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--grid", "optimizer.name=adam,nope"], "cell optimizer.lr=0.001,optimizer.name=nope: "),
        (["--grid", "optimizer.bogus=1"], "unknown config key 'optimizer.bogus'"),
        (["--grid", "optimizer.lr=1,2"], "--grid optimizer.lr is given twice"),
        (["--grid", "optimizer.name"], "--grid must be KEY=VALUE"),
        (["--grid", "optimizer.name=sgd,sgd"], "the value 'sgd' is given twice"),
        (["--set", "optimizer.lr=0.1"], "optimizer.lr is both in --grid and in --set"),
        (["--set", "eval_every=many"], "eval_every"),
        (["--set", "steps=5"], "steps is also given by its own flag"),
        (["--jobs", "0"], "--jobs must be from 1 to"),
        (["--seeds", "2-1"], "--seeds: the range 2-1 runs backwards"),
    ],
)
def test_bad_input_gets_one_line_and_writes_nothing(tmp_path, capsys, options, message):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY_EXPERIMENT))
    refused_in_process(sweep_argv(tmp_path, *options), capsys, message)
    assert not (tmp_path / "out").exists()


def test_a_bad_grid_value_through_the_executable(tmp_path):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY_EXPERIMENT))
    argv = sweep_argv(tmp_path)
    argv[argv.index("optimizer.lr=1e-3,1e-2")] = "optimizer.lr=1e-3,abc"
    result = run_dynamics(*argv)
    assert_one_line_error(result)
    assert "cell optimizer.lr=abc: config key 'optimizer.lr' must be a number, got 'abc'" in (
        result.stderr
    )
    assert not (tmp_path / "out").exists()


def test_a_foreign_file_in_place_of_the_summary_is_refused(tmp_path, capsys):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY_EXPERIMENT))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "sweep.json").write_text('{"mine": true}')
    refused_in_process(sweep_argv(tmp_path), capsys, "sweep.json exists; pass --overwrite")
    assert files_under(tmp_path / "out") == {"sweep.json": b'{"mine": true}'}


def test_an_extended_grid_trains_only_its_new_cells(swept):
    folder, _ = swept
    out = folder / "out"
    kept = list(out.glob("cells/*/*/*.h5"))
    before = {p: p.stat().st_mtime_ns for p in kept}
    argv = [str(a) for a in sweep_argv(folder)]
    argv[argv.index("optimizer.lr=1e-3,1e-2")] = "optimizer.lr=1e-3,1e-2,3e-2"
    result = run_dynamics(*argv, "--no-progress")
    assert result.returncode == 0, result.stderr
    assert {p: p.stat().st_mtime_ns for p in kept} == before
    data = sweep_json(folder)
    assert data["grid"] == {"optimizer.lr": [*LRS, 0.03]}
    assert [c["status"] for c in data["cells"]] == ["reused", "reused", "trained"]
    assert len(list((out / "cells" / "optimizer.lr=0.03").glob("*/seed*.h5"))) == 4


def test_a_cell_missing_a_run_trains_that_run_alone(swept, tmp_path):
    """A cell left incomplete (a run deleted, as by a job killed before it wrote) is not
    reused whole: the seed runner reads back its finished runs and trains the missing one."""
    folder = tmp_path / "copy"
    shutil.copytree(swept[0], folder)
    cell = folder / "out" / "cells" / CELLS[0]
    missing = cell / "shifted" / "seed1.h5"
    missing.unlink()
    kept = [p for p in cell.rglob("*.h5")]
    before = {p: p.stat().st_mtime_ns for p in kept}
    result = run_dynamics(*sweep_argv(folder))
    assert result.returncode == 0, result.stderr
    assert {p: p.stat().st_mtime_ns for p in kept} == before
    assert open_run(missing).status().state == "finished"
    assert [c["status"] for c in sweep_json(folder)["cells"]] == ["trained", "reused"]
    original = swept[0] / "out" / "cells" / CELLS[0] / "shifted" / "seed1.h5"
    for name, values in recorded(original).items():
        np.testing.assert_array_equal(values, recorded(missing)[name], err_msg=name)


def test_a_sweep_through_submitits_local_executor_records_what_local_runs_record(swept, tmp_path):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY_EXPERIMENT))
    argv = sweep_argv(tmp_path, "--launcher", "submitit-local")
    argv[argv.index("0-1")] = "0"
    del argv[argv.index("--jobs") : argv.index("--jobs") + 2]
    result = run_dynamics(*argv)
    assert result.returncode == 0, result.stderr
    assert [c["status"] for c in sweep_json(tmp_path)["cells"]] == ["trained", "trained"]
    for cell in CELLS:
        for variant in ("unshifted", "shifted"):
            local = swept[0] / "out" / "cells" / cell / variant / "seed0.h5"
            job = tmp_path / "out" / "cells" / cell / variant / "seed0.h5"
            for name, values in recorded(local).items():
                np.testing.assert_array_equal(values, recorded(job)[name], err_msg=name)
    assert list((tmp_path / "out" / ".submitit").glob("*_0_log.err"))
    assert (tmp_path / "out" / "sweep.html").is_file()
