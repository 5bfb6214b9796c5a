"""The probe batch a run stored, rebuilt with its structure."""

from __future__ import annotations

from typing import Any

import torch

from dynamics.errors import DynamicsError
from dynamics.geometry.plane import missing_plane_data
from dynamics.params.batch_tree import unflatten_batch
from dynamics.store import Run, names


def probe_batch(run: Run) -> Any:
    """The stored probe batch, rebuilt with its structure (dicts, lists, tuples, named
    tuples; see :mod:`dynamics.params.batch_tree`).

    A file from before the structure was stored gives its tensors as a tuple (one tensor
    alone when there is one).

    Example::

        batch = probe_batch(run)  # as the loop handed it to the module
        loss = recorded_loss_rule(run)(rebuild_module(run), batch)  # the run's own loss

    Raises:
        DynamicsError: the run stores no probe batch, or one that cannot be rebuilt.
    """
    leaf_names = sorted(
        (n for n in run.vector_names if n.startswith(names.PROBE_BATCH_PREFIX)),
        key=lambda n: int(n.rpartition(".")[2]),
    )
    leaves = [run.vector(n) for n in leaf_names]
    structure = next(
        (
            probe["settings"][names.PROBE_BATCH_STRUCTURE]
            for probe in run.attrs.get(names.ATTR_PROBES) or ()
            if names.PROBE_BATCH_STRUCTURE in (probe.get("settings") or {})
        ),
        None,
    )
    if any(leaf is None for leaf in leaves) or not (leaves or structure):
        raise missing_plane_data(run, "probe batch")
    tensors = [torch.from_numpy(leaf) for leaf in leaves]
    if structure is None:
        return tuple(tensors) if len(tensors) > 1 else tensors[0]
    try:
        return unflatten_batch(structure, tensors)
    except ValueError as error:
        raise DynamicsError(f"{run.path.name}: {error}") from None
