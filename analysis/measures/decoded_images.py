"""The decoded images :class:`~dynamics.callbacks.BiasComponent` stores: per layer, the full,
bias-only and remainder-only decodes of a few fixed examples at thinned steps, beside their
targets (seed 002, Fig. 5). Drawn by :mod:`dynamics.analysis.figures.decoded_images`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynamics.store import Run, names

__all__ = ["DECODES", "DecodedImages", "decoded_images", "shown_rows"]

#: The decodes of a stored row, in their stored order.
DECODES = ("full", "bias-only", "remainder-only")


@dataclass(frozen=True)
class DecodedImages:
    """One run's stored decodes.

    Attributes:
        layers: the split layers.
        step: steps of the stored rows, shape (n,).
        decodes: shape (n, layers, 3 decodes, examples, C, H, W).
        target: the examples' targets, shape (examples, C, H, W).
    """

    layers: tuple[str, ...]
    step: np.ndarray
    decodes: np.ndarray
    target: np.ndarray


def decoded_images(run: Run) -> DecodedImages | None:
    """The decoded images ``run`` stores, or None when it stores none."""
    rows = run.recorded(names.BIAS_COMPONENT_IMAGES)
    target = run.vector(names.BIAS_COMPONENT_TARGET)
    if rows is None or target is None:
        return None
    layers = run.columns(names.BIAS_COMPONENT, "bias_share")
    return DecodedImages(layers, rows.step, rows[names.BIAS_COMPONENT_DECODES], target)


def shown_rows(step: np.ndarray) -> list[int]:
    """Indices of the rows shown: early (the first after step 0), middle (the median of the
    rows after it: :class:`~dynamics.callbacks.BiasComponent` spaces rows geometrically, so
    its step is near the geometric mean of the others) and late (the last); fewer when fewer
    rows are stored."""
    last = len(step) - 1
    early = min(1, last)
    return sorted({early, (early + last) // 2, last})
