"""The one smoother the analysis uses: a centred moving average truncated at the ends."""

from __future__ import annotations

import numpy as np

#: Half-width of the moving average, as a fraction of a series' records: the smoothing of the
#: overshoot detector and of the comparisons alike (why 0.02: ``docs/overshoot.md``).
SMOOTH_FRACTION = 0.02


def moving_average(x: np.ndarray, half_width: int) -> np.ndarray:
    """Centred moving average over ``2 * half_width + 1`` records, truncated at the ends.

    Truncation (fewer records near the ends, never padding) keeps a monotone series monotone, so
    smoothing cannot invent an overshoot.
    """
    x = np.asarray(x, dtype=float)
    if half_width < 1:
        return x.copy()
    n = x.size
    # Centre before the cumulative sum so long series with a large offset keep their precision.
    offset = np.median(x) if n else 0.0
    csum = np.concatenate(([0.0], np.cumsum(x - offset)))
    idx = np.arange(n)
    lo = np.maximum(idx - half_width, 0)
    hi = np.minimum(idx + half_width + 1, n)
    return (csum[hi] - csum[lo]) / (hi - lo) + offset
