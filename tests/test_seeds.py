"""``dynamics run --seeds``: every variant for every seed, in parallel processes, summarized."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import yaml

from dynamics import open_run
from dynamics.callbacks import LoggedMetrics, TrainingLoss
from dynamics.cli import main
from dynamics.errors import DynamicsError
from dynamics.experiments import TeacherStudentData, TeacherStudentModule
from dynamics.experiments.config import ExperimentConfig
from dynamics.experiments.config_files import load_config
from dynamics.experiments.experiment import Built, Experiment, Recording
from dynamics.experiments.registry import register
from dynamics.experiments.seed_runs import run_seeds
from tests.conftest import TINY_EXPERIMENT, run_dynamics
from tests.test_user_input import MINE, files_under, refused_in_process

TINY = {**TINY_EXPERIMENT, "steps": 5, "eval_every": 2, "record": {"hessian_top_k": 0}}
VARIANTS = ("unshifted", "shifted")


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    """The same two seeds run with --jobs 2 and --jobs 1, and seed 1 alone with --seed."""
    folder = tmp_path_factory.mktemp("seeds")
    (folder / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    results = {}
    for name, options in [
        ("parallel", ["--seeds", "0-1", "--jobs", "2"]),
        ("serial", ["--seeds", "0,1", "--jobs", "1"]),
        ("single", ["--seed", "1"]),
    ]:
        result = run_dynamics(
            "run", folder / "tiny.yaml", "--out", folder / name, "--no-progress", *options
        )
        assert result.returncode == 0, result.stderr
        results[name] = result
    return folder, results


def recorded(path: Path) -> dict[str, np.ndarray]:
    """Every recorded series and vector of a run file (not its status: process id, times)."""
    arrays = {}

    def keep(name: str, item: object) -> None:
        if isinstance(item, h5py.Dataset) and not name.startswith("status"):
            arrays[name] = item[()]

    with h5py.File(path, "r") as file:
        file.visititems(keep)
    return arrays


def test_every_variant_trains_for_every_seed_and_shares_theta0_per_seed(groups):
    folder, results = groups
    runs = {
        (v, s): open_run(folder / "parallel" / v / f"seed{s}.h5") for v in VARIANTS for s in (0, 1)
    }
    assert sorted(p.name for p in (folder / "parallel").iterdir()) == [
        "shifted",
        "summary.json",
        "unshifted",
    ]
    for (variant, seed), run in runs.items():
        assert run.config["seed"] == seed and run.config["variant"] == variant
        assert "seeds" not in run.config and run.series("loss").step[-1] == 4
    assert runs["unshifted", 0].shares_theta0(runs["shifted", 0])
    assert runs["unshifted", 1].shares_theta0(runs["shifted", 1])
    assert not runs["unshifted", 0].shares_theta0(runs["unshifted", 1])
    assert "share θ0" in results["parallel"].stdout


def test_jobs_and_a_single_seed_record_the_same_series(groups):
    folder, _ = groups
    for variant in VARIANTS:
        for seed in (0, 1):
            parallel = recorded(folder / "parallel" / variant / f"seed{seed}.h5")
            serial = recorded(folder / "serial" / variant / f"seed{seed}.h5")
            assert parallel.keys() == serial.keys() and len(parallel) > 10
            for name, values in parallel.items():
                np.testing.assert_array_equal(values, serial[name], err_msg=name)
        # seed 1 of a group is the run `--seed 1` makes
        alone = recorded(folder / "single" / f"{variant}.h5")
        for name, values in recorded(folder / "serial" / variant / "seed1.h5").items():
            np.testing.assert_array_equal(values, alone[name], err_msg=name)


def test_summary_holds_each_seeds_figures_and_their_spread(groups):
    folder, results = groups
    summary = json.loads((folder / "parallel" / "summary.json").read_text())
    assert summary["seeds"] == [0, 1] and summary["failed"] == []
    assert summary["config"]["seeds"] == [0, 1] and "seed" not in summary["config"]
    for variant in VARIANTS:
        entry = summary["variants"][variant]
        finals, bests = [], []
        for seed in (0, 1):
            path = folder / "parallel" / entry["runs"][str(seed)]
            heldout = open_run(path).heldout_loss()  # direct from the file
            finals.append(float(heldout.values[-1]))
            bests.append(float(heldout.values.min()))
            assert entry["figures"]["best_heldout_step"]["per_seed"][str(seed)] == int(
                heldout.step[np.argmin(heldout.values)]
            )
        final = entry["figures"]["final_heldout_loss"]
        assert [final["per_seed"][s] for s in ("0", "1")] == finals
        assert final["mean"] == pytest.approx(np.mean(finals))
        assert final["std"] == pytest.approx(np.std(finals, ddof=1))
        assert (final["min"], final["max"]) == (min(finals), max(finals))
        assert [entry["figures"]["best_heldout_loss"]["per_seed"][s] for s in "01"] == bests
        row = next(
            line
            for line in results["parallel"].stdout.splitlines()
            if line.startswith(variant) and "final held-out loss" in line
        )
        assert f"{final['mean']:.5g} ± " in row and f"{finals[1]:.5g}" in row
    assert "standard deviation" in results["parallel"].stdout


def test_seeds_from_the_config_and_the_command_line(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("seeds: 0-2,5\n")
    assert load_config(config)[1].seeds == [0, 1, 2, 5]
    config.write_text("seeds: [4, 2]\nsteps: 3\neval_every: 1\n")
    assert load_config(config)[1].seeds == [2, 4]
    assert load_config(config, seed=7)[1].seeds is None  # --seed: one seed, as before
    assert load_config(config, seed=7)[1].seed == 7
    config.write_text("seed: 3\n")
    assert load_config(config, seeds=[0, 1])[1].seeds == [0, 1]
    config.write_text("seed: 3\nseeds: 0-1\n")
    with pytest.raises(DynamicsError, match="give seed or seeds, not both"):
        load_config(config)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--seeds", "3-1"], "--seeds: the range 3-1 runs backwards"),
        (["--seeds", "0,0"], "--seeds: seed 0 is given twice"),
        (["--seeds", "-1"], "--seeds must be seeds >= 0"),
        (["--seeds", "0-x"], "--seeds must be seeds >= 0"),
        (["--seeds", "0-100000"], "more than 1000 seeds"),
        (["--seed", "0", "--seeds", "0-1"], "not allowed with argument --seed"),
        (["--seeds", "0-1", "--jobs", "0"], "--jobs must be from 1 to"),
        (["--jobs", "1"], "--jobs goes with --seeds"),
        (["--seeds", "0-1"], "seed0.h5 exists; pass --overwrite"),
        (["--seeds", "0", "--overwrite"], "seed7.h5 is not one of this command's seeds"),
        (["--seeds", "1-2", "--overwrite", "--lr", "0"], "--lr must be"),
    ],
)
def test_bad_seed_options_get_one_line_and_change_nothing(tmp_path, capsys, options, message):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    out = tmp_path / "out"
    (out / "unshifted").mkdir(parents=True)
    (out / "unshifted" / "seed0.h5").write_text(MINE)
    (out / "shifted").mkdir()
    (out / "shifted" / "seed7.h5").write_text(MINE)
    before = files_under(tmp_path)
    argv = ["run", tmp_path / "tiny.yaml", "--out", out, "--no-progress", *options]
    if "not allowed" in message:  # argparse's own one line
        with pytest.raises(SystemExit) as exit_:
            main([str(a) for a in argv])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    else:
        refused_in_process(argv, capsys, message)
    assert files_under(tmp_path) == before


# ---------------------------------------------------------------------------------------------
# A run that fails does not stop the others, in any process


ARCH = dict(width=8, expansion=2, depth=2)


class Failing(TeacherStudentModule):
    """A student whose training fails at step 2 as ``failure`` says: raise, or die by SIGKILL."""

    def __init__(self, failure: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self.failure = failure

    def training_step(self, batch, batch_idx):
        if self.global_step == 2 and self.failure == "raise":
            raise ValueError("a failure in training")
        if self.global_step == 2 and self.failure == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(batch, batch_idx)


@dataclass
class FailingConfig(ExperimentConfig):
    steps: int = 4
    eval_every: int = 2
    seeds: list[int] | None = field(default_factory=lambda: [0, 1, 2])
    #: ``{"variant/seed": "raise" or "kill"}``
    failures: dict[str, str] = field(default_factory=dict)


class FailingExperiment(Experiment[FailingConfig]):
    name = "test_failing_runs"
    config_class = FailingConfig
    setting = "lr"

    def variants(self, config):
        return {"slow": 1e-3, "fast": 1e-2}

    def build(self, config, variant):
        failure = config.failures.get(f"{variant}/{config.seed}", "")
        module = Failing(failure, **ARCH, seed=config.seed, lr=self.variants(config)[variant])
        return Built(module, TeacherStudentData(**ARCH, batch_size=8, heldout_size=16))

    def recordings(self, config, built):
        return {name: Recording([TrainingLoss(), LoggedMetrics(["val_loss"])]) for name in built}


FAILING = register(FailingExperiment())


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_failed_run_is_one_line_and_the_others_are_kept(tmp_path, capsys, monkeypatch, jobs):
    # The spawned processes import this module to find the experiment, as a user's would.
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1]))
    failures = {"fast/1": "raise"} if jobs == 1 else {"fast/1": "raise", "slow/2": "kill"}
    config = FailingConfig(failures=failures).validate()
    torch.set_num_threads(1)

    group = run_seeds(FAILING, config, tmp_path / "out", jobs=jobs, progress=False)

    err = capsys.readouterr().err
    assert "dynamics: run fast seed 1 failed: ValueError: a failure in training" in err
    failed = {(f.variant, f.seed) for f in group.failures}
    if jobs == 2:
        assert "dynamics: run slow seed 2 failed: its process died (killed by signal 9)" in err
        assert failed == {("fast", 1), ("slow", 2)}
    else:
        assert failed == {("fast", 1)}
    for run in [(v, s) for v in ("slow", "fast") for s in (0, 1, 2)]:
        if run not in failed:
            assert (
                open_run(tmp_path / "out" / run[0] / f"seed{run[1]}.h5").series("loss").step[-1]
                == 3
            )
    crashed = open_run(tmp_path / "out" / "fast" / "seed1.h5").status()
    assert crashed.state == "crashed" and "a failure in training" in crashed.exception
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert {(f["variant"], f["seed"]) for f in summary["failed"]} == failed
    assert summary["variants"]["fast"]["figures"]["final_train_loss"]["n"] == 2
    assert "1" not in summary["variants"]["fast"]["runs"]


def test_summary_holds_the_crossover_step_of_the_grouped_compare(groups):
    folder, results = groups
    summary = json.loads((folder / "parallel" / "summary.json").read_text())
    compared = run_dynamics("compare", folder / "parallel", "--json")
    assert compared.returncode == 0, compared.stderr
    statistics = json.loads(compared.stdout)["comparisons"][0]["statistics"]
    overtakes = next(s for s in statistics if s["measure"].startswith("step shifted overtakes"))
    crossover = summary["crossover"]["shifted"]
    assert crossover["baseline"] == "unshifted" and list(summary["crossover"]) == ["shifted"]
    assert {int(s): v for s, v in crossover["per_seed"].items()} == dict(
        zip(overtakes["seeds"], overtakes["values"])
    )
    assert [f"seed {s}: {why}" for s, why in crossover["not_measured"].items()] == overtakes[
        "missing"
    ]
    assert "overtakes unshifted on held-out loss for good at step" in results["parallel"].stdout


def test_validation_metrics_join_the_summary_and_the_table(tmp_path):
    config = {
        "experiment": "vit_digits",
        "steps": 6,
        "eval_every": 2,
        "model": {"width": 16, "depth": 1, "heads": 2},
        "data": {"batch_size": 16},
        "record": {"hessian_top_k": 0, "snapshot_budget_mb": 1},
    }
    (tmp_path / "vit.yaml").write_text(yaml.safe_dump(config))
    result = run_dynamics(
        "run", tmp_path / "vit.yaml", "--out", tmp_path / "out", "--seeds", "0-1", "--no-progress"
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["figures"]["final_val_acc"] == "final val_acc"
    for variant in ("unshifted", "adaptive"):
        figure = summary["variants"][variant]["figures"]["final_val_acc"]
        accuracies = []
        for seed in (0, 1):
            with h5py.File(tmp_path / "out" / variant / f"seed{seed}.h5", "r") as file:
                accuracies.append(float(file["series/validation/val_acc"][-1]))
        assert [figure["per_seed"][s] for s in ("0", "1")] == accuracies
        row = next(
            line
            for line in result.stdout.splitlines()
            if line.startswith(variant) and "final val_acc" in line
        )
        assert f"{accuracies[0]:.5g}" in row
    assert "val_loss" not in "".join(summary["figures"])  # the held-out loss is listed once
