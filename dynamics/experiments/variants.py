"""What the shift experiments' variants share: one θ0 whatever the shift, one probe batch,
the curvature probe their record section asks for."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from dynamics.bias import shift_activations
from dynamics.callbacks import HessianSpectrum
from dynamics.experiments.registry import Built

NetworkT = TypeVar("NetworkT", bound=nn.Module)


def shifted_network(
    build: Callable[[], NetworkT],
    seed: int,
    shift: str | float,
    *,
    include: Sequence[str] = (),
    dim: int = -1,
) -> NetworkT:
    """``build()`` under ``seed`` (the global random state left as it was), then its
    activations shifted unless ``shift`` is ``"none"``.

    Surgery keeps the parameters, so equal seeds give equal θ0 whatever the shift.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        network = build()
    if shift != "none":
        shift_activations(network, shift, include=include, dim=dim)
    return network


def shared_probe_batch(built: Mapping[str, Built]) -> Any:
    """The first variant's first training batch: the probe batch every variant records on
    (their data are built alike, so any variant's would do)."""
    data = next(iter(built.values())).data
    data.setup("fit")
    return next(iter(data.train_dataloader()))


def hessian_probes(top_k: int, every_n_steps: int, probe_batch: Any) -> list[HessianSpectrum]:
    """The top-``top_k`` Hessian probe on the shared probe batch, or none when ``top_k`` is 0
    (an experiment's ``record.hessian_top_k``)."""
    if not top_k:
        return []
    return [HessianSpectrum(k=top_k, every_n_steps=every_n_steps, batch=probe_batch)]
