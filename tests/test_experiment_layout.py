"""The experiments' layout: built-ins listed without importing them, configs shipped and named."""

import importlib
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import h5py
import pytest
import torch
import yaml

from dynamics import open_run
from dynamics.callbacks import DynamicsRecorder, ParameterDisplacement, TrainingLoss
from dynamics.cli import main
from dynamics.experiments import TeacherStudentData, TeacherStudentModule
from dynamics.experiments.config import ConfigError
from dynamics.experiments.config_files import config_file, load_config, shipped_configs
from dynamics.experiments.experiment import Experiment
from dynamics.experiments.registry import BUILTINS, get, known, register
from dynamics.experiments.shift_experiment import ShiftExperiment
from dynamics.model.rebuild import RENAMED_CLASSES, rebuild_module
from dynamics.store import names
from tests.conftest import make_quiet_trainer

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_the_registry_lists_the_builtins_without_importing_them():
    code = (
        "import sys\n"
        "from dynamics.experiments.registry import known\n"
        "names = known()\n"
        "loaded = [m for m in sys.modules if m.endswith('.experiment') or m.endswith('.config')]\n"
        "print(names, loaded)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    names, loaded = out.stdout.strip().split("] ")
    assert names == "['autoencoder', 'char_gpt', 'teacher_student', 'vit_digits'"
    assert [m for m in eval(loaded) if m.startswith("dynamics.experiments.")] == [
        "dynamics.experiments.experiment"  # the base class, which imports no experiment
    ]


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_every_builtin_resolves_to_its_shift_experiment(name):
    experiment = get(name)
    assert isinstance(experiment, ShiftExperiment) and experiment.name == name
    assert get(name) is experiment  # imported once
    assert experiment.setting == "shift" and name in known()


def test_a_builtin_name_cannot_be_registered_again():
    class Impostor(Experiment):
        name = "char_gpt"

        def variants(self, config): ...
        def build(self, config, variant): ...
        def recordings(self, config, built): ...

    with pytest.raises(ValueError, match="'char_gpt' is already registered"):
        register(Impostor())


def test_every_config_file_is_shipped_with_its_experiment_and_description():
    shipped = shipped_configs()
    assert sorted(shipped) == sorted(p.stem for p in CONFIGS.glob("*.yaml"))
    for name, config in shipped.items():
        assert config.path.read_bytes() == (CONFIGS / f"{name}.yaml").read_bytes()
        first_comment = (CONFIGS / f"{name}.yaml").read_text().splitlines()[0]
        assert config.description == first_comment.removeprefix("# ") and config.description
        data = yaml.safe_load(config.path.read_text())
        assert config.experiment == data.get("experiment", "LightningCLI")


def test_a_shipped_config_loads_by_name_as_by_its_file():
    by_name = load_config("vit_digits", steps=70)
    by_file = load_config(CONFIGS / "vit_digits.yaml", steps=70)
    assert by_name[0] is by_file[0] and by_name[1] == by_file[1]
    assert config_file("my/config.yaml") == Path("my/config.yaml")  # a path stays a path
    with pytest.raises(ConfigError, match="^config 'nope' is neither a file nor a shipped config"):
        config_file("nope")


def test_a_file_in_the_working_directory_wins_over_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("teacher_student").write_text("experiment: vit_digits\n")
    assert load_config("teacher_student")[0].name == "vit_digits"


def test_dynamics_configs_lists_the_shipped_configs(capsys):
    assert main(["configs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["name", "experiment", "what", "it", "is"]
    rows = {line.split()[0]: line.split()[1] for line in lines[1:-1]}
    assert rows == {n: c.experiment for n, c in shipped_configs().items()}
    assert rows["lightning_cli"] == "LightningCLI" and rows["char_gpt"] == "char_gpt"


def test_dynamics_run_takes_a_shipped_name(tmp_path, capsys):
    # Resolved and loaded: the refusal is of --steps, below the shipped config's eval_every.
    assert main(["run", "teacher_student", "--steps", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == "dynamics: error: --steps must be at least the config's eval_every (100), " + (
        "or no held-out loss is ever measured, got 1; for fewer steps add --set eval_every=N "
        "(N <= 1)\n"
    )
    assert main(["run", "teacher_studnet", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "autoencoder, char_gpt, lightning_cli, teacher_student" in err
    assert main(["run", "lightning_cli", "--out", str(tmp_path)]) == 2
    assert "a LightningCLI config" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_every_experiment_folder_and_the_configs_are_in_the_wheel():
    """A wheel holds only the packages pyproject.toml names: a new experiment's folder left out
    would install without its code."""
    root = CONFIGS.parent
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {
        ".".join(p.parent.relative_to(root).parts)
        for p in (root / "dynamics" / "experiments").glob("*/__init__.py")
    }
    assert folders and folders <= set(setuptools["packages"])
    assert setuptools["package-dir"]["dynamics.configs"] == "configs"
    assert setuptools["package-data"]["dynamics.configs"] == ["*.yaml"]


@pytest.mark.parametrize("old", sorted(RENAMED_CLASSES))
def test_every_renamed_class_is_gone_from_its_old_path_and_found_at_its_new(old):
    """Both ends checked: an import-path rewrite run over the table would make it map new
    paths to themselves, and old files would stop rebuilding unnoticed."""
    new = RENAMED_CLASSES[old]
    module, _, name = new.rpartition(".")
    assert name == old.rpartition(".")[2]
    assert isinstance(getattr(importlib.import_module(module), name), type)
    old_module, _, _ = old.rpartition(".")
    try:
        assert not hasattr(importlib.import_module(old_module), name)
    except ModuleNotFoundError:
        pass


def test_a_run_recorded_under_an_old_class_path_still_rebuilds(tmp_path):
    arch = dict(width=8, expansion=2, depth=2)
    path = tmp_path / "old.h5"
    recorder = DynamicsRecorder(path, probes=[TrainingLoss(), ParameterDisplacement()])
    trainer = make_quiet_trainer(max_steps=2, callbacks=[recorder], limit_val_batches=0)
    trainer.fit(TeacherStudentModule(**arch, seed=3), TeacherStudentData(**arch, batch_size=4))
    old = "dynamics.experiments.teacher_student.TeacherStudentModule"  # before issue 23
    with h5py.File(path, "r+") as file:
        record = json.loads(file.attrs[names.ATTR_MODULE])
        assert record["class_path"] == RENAMED_CLASSES[old]
        file.attrs[names.ATTR_MODULE] = json.dumps({**record, "class_path": old})
    run = open_run(path)
    assert run.attrs[names.ATTR_MODULE]["class_path"] == old

    rebuilt = rebuild_module(run)

    assert type(rebuilt) is TeacherStudentModule and rebuilt.hparams.seed == 3
    theta0 = TeacherStudentModule(**arch, seed=3).state_dict()
    assert all(torch.equal(rebuilt.state_dict()[k], v) for k, v in theta0.items())
