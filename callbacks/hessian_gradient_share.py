"""The share of the gradient inside the top-k Hessian eigenspace at each ``HessianSpectrum`` row."""

from __future__ import annotations

from typing import Any

import torch

from dynamics.callbacks.hessian_measurement import HessianMeasurement, SpectrumRow
from dynamics.callbacks.probe import SeriesSpec
from dynamics.store import names
from dynamics.store.views import standard_view


class GradientShare(HessianMeasurement):
    """``gradient_share``: ``‖P_k g‖² / ‖g‖²`` for the probe-batch gradient ``g`` and the
    projector ``P_k`` on the row's top-k eigenvectors (the operator's gradient: no extra pass;
    under DDP and FSDP alike the gradient of the rank-averaged probe loss).

    Example::

        HessianSpectrum(k=5, measurements=[GradientShare()])
    """

    def series(self, k: int, size: int) -> dict[str, dict[str, SeriesSpec]]:
        view = standard_view(names.HESSIAN, names.HESSIAN_GRADIENT_SHARE)
        return {names.HESSIAN: {names.HESSIAN_GRADIENT_SHARE: SeriesSpec(view=view)}}

    def measure(self, row: SpectrumRow) -> dict[str, dict[str, Any]]:
        gradient = row.operator.gradient
        inside = torch.linalg.vector_norm(row.pairs.eigenvectors @ gradient) ** 2
        share = (inside / torch.linalg.vector_norm(gradient) ** 2).item()
        return {names.HESSIAN: {names.HESSIAN_GRADIENT_SHARE: share}}
