"""Groups of runs over seeds, paired by seed and compared with a reference group, as numbers.

A group is a folder of run files named ``seed<k>.h5`` (or a glob of them); a directory laid out
as ``DIR/<variant>/seed<k>.h5`` gives one group per subfolder. Runs pair by seed: the number in
the file name (``seed3.h5``), else the recorded config's ``seed``. Every group must hold the
same seeds: a seed one group lacks is refused by name rather than silently left out.

Per seed pair, each measure is one number (other group vs reference): the final and the best
smoothed held-out loss (other − reference; the training loss when either run lacks two
held-out values), the step where the other group overtakes for good, the median over time of
the λ1 ratio (other / reference, when both recorded the Hessian), and per layer the overshoot
magnitudes (peak / plateau, peak / start, isotonic residual area; other − reference). Across
seeds each measure gets the statistics of :mod:`.paired_statistics`.

A band over seeds (:func:`seed_band`) is the mean and the min–max envelope (not a confidence
interval): each seed's series is read at the steps of the group's first seed inside the range
all seeds cover (linear interpolation, exact when the schedules agree).
"""

from __future__ import annotations

import functools
import glob
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dynamics.analysis.measures.overshoot import OvershootReport
from dynamics.analysis.measures.paired_statistics import (
    DIFFERENCE,
    RATIO,
    VALUE,
    PairedStatistic,
    paired_statistic,
)
from dynamics.analysis.measures.run_comparison import (
    compared_loss,
    eigenvalue_ratio,
    finite,
    loss_crossover,
    smooth,
)
from dynamics.analysis.measures.run_series import run_overshoot
from dynamics.errors import DynamicsError, ParameterError
from dynamics.store import Metric, Run, open_run, other_output

__all__ = [
    "Group",
    "GroupComparison",
    "compare_groups",
    "directory_groups",
    "groups_json",
    "is_group_directory",
    "load_groups",
    "overtaking_step",
    "parse_group",
    "seed_band",
]

_SEED = re.compile(r"seed(\d+)$")
#: Overshoot magnitudes compared per layer: (measure name, attribute of the layer's verdict).
OVERSHOOT_MAGNITUDES = (
    ("peak / plateau", "peak_over_plateau"),
    ("peak / start", "peak_over_start"),
    ("isotonic residual area", "residual_area"),
)


@dataclass(frozen=True)
class Group:
    """A named group of runs, one per seed.

    Attributes:
        name: the group's name (``unshifted``).
        runs: ``{seed: run}`` in seed order.
    """

    name: str
    runs: dict[int, Run]

    @property
    def seeds(self) -> list[int]:
        return list(self.runs)


@dataclass(frozen=True)
class GroupComparison:
    """One group against the reference, measure by measure over the paired seeds."""

    reference: str
    other: str
    statistics: tuple[PairedStatistic, ...]


def parse_group(text: str) -> tuple[str, str]:
    """``NAME=PATH`` as ``(name, path)``.

    Raises:
        DynamicsError: no ``=``, or an empty name or path.
    """
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path:
        raise ParameterError("group", f"must be NAME=FOLDER or NAME=GLOB, got {text!r}")
    return name.strip(), path


