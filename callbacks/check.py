"""``check_probe``: a user's own test that a probe keeps the contract of ``callbacks/probe.py``."""

from __future__ import annotations

import copy
import io
import pickle
import random
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

from dynamics.callbacks.probe import Probe
from dynamics.callbacks.recorder import DynamicsRecorder
from dynamics.store import Series, SeriesSpec, open_run

#: Hooks that see the module, so must leave it (and the RNG) as they found it.
_MODULE_HOOKS = (
    "validate",
    "setup",
    "on_step_start",
    "on_micro_batch_end",
    "on_before_optimizer_step",
    "on_step_end",
    "on_validation_end",
    "final_vectors",
)
_ROW_HOOKS = ("on_step_end", "on_validation_end")


def check_probe(probe: Probe, module: nn.Module, batch: Any, steps: int = 3) -> dict[str, Series]:
    """Record ``probe`` for a few CPU training steps on ``module`` and check its contract.

    The fit trains copies of ``module`` and ``probe`` on ``batch`` repeated ``steps`` times
    (then validates on it once, when the module has a ``validation_step``), with the recorder
    set to raise any probe error. It checks that:

    - rows match the declared series: names, shapes, and the kind of dtype (float, integer);
    - ``.grad``, parameters, buffers, train/eval flags and the RNGs (torch, NumPy, Python) are
      the same after each hook that sees the module as before it;
    - ``state_dict`` holds only tensors and plain values (Lightning loads checkpoints with
      ``torch.load(weights_only=True)``, which refuses anything else), and a fresh probe that
      loads it, saved and loaded so, returns the same state.

    Example::

        series = check_probe(MyProbe(), MyModule(), next(iter(loader)), steps=3)
        series["my_group"].values

    Args:
        probe: the probe to check (not modified).
        module: a LightningModule of either namespace (not modified).
        batch: one training batch, as the module's dataloader yields it.
        steps: optimizer steps to record.

    Returns:
        The probe's recorded series, ``{group: Series}``.

    Raises:
        AssertionError: the contract is broken (the message says where), or a hook raised.
    """
    lightning, recorder_class = _namespace(module)
    original, probe, module = probe, copy.deepcopy(probe), copy.deepcopy(module)
    loader = DataLoader([batch] * steps, batch_size=None)
    validates = type(module).validation_step is not lightning.LightningModule.validation_step
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "check.h5"
        recorder = recorder_class(path, [_Audited(probe, module)], on_probe_error="raise")
        trainer = lightning.Trainer(
            max_steps=steps,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=1 if validates else 0,
            callbacks=[recorder],
        )
        try:
            trainer.fit(module, loader, loader if validates else None)
        except AssertionError:
            raise
        except Exception as error:
            raise AssertionError(f"{type(original).__name__}: {error}") from error
        run = open_run(path)
        series = {group: run.series(group) for group in run.groups}
    state = probe.state_dict()
    checkpoint = io.BytesIO()
    torch.save(state, checkpoint)  # a checkpoint must be able to hold it
    checkpoint.seek(0)
    try:  # and Lightning's default load to take it back
        loaded = torch.load(checkpoint, weights_only=True)
    except pickle.UnpicklingError as error:
        refused = str(error).split("WeightsUnpickler error: ")[-1].splitlines()[0]
        raise AssertionError(
            f"{type(original).__name__}.state_dict() holds more than tensors and plain values, "
            f"which a checkpoint loaded with weights_only=True (Lightning's default) refuses: "
            f"{refused}"
        ) from None
    fresh = copy.deepcopy(original)
    fresh.load_state_dict(loaded)
    assert _same(fresh.state_dict(), state), (
        f"{type(original).__name__}.load_state_dict(state) then state_dict() differs from state"
    )
    return series


