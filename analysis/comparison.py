"""Comparison of runs, as numbers: alignment by step, loss crossover, config differences and
the ratio of top Hessian eigenvalues. No HTML and no plotting (see :mod:`.compare`).

Series are aligned by optimizer step: the other run is read at the reference's recorded steps
inside the range both cover, linearly interpolated between its own records (exact where the
schedules agree, as they do for runs of one config).

Losses are compared after a centred moving average over ``2h + 1`` records with
``h = round(SMOOTH_FRACTION * n)`` (no smoothing for short series such as a handful of held-out
evaluations), so that step noise in the training loss does not produce spurious crossovers.

A comparison is only meaningful when the runs differ in the named variant alone: θ0 (its
recorded hash), the data section of the config and every other config key except
:data:`IGNORED_CONFIG_KEYS` are checked (:func:`comparability`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from dynamics.analysis.smoothing import moving_average
from dynamics.store import Metric, Run, names

__all__ = [
    "IGNORED_CONFIG_KEYS",
    "SMOOTH_FRACTION",
    "Check",
    "ComparedLoss",
    "Crossover",
    "align",
    "comparability",
    "compared_loss",
    "config_differences",
    "crossover",
    "differing_keys",
    "eigenvalue_ratio",
    "finite",
    "flatten_config",
    "loss_crossover",
    "smooth",
    "top_eigenvalue",
]

#: Smoothing half-width as a fraction of a loss series' records: about 4% of the run per window,
#: the scale the overshoot detector smooths on as well.
SMOOTH_FRACTION = 0.02
#: Config keys (at any depth) that name the variant rather than change the experiment.
IGNORED_CONFIG_KEYS = frozenset({"variant", "shift", "run_name"})


@dataclass(frozen=True)
class Crossover:
    """Which of two runs ends ahead on a loss, and from which step on.

    Attributes:
        metric: the loss compared (``"held-out loss (val_loss)"`` or ``"train loss"``).
        first_leader: the run with the lower smoothed loss at the first aligned step, or None
            on a tie.
        winner: the run with the lower smoothed loss at the last aligned step, or None on a tie.
        step: the step where the winner overtook for good (linear interpolation of where the
            smoothed difference crosses zero), or None when it led at every aligned step.
        final_gap: the loser's final smoothed loss minus the winner's (>= 0).
        final_gap_relative: ``final_gap`` over the loser's final smoothed loss.
    """

    metric: str
    first_leader: str | None
    winner: str | None
    step: float | None
    final_gap: float
    final_gap_relative: float


@dataclass(frozen=True)
class ComparedLoss:
    """The loss two runs are compared on, as each recorded it.

    Attributes:
        metric: what it is (``"held-out loss (val_loss)"`` or ``"train loss"``).
        reference: the reference run's.
        other: the other run's.
    """

    metric: str
    reference: Metric
    other: Metric


@dataclass(frozen=True)
class Check:
    """One comparability check of two runs.

    Attributes:
        name: what is compared (``"θ0"``, ``"data"``, ``"config"``).
        differs: whether the runs differ in it (or it cannot be told).
        details: what differs, in a line.
    """

    name: str
    differs: bool
    details: str


def smooth(values: ArrayLike, fraction: float = SMOOTH_FRACTION) -> np.ndarray:
    """:func:`moving_average` with a half-width of ``round(fraction * n)`` records."""
    x = np.asarray(values, dtype=float)
    return moving_average(x, round(fraction * len(x)))


def finite(step: ArrayLike, values: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """``(step, values)`` without the records whose value is NaN or infinite."""
    step, values = np.asarray(step), np.asarray(values, dtype=float)
    keep = np.isfinite(values)
    return step[keep], values[keep]


def align(
    step_a: ArrayLike, a: ArrayLike, step_b: ArrayLike, b: ArrayLike
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Read series ``b`` at the steps of ``a`` that lie inside ``b``'s range.

    Returns:
        ``(steps, a at steps, b interpolated at steps)``; empty when the ranges do not meet.
    """
    step_a, a = np.asarray(step_a, dtype=float), np.asarray(a, dtype=float)
    step_b, b = np.asarray(step_b, dtype=float), np.asarray(b, dtype=float)
    if not len(step_a) or not len(step_b):
        return np.empty(0), np.empty(0), np.empty(0)
    inside = (step_a >= step_b[0]) & (step_a <= step_b[-1])
    steps = step_a[inside]
    return steps, a[inside], np.interp(steps, step_b, b)


