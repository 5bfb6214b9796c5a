"""Overshoot detector: does a residual-stream norm rise and then fall while the loss drops fastest?

The signature (seed paper, Fig. 2 bottom and Fig. 7a) is a hidden-state magnitude that climbs to
a peak and then settles on a lower plateau, with the peak inside the window of fastest loss
reduction. Each layer's series is smoothed by a centred moving average over records (half-width
a fixed fraction of the series), its noise estimated from second differences, and an overshoot
needs a rise and a fall above ``min_snr`` times that noise plus a minimum non-monotonicity
(isotonic-fit residual). Pure numpy and scikit-learn, so it runs on anything a run file holds.
The smoothing and noise rules and the calibration of every threshold are derived in
``docs/overshoot.md``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from dynamics.analysis.measures.smoothing import SMOOTH_FRACTION, moving_average

__all__ = [
    "LayerOvershoot",
    "LossWindow",
    "OvershootReport",
    "OvershootThresholds",
    "detect_overshoot",
]

Step = int | float


@dataclass(frozen=True)
class OvershootThresholds:
    """Knobs of the detector, reported with every result so a verdict can be reproduced.

    Why each default has its value (simulations, false-positive rates) is in
    ``docs/overshoot.md``.

    Attributes:
        smooth_fraction: half-width of the moving-average window, as a fraction of the finite
            records (0.02: a window of about 4% of the series).
        tail_fraction: the plateau is the median of this last fraction of the finite records,
            and the peak must come before it.
        min_points: fewer finite records than this give the verdict ``"too_short"``.
        min_snr: the rise (peak over start) and the fall (peak over plateau) must each exceed
            this many noise deviations of the smoothed curve.
        min_nonmonotonicity: least non-monotonicity score (RMS residual of the best isotonic
            fit to the smoothed series, over its range).
        min_relative_drop: least fall, as a fraction of the peak value.
        window_fraction: the loss window is where the slope of the smoothed log-loss is at
            least this fraction of the steepest slope (0.5: full width at half maximum).
    """

    smooth_fraction: float = SMOOTH_FRACTION
    tail_fraction: float = 0.2
    min_points: int = 10
    min_snr: float = 5.0
    min_nonmonotonicity: float = 0.02
    min_relative_drop: float = 0.01
    window_fraction: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.min_points, np.integer):  # keep to_dict() JSON-ready
            object.__setattr__(self, "min_points", int(self.min_points))
        checks = [
            ("smooth_fraction", 0 < self.smooth_fraction < 0.5, "in (0, 0.5)"),
            ("tail_fraction", 0 < self.tail_fraction < 1, "in (0, 1)"),
            (
                "min_points",
                isinstance(self.min_points, int) and self.min_points >= 5,
                "an integer >= 5",
            ),
            ("min_snr", self.min_snr >= 0, ">= 0"),
            ("min_nonmonotonicity", self.min_nonmonotonicity >= 0, ">= 0"),
            ("min_relative_drop", self.min_relative_drop >= 0, ">= 0"),
            ("window_fraction", 0 < self.window_fraction <= 1, "in (0, 1]"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class LossWindow:
    """The window of fastest loss reduction.

    Attributes:
        found: Whether the smoothed loss decreases anywhere (and the series was long enough).
        start_step: First step of the window (a recorded loss step), or None.
        end_step: Last step of the window (a recorded loss step), or None.
        steepest_step: Step of the steepest descent, or None.
        steepest_slope: Slope of the smoothed loss there, per step (negative), or None.
        scale: ``"log"`` when the slope is of log-loss; ``"linear"`` when some finite loss is
            not positive, so the log is undefined and the loss itself is used.
        n_points: Finite loss records used.
        n_nonfinite: Loss records ignored because they are NaN or infinite.
        reason: One line saying what was found or why nothing was.
    """

    found: bool
    start_step: Step | None
    end_step: Step | None
    steepest_step: Step | None
    steepest_slope: float | None
    scale: str
    n_points: int
    n_nonfinite: int
    reason: str

    def contains(self, step: Step) -> bool:
        """Whether ``step`` lies in the window (inclusive); False when no window was found."""
        return self.found and self.start_step <= step <= self.end_step


@dataclass(frozen=True)
class LayerOvershoot:
    """Verdict for one norm series.

    Values are None where the verdict (``"too_short"`` or ``"constant"``) leaves them undefined.

    Attributes:
        name: The layer's name.
        verdict: ``"overshoot"``, ``"no_overshoot"``, ``"too_short"`` or ``"constant"``.
        overshoot: Whether the series rises to a peak and settles clearly lower.
        signature: The paper's signature: an overshoot whose peak lies in the loss window;
            None without a loss series.
        reason: One line explaining the verdict.
        peak_step: Step of the maximum of the smoothed series.
        peak_value: That maximum.
        start_value: Median of the first ``h + 1`` finite records (one smoothing half-window).
        plateau_value: Median of the final tail of finite records.
        peak_over_plateau: ``peak_value / plateau_value`` (None unless the plateau is positive).
        peak_over_start: ``peak_value / start_value`` (None unless the start is positive).
        nonmonotonicity: RMS residual of the best increasing-or-decreasing isotonic fit to the
            smoothed series, divided by the smoothed series' range: 0 for a monotone series.
        residual_area: the overshoot's magnitude as an area: the integral over steps
            (trapezoid rule) of the absolute difference between the smoothed series and that
            best isotonic fit, in norm × steps; 0 for a monotone series.
        snr: ``min(rise, fall)`` over the smoothed-curve noise; None when the noise is zero.
        noise: Standard deviation of the noise left in the smoothed series (module docstring).
        smoothing_half_width: ``h``, in records.
        peak_in_window: Whether ``peak_step`` lies in the loss window; None without a loss
            series or without a peak.
        n_points: Finite records used.
        n_nonfinite: Records ignored because they are NaN or infinite.
    """

    name: str
    verdict: str
    overshoot: bool
    signature: bool | None
    reason: str
    peak_step: Step | None
    peak_value: float | None
    start_value: float | None
    plateau_value: float | None
    peak_over_plateau: float | None
    peak_over_start: float | None
    nonmonotonicity: float | None
    residual_area: float | None
    snr: float | None
    noise: float | None
    smoothing_half_width: int | None
    peak_in_window: bool | None
    n_points: int
    n_nonfinite: int


@dataclass(frozen=True)
class OvershootReport:
    """Per-layer verdicts, the loss window they were judged against, and the thresholds used."""

    layers: tuple[LayerOvershoot, ...]
    loss_window: LossWindow | None
    thresholds: OvershootThresholds

    @property
    def any_overshoot(self) -> bool:
        return any(layer.overshoot for layer in self.layers)

    def layer(self, name: str) -> LayerOvershoot:
        """The verdict for the layer called ``name``."""
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values: plain str/int/float/bool/None, lists and dicts, no NaN."""
        return {
            "any_overshoot": self.any_overshoot,
            "layers": [asdict(layer) for layer in self.layers],
            "loss_window": None if self.loss_window is None else asdict(self.loss_window),
            "thresholds": asdict(self.thresholds),
        }


