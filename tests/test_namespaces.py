"""The recorder under both Lightning namespaces: ``pytorch_lightning`` and ``lightning.pytorch``."""

from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import pytorch_lightning as pl
import yaml
from lightning.pytorch import strategies
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel

from dynamics import open_run
from dynamics.callbacks import DynamicsRecorder
from dynamics.callbacks import lightning as lightning_callbacks
from dynamics.callbacks.probe import refuse_deepspeed
from dynamics.sharding import UnsupportedSharding


def test_each_namespace_gets_a_callback_of_its_own():
    assert issubclass(lightning_callbacks.DynamicsRecorder, L.Callback)
    assert issubclass(DynamicsRecorder, pl.Callback)
    # the same state key, so a checkpoint written under one namespace resumes under the other
    a, b = lightning_callbacks.DynamicsRecorder("r.h5"), DynamicsRecorder("r.h5")
    assert a.state_key == b.state_key


def test_lightning_trainer_records_the_default_probes(tmp_path):
    path = tmp_path / "run.h5"
    trainer = L.Trainer(
        max_steps=5,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[lightning_callbacks.DynamicsRecorder(path)],
    )
    trainer.fit(BoringModel())
    run = open_run(path)
    assert {"loss", "hidden_norms", "displacement", "snapshots"} <= set(run.groups)
    np.testing.assert_array_equal(run.series("loss").step, np.arange(5))
    assert run.events() == [] and run.status().state == "finished"
    assert run.attrs["versions"]["lightning"] == L.__version__


CONFIG = """
trainer:
  max_steps: 4
  accelerator: cpu
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: dynamics.callbacks.lightning.DynamicsRecorder
      init_args:
        path: run.h5
        probes:
          - class_path: dynamics.callbacks.TrainingLoss
          - class_path: dynamics.callbacks.HiddenStateNorms
            init_args:
              every_n_steps: 2
model:
  class_path: lightning.pytorch.demos.boring_classes.BoringModel
"""


def test_lightning_cli_accepts_the_recorder_in_a_yaml_callbacks_list(tmp_path, monkeypatch):
    (tmp_path / "config.yaml").write_text(CONFIG)
    monkeypatch.chdir(tmp_path)
    LightningCLI(args=["fit", "--config", "config.yaml"], save_config_callback=None)
    run = open_run(tmp_path / "run.h5")
    np.testing.assert_array_equal(run.series("loss").step, np.arange(4))
    np.testing.assert_array_equal(run.series("hidden_norms").step, [0, 2])


def test_lightning_cli_refuses_the_other_namespace_callback(tmp_path, monkeypatch, capsys):
    config = yaml.safe_load(CONFIG)
    config["trainer"]["callbacks"][0]["class_path"] = "dynamics.callbacks.DynamicsRecorder"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        LightningCLI(args=["fit", "--config", "config.yaml"], save_config_callback=None)
    assert "DynamicsRecorder" in capsys.readouterr().err


@pytest.mark.parametrize("namespace", [strategies, pl.strategies])
def test_deepspeed_of_either_namespace_is_refused_at_setup(namespace):
    # DeepSpeedStrategy() refuses to construct without deepspeed; the type is what matters.
    strategy = namespace.DeepSpeedStrategy
    trainer = SimpleNamespace(strategy=strategy.__new__(strategy))
    recorder = (
        DynamicsRecorder if namespace is pl.strategies else lightning_callbacks.DynamicsRecorder
    )("r.h5")
    with pytest.raises(UnsupportedSharding) as refused:
        recorder.setup(trainer, None, "fit")
    message = str(refused.value)
    assert "\n" not in message and "DeepSpeedStrategy" in message
    assert "use FSDPStrategy, or ModelParallelStrategy with fully_shard" in message.replace(
        "shard with", "use"
    )


@pytest.mark.parametrize("namespace", [strategies, pl.strategies])
@pytest.mark.parametrize("name", ["FSDPStrategy", "ModelParallelStrategy"])
def test_sharded_strategies_of_either_namespace_are_recorded(namespace, name):
    strategy = getattr(namespace, name)
    refuse_deepspeed(SimpleNamespace(strategy=strategy.__new__(strategy)))  # no refusal


def test_init_biases_under_the_lightning_namespace(tmp_path):
    assert issubclass(lightning_callbacks.InitBiases, L.Callback)
    model = BoringModel()
    trainer = L.Trainer(
        max_steps=1,
        callbacks=[lightning_callbacks.InitBiases("constant", {"value": 0.25})],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model)
    table = trainer.callbacks[0].table  # what was set at fit setup
    assert [(entry.module, entry.parameter) for entry in table] == [("layer", "bias")]
    assert "0.25" in table[0].value
