"""The views of runs, one call each: what ``dynamics report`` (one run) and ``dynamics compare``
(several) draw of a run, for a notebook, e.g. ``figures.hidden_norms("runs/demo/shifted.h5")``.

Each takes a run (a :class:`~dynamics.store.Run` or the path of its file) or several and returns
a plotly figure. A group is drawn from the views its series were recorded with
(:mod:`dynamics.analysis.figures.series`), with what its dedicated view adds
(:mod:`dynamics.analysis.figures.dedicated_views`): one run's hidden-state norms carry their
overshoot verdicts, as in its report.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go
from numpy.typing import ArrayLike

from dynamics.analysis.figures.dedicated_views import (
    Marks,
    dedicated_view,
    descent_window,
    drawn_series,
    run_marks,
)
from dynamics.analysis.figures.lines import DISPLAY_BUDGET, Curve, line_figure, run_colors
from dynamics.analysis.figures.series import compared_view_figure, density_figure, view_figure
from dynamics.analysis.measures.run_series import (
    RunLike,
    density_rows,
    given_labels,
    group_title,
    open_runs,
)
from dynamics.errors import DynamicsError
from dynamics.store import Run, names

__all__ = [
    "displacement",
    "eigenvalues",
    "group",
    "hidden_norms",
    "loss",
    "loss_figure",
    "run_loss_figure",
    "spectral_density",
]


def loss(runs: RunLike | Sequence[RunLike], *, labels: Sequence[str] | None = None) -> go.Figure:
    """The training and held-out loss on a log axis.

    One run: with the window of fastest loss descent shaded when the run recorded hidden-state
    norms (the window its overshoot verdicts are judged against), as its report draws it.
    Several runs: overlaid, one colour per run, training loss solid and held-out dashed, as the
    comparison page draws them.

    Args:
        runs: a run (a :class:`~dynamics.store.Run` or the path of its file), or several.
        labels: the legend names of several runs; default their names, told apart by their
            files when alike.

    Raises:
        DynamicsError: a run recorded neither loss, a path is not a readable run file, or
            the labels do not match the runs.

    Example::

        figures.loss("runs/demo/shifted.h5").show()
        figures.loss(["runs/demo/unshifted.h5", "runs/demo/shifted.h5"], labels=["a", "b"])
    """
    opened = open_runs(runs)
    for run in opened:
        if run.train_loss() is None and run.heldout_loss() is None:
            raise DynamicsError(f"{run.path}: no training or held-out loss recorded")
    if len(opened) == 1:
        return run_loss_figure(opened[0], descent_window(run_marks(opened[0])))
    curves = []
    for run, label, color in zip(opened, given_labels(opened, labels), run_colors(len(opened))):
        train, heldout = run.train_loss(), run.heldout_loss()
        if train is not None:
            curves.append(Curve(f"{label} train", train.step, train.values, color, group=label))
        if heldout is not None:
            curves.append(
                Curve(
                    f"{label} held-out",
                    heldout.step,
                    heldout.values,
                    color,
                    dash="dash",
                    markers=True,
                    group=label,
                )
            )
    return line_figure(curves, title="Loss", y_title="loss", log_y=True)


def hidden_norms(
    runs: RunLike | Sequence[RunLike], *, labels: Sequence[str] | None = None
) -> go.Figure:
    """The hidden-state norm of every recorded layer, one panel per layer.

    One run: with its overshoot peaks starred and the window of fastest loss descent shaded,
    as its report draws it. Several runs: one line per run in each layer's panel.

    Args:
        runs: a run or several (see :func:`loss`).
        labels: the legend names of several runs (see :func:`loss`).

    Raises:
        DynamicsError: a run recorded no hidden-state norms, or its norms cannot be judged
            for overshoot (too few records).

    Example::

        figures.hidden_norms("runs/demo/shifted.h5").show()
    """
    return _group_views(runs, names.HIDDEN_NORMS, labels)


def eigenvalues(
    runs: RunLike | Sequence[RunLike], *, labels: Sequence[str] | None = None
) -> go.Figure:
    """The top Hessian eigenvalues over steps (one line per eigenvalue; one panel per run).

    Args:
        runs: a run or several (see :func:`loss`).
        labels: the panel titles of several runs (see :func:`loss`).

    Raises:
        DynamicsError: a run recorded no Hessian eigenvalues.

    Example::

        figures.eigenvalues(["runs/demo/unshifted.h5", "runs/demo/shifted.h5"]).show()
    """
    return _group_views(runs, names.HESSIAN, labels, only=names.HESSIAN_EIGENVALUES)


def displacement(
    runs: RunLike | Sequence[RunLike], *, labels: Sequence[str] | None = None
) -> go.Figure:
    """The distance from the initialization (in total and per tensor) and the update size.

    Args:
        runs: a run or several (see :func:`loss`).
        labels: the legend names of several runs (see :func:`loss`).

    Raises:
        DynamicsError: a run recorded no parameter displacement.

    Example::

        figures.displacement("runs/demo/shifted.h5").show()
    """
    return _group_views(runs, names.DISPLACEMENT, labels)


def group(
    runs: RunLike | Sequence[RunLike], name: str, *, labels: Sequence[str] | None = None
) -> go.Figure:
    """Every drawn series of a recorded group, as the views it was recorded with say.

    Any group is drawn this way, that of a user's own probe included; the loss (training and
    held-out) is left to :func:`loss`, which draws it with its window.

    Args:
        runs: a run or several (see :func:`loss`).
        name: the group, e.g. ``"hessian"`` or a user probe's name.
        labels: the legend names of several runs (see :func:`loss`).

    Raises:
        DynamicsError: a run recorded no drawn series in the group.

    Example::

        figures.group("runs/demo/shifted.h5", "activation_bias").show()
    """
    return _group_views(runs, name, labels)


def spectral_density(
    runs: RunLike | Sequence[RunLike], *, labels: Sequence[str] | None = None
) -> go.Figure:
    """The Hessian's spectral density over steps, one heatmap per run on one scale (see
    :func:`density_figure`).

    Args:
        runs: a run or several (see :func:`loss`).
        labels: the panel titles of several runs (see :func:`loss`).

    Raises:
        DynamicsError: a run recorded no spectral density (``HessianSpectrum(density_runs=...)``)
            or no finite row of it.

    Example::

        figures.spectral_density("runs/demo/shifted.h5").show()
    """
    opened = open_runs(runs)
    rows = [density_rows(run) for run in opened]
    for run, density in zip(opened, rows):
        if density is None:
            raise DynamicsError(f"{run.path}: no spectral density recorded")
    titles = [""] if len(opened) == 1 else given_labels(opened, labels)
    return density_figure(dict(zip(titles, rows)))


def run_loss_figure(run: Run, window: tuple[float, float] | None = None) -> go.Figure:
    """One run's training and held-out loss (:func:`loss_figure`), ``window`` shaded.

    Example::

        run_loss_figure(run, descent_window(run_marks(run)))
    """
    train, heldout = run.train_loss(), run.heldout_loss()
    return loss_figure(
        None if train is None else (train.step, train.values),
        None if heldout is None else (heldout.step, heldout.values),
        heldout_name=None if heldout is None else heldout.name,
        window=window,
    )


def loss_figure(
    train: tuple[ArrayLike, ArrayLike] | None,
    heldout: tuple[ArrayLike, ArrayLike] | None = None,
    *,
    heldout_name: str | None = None,
    window: tuple[float, float] | None = None,
    budget: int = DISPLAY_BUDGET,
) -> go.Figure:
    """Training and held-out loss on a log axis, with the window of fastest loss reduction.

    Args:
        train: ``(step, loss)`` of the training loss, or None.
        heldout: ``(step, loss)`` of the held-out loss, or None.
        heldout_name: the metric the held-out loss was logged as, shown in the legend.
        window: ``(start_step, end_step)`` of the window of fastest loss reduction.
        budget: display budget per trace.

    Example::

        loss_figure((steps, train_loss), (eval_steps, val_loss), heldout_name="val_loss")
    """
    curves = []
    if train is not None:
        curves.append(Curve("train", np.asarray(train[0]), np.asarray(train[1]), "#1f77b4"))
    if heldout is not None:
        step, values = heldout
        name = f"held-out ({heldout_name})" if heldout_name else "held-out"
        curves.append(Curve(name, np.asarray(step), np.asarray(values), "#d62728", markers=True))
    return line_figure(
        curves, title="Loss", y_title="loss", log_y=True, window=window, budget=budget
    )


def _group_views(
    runs: RunLike | Sequence[RunLike],
    name: str,
    labels: Sequence[str] | None,
    only: str | None = None,
) -> go.Figure:
    """The group's series (or only the series ``only``) of one run, or of several compared."""
    opened = open_runs(runs)
    alone = len(opened) == 1
    # One run's figure carries what its dedicated view marks, as in its report.
    marks = dedicated_view(name).marks(opened[0]) if alone else Marks()
    drawn = []
    for run in opened:
        series = drawn_series(run, name, marks)
        series = [s for s in series if only is None or s.name == only]
        if not series:
            raise DynamicsError(f"{run.path}: {_not_drawn(run, name, only)}")
        drawn.append(series)
    title = None if only else group_title(name)
    if alone:
        return view_figure(drawn[0], title=title, window=marks.window)
    return compared_view_figure(dict(zip(given_labels(opened, labels), drawn)), title=title)


def _not_drawn(run: Run, name: str, only: str | None) -> str:
    """Why a run has nothing to draw of the group ``name`` (or of its series ``only``)."""
    if name not in run.groups:
        return f"no {name!r} recorded (it recorded {', '.join(run.groups) or 'nothing'})"
    if len(run.series(name)) == 0:
        return f"{name!r} holds no row"
    if only is not None:
        return f"no {only} recorded in {name!r}"
    if name in (names.LOSS, names.VALIDATION):
        return f"nothing in {name!r} is drawn from a view; figures.loss draws the loss"
    return f"no series of {name!r} declares a view"
