"""The Hutch++ trace of the Hessian at each ``HessianSpectrum`` row."""

from __future__ import annotations

from typing import Any

from dynamics.callbacks.hessian_measurement import HessianMeasurement, SpectrumRow
from dynamics.callbacks.probe import SeriesSpec
from dynamics.curvature import hutch_plus_plus
from dynamics.errors import ParameterError
from dynamics.store import names
from dynamics.store.views import standard_view


class HessianTrace(HessianMeasurement):
    """``trace`` and ``trace_stderr``: the Hutch++ estimate of ``tr H`` from ``hvp`` products
    and its standard error (:func:`dynamics.curvature.hutch_plus_plus`).

    Example::

        HessianSpectrum(k=5, measurements=[HessianTrace(hvp=60)])
    """

    def __init__(self, hvp: int) -> None:
        if hvp < 4:
            raise ParameterError("hvp", f"must be at least 4 for Hutch++, got {hvp}")
        self.hvp = hvp

    def series(self, k: int, size: int) -> dict[str, dict[str, SeriesSpec]]:
        view = standard_view(names.HESSIAN, names.HESSIAN_TRACE)
        specs = {
            names.HESSIAN_TRACE: SeriesSpec(view=view),
            names.HESSIAN_TRACE_STDERR: SeriesSpec(),
        }
        return {names.HESSIAN: specs}

    def measure(self, row: SpectrumRow) -> dict[str, dict[str, Any]]:
        trace = hutch_plus_plus(row.operator, self.hvp, seed=row.seed)
        return {
            names.HESSIAN: {
                names.HESSIAN_TRACE: trace.trace,
                names.HESSIAN_TRACE_STDERR: trace.stderr,
            }
        }
