"""How the controlled experiment's claims depend on its setup, which seed 002 does not state.

The summaries give neither the optimizer nor the learning rate of the teacher–student
experiment, so a verdict on the default config alone may say more about the setup than about
the shift. The reproduction therefore runs the same comparison over a small preset grid of
setups (:data:`SETUPS`) and measures every teacher–student claim in each, with the same
criteria (:mod:`dynamics.experiments.paper.claims`). The null pair keeps the default setup but
shifts the "shifted" student by a tiny constant: what its verdicts show is the setup's own
sensitivity (two students that barely differ), not the shift's effect.

The orthogonality claim is also read three ways over time
(:mod:`dynamics.analysis.measures.displacement_geometry`): the angle between the students'
θt − θ0, between their in-plane paths (in orthonormal and in oblique coordinates), and between
their initial gradients, beside both students' in-plane shares; :func:`reading_statements`
says in words which reading holds in which setup, whatever the numbers are.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dynamics.analysis.measures.displacement_geometry import displacement_geometry
from dynamics.analysis.measures.seed_groups import Group, GroupComparison
from dynamics.experiments.paper.claims import ORTHOGONAL_COSINE, ClaimResult, evaluate_claims

__all__ = [
    "EXPERIMENT",
    "READINGS",
    "SENSITIVITY",
    "SETUPS",
    "ReadingProfile",
    "Setup",
    "SetupResult",
    "measure_setup",
    "reading_statements",
]

#: The experiment whose claims the section measures across setups.
EXPERIMENT = "teacher_student"
#: The reproduction's folder of the setups' groups: ``OUT/sensitivity/<setup key>/``.
SENSITIVITY = "sensitivity"


@dataclass(frozen=True)
class Setup:
    """One setup of the grid: the overrides of the controlled experiment's config.

    Attributes:
        key: folder and JSON name.
        label: what the page calls it.
        overrides: dotted config keys over the reproduction's teacher–student config; none:
            the reproduction's own teacher–student runs are this setup's.
        null: the null pair (no real shift), whose verdicts are the setup's own noise.
    """

    key: str
    label: str
    overrides: Mapping[str, Any] = field(default_factory=dict)
    null: bool = False


#: The preset grid: Adam at the default learning rate and 10× it, plain SGD at two learning
#: rates a decade apart (1e-1 trains both students; in a trial, 5e-1 diverged the unshifted
#: one), and the null pair.
SETUPS = (
    Setup("adam-default", "Adam, lr 1e-3 (the default)"),
    Setup("adam-lr1e-2", "Adam, lr 1e-2 (10× the default)", {"optimizer.lr": 1e-2}),
    Setup("sgd-lr1e-2", "SGD, lr 1e-2", {"optimizer.name": "sgd", "optimizer.lr": 1e-2}),
    Setup("sgd-lr1e-1", "SGD, lr 1e-1", {"optimizer.name": "sgd", "optimizer.lr": 1e-1}),
    Setup(
        "null-shift-0.01",
        "null pair: Adam at the default, the 'shifted' student shifted by 0.01",
        {"variants.shifted": 0.01},
        null=True,
    ),
)

#: The orthogonality readings, by key, as the page and JSON name them.
READINGS = {
    "displacement": "θt − θ0 of the two students",
    "path": "in-plane paths, orthonormal coordinates (a, b)",
    "oblique": "in-plane paths, the unit initial gradients' coordinates (α, β)",
    "gradients": "the initial gradients g0",
}


@dataclass(frozen=True)
class ReadingProfile:
    """One orthogonality reading of a setup over time, across its seeds.

    Attributes:
        steps: the steps every seed stored θt at.
        cosines: ``{seed: cosine per step}``.
    """

    steps: np.ndarray
    cosines: dict[int, np.ndarray]

    def angles_deg(self) -> np.ndarray:
        """The angle per seed (rows, in seed order) and step, in degrees."""
        rows = np.vstack([self.cosines[s] for s in sorted(self.cosines)])
        return np.degrees(np.arccos(np.clip(rows, -1.0, 1.0)))

    def holds_at_end(self) -> int:
        """Seeds whose |cos| at the last step is below :data:`ORTHOGONAL_COSINE`."""
        return sum(bool(abs(c[-1]) < ORTHOGONAL_COSINE) for c in self.cosines.values())

    def holds_over_last_half(self) -> int:
        """Seeds whose |cos| is below the bound at every stored step of the run's second half."""
        late = self.steps >= self.steps[-1] / 2
        return sum(bool(np.all(np.abs(c[late]) < ORTHOGONAL_COSINE)) for c in self.cosines.values())


@dataclass(frozen=True)
class SetupResult:
    """A setup's claims and orthogonality readings.

    Attributes:
        setup: the setup.
        trained: the optimizer and learning rate its runs recorded (what trained, whatever
            the setup's label and the config folder say).
        seeds: the seeds measured.
        claims: the teacher–student claims, as the reproduction decides them.
        readings: each of :data:`READINGS` over time; absent when no seed gave it.
        shares: ``(steps, {seed: (unshifted share, shifted share)})`` of ‖θt − θ0‖² in the
            initial-gradient plane, or None.
        remarks: one line per seed a reading could not be taken for.
    """

    setup: Setup
    trained: str
    seeds: tuple[int, ...]
    claims: list[ClaimResult]
    readings: dict[str, ReadingProfile]
    shares: tuple[np.ndarray, dict[int, tuple[np.ndarray, np.ndarray]]] | None
    remarks: list[str]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values: each claim's verdict and figure, each reading per seed."""
        readings = {}
        for key, profile in self.readings.items():
            readings[key] = {
                "reading": READINGS[key],
                "steps": profile.steps.tolist(),
                "cosine_per_seed": {str(s): _json(c) for s, c in profile.cosines.items()},
                "seeds_holding_at_end": profile.holds_at_end(),
                "seeds_holding_over_last_half": profile.holds_over_last_half(),
            }
        shares = None
        if self.shares is not None:
            steps, per_seed = self.shares
            shares = {
                "steps": steps.tolist(),
                "per_seed": {
                    str(s): {"unshifted": _json(a), "shifted": _json(b)}
                    for s, (a, b) in per_seed.items()
                },
            }
        return {
            "key": self.setup.key,
            "label": self.setup.label,
            "overrides": dict(self.setup.overrides),
            "null": self.setup.null,
            "trained": self.trained,
            "seeds": list(self.seeds),
            "claims": [r.to_dict() for r in self.claims],
            "readings": readings,
            "in_plane_shares": shares,
            "remarks": self.remarks,
        }


