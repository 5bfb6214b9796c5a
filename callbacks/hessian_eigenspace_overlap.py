"""How fast the top-k Hessian eigenspace rotates between ``HessianSpectrum`` rows, and how much of
the update between them moved along it."""

from __future__ import annotations

import math
from typing import Any

import torch

from dynamics.callbacks.hessian_measurement import HessianMeasurement, SpectrumRow
from dynamics.callbacks.probe import SeriesSpec
from dynamics.geometry.subspace_overlap import subspace_overlap, update_share
from dynamics.params.vectors import flatten
from dynamics.store import names
from dynamics.store.views import standard_view


class EigenspaceOverlap(HessianMeasurement):
    """``overlap_previous`` (``‖V_sᵀ V_t‖²_F / k``) and ``update_share``
    (``‖V_s (θt − θs)‖² / ‖θt − θs‖²``) against the previous row; NaN on a fit's first row.
    Holds one parameter vector (θ at the previous row; whole on every rank under FSDP too),
    kept in checkpoints.

    Example::

        HessianSpectrum(k=5, measurements=[EigenspaceOverlap()])
    """

    may_be_nan = (names.HESSIAN_OVERLAP, names.HESSIAN_UPDATE_SHARE)

    def __init__(self) -> None:
        self._theta: torch.Tensor | None = None  # θ at the previous row

    def series(self, k: int, size: int) -> dict[str, dict[str, SeriesSpec]]:
        return {
            names.HESSIAN: {
                name: SeriesSpec(view=standard_view(names.HESSIAN, name))
                for name in (names.HESSIAN_OVERLAP, names.HESSIAN_UPDATE_SHARE)
            }
        }

    def measure(self, row: SpectrumRow) -> dict[str, dict[str, Any]]:
        theta = flatten(row.operator.params).detach()
        previous, vectors = row.previous, row.pairs.eigenvectors
        first = previous is None or self._theta is None
        overlap = math.nan if first else subspace_overlap(vectors, previous)
        share = math.nan if first else update_share(theta - self._theta, previous)
        self._theta = theta
        return {names.HESSIAN: {names.HESSIAN_OVERLAP: overlap, names.HESSIAN_UPDATE_SHARE: share}}

    def teardown(self) -> None:
        self._theta = None

    def state_dict(self) -> dict[str, Any]:
        return {} if self._theta is None else {"theta": self._theta.cpu()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._theta = state.get("theta")
