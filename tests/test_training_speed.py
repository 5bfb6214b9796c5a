"""The fast ``dynamics run`` path records what the Trainer before it recorded, bit for bit."""

from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger

from dynamics import open_run
from dynamics.callbacks import DynamicsRecorder, TrainingLoss
from dynamics.experiments.config_files import load_config
from dynamics.experiments.progress import ReturnedLossBar
from dynamics.experiments.runner import run_experiment, trainer_for
from dynamics.store import names

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "teacher_student.yaml"
SHORT = {"steps": 30, "eval_every": 10, "record.hessian_every_n_steps": 10}


def _before(config, callbacks, **settings):
    """The Trainer ``dynamics run`` built before the fast path: Lightning's default progress
    bar, redrawn every step, for which the student logs its training loss every step."""
    before = dict(
        max_steps=config.steps,
        val_check_interval=config.eval_every,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=True,
        deterministic=True,
    )
    return pl.Trainer(**(before | settings))


def test_fast_path_records_what_the_default_trainer_recorded(tmp_path):
    experiment, config = load_config(CONFIG, **SHORT)
    torch.set_num_threads(config.threads)
    built = {name: experiment.build(config, name) for name in experiment.variants(config)}
    recordings = experiment.recordings(config, built)
    for name in built:
        recorder = DynamicsRecorder(
            tmp_path / "before" / f"{name}.h5",
            probes=recordings[name].probes,
            config={"experiment": experiment.name, "variant": name, **config.to_dict()},
            run_name=name,
        )
        trainer = _before(config, [recorder])
        trainer.fit(built[name].module, built[name].data)
        assert "train_loss" in trainer.callback_metrics  # logged every step, as before

    run_experiment(experiment, config, tmp_path / "now", progress=True)

    for name in built:
        before, now = (open_run(tmp_path / path / f"{name}.h5") for path in ("before", "now"))
        assert before.groups == now.groups
        assert {names.LOSS, names.VALIDATION, names.HESSIAN} <= set(now.groups)
        for group in now.groups:
            old, new = before.series(group), now.series(group)
            np.testing.assert_array_equal(old.step, new.step, err_msg=group)
            assert old.values.keys() == new.values.keys()
            for key in new.values:
                np.testing.assert_array_equal(old[key], new[key], err_msg=f"{group}/{key}")
        assert len(now.train_loss().values) == config.steps
        assert list(now.heldout_loss().step) == [10, 20, 30]
        assert before.theta0_sha256 == now.theta0_sha256 is not None
        final = now.vector(names.THETA_FINAL)
        assert final is not None and np.array_equal(before.vector(names.THETA_FINAL), final)


def test_the_bar_shows_the_returned_loss_the_module_no_longer_logs(tmp_path):
    experiment, config = load_config(CONFIG, steps=5, eval_every=5)
    built = experiment.build(config, "unshifted")
    recorder = DynamicsRecorder(tmp_path / "run.h5", probes=[TrainingLoss()])
    trainer = trainer_for(config, [recorder], progress=True)
    trainer.fit(built.module, built.data)

    bar = trainer.progress_bar_callback
    assert isinstance(bar, ReturnedLossBar) and bar.refresh_rate == 1
    assert "train_loss" not in trainer.callback_metrics
    shown = bar.get_metrics(trainer, built.module)["train_loss"]
    assert shown == float(open_run(tmp_path / "run.h5").train_loss().values[-1])
    assert ReturnedLossBar(2000).refresh_rate == 20


@pytest.mark.parametrize(("logger", "bar"), [(False, False), (True, False), (False, True)])
def test_the_student_logs_its_loss_for_a_logger_or_lightnings_bar(tmp_path, logger, bar):
    experiment, config = load_config(CONFIG, steps=2, eval_every=2)
    built = experiment.build(config, "unshifted")
    trainer = _before(
        config,
        [],
        logger=CSVLogger(tmp_path) if logger else False,
        enable_progress_bar=bar,
    )
    trainer.fit(built.module, built.data)
    assert ("train_loss" in trainer.callback_metrics) == (logger or bar)