#: The thresholds' defaults, written once (in the class), which detect_overshoot's keywords take.
_DEFAULTS = OvershootThresholds()


def detect_overshoot(
    steps: ArrayLike,
    norms: ArrayLike,
    *,
    loss_steps: ArrayLike | None = None,
    loss: ArrayLike | None = None,
    layer_names: list[str] | tuple[str, ...] | None = None,
    smooth_fraction: float = _DEFAULTS.smooth_fraction,
    tail_fraction: float = _DEFAULTS.tail_fraction,
    min_points: int = _DEFAULTS.min_points,
    min_snr: float = _DEFAULTS.min_snr,
    min_nonmonotonicity: float = _DEFAULTS.min_nonmonotonicity,
    min_relative_drop: float = _DEFAULTS.min_relative_drop,
    window_fraction: float = _DEFAULTS.window_fraction,
) -> OvershootReport:
    """Judge each norm series for a rise-then-fall overshoot, and place its peak in the loss.

    A series overshoots when all of these hold (thresholds documented in
    :class:`OvershootThresholds`): its smoothed maximum comes after the first record and before
    the final tail; the fall from that peak to the tail's median is at least
    ``min_relative_drop`` of the peak; the non-monotonicity score reaches
    ``min_nonmonotonicity``; and both the rise from the start and the fall to the plateau exceed
    ``min_snr`` smoothed-noise units. NaN and infinite values are ignored (and counted).

    Args:
        steps: Strictly increasing steps of the norm records, shape ``(n,)``; spacing may be
            uneven.
        norms: Norm series, shape ``(n,)`` for one layer or ``(n, L)`` with one column per layer.
        loss_steps: Strictly increasing steps of the loss records; given together with ``loss``.
        loss: Training loss at ``loss_steps``; its steepest descent defines the loss window.
        layer_names: One name per column; defaults to ``layer_0``, ``layer_1``, ...
        smooth_fraction: See :class:`OvershootThresholds`.
        tail_fraction: See :class:`OvershootThresholds`.
        min_points: See :class:`OvershootThresholds`.
        min_snr: See :class:`OvershootThresholds`.
        min_nonmonotonicity: See :class:`OvershootThresholds`.
        min_relative_drop: See :class:`OvershootThresholds`.
        window_fraction: See :class:`OvershootThresholds`.

    Returns:
        An :class:`OvershootReport` with one :class:`LayerOvershoot` per column.

    Raises:
        ValueError: On mismatched lengths, steps that are not finite and strictly increasing,
            non-numeric values, a wrong number of layer names, or an out-of-range threshold.

    Example::

        report = detect_overshoot(steps, norms, loss_steps=steps, loss=loss,
                                  layer_names=["block1", "block2"])
        [layer.verdict for layer in report.layers]  # ['overshoot', 'no_overshoot']
    """
    thresholds = OvershootThresholds(
        smooth_fraction=smooth_fraction,
        tail_fraction=tail_fraction,
        min_points=min_points,
        min_snr=min_snr,
        min_nonmonotonicity=min_nonmonotonicity,
        min_relative_drop=min_relative_drop,
        window_fraction=window_fraction,
    )
    steps_arr = _steps(steps, "steps")
    columns = _numeric(norms, "norms")
    if columns.ndim not in (1, 2):
        raise ValueError(f"norms must have shape (n,) or (n, L), got {columns.shape}")
    if columns.shape[0] != steps_arr.shape[0]:
        raise ValueError(
            f"norms has {columns.shape[0]} rows but steps has {steps_arr.shape[0]} entries"
        )
    if columns.ndim == 1:
        columns = columns[:, None]
    names = _layer_names(layer_names, columns.shape[1])

    window = None
    if (loss_steps is None) != (loss is None):
        raise ValueError("loss_steps and loss must be given together")
    if loss is not None:
        loss_steps_arr = _steps(loss_steps, "loss_steps")
        loss_arr = _numeric(loss, "loss")
        if loss_arr.ndim != 1 or loss_arr.shape[0] != loss_steps_arr.shape[0]:
            raise ValueError(
                f"loss must have shape ({loss_steps_arr.shape[0]},) to match loss_steps, "
                f"got {loss_arr.shape}"
            )
        window = _loss_window(loss_steps_arr, loss_arr, thresholds)

    layers = tuple(
        _judge_layer(name, steps_arr, columns[:, j], window, thresholds)
        for j, name in enumerate(names)
    )
    return OvershootReport(layers=layers, loss_window=window, thresholds=thresholds)


