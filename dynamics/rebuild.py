"""Rebuilding a run's model offline from what the run file recorded at fit time."""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from dynamics.errors import DynamicsError
from dynamics.store import Run, names


def rebuild_module(run: Run) -> nn.Module:
    """The run's module class, instantiated with its recorded init args, at θ0.

    Raises:
        DynamicsError: the class cannot be imported or instantiated from the recorded args
            (e.g. a module whose ``__init__`` takes objects that were not saved as hparams).
    """
    spec = run.attrs.get(names.ATTR_MODULE) or {}
    class_path = spec.get("class_path", "")
    module_name, _, class_name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
        module = cls(**(spec.get("init_args") or {}))
    except Exception as error:  # any failure of user code means: cannot rebuild offline
        raise DynamicsError(
            f"{run.path.name}: cannot rebuild model {class_path or '(not recorded)'} offline "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
        ) from None
    from dynamics.params import load_vector

    theta0 = run.vector(names.THETA0)
    if theta0 is None or run.layout is None:
        raise DynamicsError(f"{run.path.name}: no θ0 or parameter layout recorded")
    try:
        load_vector(module, torch.from_numpy(theta0), run.layout)
    except ValueError as error:
        raise DynamicsError(f"{run.path.name}: rebuilt model does not match: {error}") from None
    return module


def probe_batch(run: Run) -> Any:
    """The stored probe batch (``probe_batch.<i>`` vectors) as a tuple of tensors.

    Raises:
        DynamicsError: the run stores no probe batch.
    """
    leaf_names = sorted(
        (n for n in run.vector_names if n.startswith(names.PROBE_BATCH_PREFIX)),
        key=lambda n: int(n.rpartition(".")[2]),
    )
    leaves = [run.vector(n) for n in leaf_names]
    if not leaves or any(leaf is None for leaf in leaves):
        raise DynamicsError(f"{run.path.name}: no probe batch stored (record with GradientPlane)")
    tensors = tuple(torch.from_numpy(leaf) for leaf in leaves)
    return tensors if len(tensors) > 1 else tensors[0]
