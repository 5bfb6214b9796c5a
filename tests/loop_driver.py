"""Run files as loops other than Lightning write them, for the offline tools' tests: the recorder
core (:class:`~dynamics.callbacks.recording.Recording`) driven directly through a
:class:`~dynamics.callbacks.fit.Fit`, the way the Hugging Face and plain-loop adapters drive it.

Only for tests: it checks what offline tools do with a file, not how a loop's adapter behaves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dynamics.callbacks.fit import Fit
from dynamics.callbacks.probe import Probe
from dynamics.callbacks.recording import Recording
from dynamics.passes.loss_rule import LossRule
from dynamics.store import names


def record(
    path: str | Path,
    module: nn.Module,
    batches: Iterable[Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    *,
    loop: str,
    loss_rule: LossRule,
    probes: Sequence[Probe],
    lr: float = 1e-2,
) -> Path:
    """Train ``module`` one optimizer step per batch (AdamW, ``lr``), its loss ``loss_fn``,
    recorded into ``path`` as ``loop`` with ``loss_rule``; the path."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.0)
    fit = Fit(module, loop=loop, optimizers=[optimizer], loss_rule=loss_rule)
    recording = Recording(path, probes=list(probes))
    recording.begin(fit)
    for batch in batches:
        recording.batch_start(fit, batch)
        loss = loss_fn(module, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        fit.global_step += 1
        recording.batch_end(fit, batch, loss.detach())
    recording.train_end(fit)
    recording.close(fit, names.FINISHED)
    return Path(path)


class PlainNet(nn.Module):
    """A plain ``nn.Module`` (no Lightning, no saved hyperparameters, no init args)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(3, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)))


def plain_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A plain loop's module-level loss function, which offline tools can import (trusted)."""
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def plain_batches(count: int = 4, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(count, size, 3, generator=generator)
    return [(xi, xi.sum(1, keepdim=True).sin()) for xi in x]