def crossover(
    step_a: ArrayLike,
    loss_a: ArrayLike,
    step_b: ArrayLike,
    loss_b: ArrayLike,
    names: tuple[str, str] = ("a", "b"),
    metric: str = "loss",
    fraction: float = SMOOTH_FRACTION,
) -> Crossover | None:
    """Where the run that ends ahead on a loss took the lead for good.

    Non-finite records are dropped, each loss is smoothed (:func:`smooth`), and ``b`` is read
    at ``a``'s steps (:func:`align`).

    Args:
        step_a: steps of run a's loss.
        loss_a: run a's loss.
        step_b: steps of run b's loss.
        loss_b: run b's loss.
        names: the two runs' names, as the result names them.
        metric: what the loss is, as the result names it.
        fraction: smoothing half-width as a fraction of each series' records.

    Returns:
        The crossover, or None when fewer than two aligned steps remain.
    """
    sa, a = finite(step_a, loss_a)
    sb, b = finite(step_b, loss_b)
    steps, a, b = align(sa, smooth(a, fraction), sb, smooth(b, fraction))
    if len(steps) < 2:
        return None
    gap = a - b  # positive where b is lower, i.e. ahead
    sign = np.sign(gap)

    def leader(s: float) -> str | None:
        return None if s == 0 else names[1] if s > 0 else names[0]

    final = sign[-1]
    behind = np.flatnonzero(sign != final)
    step = None
    if final != 0 and behind.size:
        i = behind[-1]  # the winner is strictly ahead from record i + 1 on
        step = float(steps[i] + (steps[i + 1] - steps[i]) * gap[i] / (gap[i] - gap[i + 1]))
    loser_final = max(a[-1], b[-1])
    return Crossover(
        metric=metric,
        first_leader=leader(sign[0]),
        winner=leader(final),
        step=step,
        final_gap=float(abs(gap[-1])),
        final_gap_relative=float(abs(gap[-1]) / loser_final) if loser_final > 0 else float("nan"),
    )


def compared_loss(reference: Run, other: Run) -> ComparedLoss | None:
    """The loss two runs are compared on: held-out when both have two finite values of it
    (it measures what the comparison is about), else training; None when neither is shared."""
    held = reference.heldout_loss(), other.heldout_loss()
    if all(h is not None and np.isfinite(h.values).sum() >= 2 for h in held):
        return ComparedLoss(f"held-out loss ({held[0].name})", *held)
    train = reference.train_loss(), other.train_loss()
    if None in train:
        return None
    return ComparedLoss("train loss", *train)


def loss_crossover(reference: Run, other: Run, names: tuple[str, str]) -> Crossover | None:
    """:func:`crossover` of the two runs on their :func:`compared_loss`, or None."""
    loss = compared_loss(reference, other)
    if loss is None:
        return None
    ref, oth = loss.reference, loss.other
    return crossover(ref.step, ref.values, oth.step, oth.values, names, loss.metric)


def top_eigenvalue(run: Run) -> Metric | None:
    """λ1, the first column of the recorded top Hessian eigenvalues, or None."""
    rows = run.recorded(names.HESSIAN)
    if rows is None or names.HESSIAN_EIGENVALUES not in rows.values:
        return None
    return Metric("lambda_1", rows.step, rows[names.HESSIAN_EIGENVALUES][:, 0])


def eigenvalue_ratio(reference: Run, other: Run) -> tuple[np.ndarray, np.ndarray] | None:
    """``(steps, λ1 of other / λ1 of reference)`` where the reference's λ1 is positive."""
    ref, oth = top_eigenvalue(reference), top_eigenvalue(other)
    if ref is None or oth is None:
        return None
    steps, a, b = align(*finite(ref.step, ref.values), *finite(oth.step, oth.values))
    positive = a > 0
    if not positive.any():
        return None
    return steps[positive], b[positive] / a[positive]


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{dotted key: value}``."""
    flat = {}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_config(value, path + "."))
        else:
            flat[path] = value
    return flat


def config_differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Dotted config keys whose values differ, ``{key: (value in a, value in b)}``.

    Keys in :data:`IGNORED_CONFIG_KEYS` (at any depth) are left out; a key present in one
    config only differs, with None for the missing side.
    """
    flat_a, flat_b = flatten_config(a), flatten_config(b)
    return {
        key: (flat_a.get(key), flat_b.get(key))
        for key in sorted(flat_a.keys() | flat_b.keys())
        if key.rsplit(".", 1)[-1] not in IGNORED_CONFIG_KEYS
        and (key not in flat_a or key not in flat_b or flat_a[key] != flat_b[key])
    }


def differing_keys(configs: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
    """Dotted keys whose values are not the same in all configs, with each config's value as
    JSON (``null`` where a config lacks the key); variant keys included."""
    flats = [flatten_config(config) for config in configs]
    values = {key: [_json(flat.get(key)) for flat in flats] for key in sorted(set().union(*flats))}
    return {key: texts for key, texts in values.items() if len(set(texts)) > 1}


def comparability(reference: Run, other: Run) -> list[Check]:
    """Whether two runs differ in θ0, in the data section of the config, or in the rest."""
    hashes = reference.theta0_sha256, other.theta0_sha256
    if None in hashes:
        where = "both runs" if hashes == (None, None) else "one run"
        theta = Check("θ0", True, f"θ0 hash not recorded in {where}")
    else:
        theta = Check(
            "θ0", not reference.shares_theta0(other), f"{hashes[0][:12]}… vs {hashes[1][:12]}…"
        )
    differences = config_differences(reference.config, other.config)
    data = {k: v for k, v in differences.items() if k.split(".", 1)[0] == "data"}
    rest = {k: v for k, v in differences.items() if k not in data}
    return [
        theta,
        Check("data", bool(data), _describe(data) or "same data config"),
        Check("config", bool(rest), _describe(rest) or "no difference beyond the variant"),
    ]


def _describe(differences: dict[str, tuple[Any, Any]]) -> str:
    shown = [f"{k}: {_json(a)} vs {_json(b)}" for k, (a, b) in list(differences.items())[:6]]
    more = len(differences) - len(shown)
    return "; ".join(shown) + (f"; and {more} more" if more > 0 else "")


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)
