"""Run extra passes (Hessian products, plane evaluations) without perturbing training.

A probe's extra forward/backward must leave the run exactly where it found it: the next
training step has to draw the same dropout masks, normalise with the same BatchNorm running
statistics, see the same train/eval flags and step with the same ``.grad``. Everything such a
pass can touch is saved on entry and put back on exit; values are restored in place, so
references held elsewhere (optimizers, DDP buckets) stay valid.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Literal, get_args

import torch
from torch import nn

#: How an extra pass runs the module. ``"eval"``: every submodule in eval mode — dropout off,
#: BatchNorm on its running statistics — so the pass is a deterministic function of θ.
#: ``"train"``: every submodule's flag as training left it (during a fit, dropout draws and batch
#: statistics, as the training step sees the loss).
Mode = Literal["eval", "train"]

_IN_EXTRA_PASS: ContextVar[bool] = ContextVar("dynamics_in_extra_pass", default=False)


def in_extra_pass() -> bool:
    """Whether the caller runs inside :func:`side_effect_free`.

    Forward hooks that record the *training* forward (hidden-state norms) check this to ignore
    the forwards of extra passes made by other probes at the same step.
    """
    return _IN_EXTRA_PASS.get()


def checked_mode(mode: str) -> Mode:
    """``mode`` if it is a :data:`Mode`.

    Raises:
        ValueError: otherwise.
    """
    if mode not in get_args(Mode):
        raise ValueError(f"mode must be 'eval' or 'train', got {mode!r}")
    return mode


@contextmanager
def side_effect_free(module: nn.Module, mode: Mode = "train") -> Iterator[None]:
    """Undo, on exit, every side effect an extra pass through ``module`` can have.

    Forks the CPU (and any initialised CUDA) random number generators, and saves then restores:
    each submodule's ``training`` flag, every buffer (BatchNorm running statistics and
    ``num_batches_tracked``) by value, and each parameter's ``.grad`` (the same tensor object,
    with the same values). Extra passes should still use :func:`torch.autograd.grad`, never
    ``.backward()``, so that nothing is accumulated in the first place.

    Example::

        with side_effect_free(module, "eval"):
            g = torch.autograd.grad(module_loss(module, batch), params)
        # RNG, buffers, train/eval flags and .grad are as they were

    Args:
        module: the module whose state the pass may touch (normally the whole model).
        mode: the :data:`Mode` the pass runs the module in; the flags are saved before it is
            applied, so every submodule's own flag is restored exactly.
    """
    checked_mode(mode)
    flags = [(m, m.training) for m in module.modules()]
    buffers = [
        (owner, name, buffer, buffer.clone())
        for owner in module.modules()
        for name, buffer in owner.named_buffers(recurse=False)
    ]
    grads = [(p, p.grad, None if p.grad is None else p.grad.clone()) for p in module.parameters()]
    # Forking every visible CUDA device would initialise CUDA in CPU-only runs; a run that
    # has not initialised CUDA has no CUDA generator state to protect.
    cuda_devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    token = _IN_EXTRA_PASS.set(True)
    try:
        if mode == "eval":
            module.eval()
        with torch.random.fork_rng(devices=cuda_devices):
            yield
    finally:
        _IN_EXTRA_PASS.reset(token)
        with torch.no_grad():
            for owner, name, buffer, saved in buffers:
                setattr(owner, name, buffer)  # a pass may have rebound the attribute
                buffer.copy_(saved)
            for p, grad, saved in grads:
                p.grad = grad
                if grad is not None:
                    grad.copy_(saved)
        for m, training in flags:
            # Module.train() recurses into children; set each module's own flag only.
            m.training = training