def is_group_directory(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory laid out as ``<variant>/seed<k>.h5``: no run file of
    its own, and subfolders that hold some."""
    path = Path(path)
    return (
        path.is_dir()
        and not any(path.glob("*.h5"))
        and any(sub.is_dir() and any(sub.glob("*.h5")) for sub in path.iterdir())
    )


def directory_groups(path: str | os.PathLike) -> list[tuple[str, str]]:
    """``(variant, folder)`` of every subfolder of ``path`` that holds run files, by name,
    except that a baseline comes first: the one subfolder whose runs recorded a variant whose
    setting is ``none`` in the config's ``variants`` (``unshifted: none``).

    Example::

        load_groups(directory_groups("runs/reproduce/teacher_student"))
    """
    path = Path(path)
    subfolders = sorted(sub for sub in path.iterdir() if sub.is_dir() and any(sub.glob("*.h5")))
    baseline = [sub for sub in subfolders if _is_baseline(sorted(sub.glob("*.h5"))[0])]
    if len(baseline) == 1:
        subfolders.remove(baseline[0])
        subfolders.insert(0, baseline[0])
    return [(sub.name, str(sub)) for sub in subfolders]


def _is_baseline(path: Path) -> bool:
    config = open_run(path).config
    variants = config.get("variants")
    return isinstance(variants, dict) and variants.get(config.get("variant")) == "none"


def load_groups(specs: Sequence[tuple[str, str | os.PathLike]]) -> list[Group]:
    """Open each group's runs and check that they pair by seed.

    Args:
        specs: ``(name, folder or glob)`` per group; the first is the reference.

    Raises:
        DynamicsError: fewer than two groups, a name given twice, a group without run files,
            a run whose seed cannot be told, a seed twice in a group, or seeds that do not
            pair (named).

    Example::

        groups = load_groups([("base", "runs/base"), ("shifted", "runs/shifted/seed*.h5")])
    """
    if len(specs) < 2:
        raise DynamicsError(f"a grouped compare needs at least two groups, got {len(specs)}")
    names = [name for name, _ in specs]
    if len(set(names)) < len(names):
        raise DynamicsError(f"group names must differ, got {', '.join(names)}")
    groups = [Group(name, _group_runs(name, str(where))) for name, where in specs]
    reference = set(groups[0].seeds)
    for group in groups[1:]:
        lacking = sorted(set(group.seeds) ^ reference)
        if lacking:
            where = {
                seed: groups[0].name if seed not in reference else group.name for seed in lacking
            }
            listed = ", ".join(f"seed {seed} (not in {where[seed]})" for seed in lacking)
            raise DynamicsError(
                f"groups {groups[0].name} and {group.name} do not pair by seed: {listed}"
            )
    return groups


def _group_runs(name: str, where: str) -> dict[int, Run]:
    path = Path(where)
    found = path.glob("*.h5") if path.is_dir() else map(Path, glob.glob(where))
    # a plane grid written beside the runs is this toolkit's output, not a run of the group
    files = sorted(p for p in found if p.is_file() and not other_output(p))
    if not files:
        raise DynamicsError(f"group {name}: no run files (*.h5) in {where}")
    runs: dict[int, Run] = {}
    for file in files:
        run = open_run(file)
        seed = _seed(run)
        if seed in runs:
            raise DynamicsError(
                f"group {name}: seed {seed} twice ({runs[seed].path.name}, {file.name})"
            )
        runs[seed] = run
    return dict(sorted(runs.items()))


def _seed(run: Run) -> int:
    match = _SEED.search(run.path.stem)
    if match:
        return int(match.group(1))
    seed = run.config.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        return seed
    raise DynamicsError(
        f"{run.path}: cannot tell its seed (name it seed<k>.h5 or record config seed)"
    )


def compare_groups(groups: Sequence[Group]) -> list[GroupComparison]:
    """Every group after the first against the first, measure by measure (module docstring).

    Example::

        comparisons = compare_groups(groups)
        [stat.measure for stat in comparisons[0].statistics]
    """
    reference = groups[0]
    overshoots = {run.path: run_overshoot(run) for group in groups for run in group.runs.values()}
    comparisons = []
    for group in groups[1:]:
        pairs = [(seed, reference.runs[seed], group.runs[seed]) for seed in reference.seeds]
        names = (reference.name, group.name)
        loss = _loss_name(pairs)
        statistics = [
            _measure(f"final {loss}, {group.name} − {reference.name}", DIFFERENCE, pairs, _final),
            _measure(f"best {loss}, {group.name} − {reference.name}", DIFFERENCE, pairs, _best),
            _measure(
                f"step {group.name} overtakes {reference.name}{_interpolated(pairs)}",
                VALUE,
                pairs,
                functools.partial(overtaking_step, names=names),
            ),
            _measure(f"λ1 ratio, {group.name} / {reference.name}", RATIO, pairs, _lambda_ratio),
        ]
        layers = _layers([overshoots[run.path] for _, *runs in pairs for run in runs])
        for layer in layers:
            for title, attribute in OVERSHOOT_MAGNITUDES:
                statistics.append(
                    _measure(
                        f"overshoot {title} at {layer}, {group.name} − {reference.name}",
                        DIFFERENCE,
                        pairs,
                        _magnitude(overshoots, layer, attribute),
                    )
                )
        comparisons.append(GroupComparison(reference.name, group.name, tuple(statistics)))
    return comparisons


Measure = Callable[[Run, Run], "float | str"]


def _measure(
    title: str, kind: str, pairs: list[tuple[int, Run, Run]], measure: Measure
) -> PairedStatistic:
    """Apply ``measure`` to each seed pair: a number, or a string saying why there is none."""
    seeds, values, missing = [], [], []
    for seed, a, b in pairs:
        value = measure(a, b)
        if isinstance(value, str):
            missing.append(f"seed {seed}: {value}")
        else:
            seeds.append(seed)
            values.append(value)
    return paired_statistic(title, kind, seeds, values, missing)


def _loss_name(pairs: list[tuple[int, Run, Run]]) -> str:
    """``held-out loss`` or ``train loss`` when every seed pair is compared on it, else
    ``loss`` (held-out for some seeds, training for others)."""
    compared = [compared_loss(a, b) for _, a, b in pairs]
    metrics = {loss.metric.split(" (")[0] for loss in compared if loss is not None}
    return metrics.pop() if len(metrics) == 1 else "loss"


def _interpolated(pairs: list[tuple[int, Run, Run]]) -> str:
    """What the overtaking step is when the compared loss was recorded sparsely: a step
    interpolated between records, placed by them only within their spacing."""
    spacings = [
        int(np.max(np.diff(m.step)))
        for loss in (compared_loss(a, b) for _, a, b in pairs)
        if loss is not None
        for m in (loss.reference, loss.other)
        if len(m.step) > 1
    ]
    spacing = max(spacings, default=1)
    if spacing <= 1:
        return ""
    return f" (interpolated between loss records up to {spacing} steps apart)"


def _smoothed_loss(a: Run, b: Run) -> tuple[np.ndarray, np.ndarray] | str:
    loss = compared_loss(a, b)
    if loss is None:
        return "no loss both runs recorded"
    curves = [smooth(finite(m.step, m.values)[1]) for m in (loss.reference, loss.other)]
    if not all(len(c) for c in curves):
        return "no finite loss"
    return curves[0], curves[1]


def _final(a: Run, b: Run) -> float | str:
    curves = _smoothed_loss(a, b)
    return curves if isinstance(curves, str) else float(curves[1][-1] - curves[0][-1])


def _best(a: Run, b: Run) -> float | str:
    curves = _smoothed_loss(a, b)
    return curves if isinstance(curves, str) else float(curves[1].min() - curves[0].min())


def overtaking_step(a: Run, b: Run, names: tuple[str, str]) -> float | str:
    """The step after which ``b`` (named ``names[1]``) stays ahead of ``a`` on the compared
    loss, or why there is none (``a`` ahead at the end, ``b`` ahead throughout)."""
    result = loss_crossover(a, b, names)
    if result is None:
        return "no overlapping loss"
    if result.winner != names[1]:
        return f"{result.winner or 'nobody'} ahead at the end"
    if result.step is None:
        return f"{names[1]} ahead throughout"
    return result.step


def _lambda_ratio(a: Run, b: Run) -> float | str:
    ratio = eigenvalue_ratio(a, b)
    if ratio is None:
        return "λ1 not recorded in both"
    return float(np.median(ratio[1]))


def _layers(reports: list[OvershootReport | None]) -> list[str]:
    """The layers every run's overshoot report judged, in the first report's order."""
    if not reports or any(r is None for r in reports):
        return []
    shared = set.intersection(*({x.name for x in r.layers} for r in reports))
    return [x.name for x in reports[0].layers if x.name in shared]


def _magnitude(
    overshoots: dict[Path, OvershootReport | None], layer: str, attribute: str
) -> Measure:
    """Other − reference of one overshoot magnitude of ``layer``."""

    def measure(a: Run, b: Run) -> float | str:
        values = [getattr(overshoots[run.path].layer(layer), attribute) for run in (a, b)]
        if None in values:
            return f"{attribute.replace('_', ' ')} undefined (series too short or constant)"
        return float(values[1] - values[0])

    return measure


def groups_json(groups: Sequence[Group], comparisons: Sequence[GroupComparison]) -> dict[str, Any]:
    """What ``dynamics compare --json`` prints: the groups' runs by seed and every statistic."""
    return {
        "reference": groups[0].name,
        "groups": {
            g.name: {str(seed): str(run.path) for seed, run in g.runs.items()} for g in groups
        },
        "comparisons": [
            {
                "reference": c.reference,
                "other": c.other,
                "statistics": [stat.to_dict() for stat in c.statistics],
            }
            for c in comparisons
        ],
    }


def seed_band(metrics: list[Metric | None]) -> tuple[np.ndarray, ...] | None:
    """``(steps, mean, low, high)`` over the seeds' series, or None unless every seed has
    at least two finite records that overlap."""
    if any(m is None for m in metrics):
        return None
    series = [finite(m.step, m.values) for m in metrics]
    if any(len(values) < 2 for _, values in series):
        return None
    steps = series[0][0].astype(float)
    start = max(s[0] for s, _ in series)
    end = min(s[-1] for s, _ in series)
    steps = steps[(steps >= start) & (steps <= end)]
    if len(steps) < 2:
        return None
    table = np.stack([np.interp(steps, s, v) for s, v in series])
    return steps, table.mean(0), table.min(0), table.max(0)
