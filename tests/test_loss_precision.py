"""LossChangeSplit measures in the precision the loss allows (issue 22, item 5).

Under ``model.double()`` a Hugging Face causal LM still returns its loss in float32 (it casts
its logits), so no row could meet a float64 tolerance and every row blamed "kinked activations
such as ReLU" on a GELU model. The tolerance now comes from the loss's own dtype, and the run
file says why; a loss that is float64 keeps the tight tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

from dynamics import open_run
from dynamics.callbacks import DynamicsRecorder, LossChangeSplit
from dynamics.passes.loss_change import split_loss_change
from dynamics.store import names
from tests.conftest import make_quiet_trainer


class TinyGPT2(pl.LightningModule):
    """A one-block GPT-2 from a config, trained on dict batches of token ids."""

    def __init__(self) -> None:
        super().__init__()
        config = GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16, n_positions=8)
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        ids = torch.randint(0, 16, (16, 8), generator=torch.Generator().manual_seed(0))
        return DataLoader([{"input_ids": row} for row in ids], batch_size=4)


class DoubleMLP(pl.LightningModule):
    """A float64 GELU network whose loss is float64 too."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 3)).double()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        return DataLoader(list(zip(x, (x[:, 0] > 0).long())), batch_size=4)


def fit(module: pl.LightningModule, path) -> object:
    torch.manual_seed(0)
    make_quiet_trainer(
        max_steps=3,
        callbacks=[DynamicsRecorder(path, [LossChangeSplit(every_n_steps=1)])],
    ).fit(module)
    return open_run(path)


def rows(run) -> dict[str, np.ndarray]:
    return run.series(names.LOSS_CHANGE).values


def test_a_float32_loss_of_a_double_gpt2_is_measured_to_float32(tmp_path):
    torch.manual_seed(0)
    module = TinyGPT2().double()
    batch = next(iter(module.train_dataloader()))
    assert module.training_step(batch, 0).dtype == torch.float32  # what the model does
    run = fit(module, tmp_path / "gpt2.h5")
    values = rows(run)
    assert len(values[names.LOSS_CHANGE_CONVERGED]) == 3
    assert values[names.LOSS_CHANGE_CONVERGED].tolist() == [1, 1, 1]
    # Met within float32's rounding of the loss, which no float64 tolerance would accept.
    floor = 1e3 * torch.finfo(torch.float32).eps * np.abs(values[names.LOSS_CHANGE_LOSS])
    assert (np.abs(values[names.LOSS_CHANGE_RESIDUAL]) <= floor).all()
    messages = [e.message for e in run.events() if e.probe == names.LOSS_CHANGE]
    assert messages and all("comes back in float32" in m for m in messages), messages
    assert not any("ReLU" in m for m in messages)


def test_a_float64_loss_keeps_the_float64_tolerance(tmp_path):
    run = fit(DoubleMLP(), tmp_path / "mlp.h5")
    values = rows(run)
    assert values[names.LOSS_CHANGE_CONVERGED].tolist() == [1, 1, 1]
    tight = np.maximum(
        1e-6 * np.abs(values[names.LOSS_CHANGE_DELTA]),
        1e3 * torch.finfo(torch.float64).eps * np.abs(values[names.LOSS_CHANGE_LOSS]),
    )
    assert (np.abs(values[names.LOSS_CHANGE_RESIDUAL]) <= tight * (1 + 1e-9)).all()
    assert not [e for e in run.events() if e.probe == names.LOSS_CHANGE]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_tolerance_follows_the_dtype_the_loss_comes_back_in(dtype):
    # Float64 parameters in both cases: only the loss's own dtype differs.
    start, end = [torch.tensor([1.0, 2.0], dtype=torch.float64)], [torch.tensor([0.9, 2.1])]
    end = [end[0].double()]
    split = split_loss_change(lambda t: ((t[0] ** 2).sum() + 1e4).to(dtype), start, end, [0])
    loss = max(abs(split.loss_before), abs(split.loss_after))
    floor = 1e3 * torch.finfo(dtype).eps * loss
    assert split.loss_dtype == dtype
    assert split.tolerance == pytest.approx(max(1e-6 * abs(split.delta), floor), rel=1e-12)
