"""The experiment registry: an experiment defined outside the package runs from its config."""

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from dynamics import open_run
from dynamics.callbacks import LoggedMetrics, TrainingLoss
from dynamics.errors import DynamicsError
from dynamics.experiments import TeacherStudentData, TeacherStudentModule
from dynamics.experiments.config import ConfigError, ExperimentConfig
from dynamics.experiments.config_files import load_config
from dynamics.experiments.experiment import Built, Experiment, Recording
from dynamics.experiments.registry import get, register
from dynamics.experiments.runner import run_experiment

ARCH = dict(width=8, expansion=2, depth=2)
TEACHER_STUDENT = Path(__file__).resolve().parents[1] / "configs" / "teacher_student.yaml"


@dataclass
class LearningRatesConfig(ExperimentConfig):
    steps: int = 6
    eval_every: int = 3
    variants: dict[str, float] = field(default_factory=lambda: {"slow": 1e-3, "fast": 1e-2})


class LearningRates(Experiment[LearningRatesConfig]):
    """One student per learning rate: a second experiment, known only to this test file."""

    name = "test_learning_rates"
    config_class = LearningRatesConfig
    setting = "lr"

    def variants(self, config):
        return config.variants

    def build(self, config, variant):
        module = TeacherStudentModule(**ARCH, seed=config.seed, lr=config.variants[variant])
        return Built(module, TeacherStudentData(**ARCH, batch_size=16, heldout_size=32))

    def recordings(self, config, built):
        return {name: Recording([TrainingLoss(), LoggedMetrics(["val_loss"])]) for name in built}


LEARNING_RATES = register(LearningRates())


def test_a_registered_experiment_runs_from_its_config(tmp_path):
    (tmp_path / "lr.yaml").write_text("experiment: test_learning_rates\nseed: 3\n")
    experiment, config = load_config(tmp_path / "lr.yaml", steps=4)
    assert experiment is LEARNING_RATES and (config.seed, config.steps) == (3, 4)

    results = run_experiment(experiment, config, tmp_path / "runs", progress=False)

    assert [(r.name, r.setting) for r in results] == [("slow", 1e-3), ("fast", 1e-2)]
    run = open_run(tmp_path / "runs" / "fast.h5")
    assert run.config["experiment"] == "test_learning_rates" and run.config["variant"] == "fast"
    assert run.series("loss").step[-1] == 3 and len(run.series("validation")) == 1


def test_registry_refuses_unknown_names_and_a_second_registration():
    with pytest.raises(DynamicsError, match="unknown experiment 'nope'; known: .*teacher_student"):
        get("nope")
    with pytest.raises(ValueError, match="already registered"):
        register(LearningRates())


def test_equal_seed_numbers_give_independent_streams():
    """Student seed 1 and teacher seed 1 (the default) used to build the teacher as the student:
    zero loss, and a traceback for a zero gradient. Each stream now draws from its own spawn."""
    from dynamics.experiments.teacher_student.streams import STREAMS, stream_seed

    assert len({stream_seed(1, stream) for stream in STREAMS}) == len(STREAMS)
    assert stream_seed(1, "training data", 0) != stream_seed(1, "training data", 1)  # DDP ranks
    student = TeacherStudentModule(**ARCH, seed=1).student
    teacher = TeacherStudentData(**ARCH, teacher_seed=1).teacher
    assert any((s != t).any() for s, t in zip(student.parameters(), teacher.parameters()))


def test_run_with_the_teachers_seed_number(tmp_path, dynamics):
    (tmp_path / "tiny.yaml").write_text(
        "steps: 4\neval_every: 2\nmodel: {width: 8, expansion: 2, depth: 2}\n"
        "data: {batch_size: 8, heldout_size: 16}\nrecord: {hessian_top_k: 0}\n"
    )
    result = dynamics("run", tmp_path / "tiny.yaml", "--out", tmp_path, "--seed", "1")
    assert result.returncode == 0, result.stderr
    assert open_run(tmp_path / "shifted.h5").shares_theta0(open_run(tmp_path / "unshifted.h5"))


def test_accelerator_is_validated_and_reaches_the_trainer(tmp_path, monkeypatch):
    assert load_config(TEACHER_STUDENT)[1].accelerator == "cpu"
    for bad, message in [
        ("tpu9", "accelerator must be one of cpu, cuda, mps, gpu, auto, got 'tpu9'"),
        (["cpu"], "accelerator must be one of .*, got \\['cpu'\\]"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(TEACHER_STUDENT, accelerator=bad)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="^accelerator cuda: this machine has none$"):
            load_config(TEACHER_STUDENT, accelerator="cuda")

    seen = {}

    class Spy(pl.Trainer):
        def __init__(self, **settings):
            seen.update(settings)
            super().__init__(**settings)

    monkeypatch.setattr(pl, "Trainer", Spy)
    experiment, config = load_config(TEACHER_STUDENT, steps=2, eval_every=2, accelerator="auto")
    run_experiment(experiment, config, tmp_path, progress=False)
    assert seen["accelerator"] == "auto" and seen["devices"] == 1
    assert open_run(tmp_path / "shifted.h5").config["accelerator"] == "auto"


def test_an_unknown_accelerator_is_one_line_from_the_cli(tmp_path, dynamics, one_line_error):
    (tmp_path / "gpu.yaml").write_text("accelerator: tpu9\nsteps: 2\neval_every: 2\n")
    result = dynamics("run", tmp_path / "gpu.yaml", "--out", tmp_path / "runs")
    one_line_error(result)
    assert "accelerator must be one of" in result.stderr
    assert not (tmp_path / "runs").exists()
