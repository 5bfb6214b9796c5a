"""The one rule by which every probe and every offline tool finds a module's loss.

A module that defines ``dynamics_loss(batch)`` is asked for it; otherwise its ``training_step``
is called with logging switched off, and the loss is its tensor output or ``output["loss"]``.
Modules never have to change to be recorded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


def module_loss(module: nn.Module, batch: Any, batch_idx: int = 0) -> torch.Tensor:
    """The scalar training loss of ``module`` on ``batch``, by the rule above.

    Raises:
        TypeError: if the module offers neither ``dynamics_loss`` nor a ``training_step`` whose
            output is a scalar tensor or a mapping with a ``"loss"`` tensor.
    """
    if hasattr(module, "dynamics_loss"):
        loss = module.dynamics_loss(batch)
    elif hasattr(module, "training_step"):
        with _logging_suppressed(module):
            output = module.training_step(batch, batch_idx)
        loss = output.get("loss") if isinstance(output, dict) else output
    else:
        raise TypeError(f"{type(module).__name__} has neither dynamics_loss nor training_step")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            f"{type(module).__name__}'s loss must be a scalar tensor, got {type(loss).__name__}"
        )
    return loss.reshape(())


@contextmanager
def _logging_suppressed(module: nn.Module) -> Iterator[None]:
    # Extra passes must not add points to the user's logs (or trip Lightning's checks on
    # logging from outside a loop), so log/log_dict are shadowed on the instance for the call.
    shadowed = [name for name in ("log", "log_dict") if hasattr(module, name)]
    for name in shadowed:
        setattr(module, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for name in shadowed:
            delattr(module, name)