def _numeric(values: ArrayLike, what: str) -> np.ndarray:
    try:
        return np.asarray(values, dtype=float)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{what} must be numeric: {err}") from None


def _steps(values: ArrayLike, what: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be one-dimensional, got shape {arr.shape}")
    if not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise ValueError(f"{what} must be numeric, got dtype {arr.dtype}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{what} must be finite")
    bad = np.flatnonzero(np.diff(arr) <= 0)
    if bad.size:
        i = bad[0] + 1
        raise ValueError(
            f"{what} must be strictly increasing: {what}[{i}]={arr[i].item()} "
            f"follows {what}[{i - 1}]={arr[i - 1].item()}"
        )
    return arr


def _layer_names(layer_names: list[str] | tuple[str, ...] | None, count: int) -> list[str]:
    if layer_names is None:
        return [f"layer_{j}" for j in range(count)]
    names = [str(name) for name in layer_names]
    if len(names) != count:
        raise ValueError(f"layer_names has {len(names)} names for {count} norm columns")
    if len(set(names)) != len(names):
        raise ValueError("layer_names must be unique")
    return names


def _half_width(n: int, thresholds: OvershootThresholds) -> int:
    return max(1, round(thresholds.smooth_fraction * n))


def _smoothed_noise(x: np.ndarray, s: np.ndarray, h: int) -> float:
    """Standard deviation of the noise left in ``s``, the ``h``-smoothing of ``x`` (module doc)."""
    w = 2 * h + 1
    white = math.sqrt(float(np.mean(np.diff(x, n=2) ** 2)) / 6.0 / w)
    if x.size < 12 * w:
        return white
    d2 = s[2 * w :] - 2.0 * s[w:-w] + s[: -2 * w]
    lagged = 1.4826 * float(np.median(np.abs(d2 - np.median(d2)))) / math.sqrt(6.0)
    return max(white, lagged)


def _isotonic_residual(t: np.ndarray, s: np.ndarray) -> tuple[float, float]:
    """``(non-monotonicity, residual area)`` of the best monotone (isotonic) fit to ``s``.

    The best fit is the increasing or the decreasing one with the smaller RMS residual (fitted
    over record order, as the smoothing is); the non-monotonicity is that RMS over the series'
    range, the area the integral of the absolute residual over the steps ``t``.
    """
    # Imported here: scikit-learn takes seconds to load, and every offline command imports this
    # module (dynamics.analysis) whether or not it detects overshoots.
    from sklearn.isotonic import IsotonicRegression

    idx = np.arange(s.size, dtype=float)
    residuals = [
        s - IsotonicRegression(increasing=inc).fit_transform(idx, s) for inc in (True, False)
    ]
    best = min(residuals, key=lambda r: float(np.mean(r**2)))
    rms = math.sqrt(float(np.mean(best**2)))
    area = float(np.trapezoid(np.abs(best), t.astype(float)))
    return rms / float(np.ptp(s)), area


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _loss_window(
    steps: np.ndarray, loss: np.ndarray, thresholds: OvershootThresholds
) -> LossWindow:
    finite = np.isfinite(loss)
    n_nonfinite = int(np.count_nonzero(~finite))
    t, y = steps[finite], loss[finite]
    scale = "log" if y.size == 0 or np.all(y > 0) else "linear"
    n = int(y.size)

    def missing(reason: str) -> LossWindow:
        return LossWindow(
            found=False,
            start_step=None,
            end_step=None,
            steepest_step=None,
            steepest_slope=None,
            scale=scale,
            n_points=n,
            n_nonfinite=n_nonfinite,
            reason=reason,
        )

    if n < thresholds.min_points:
        return missing(f"only {n} finite loss values; at least {thresholds.min_points} needed")
    h = _half_width(n, thresholds)
    curve = moving_average(np.log(y) if scale == "log" else y, h)
    # Differentiation amplifies what noise one pass left; a second pass on the slope
    # keeps the half-maximum window contiguous instead of fragmenting at its edges.
    slope = moving_average(np.gradient(curve, t.astype(float)), h)
    k = int(np.argmin(slope))
    if slope[k] >= 0:
        return missing("the smoothed loss never decreases")
    outside = np.flatnonzero(slope > thresholds.window_fraction * slope[k])
    before, after = outside[outside < k], outside[outside > k]
    lo = int(before[-1]) + 1 if before.size else 0
    hi = int(after[0]) - 1 if after.size else n - 1
    return LossWindow(
        found=True,
        start_step=t[lo].item(),
        end_step=t[hi].item(),
        steepest_step=t[k].item(),
        steepest_slope=float(slope[k]),
        scale=scale,
        n_points=n,
        n_nonfinite=n_nonfinite,
        reason=f"steepest descent at step {t[k].item()}",
    )


def _judge_layer(
    name: str,
    steps: np.ndarray,
    column: np.ndarray,
    window: LossWindow | None,
    thresholds: OvershootThresholds,
) -> LayerOvershoot:
    finite = np.isfinite(column)
    n_nonfinite = int(np.count_nonzero(~finite))
    t, x = steps[finite], column[finite]
    n = int(x.size)

    def undefined(verdict: str, reason: str) -> LayerOvershoot:
        return LayerOvershoot(
            name=name,
            verdict=verdict,
            overshoot=False,
            signature=None if window is None else False,
            reason=reason,
            peak_step=None,
            peak_value=None,
            start_value=None,
            plateau_value=None,
            peak_over_plateau=None,
            peak_over_start=None,
            nonmonotonicity=None,
            residual_area=None,
            snr=None,
            noise=None,
            smoothing_half_width=None,
            peak_in_window=None,
            n_points=n,
            n_nonfinite=n_nonfinite,
        )

    if n < thresholds.min_points:
        return undefined(
            "too_short", f"only {n} finite values; at least {thresholds.min_points} needed"
        )
    if np.ptp(x) == 0:
        return undefined("constant", "the series is constant")

    h = _half_width(n, thresholds)
    s = moving_average(x, h)
    p = int(np.argmax(s))
    peak = float(s[p])
    start = float(np.median(x[: h + 1]))
    tail_start = n - max(1, math.ceil(thresholds.tail_fraction * n))
    plateau = float(np.median(x[tail_start:]))
    rise, fall = peak - start, peak - plateau
    noise = _smoothed_noise(x, s, h)
    snr = min(rise, fall) / noise if noise > 0 else None
    score, area = _isotonic_residual(t, s)
    peak_step = t[p].item()
    peak_in_window = None if window is None else window.contains(peak_step)

    if p == 0:
        reason = "the series peaks at its first record and only falls"
    elif p >= tail_start:
        reason = "the peak lies in the final tail, so there is no later plateau to settle on"
    elif fall < thresholds.min_relative_drop * abs(peak):
        reason = (
            f"it falls {fall / abs(peak):.2%} of the peak after it, "
            f"below min_relative_drop={thresholds.min_relative_drop:g}"
        )
    elif score < thresholds.min_nonmonotonicity:
        reason = (
            f"non-monotonicity {score:.3g} is below "
            f"min_nonmonotonicity={thresholds.min_nonmonotonicity:g}"
        )
    elif snr is not None and snr < thresholds.min_snr:
        reason = (
            f"rise and fall reach only {snr:.3g} noise units, below min_snr={thresholds.min_snr:g}"
        )
    else:
        reason = ""
    overshoot = not reason
    if overshoot:
        reason = (
            f"rises {rise:.4g} to a peak of {peak:.4g} at step {peak_step}, "
            f"then settles {fall:.4g} lower"
        )
    return LayerOvershoot(
        name=name,
        verdict="overshoot" if overshoot else "no_overshoot",
        overshoot=overshoot,
        signature=None if window is None else overshoot and bool(peak_in_window),
        reason=reason,
        peak_step=peak_step,
        peak_value=peak,
        start_value=start,
        plateau_value=plateau,
        peak_over_plateau=_ratio(peak, plateau),
        peak_over_start=_ratio(peak, start),
        nonmonotonicity=score,
        residual_area=area,
        snr=snr,
        noise=noise,
        smoothing_half_width=h,
        peak_in_window=peak_in_window,
        n_points=n,
        n_nonfinite=n_nonfinite,
    )
