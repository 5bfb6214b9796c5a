"""What a fit is, as JSON the run file keeps: the training loop and its loss rule, the module's
submodules (and which of them ``torch.compile`` compiled), the optimizers and schedulers with
their hyperparameters, and the training data when the loop can describe it.

The recorder stores these at the first training batch, so that two runs of any project (not
only runs whose ``config=`` says what they are) can be compared offline for what they share.
Values that are not JSON (a tensor, a function) become stable text — a tensor's value or shape,
an object's class name — never an address that would make two equal runs look different.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence, Sized
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from dynamics.callbacks.fit import Fit
from dynamics.model.record import class_path
from dynamics.params.naming import compiled_modules, named_submodules
from dynamics.store import names

__all__ = [
    "class_path",
    "compiled_modules",
    "data_description",
    "fit_attributes",
    "optimizer_settings",
    "plain",
    "scheduler_settings",
    "submodules",
]


def fit_attributes(fit: Fit) -> dict[str, Any]:
    """The root attributes describing the fit: the loop and its loss rule, submodules,
    optimizers, schedulers, precision and data. One that cannot be described (a custom
    scheduler whose ``state_dict`` raises) is left out with a warning, so that it reads "not
    recorded" and the fit goes on."""
    describe: dict[str, Callable[[], Any]] = {
        names.ATTR_LOOP: lambda: fit.loop,
        names.ATTR_LOSS_RULE: lambda: fit.loss_rule.to_dict(),
        names.ATTR_SUBMODULES: lambda: submodules(fit.module),
        names.ATTR_COMPILED: lambda: compiled_modules(fit.module),
        names.ATTR_OPTIMIZERS: lambda: optimizer_settings(fit),
        names.ATTR_SCHEDULERS: lambda: scheduler_settings(fit),
        names.ATTR_PRECISION: lambda: str(fit.precision),
        names.ATTR_DATA: lambda: data_description(fit),
    }
    described = {}
    for name, how in describe.items():
        try:
            described[name] = json.loads(json.dumps(how()))  # JSON, as the file stores it
        except Exception as error:
            fit.warn(
                f"DynamicsRecorder: the run's {name} is not recorded "
                f"({type(error).__name__}: {error})"
            )
    return described


def plain(value: Any) -> Any:
    """``value`` as JSON-safe data: containers kept, scalars and one-element tensors as
    numbers, other tensors as their shape, other objects as ``str(value)`` (a path, a module's
    repr) unless that holds a memory address (a function), then as ``<their name>``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else f"tensor{tuple(value.shape)}"
    if hasattr(value, "item") and getattr(value, "shape", None) == ():  # numpy scalars
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    text = str(value)
    if " at 0x" not in text:
        return text
    return f"<{getattr(value, '__qualname__', None) or type(value).__qualname__}>"


def submodules(module: nn.Module) -> dict[str, list[str]]:
    """``{name: [class path, extra_repr()]}`` of every submodule: what the layout cannot show
    (an activation's class, a convolution's stride, a dropout's rate). ``torch.compile``'s
    wrappers are left out, as in the layout: compiled or not, one model has one description
    (whether it was compiled is :func:`compiled_modules`'s)."""
    return {
        name: [class_path(child), child.extra_repr()] for name, child in named_submodules(module)
    }


def optimizer_settings(fit: Fit) -> list[dict[str, Any]]:
    """Each optimizer's class and its parameter groups' hyperparameters (the parameters
    themselves left out, their count kept)."""
    return [
        {
            "class_path": class_path(optimizer),
            "param_groups": [
                {k: plain(v) for k, v in group.items() if k != "params"}
                | {"n_tensors": len(group["params"])}
                for group in optimizer.param_groups
            ],
        }
        for optimizer in fit.optimizers
    ]


def scheduler_settings(fit: Fit) -> list[dict[str, Any]]:
    """Each learning-rate scheduler's class, when it steps, and the public part of its state
    (step sizes, factors, base learning rates), as at the first training batch."""
    return [
        {
            "class_path": class_path(config.scheduler),
            "interval": config.interval,
            "frequency": config.frequency,
            "state": {
                k: plain(v)
                for k, v in config.scheduler.state_dict().items()
                if not k.startswith("_") and k != "last_epoch"  # progress, not setting
            },
        }
        for config in fit.schedulers
    ]


def data_description(fit: Fit) -> dict[str, Any]:
    """The DataModule's class and saved hyperparameters, and each training loader's dataset
    class, length, batch size and sampler; empty when the loop knows neither."""
    described: dict[str, Any] = {}
    datamodule = fit.datamodule
    if datamodule is not None:
        described["datamodule"] = {
            "class_path": class_path(datamodule),
            "init_args": plain(dict(getattr(datamodule, "hparams_initial", {}) or {})),
        }
    loaders = _leaves(fit.train_dataloader)
    if loaders:
        described["train"] = [_loader(loader) for loader in loaders]
    return described


def _loader(loader: Any) -> dict[str, Any]:
    if not isinstance(loader, DataLoader):
        return {"iterable": class_path(loader)}
    dataset = loader.dataset
    return {
        "dataset": class_path(dataset),
        "length": len(dataset) if isinstance(dataset, Sized) else None,
        "batch_size": loader.batch_size,
        "sampler": class_path(loader.sampler),
        "drop_last": loader.drop_last,
    }


def _leaves(loaders: Any) -> list[Any]:
    """The loaders of a loop's train iterables (one, or a list or dict of them)."""
    if loaders is None:
        return []
    if isinstance(loaders, Mapping):
        return [leaf for key in sorted(loaders) for leaf in _leaves(loaders[key])]
    if isinstance(loaders, Sequence) and not isinstance(loaders, (str, DataLoader)):
        return [leaf for item in loaders for leaf in _leaves(item)]
    return [loaders]