def measure_setup(
    setup: Setup, groups: Sequence[Group], comparison: GroupComparison
) -> SetupResult:
    """Every teacher–student claim and the orthogonality readings of one setup's two groups.

    Example::

        groups = load_groups(directory_groups("runs/reproduce/sensitivity/sgd-lr1e-1"))
        result = measure_setup(SETUPS[3], groups[:2], compare_groups(groups)[0])
        [(r.claim.key, r.verdict) for r in result.claims]
    """
    reference, other = groups
    claims = [
        r
        for r in evaluate_claims({EXPERIMENT: ((reference, other), comparison)})
        if r.claim.experiment == EXPERIMENT
    ]
    per_seed: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = {k: {} for k in READINGS}
    shares: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    remarks = []
    for seed in reference.seeds:
        geometry = displacement_geometry(reference.runs[seed], other.runs[seed])
        if isinstance(geometry, str):
            remarks.append(f"seed {seed}: {geometry}")
            continue
        steps = geometry.steps
        per_seed["displacement"][seed] = (steps, geometry.cosine)
        if geometry.path_cosine is None:
            remarks.append(f"seed {seed}: {geometry.plane_remark}")
            continue
        per_seed["path"][seed] = (steps, geometry.path_cosine)
        per_seed["oblique"][seed] = (steps, geometry.oblique_cosine)
        per_seed["gradients"][seed] = (steps, np.full(len(steps), geometry.gradient_cosine))
        (steps_a, share_a), (steps_b, share_b) = geometry.in_plane
        common, ia, ib = np.intersect1d(steps_a, steps_b, return_indices=True)
        shares[seed] = (common, share_a[ia], share_b[ib])
    readings = {}
    for key, series in per_seed.items():
        if series:
            steps, cut = _at_common_steps(series)
            readings[key] = ReadingProfile(steps, {seed: c for seed, (c,) in cut.items()})
    in_plane = _at_common_steps(shares) if shares else None
    trained = _trained_with(reference.runs[reference.seeds[0]].config)
    return SetupResult(setup, trained, tuple(reference.seeds), claims, readings, in_plane, remarks)


def reading_statements(results: Sequence[SetupResult]) -> list[str]:
    """One sentence per setup: which orthogonality readings hold there, at the end and over
    the run's second half (every seed's |cos| below :data:`ORTHOGONAL_COSINE`)."""
    lines = []
    for result in results:
        n = len(result.seeds)
        parts = []
        for key, profile in result.readings.items():
            end, late = profile.holds_at_end(), profile.holds_over_last_half()
            median = float(np.median(profile.angles_deg()[:, -1]))
            if key == "gradients":  # one angle per seed, the same at every step
                state = "holds" if end == n else f"holds for {end} of {n} seeds"
            elif end == n and late == n:
                state = "holds at the end and over the second half"
            elif end == n:
                state = "holds at the end only"
            elif end:
                state = f"holds at the end for {end} of {n} seeds"
            else:
                state = "does not hold"
            angle = "median angle" if key == "gradients" else "median final angle"
            parts.append(f"{READINGS[key]}: {state} ({angle} {median:.0f}°)")
        missing = [READINGS[k] for k in READINGS if k not in result.readings]
        if missing:
            parts.append(f"not measured: {', '.join(missing)}")
        lines.append(f"{result.setup.label}: " + "; ".join(parts) + ".")
    return lines


def _trained_with(config: Mapping[str, Any]) -> str:
    """The optimizer and learning rate a run's stored config names ("adam, lr 0.001"); a run
    file is input, so a value of another type is shown as "?", not formatted."""
    optimizer = config.get("optimizer")
    optimizer = optimizer if isinstance(optimizer, Mapping) else {}
    name, lr = optimizer.get("name"), optimizer.get("lr")
    name = name if isinstance(name, str) else "?"
    lr = f"{lr:g}" if isinstance(lr, (int, float)) and not isinstance(lr, bool) else "?"
    return f"{name}, lr {lr}"


def _at_common_steps(
    series: dict[int, tuple[np.ndarray, ...]],
) -> tuple[np.ndarray, dict[int, tuple[np.ndarray, ...]]]:
    """``{seed: (steps, *values)}`` cut to the steps every seed has (one config stores the
    same steps in each seed, so this drops nothing unless a run stopped early)."""
    steps = functools.reduce(np.intersect1d, (t for t, *_ in series.values()))
    return steps, {
        seed: tuple(v[np.isin(t, steps)] for v in values)
        for seed, (t, *values) in sorted(series.items())
    }


def _json(values: np.ndarray) -> list[float | None]:
    return [float(v) if np.isfinite(v) else None for v in values]
