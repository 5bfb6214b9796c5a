"""What a run's recorded series are drawn as: the figures' inputs, read through the typed
readers of :class:`~dynamics.store.Run`.

Every series that declares a view is drawn from it (:func:`series_views`), except those a
dedicated view draws instead (the table of :mod:`dynamics.analysis.figures.dedicated_views`
says which). The numbers dedicated views mark or draw are here too: a run's overshoot verdicts
(:func:`run_overshoot`) with their peaks and loss window, and its spectral density
(:func:`density_rows`).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from dynamics.analysis.measures.overshoot import OvershootReport, detect_overshoot
from dynamics.errors import DynamicsError
from dynamics.store import Run, View, names, open_run

__all__ = [
    "STANDARD_GROUPS",
    "Peak",
    "RunLike",
    "SeriesView",
    "density_rows",
    "drawn_groups",
    "given_labels",
    "group_title",
    "loss_window",
    "open_runs",
    "overshoot_peaks",
    "run_labels",
    "run_overshoot",
    "series_views",
]

#: A run for the views of runs: an open :class:`~dynamics.store.Run`, or the path of its file.
RunLike = Run | str | os.PathLike

#: The standard probes' groups, in the order pages draw them; other groups follow by name.
STANDARD_GROUPS = (
    names.LOSS,
    names.VALIDATION,
    names.HIDDEN_NORMS,
    names.ACTIVATION_BIAS,
    names.DISPLACEMENT,
    names.HESSIAN,
    names.PLANE,
)


@dataclass(frozen=True)
class Peak:
    """An overshoot peak to mark: a layer's name, the step and the value of its maximum."""

    name: str
    step: float
    value: float


@dataclass(frozen=True)
class SeriesView:
    """A recorded series with the view it declared: what
    :func:`~dynamics.analysis.figures.view_figure` draws.

    Attributes:
        name: the series' name in its group; several runs' series are matched by it.
        view: how it is drawn.
        step: steps, shape (n,).
        values: shape (n,) or (n, columns); further axes are flattened into columns.
        columns: names of the columns (default ``<name>_<j>``).
        peaks: overshoot peaks to mark, each on the column its name names.
    """

    name: str
    view: View
    step: np.ndarray
    values: np.ndarray
    columns: Sequence[str] = ()
    peaks: Sequence[Peak] = ()


def drawn_groups(runs: Iterable[Run]) -> list[str]:
    """The groups any of the runs recorded, standard ones first, in drawing order."""
    recorded = {group for run in runs for group in run.groups}
    return [g for g in STANDARD_GROUPS if g in recorded] + sorted(recorded - {*STANDARD_GROUPS})


def run_labels(runs: Sequence[Run]) -> list[str]:
    """A label per run for legends and panel titles: its name, told apart by its file when
    two runs are named alike (e.g. ``shifted`` from two output folders)."""
    run_names = [run.name for run in runs]
    return [
        f"{name} ({run.path.parent.name}/{run.path.name})" if run_names.count(name) > 1 else name
        for name, run in zip(run_names, runs)
    ]


def group_title(group: str) -> str:
    """The title of a figure drawing several series of ``group``: its name, as words."""
    return group.replace("_", " ").capitalize()


def series_views(
    run: Run,
    group: str,
    peaks: Mapping[str, Sequence[Peak]] | None = None,
    skip: Collection[str] = (),
) -> list[SeriesView]:
    """Every series of ``group`` that declares a view, but those in ``skip``.

    Args:
        run: the run.
        group: one of its groups (or any name: a group it did not record has no series).
        peaks: ``{series: overshoot peaks}`` to mark on it.
        skip: series of the group a dedicated view draws instead.

    Raises:
        RunFileError: the group's data cannot be read (a damaged file).

    Example::

        views = series_views(open_run("runs/demo/shifted.h5"), "hessian")
        [view.name for view in views]  # ['eigenvalues', 'residuals', ...]
    """
    views = {n: v for n, v in run.views(group).items() if n not in skip}
    rows = run.recorded(group) if views else None
    if rows is None:
        return []
    return [
        SeriesView(
            name,
            view,
            rows.step,
            rows[name],
            run.columns(group, name),
            tuple((peaks or {}).get(name, ())),
        )
        for name, view in views.items()
    ]


def density_rows(run: Run) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``(step, nodes, weights)`` of the recorded spectral density, or None when the run has
    no row with a finite node."""
    rows = run.recorded(names.HESSIAN)
    wanted = (names.HESSIAN_DENSITY_NODES, names.HESSIAN_DENSITY_WEIGHTS)
    if rows is None or not all(name in rows.values for name in wanted):
        return None
    nodes, weights = (rows[name] for name in wanted)
    return (rows.step, nodes, weights) if np.isfinite(nodes).any() else None


def run_overshoot(run: Run) -> OvershootReport | None:
    """Overshoot verdicts of every recorded layer's hidden-state norm, or None without norms.

    The loss window comes from the training loss when the run recorded one.

    Raises:
        DynamicsError: the norms cannot be judged (e.g. too few records).

    Example::

        report = run_overshoot(open_run("runs/demo/shifted.h5"))
    """
    norms = run.recorded(names.HIDDEN_NORMS)
    if norms is None or names.HIDDEN_NORM not in norms.values:
        return None
    loss = run.train_loss()
    try:
        return detect_overshoot(
            norms.step,
            norms[names.HIDDEN_NORM],
            loss_steps=None if loss is None else loss.step,
            loss=None if loss is None else loss.values,
            layer_names=list(run.columns(names.HIDDEN_NORMS, names.HIDDEN_NORM)),
        )
    except ValueError as error:
        raise DynamicsError(f"{run.path}: cannot judge overshoot: {error}") from error


def overshoot_peaks(report: OvershootReport | None) -> dict[str, list[Peak]]:
    """``{series: peaks}`` of the layers judged to overshoot, to mark on the norms."""
    layers = report.layers if report else ()
    return {
        names.HIDDEN_NORM: [Peak(x.name, x.peak_step, x.peak_value) for x in layers if x.overshoot]
    }


def loss_window(report: OvershootReport | None) -> tuple[float, float] | None:
    """``(start, end)`` step of the window of fastest loss reduction, when one was found."""
    window = report.loss_window if report else None
    return (window.start_step, window.end_step) if window and window.found else None


def open_runs(runs: RunLike | Sequence[RunLike]) -> list[Run]:
    """One run or several, each open (a path is opened).

    Raises:
        DynamicsError: no run given, or a path that is not a readable run file.
    """
    if isinstance(runs, Run | str | os.PathLike):
        runs = [runs]
    opened = [run if isinstance(run, Run) else open_run(run) for run in runs]
    if not opened:
        raise DynamicsError("no run given")
    return opened


def given_labels(runs: list[Run], labels: Sequence[str] | None) -> list[str]:
    """The labels given for ``runs``, or :func:`run_labels` of them when none are.

    Raises:
        DynamicsError: as many labels as runs were not given.
    """
    if labels is None:
        return run_labels(runs)
    if len(labels) != len(runs):
        raise DynamicsError(f"{len(labels)} labels for {len(runs)} runs")
    return list(labels)