class _Audited:
    """Stands in for a probe in the check's recorder: every hook that sees the module is
    compared before and after, and rows are compared with the declared series."""

    def __init__(self, probe: Probe, module: nn.Module) -> None:
        self._probe = probe
        self._module = module

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._probe, attr)
        if attr not in _MODULE_HOOKS:
            return value

        def audited(*args: Any) -> Any:
            before = _State(self._module)
            result = value(*args)
            changed = before.changes(_State(self._module))
            assert not changed, f"{type(self._probe).__name__}.{attr} changed {', '.join(changed)}"
            if attr in _ROW_HOOKS:
                _check_dtypes(self._probe, attr, result)
            return result

        return audited


class _State:
    """What a probe's hooks must leave as they found it."""

    def __init__(self, module: nn.Module) -> None:
        self.tensors = {
            **{f"parameter {n}": p.detach().clone() for n, p in module.named_parameters()},
            **{f"buffer {n}": b.clone() for n, b in module.named_buffers()},
            **{
                f".grad of {n}": p.grad.clone()
                for n, p in module.named_parameters()
                if p.grad is not None
            },
        }
        self.grads = {n: p.grad for n, p in module.named_parameters()}  # the same objects
        self.flags = {n: m.training for n, m in module.named_modules()}
        self.rng = [torch.get_rng_state(), *_cuda_rng_states()]
        self.numpy_rng = np.random.get_state()
        self.python_rng = random.getstate()

    def changes(self, after: _State) -> list[str]:
        changed = [
            name
            for name, tensor in self.tensors.items()
            if name not in after.tensors or not _equal(tensor, after.tensors[name])
        ]
        changed += [
            f".grad of {n} (object)" for n, g in self.grads.items() if after.grads[n] is not g
        ]
        changed += [
            f"train/eval flag of {n or 'the module'}" for n in _differ(self.flags, after.flags)
        ]
        if len(self.rng) != len(after.rng) or not all(map(torch.equal, self.rng, after.rng)):
            changed.append("the torch RNG")
        if not _same(list(self.numpy_rng), list(after.numpy_rng)):
            changed.append("the NumPy RNG")
        if self.python_rng != after.python_rng:
            changed.append("the Python RNG")
        return changed


def _check_dtypes(probe: Probe, hook: str, rows: dict[str, dict[str, Any]]) -> None:
    declared = {group: specs for group, specs in probe.series().items()}
    for group, values in rows.items():
        for name, value in values.items():
            spec: SeriesSpec = declared[group][name]
            kind = _kind(value)
            expected = "f" if spec.dtype == "bfloat16" else np.dtype(spec.dtype).kind
            assert kind == expected or {kind, expected} == {"i", "u"}, (
                f"{type(probe).__name__}.{hook} row {group}/{name} has dtype kind {kind!r}, "
                f"declared {spec.dtype}"
            )


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "f" if value.is_floating_point() else "b" if value.dtype == torch.bool else "i"
    return np.asarray(value).dtype.kind


def _cuda_rng_states() -> list[torch.Tensor]:
    # Reading CUDA generators would initialise CUDA in a CPU-only process.
    return torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.isnan(), b.isnan())
        and (
            torch.equal(a.nan_to_num(), b.nan_to_num())
            if a.is_floating_point()
            else torch.equal(a, b)
        )
    )


def _differ(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return [k for k in a.keys() | b.keys() if a.get(k) != b.get(k)]


def _same(a: Any, b: Any) -> bool:
    """Equal values through nested dicts, lists and tuples of tensors, arrays and scalars."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(_same(x, y) for x, y in zip(a, b))
        )
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and _equal(a.cpu(), b.cpu())
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
    return a == b


def _namespace(module: nn.Module) -> tuple[ModuleType, type]:
    """The module's Lightning namespace, and the recorder for it."""
    lightning_pytorch = sys.modules.get("lightning.pytorch")
    if lightning_pytorch is not None and isinstance(module, lightning_pytorch.LightningModule):
        from dynamics.callbacks.lightning import DynamicsRecorder as LightningRecorder

        return lightning_pytorch, LightningRecorder
    return pl, DynamicsRecorder
