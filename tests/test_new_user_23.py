"""What a new user of issue 23's surfaces hit: each test is one bug found by trying them."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dynamics
from dynamics.callbacks import ActivationBias, DynamicsRecorder, HiddenStateNorms, UnitHealth
from dynamics.cli.common import error_line
from dynamics.errors import DynamicsError, ParameterError
from dynamics.store.writer import RunWriter
from tests.conftest import cli_in_process


def test_an_existing_output_names_the_parameter_in_python_and_the_flag_on_the_command_line(
    tmp_path,
):
    from dynamics.analysis.output import check_output

    existing = tmp_path / "run.h5"
    existing.write_bytes(b"a user's file")
    for refuse in (lambda: RunWriter.check_path(existing), lambda: check_output(existing, False)):
        with pytest.raises(DynamicsError) as caught:
            refuse()
        assert "--overwrite" not in str(caught.value)
        assert str(caught.value).endswith("exists; pass overwrite to replace it")
        assert error_line(caught.value).endswith("exists; pass --overwrite to replace it")
    assert existing.read_bytes() == b"a user's file"


class _ValidatedMLP(pl.LightningModule):
    """A ReLU MLP with a validation loader of one batch, on fixed data."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.train_data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
        self.val_data = TensorDataset(torch.randn(8, 4) * 10, torch.randn(8, 1))
        self.validated = 0

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.validated += 1
        self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(self.train_data, batch_size=4)

    def val_dataloader(self):
        return DataLoader(self.val_data, batch_size=8)


def test_a_validation_run_between_two_micro_batches_leaves_hidden_norms_alone(
    tmp_path, quiet_trainer
):
    # val_check_interval counts batches: 3 with accumulate_grad_batches=2 validates after the
    # first micro-batch of step 1, while the step's hooks are armed.
    rows = {}
    for name, validate in (("validated", 3), ("unvalidated", None)):
        path = tmp_path / f"{name}.h5"
        probes = [HiddenStateNorms(), ActivationBias(), UnitHealth()]
        options = {"val_check_interval": validate} if validate else {"limit_val_batches": 0}
        trainer = quiet_trainer(
            max_steps=4, accumulate_grad_batches=2, num_sanity_val_steps=0, **options
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.callbacks.append(DynamicsRecorder(path, probes=probes))
            model = _ValidatedMLP()
            trainer.fit(model)
        assert model.validated == (2 if validate else 0)  # after batches 3 and 6
        run = dynamics.open_run(path)
        rows[name] = {g: run.series(g).values for g in ("hidden_norms", "activation_bias")}
    for group, values in rows["unvalidated"].items():
        for series, expected in values.items():
            np.testing.assert_array_equal(rows["validated"][group][series], expected)
            assert np.isfinite(expected).all()


def test_steps_below_a_shipped_configs_eval_every_blame_the_steps_asked_for(capsys):
    from dynamics.experiments.config_files import load_config

    with pytest.raises(ParameterError) as caught:
        load_config("teacher_student", steps=30)
    assert caught.value.parameter == "steps"
    assert "eval_every (100)" in str(caught.value) and "got 30" in str(caught.value)
    load_config("teacher_student", steps=100)  # equal is fine
    code, line = cli_in_process(capsys, "run", "teacher_student", "--steps", "30", "--out", "x")
    assert code == 2 and line.startswith("dynamics: error: --steps must be at least the config's")


def test_two_probes_writing_one_group_leave_one_line_that_says_what_to_do(tmp_path, quiet_trainer):
    path = tmp_path / "run.h5"
    recorder = DynamicsRecorder(path, probes=[HiddenStateNorms(), ActivationBias()])
    with pytest.warns(UserWarning, match="a group has one writer"):
        quiet_trainer(max_steps=2, limit_val_batches=0, callbacks=[recorder]).fit(_ValidatedMLP())
    run = dynamics.open_run(path)
    (event,) = [e for e in run.events() if e.probe == "activation_bias"]
    assert event.kind == "disabled" and "ValueError" not in event.message
    assert "'activation_bias' is written by probe 'hidden' already" in event.message
    assert np.isfinite(run.series("activation_bias")["mean"]).all()  # HiddenStateNorms' rows
