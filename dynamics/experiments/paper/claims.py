"""The paper's claims (seed 002) as figures measured on groups of runs, each with a verdict
decided by criteria fixed here, before any number is seen.

Each claim is measured on one experiment's two groups (the reference, unshifted, and the
shifted or adaptive one), paired by seed: one number per seed, the paired statistics of
:mod:`dynamics.analysis.measures.paired_statistics` across seeds, and per seed whether the
number meets the claim's criterion. The verdict counts those seeds (:data:`VERDICT_RULE`);
nothing is tuned to pass.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dynamics.analysis.measures.displacement_geometry import (
    DisplacementGeometry,
    displacement_geometry,
)
from dynamics.analysis.measures.paired_statistics import (
    DIFFERENCE,
    RATIO,
    VALUE,
    PairedStatistic,
    paired_statistic,
)
from dynamics.analysis.measures.run_series import run_overshoot
from dynamics.analysis.measures.seed_groups import Group, GroupComparison
from dynamics.errors import DynamicsError
from dynamics.store import Run, names

__all__ = [
    "CLAIMS",
    "MIN_SEEDS",
    "NOT_MEASURED",
    "NOT_REPRODUCED",
    "NOT_RUN",
    "PARTLY",
    "REPRODUCED",
    "VERDICT_RULE",
    "Claim",
    "ClaimResult",
    "Sample",
    "evaluate_claims",
    "verdict",
]

REPRODUCED, PARTLY, NOT_REPRODUCED = "reproduced", "partly", "not reproduced"
NOT_MEASURED, NOT_RUN = "not measured", "not run"
#: Fewer seeds than this can at best be "partly": two agreeing seeds are a coin's chance in two.
MIN_SEEDS = 3
#: The early window of the early-lead claim: this fraction of the run's recorded steps.
EARLY_FRACTION = 0.1
#: Near-orthogonal displacements: |cos(θT − θ0 of one, θT − θ0 of the other)| below this
#: (an angle between 72.5° and 107.5°).
ORTHOGONAL_COSINE = 0.3
#: "Primarily outside the plane": less than this share of ‖θT − θ0‖² inside it.
IN_PLANE_SHARE = 0.5
#: "~10× smaller": a λ1 ratio at most this (within a factor 2 of 1/10).
EIGENVALUE_RATIO = 0.2
#: Transient use: the bias-only decode's correlation with the target peaks at least this high...
TRANSIENT_PEAK = 0.2
#: ...and ends at most this fraction of its peak.
TRANSIENT_FALL = 0.5

VERDICT_RULE = (
    f"reproduced: at least {MIN_SEEDS} seeds paired, every one measured, and every one meets "
    "the claim's criterion (with ≤5 seeds: the paired interval, the range of the per-seed "
    "values, lies wholly on the claimed side); partly: a strict majority of the paired seeds "
    "meet it, or every seed meets its weaker form, or fewer than "
    f"{MIN_SEEDS} seeds all meet it; not reproduced: otherwise; not measured: the experiment "
    "ran but no seed gave the figure (the reason is shown); not run: the experiment was not run."
)


@dataclass(frozen=True)
class Sample:
    """One seed's figure, whether it meets the claim (``weak``: its weaker form), and what
    else the criterion read (``detail``, shown beside the figure)."""

    value: float
    holds: bool
    weak: bool = False
    detail: str = ""


Samples = dict[int, "Sample | str"]
Measure = Callable[[Group, Group, GroupComparison], Samples]


@dataclass(frozen=True)
class Claim:
    """One claim of the paper, measured on one experiment.

    Attributes:
        key: a short identifier (JSON key, page anchor).
        experiment: the experiment it is measured on.
        statement: the paper's claim, with its section.
        figure: what is measured per seed, in words.
        criterion: what one seed's figure must show, in words.
        weaker: the weaker form that makes a "partly", or "".
        kind: how the per-seed figures are summarized
            (:mod:`dynamics.analysis.measures.paired_statistics`).
        measure: ``(reference, other, comparison) -> {seed: Sample or why not}``.
        bounds: the numbers the criterion compares the figure with (drawn on the page).
    """

    key: str
    experiment: str
    statement: str
    figure: str
    criterion: str
    weaker: str
    kind: str
    measure: Measure
    bounds: tuple[float, ...] = (0.0,)


@dataclass(frozen=True)
class ClaimResult:
    """A claim's figure over seeds and its verdict."""

    claim: Claim
    verdict: str
    statistic: PairedStatistic | None
    holds: int
    reason: str = ""
    details: dict[int, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values."""
        claim = self.claim
        return {
            "key": claim.key,
            "experiment": claim.experiment,
            "statement": claim.statement,
            "figure": claim.figure,
            "criterion": claim.criterion,
            "weaker": claim.weaker,
            "verdict": self.verdict,
            "seeds_meeting_criterion": self.holds,
            "reason": self.reason,
            "details": {str(seed): text for seed, text in self.details.items()},
            "statistic": None if self.statistic is None else self.statistic.to_dict(),
        }


def verdict(samples: Samples) -> tuple[str, int]:
    """The verdict of per-seed samples by :data:`VERDICT_RULE`, and the seeds that meet it."""
    measured = [s for s in samples.values() if isinstance(s, Sample)]
    if not measured:
        return NOT_MEASURED, 0
    holds = sum(s.holds for s in measured)
    everyone = len(measured) == len(samples)
    if everyone and holds == len(samples):
        return (REPRODUCED if len(samples) >= MIN_SEEDS else PARTLY), holds
    if 2 * holds > len(samples) or (everyone and all(s.holds or s.weak for s in measured)):
        return PARTLY, holds
    return NOT_REPRODUCED, holds


def evaluate_claims(
    groups: Mapping[str, tuple[Sequence[Group], GroupComparison]],
    not_run: Mapping[str, str] | None = None,
) -> list[ClaimResult]:
    """Every claim of :data:`CLAIMS`: measured on its experiment's groups when
    ``groups`` has them (``{experiment: ([reference, other], comparison)}``), else "not run"
    with the reason ``not_run`` gives for the experiment.

    Example::

        groups = load_groups(directory_groups("runs/reproduce/teacher_student"))
        results = evaluate_claims({"teacher_student": (groups, compare_groups(groups)[0])})
        [(r.claim.key, r.verdict) for r in results]
    """
    results = []
    for claim in CLAIMS:
        if claim.experiment not in groups:
            why = (not_run or {}).get(claim.experiment, "experiment not run")
            results.append(ClaimResult(claim, NOT_RUN, None, 0, why))
            continue
        (reference, other), comparison = groups[claim.experiment]
        samples = claim.measure(reference, other, comparison)
        decided, holds = verdict(samples)
        seeds = [s for s, x in samples.items() if isinstance(x, Sample)]
        values = [x.value for x in samples.values() if isinstance(x, Sample)]
        missing = [f"seed {s}: {x}" for s, x in samples.items() if isinstance(x, str)]
        statistic = paired_statistic(claim.figure, claim.kind, seeds, values, missing)
        reason = "; ".join(missing) if decided == NOT_MEASURED else ""
        details = {s: x.detail for s, x in samples.items() if isinstance(x, Sample) and x.detail}
        results.append(ClaimResult(claim, decided, statistic, holds, reason, details))
    return results


def _pairs(reference: Group, other: Group) -> list[tuple[int, Run, Run]]:
    return [(seed, reference.runs[seed], other.runs[seed]) for seed in reference.seeds]


def _per_seed(measure: Callable[[Run, Run], Sample | str]) -> Measure:
    """A claim measure applying ``measure(reference run, other run)`` to each seed pair; a
    figure that cannot be measured (a DynamicsError) is its one-line reason."""

    def samples(reference: Group, other: Group, _: GroupComparison) -> Samples:
        result: Samples = {}
        for seed, a, b in _pairs(reference, other):
            try:
                result[seed] = measure(a, b)
            except DynamicsError as error:
                result[seed] = str(error)
        return result

    return samples


def _from_statistic(
    prefix: str, holds: Callable[[float], bool], weak: Callable[[float], bool] | None = None
) -> Measure:
    """The per-seed values of the grouped compare's statistic whose measure starts with
    ``prefix`` (one figure, computed once, by the compare)."""

    def samples(_: Group, __: Group, comparison: GroupComparison) -> Samples:
        stat = next((s for s in comparison.statistics if s.measure.startswith(prefix)), None)
        if stat is None:
            return {}
        result: Samples = {
            s: Sample(v, holds(v), weak is not None and weak(v))
            for s, v in zip(stat.seeds, stat.values)
        }
        for line in stat.missing:
            seed, _, why = line.partition(": ")
            result[int(seed.removeprefix("seed "))] = why
        return dict(sorted(result.items()))

    return samples


def _early_gap(a: Run, b: Run) -> Sample | str:
    """Mean of (other − reference) training loss over the first :data:`EARLY_FRACTION` of
    the steps both recorded."""
    losses = [a.train_loss(), b.train_loss()]
    if None in losses:
        return "no training loss recorded"
    steps, ia, ib = np.intersect1d(losses[0].step, losses[1].step, return_indices=True)
    if len(steps) < 2:
        return "fewer than two shared training-loss steps"
    early = steps <= steps[0] + EARLY_FRACTION * (steps[-1] - steps[0])
    gap = losses[1].values[ib][early] - losses[0].values[ia][early]
    gap = gap[np.isfinite(gap)]
    if not len(gap):
        return "no finite training loss in the early window"
    value = float(gap.mean())
    return Sample(value, value > 0)


def _final_geometry(a: Run, b: Run) -> DisplacementGeometry:
    """The runs' displacement geometry (compare's), ending at θT."""
    geometry = displacement_geometry(a, b)
    if isinstance(geometry, str):
        raise DynamicsError(f"{b.path.name}: {geometry}")
    return geometry


def _displacement_cosine(a: Run, b: Run) -> Sample | str:
    value = float(_final_geometry(a, b).cosine[-1])
    if not np.isfinite(value):
        return "a run did not move (θT = θ0)"
    return Sample(value, abs(value) < ORTHOGONAL_COSINE)


def _in_plane_share(a: Run, b: Run) -> Sample | str:
    """The other run's share of ‖θT − θ0‖² inside the plane of both runs' initial gradients
    (the share the plane views print)."""
    geometry = _final_geometry(a, b)
    if not geometry.in_plane:
        return geometry.plane_remark
    share = float(geometry.in_plane[1][1][-1])
    if not np.isfinite(share):
        return f"{b.path.name}: θT = θ0, no share to take"
    return Sample(share, share < IN_PLANE_SHARE)


def _overshoot_layers(a: Run, _: Run) -> Sample | str:
    """Layers the overshoot detector flags in the reference run."""
    report = run_overshoot(a)
    if report is None:
        return "no hidden-state norms recorded"
    flagged = sum(layer.verdict == "overshoot" for layer in report.layers)
    return Sample(float(flagged), flagged >= 1)


def _overshoot_suppressed(_: Group, __: Group, comparison: GroupComparison) -> Samples:
    """Per seed, the mean over layers of (other − reference) peak / start."""
    stats = [s for s in comparison.statistics if s.measure.startswith("overshoot peak / start at ")]
    if not stats:
        return {}
    seeds = sorted({seed for s in stats for seed in s.seeds} | _missing_seeds(stats))
    result: Samples = {}
    for seed in seeds:
        values = [v for s in stats for sd, v in zip(s.seeds, s.values) if sd == seed]
        if values:
            value = float(np.mean(values))
            result[seed] = Sample(value, value < 0)
        else:
            result[seed] = "peak / start undefined at every layer"
    return result


def _missing_seeds(stats: Sequence[PairedStatistic]) -> set[int]:
    return {int(line.split(":")[0].removeprefix("seed ")) for s in stats for line in s.missing}


def _bias_transient(run: Run) -> tuple[float, float]:
    """Peak and final correlation of the bias-only decode with the target, at the first
    recorded layer (the end of the autoencoder's first stage)."""
    if names.BIAS_COMPONENT not in run.groups:
        raise DynamicsError(f"{run.path.name}: no BiasComponent series")
    corr = np.asarray(run.series(names.BIAS_COMPONENT).values["bias_corr_target"], dtype=float)
    corr = corr[:, 0] if corr.ndim == 2 else corr
    corr = corr[np.isfinite(corr)]
    if len(corr) < 2:
        raise DynamicsError(f"{run.path.name}: fewer than two finite bias-decode correlations")
    return float(corr.max()), float(corr[-1])


def _transient_unshifted(a: Run, _: Run) -> Sample | str:
    peak, final = _bias_transient(a)
    detail = f"peak {peak:.3g}, final {final:.3g}"
    return Sample(peak - final, _is_transient(peak, final), detail=detail)


def _is_transient(peak: float, final: float) -> bool:
    return peak >= TRANSIENT_PEAK and final <= TRANSIENT_FALL * peak


def _transient_absent(a: Run, b: Run) -> Sample | str:
    """Other − reference of the fall (peak − final) of the bias-only decode's correlation."""
    (peak_a, final_a), (peak_b, final_b) = map(_bias_transient, (a, b))
    value = (peak_b - final_b) - (peak_a - final_a)
    holds = value < 0 and not _is_transient(peak_b, final_b)
    detail = f"shifted: peak {peak_b:.3g}, final {final_b:.3g}"
    return Sample(value, holds, weak=value < 0, detail=detail)


def _final_metric(key: str, better: Callable[[float], bool]) -> Callable[[Run, Run], Sample | str]:
    """Other − reference of the last recorded validation metric ``key``."""

    def measure(a: Run, b: Run) -> Sample | str:
        values = []
        for run in (a, b):
            metric = run.validation_metrics().get(key)
            finite = None if metric is None else metric.values[np.isfinite(metric.values)]
            if finite is None or not len(finite):
                return f"{run.path.name}: no {key} recorded"
            values.append(float(finite[-1]))
        value = values[1] - values[0]
        return Sample(value, better(value))

    return measure


#: The claims, in the page's order.
CLAIMS: tuple[Claim, ...] = (
    Claim(
        "early-lead",
        "teacher_student",
        "The unshifted student learns faster early (§2.2, Fig. 2).",
        f"training loss, shifted − unshifted, mean over the first {EARLY_FRACTION:.0%} of steps",
        "above 0 (the unshifted student ahead)",
        "",
        DIFFERENCE,
        _per_seed(_early_gap),
    ),
    Claim(
        "late-win",
        "teacher_student",
        "The shifted student overtakes and ends lower (§2.2, Fig. 2).",
        "final smoothed held-out loss, shifted − unshifted (the grouped compare's)",
        "below 0",
        "",
        DIFFERENCE,
        _from_statistic("final ", lambda v: v < 0),
    ),
    Claim(
        "orthogonal",
        "teacher_student",
        "The two students move in nearly orthogonal directions (§2.3, Fig. 3).",
        "cosine of the students' final displacements θT − θ0",
        f"|cos| below {ORTHOGONAL_COSINE}",
        "",
        VALUE,
        _per_seed(_displacement_cosine),
        (-ORTHOGONAL_COSINE, ORTHOGONAL_COSINE),
    ),
    Claim(
        "out-of-plane",
        "teacher_student",
        "The shifted student moves primarily outside the initial-gradient plane (§2.3, Fig. 3).",
        "shifted student's in-plane share of ‖θT − θ0‖² on the plane of both initial gradients",
        f"below {IN_PLANE_SHARE}",
        "",
        VALUE,
        _per_seed(_in_plane_share),
        (IN_PLANE_SHARE,),
    ),
    Claim(
        "hessian",
        "teacher_student",
        "The shifted student's top Hessian eigenvalue is ~10× smaller (§2.4, Fig. 4).",
        "median over time of λ1(shifted) / λ1(unshifted) (the grouped compare's)",
        f"at most {EIGENVALUE_RATIO} (within 2× of 1/10)",
        "below 1 (smaller, not ~10×)",
        RATIO,
        _from_statistic("λ1 ratio", lambda v: v <= EIGENVALUE_RATIO, lambda v: v < 1),
        (EIGENVALUE_RATIO, 1.0),
    ),
    Claim(
        "overshoot-present",
        "teacher_student",
        "The unshifted student's hidden-state norm overshoots (§2.2, Fig. 2 bottom).",
        "layers the overshoot detector flags in the unshifted student",
        "at least 1",
        "",
        VALUE,
        _per_seed(_overshoot_layers),
        (1.0,),
    ),
    Claim(
        "overshoot-suppressed",
        "teacher_student",
        "Shifting suppresses the overshoot (§2.2, Fig. 2 bottom).",
        "overshoot peak / start, shifted − unshifted, mean over layers",
        "below 0",
        "",
        DIFFERENCE,
        _overshoot_suppressed,
    ),
    Claim(
        "transient-use",
        "autoencoder",
        "The unshifted autoencoder uses the bias component transiently (§3.2, Fig. 5).",
        "unshifted: fall (peak − final) of the bias-only decode's correlation with the images "
        "(first recorded layer)",
        f"peak at least {TRANSIENT_PEAK} and final at most {TRANSIENT_FALL} × peak",
        "",
        VALUE,
        _per_seed(_transient_unshifted),
        (),
    ),
    Claim(
        "transient-absent",
        "autoencoder",
        "The transient use is largely absent when shifted (§3.2, Fig. 5).",
        "fall (peak − final) of the bias-only decode's correlation, shifted − unshifted",
        "below 0, and the shifted model's decode not transient by the criterion above",
        "below 0",
        DIFFERENCE,
        _per_seed(_transient_absent),
    ),
    Claim(
        "gpt-bpc",
        "char_gpt",
        "Adaptive shifting lowers a GPT's final loss (§4, Fig. 7(c)).",
        "last held-out bits per character, adaptive − unshifted",
        "below 0",
        "",
        DIFFERENCE,
        _per_seed(_final_metric("val_bpc", lambda v: v < 0)),
    ),
    Claim(
        "vit-accuracy",
        "vit_digits",
        "Adaptive shifting raises a ViT's final top-1 accuracy (§4, Fig. 6).",
        "last held-out top-1 accuracy, adaptive − unshifted",
        "above 0",
        "",
        DIFFERENCE,
        _per_seed(_final_metric("val_acc", lambda v: v > 0)),
    ),
    Claim(
        "vit-loss",
        "vit_digits",
        "Adaptive shifting lowers a ViT's final test loss (§4, Fig. 6).",
        "final smoothed held-out loss, adaptive − unshifted (the grouped compare's)",
        "below 0",
        "",
        DIFFERENCE,
        _from_statistic("final ", lambda v: v < 0),
    ),
    Claim(
        "vit-early-lead",
        "vit_digits",
        "Adaptive shifting trails the unshifted ViT early (§4, Fig. 6).",
        f"training loss, adaptive − unshifted, mean over the first {EARLY_FRACTION:.0%} of steps",
        "above 0",
        "",
        DIFFERENCE,
        _per_seed(_early_gap),
    ),
    Claim(
        "vit-overshoot-suppressed",
        "vit_digits",
        "Adaptive shifting suppresses the residual-stream overshoot (§4.1, Fig. 7(a)).",
        "overshoot peak / start, adaptive − unshifted, mean over blocks",
        "below 0",
        "",
        DIFFERENCE,
        _overshoot_suppressed,
    ),
)
