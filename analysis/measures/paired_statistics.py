"""Paired statistics across seeds: how sure a difference between two groups of runs is.

Runs are paired by seed; each measure gives one number per seed (a difference, a ratio, or a
value such as a crossover step). With at most :data:`SIGN_TEST_MAX_SEEDS` seeds the interval is
the range of the per-seed numbers, a distribution-free interval for their median whose exact
confidence is ``1 − 2^(1−n)`` (75 % for 3 seeds, 93.75 % for 5); with more seeds it is a 95 %
BCa bootstrap interval of the mean (``scipy.stats.bootstrap``, fixed seed, geometric mean for
ratios). The exact two-sided sign test against no difference (0, or 1 for a ratio) is reported
in both cases, with the count of seeds that agree with the majority's sign.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = [
    "BOOTSTRAP_CONFIDENCE",
    "DIFFERENCE",
    "RATIO",
    "SIGN_TEST_MAX_SEEDS",
    "VALUE",
    "PairedStatistic",
    "paired_statistic",
    "sign_test",
]

#: Up to this many seeds the interval is the range (order statistics); above, a bootstrap.
SIGN_TEST_MAX_SEEDS = 5
#: Confidence of the bootstrap interval.
BOOTSTRAP_CONFIDENCE = 0.95
#: Kinds of measure: what "no difference" is and how the centre is taken.
DIFFERENCE, RATIO, VALUE = "difference", "ratio", "value"
_NULL = {DIFFERENCE: 0.0, RATIO: 1.0}


@dataclass(frozen=True)
class PairedStatistic:
    """One measure over paired seeds.

    Attributes:
        measure: what is measured (``"final held-out loss, shifted − unshifted"``).
        kind: :data:`DIFFERENCE` (other − reference), :data:`RATIO` (other / reference) or
            :data:`VALUE` (a per-seed value such as a crossover step: no sign test).
        seeds: the seeds measured, in order.
        values: the per-seed numbers.
        centre: mean (difference, value) or geometric mean (ratio); None without seeds.
        low: the interval's lower end, or None with fewer than two seeds.
        high: the interval's upper end, or None.
        confidence: the interval's confidence (exact for the range), or None.
        method: how the interval was made, in words.
        p_value: exact two-sided sign test against no difference; None for a value.
        agree: seeds whose sign (relative to no difference) is the majority's; for a value,
            the seeds that have one.
        missing: seeds paired but not measured (e.g. no crossover, λ1 not recorded), why.
    """

    measure: str
    kind: str
    seeds: tuple[int, ...]
    values: tuple[float, ...]
    centre: float | None
    low: float | None
    high: float | None
    confidence: float | None
    method: str
    p_value: float | None
    agree: int
    missing: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values."""
        return {key: list(v) if isinstance(v, tuple) else v for key, v in asdict(self).items()}


def sign_test(values: Sequence[float], null: float = 0.0) -> tuple[float, int]:
    """Exact two-sided sign test of ``values`` against ``null``.

    Values equal to ``null`` are dropped (the usual convention). Returns ``(p, agree)``: the
    p-value ``min(1, 2 · P(X ≤ min(k, m − k)))`` for ``X ~ Binomial(m, 1/2)`` with ``k``
    values above and ``m`` not equal to ``null``, and the count ``max(k, m − k)`` on the
    majority's side.
    """
    x = np.asarray(values, dtype=float) - null
    above, below = int((x > 0).sum()), int((x < 0).sum())
    m, k = above + below, min(above, below)
    if m == 0:
        return 1.0, 0
    tail = sum(math.comb(m, i) for i in range(k + 1)) / 2**m
    return min(1.0, 2 * tail), max(above, below)


def paired_statistic(
    measure: str,
    kind: str,
    seeds: Sequence[int],
    values: Sequence[float],
    missing: Sequence[str] = (),
    random_state: int = 0,
) -> PairedStatistic:
    """Centre, interval, sign test and agreement of per-seed numbers (module docstring).

    Args:
        measure: what is measured, in words.
        kind: :data:`DIFFERENCE`, :data:`RATIO` or :data:`VALUE`.
        seeds: one seed per value.
        values: the per-seed numbers (ratios must be positive).
        missing: seeds paired but not measured, each with why.
        random_state: the bootstrap's seed, so a page is reproducible.

    Example::

        paired_statistic("final loss", DIFFERENCE, {0: -0.1, 1: -0.2, 2: -0.15})
    """
    x = np.asarray(values, dtype=float)
    n = x.size
    log = kind == RATIO  # ratios are averaged and resampled on the log scale
    scale = np.log(x) if log else x
    back = np.exp if log else float
    centre = float(back(scale.mean())) if n else None
    p_value, agree = None, n
    if kind != VALUE and n:
        p_value, agree = sign_test(x, _NULL[kind])
    low = high = confidence = None
    if n < 2:
        method = f"{n} seed{'s' if n != 1 else ''}: no interval"
    elif n <= SIGN_TEST_MAX_SEEDS:
        low, high = float(x.min()), float(x.max())
        confidence = 1 - 2.0 ** (1 - n)
        method = f"range of {n} seeds (exact {confidence:.2%} interval for the median)"
    elif np.ptp(scale) == 0:  # every resample is the same: the bootstrap has nothing to spread
        low = high = centre
        confidence = BOOTSTRAP_CONFIDENCE
        method = f"{n} identical values"
    else:
        from scipy.stats import bootstrap  # scipy loads slowly; only grouped compares need it

        result = bootstrap(
            (scale,),
            np.mean,
            confidence_level=BOOTSTRAP_CONFIDENCE,
            method="BCa",
            n_resamples=9999,
            random_state=random_state,
        )
        low = float(back(result.confidence_interval.low))
        high = float(back(result.confidence_interval.high))
        confidence = BOOTSTRAP_CONFIDENCE
        mean = "geometric mean" if log else "mean"
        method = f"BCa bootstrap of the {mean} over {n} seeds ({confidence:.0%})"
    return PairedStatistic(
        measure=measure,
        kind=kind,
        seeds=tuple(int(s) for s in seeds),
        values=tuple(float(v) for v in x),
        centre=centre,
        low=low,
        high=high,
        confidence=confidence,
        method=method,
        p_value=p_value,
        agree=agree,
        missing=tuple(missing),
    )
