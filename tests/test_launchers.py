"""The seed runner's launchers: submitit's jobs record what local processes record, a failed
job is one line, and a rerun with --reuse-finished trains nothing.

Slurm itself is not reachable here: the submitit launcher is tested with submitit's local
executor (``--launcher submitit-local``), which starts a real process per job.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from dynamics import open_run
from dynamics.experiments.launchers import SubmititLauncher
from dynamics.experiments.seed_runs import run_seeds
from tests.conftest import DYNAMICS, TINY_EXPERIMENT, assert_one_line_error, run_dynamics
from tests.test_seeds import FAILING, VARIANTS, Failing, FailingConfig, recorded
from tests.test_user_input import files_under, refused_in_process

TINY = {**TINY_EXPERIMENT, "steps": 20, "eval_every": 10, "record": {"hessian_top_k": 0}}
REPO = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    """Seeds 0-1 through the local launcher and through submitit's local executor."""
    folder = tmp_path_factory.mktemp("launchers")
    (folder / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    results = {}
    for name, options in [
        ("local", ["--jobs", "1"]),
        ("submitit", ["--launcher", "submitit-local", "--launcher-option", "timeout_min=5"]),
    ]:
        result = run_dynamics(
            "run", folder / "tiny.yaml", "--seeds", "0-1", "--out", folder / name, *options
        )
        assert result.returncode == 0, result.stderr
        results[name] = result
    return folder, results


def test_submitit_jobs_record_what_local_runs_record(groups):
    folder, results = groups
    for variant in VARIANTS:
        for seed in (0, 1):
            local = folder / "local" / variant / f"seed{seed}.h5"
            job = folder / "submitit" / variant / f"seed{seed}.h5"
            a, b = recorded(local), recorded(job)
            assert a.keys() == b.keys() and len(a) > 10
            for name, values in a.items():
                np.testing.assert_array_equal(values, b[name], err_msg=name)
            assert open_run(job).status().state == "finished"
            assert open_run(job).theta0_sha256 == open_run(local).theta0_sha256
            assert open_run(job).config == open_run(local).config
    summaries = [json.loads((folder / n / "summary.json").read_text()) for n in groups[1]]
    for summary in summaries:
        summary.pop("out")
    assert summaries[0] == summaries[1] and summaries[0]["failed"] == []
    # a progress line as each job ends, and each job's log in OUT/.submitit
    assert len(re.findall(r"\[\d/4\] \w+ seed \d: ", results["submitit"].stderr)) == 4
    assert len(list((folder / "submitit" / ".submitit").glob("*_0_log.err"))) == 4
    tables = [
        [line for line in r.stdout.splitlines() if line.split()[:1] in ([v] for v in VARIANTS)]
        for r in results.values()
    ]
    assert tables[0] == tables[1] and len(tables[0]) == 9  # 8 figures, the crossover


def test_a_rerun_with_reuse_finished_trains_nothing(groups):
    folder, _ = groups
    out = folder / "submitit"
    runs = sorted(out.glob("*/seed*.h5"))
    before = {p: p.stat().st_mtime_ns for p in runs}
    jobs = set((out / ".submitit").iterdir())
    summary = json.loads((out / "summary.json").read_text())
    result = run_dynamics(
        "run", folder / "tiny.yaml", "--seeds", "0-1", "--out", out,
        "--launcher", "submitit-local", "--reuse-finished",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "4 of 4 runs finished before with this config: read back" in result.stderr
    assert {p: p.stat().st_mtime_ns for p in runs} == before
    assert set((out / ".submitit").iterdir()) == jobs  # no job was submitted
    assert json.loads((out / "summary.json").read_text()) == summary


def test_reuse_finished_refuses_a_run_of_another_config(groups):
    folder, _ = groups
    out = folder / "local"
    before = files_under(out)
    result = run_dynamics(
        "run", folder / "tiny.yaml", "--seeds", "0-1", "--out", out, "--steps", "30",
        "--reuse-finished",
    )  # fmt: skip
    assert_one_line_error(result)
    assert "finished with another config (steps: 20 there, 30 now)" in result.stderr
    assert "--overwrite" in result.stderr
    assert files_under(out) == before


def test_reuse_finished_trains_a_partial_run_again(tmp_path, monkeypatch):
    config = FailingConfig(seeds=[0]).validate()
    torch.set_num_threads(1)
    fit, failed = Failing.training_step, []

    def fail_once(self, batch, batch_idx):  # the first run (slow, seed 0) crashes at step 2
        if self.global_step == 2 and not failed:
            failed.append(True)
            raise ValueError("a crash")
        return fit(self, batch, batch_idx)

    monkeypatch.setattr(Failing, "training_step", fail_once)
    first = run_seeds(FAILING, config, tmp_path, jobs=1, progress=False)
    assert [(f.variant, f.seed) for f in first.failures] == [("slow", 0)]
    assert open_run(tmp_path / "slow" / "seed0.h5").status().state == "crashed"
    fast = (tmp_path / "fast" / "seed0.h5").stat().st_mtime_ns

    again = run_seeds(FAILING, config, tmp_path, jobs=1, progress=False, reuse_finished=True)

    assert again.failures == [] and set(again.results) == {("slow", 0), ("fast", 0)}
    assert open_run(tmp_path / "slow" / "seed0.h5").status().state == "finished"
    assert (tmp_path / "fast" / "seed0.h5").stat().st_mtime_ns == fast
    assert again.results["fast", 0] == first.results["fast", 0]


def test_a_failed_job_is_one_line_and_the_others_finish(tmp_path, capsys, monkeypatch):
    # The jobs unpickle the experiment by reference: they import this test's modules.
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    config = FailingConfig(seeds=[0, 1], failures={"fast/1": "raise", "slow/1": "kill"})
    config.validate()
    launcher = SubmititLauncher(tmp_path / "jobs", cluster="local", poll_s=0.2)

    group = run_seeds(FAILING, config, tmp_path / "out", launcher=launcher, progress=False)

    lines = [line for line in capsys.readouterr().err.splitlines() if "failed" in line]
    assert len(lines) == 2, lines
    raised = next(line for line in lines if "fast seed 1" in line)
    assert raised.startswith("dynamics: run fast seed 1 failed: ValueError: a failure in training")
    log = Path(re.search(r"\(log: (\S+)\)$", raised).group(1))
    assert log.parent == tmp_path / "jobs" and "a failure in training" in log.read_text()
    killed = next(line for line in lines if "slow seed 1" in line)
    assert re.fullmatch(
        r"dynamics: run slow seed 1 failed: its job \d+ ended without a result "
        r"\(state \w+; log: \S+_0_log\.err\)",
        killed,
    )
    assert {(f.variant, f.seed) for f in group.failures} == {("fast", 1), ("slow", 1)}
    assert set(group.results) == {("slow", 0), ("fast", 0)}
    for variant in ("slow", "fast"):
        assert open_run(tmp_path / "out" / variant / "seed0.h5").series("loss").step[-1] == 3
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert len(summary["failed"]) == 2 and list(summary["variants"]["fast"]["runs"]) == ["0"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--launcher-option", "timeout_min"], "--launcher-option goes with --launcher slurm"),
        (
            ["--launcher", "submitit-local", "--launcher-option", "timeout_min"],
            "--launcher-option must be KEY=VALUE",
        ),
        (
            ["--launcher", "submitit-local", "--launcher-option", "colour=red"],
            "--launcher-option refused by submitit: Parameter 'colour' need to be prefixed",
        ),
        (
            ["--launcher", "submitit-local", "--launcher-option", "timeout_min=soon"],
            '--launcher-option refused by submitit: Parameter "timeout_min" expected type',
        ),
        (
            ["--launcher", "slurm", "--launcher-option", "a_b=1", "--launcher-option", "a_b=2"],
            "--launcher-option a_b is given twice",
        ),
        (["--seed", "0", "--launcher", "submitit-local"], "--launcher goes with --seeds"),
        (["--seed", "0", "--reuse-finished"], "--reuse-finished goes with --seeds"),
        (["reproduce", "--launcher-folder", "jobs"], "--launcher-folder goes with --launcher"),
    ],
)
def test_bad_launcher_options_get_one_line_and_change_nothing(tmp_path, capsys, options, message):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    seeds = [] if "--seed" in options else ["--seeds", "0-1"]
    before = files_under(tmp_path)
    argv = ["run", tmp_path / "tiny.yaml", *seeds, "--out", tmp_path / "out", *options]
    if options[0] == "reproduce":
        argv = [*options, "--out", tmp_path / "out"]
    refused_in_process(argv, capsys, message)
    assert files_under(tmp_path) == before


def test_a_cluster_launcher_without_submitit_says_how_to_install_it(tmp_path):
    # A submitit that cannot be imported, ahead of the installed one.
    (tmp_path / "hide" / "submitit").mkdir(parents=True)
    (tmp_path / "hide" / "submitit" / "__init__.py").write_text("raise ImportError('hidden')\n")
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    result = subprocess.run(
        [DYNAMICS, "run", str(tmp_path / "tiny.yaml"), "--seeds", "0-1",
         "--out", str(tmp_path / "out"), "--launcher", "slurm"],
        capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path / "hide")},
    )  # fmt: skip
    assert_one_line_error(result)
    assert result.stderr.strip().endswith(
        "--launcher slurm needs submitit: pip install 'dynamics-for-pytorch[cluster]'"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(shutil.which("srun") is not None, reason="this machine has Slurm")
def test_slurm_asked_for_where_there_is_none_is_one_line(tmp_path):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    out = tmp_path / "out"
    for command in (["run", tmp_path / "tiny.yaml", "--seeds", "0"],
                    ["sweep", tmp_path / "tiny.yaml", "--grid", "optimizer.lr=1e-3",
                     "--seeds", "0"]):  # fmt: skip
        result = run_dynamics(*command, "--out", out, "--launcher", "slurm")
        assert_one_line_error(result)
        assert "the slurm launcher cannot start here: " in result.stderr
        assert not out.exists()
