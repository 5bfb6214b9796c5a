"""Plotly figures of recorded runs: one call per view, for a notebook or a page.

Two levels, both public and stable:

- **Views of runs** (:func:`loss`, :func:`hidden_norms`, :func:`eigenvalues`,
  :func:`displacement`, :func:`spectral_density`, :func:`plane_path`, :func:`plane_share`,
  :func:`group`): each takes a run (a :class:`~dynamics.store.Run` or a path) or several and
  returns the figure ``dynamics report`` (one run) or ``dynamics compare`` (several) draws of
  it, e.g. ``figures.hidden_norms("runs/demo/shifted.h5").show()`` in Jupyter.
- **Builders** (``*_figure``): pure functions of arrays (or :class:`Curve` and
  :class:`SeriesView` bundles of them) that the views above and the pages are made of.
  :func:`view_figure` and :func:`compared_view_figure` draw any series as the
  :class:`~dynamics.store.View` it was recorded with says.

A trace longer than the display budget is decimated by :func:`decimate`, which keeps the
minimum and the maximum of each bucket of consecutive records, so an overshoot peak or a loss
spike is never smoothed away; a figure holding a decimated trace says so in its subtitle.

Traces are SVG scatter traces, not WebGL ones: with a decimated budget of a few thousand points
SVG is fast enough and renders everywhere, headless browsers without a GPU included.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go
from numpy.typing import ArrayLike
from plotly.colors import qualitative, sample_colorscale
from plotly.subplots import make_subplots

from dynamics.analysis.run_views import (
    Peak,
    SeriesView,
    density_rows,
    group_title,
    loss_window,
    overshoot_peaks,
    run_labels,
    run_overshoot,
    series_views,
)
from dynamics.curvature.broadening import broadened_density
from dynamics.errors import DynamicsError
from dynamics.store import Run, Series, names, open_run

__all__ = [
    "DISPLAY_BUDGET",
    "Curve",
    "Decimated",
    "Peak",
    "RunLike",
    "SeriesView",
    "compared_view_figure",
    "decimate",
    "density_figure",
    "displacement",
    "displacement_figure",
    "eigenvalues",
    "group",
    "hessian_figure",
    "hidden_norms",
    "layer_figure",
    "line_figure",
    "loss",
    "loss_figure",
    "panels_figure",
    "plane_figure",
    "plane_path",
    "plane_paths_figure",
    "plane_share",
    "run_colors",
    "spectral_density",
    "view_figure",
]

#: A run for the views of runs: an open :class:`~dynamics.store.Run`, or the path of its file.
RunLike = Run | str | os.PathLike

#: Points per trace above which a trace is decimated for display. 2,000 points is more than a
#: figure's pixel width, so the min/max envelope looks the same as the full series, and keeps a
#: report with dozens of traces to a few hundred kilobytes of data.
DISPLAY_BUDGET = 2000
_HEIGHT = 380
_ROW_HEIGHT = 250  # of one row of panels in a figure of several rows
_COLUMNS = 4  # most panels side by side; more wrap onto further rows
_WINDOW_COLOR = "rgba(255, 165, 0, 0.18)"
_SINGLE_COLOR = "#1f77b4"


@dataclass(frozen=True)
class Decimated:
    """A series reduced for display.

    Attributes:
        step: steps of the kept records.
        values: their values.
        original: records before decimation.
        bucket: records per bucket (1 when nothing was dropped).
    """

    step: np.ndarray
    values: np.ndarray
    original: int
    bucket: int

    @property
    def decimated(self) -> bool:
        return self.bucket > 1


@dataclass(frozen=True)
class Curve:
    """One line of a figure and how to draw it.

    Attributes:
        name: legend entry.
        step: steps, shape (n,).
        values: values, shape (n,).
        color: line colour; plotly's default cycle when None.
        dash: ``"solid"``, ``"dash"``, ``"dot"``, ...
        markers: draw a marker at each record (sparse series such as held-out loss).
        group: legend group, so traces that belong together toggle together.
        show_legend: whether the curve gets a legend entry.
    """

    name: str
    step: np.ndarray
    values: np.ndarray
    color: str | None = None
    dash: str = "solid"
    markers: bool = False
    group: str | None = None
    show_legend: bool = True


def decimate(step: ArrayLike, values: ArrayLike, budget: int = DISPLAY_BUDGET) -> Decimated:
    """Keep at most ``budget`` records of a series, including every bucket's extremes.

    The records are cut into consecutive buckets of ``ceil(n / (budget // 2))`` records; of
    each bucket the minimum and the maximum are kept, in step order. The global extremes are
    therefore always kept, and so is any spike, even of one record, that is the largest (or
    smallest) value of its bucket. NaN records are skipped unless a whole bucket is NaN, in
    which case one NaN is kept so the line shows the gap.

    Args:
        step: steps, shape (n,).
        values: values, shape (n,).
        budget: most records to keep; at least 2.

    Returns:
        The kept records; unchanged (``bucket == 1``) when ``n <= budget``.
    """
    if budget < 2:
        raise ValueError(f"budget must be at least 2, got {budget}")
    step = np.asarray(step)
    values = np.asarray(values)
    n = len(step)
    if n <= budget:
        return Decimated(step, values, n, 1)
    bucket = -(-n // (budget // 2))
    buckets = -(-n // bucket)
    padded = np.full(buckets * bucket, np.nan)
    padded[:n] = values
    rows = padded.reshape(buckets, bucket)
    nan = np.isnan(rows)
    # NaN never wins: an all-NaN bucket yields its first record, which is real (rows start < n).
    low = np.argmin(np.where(nan, np.inf, rows), axis=1)
    high = np.argmax(np.where(nan, -np.inf, rows), axis=1)
    starts = np.arange(buckets) * bucket
    keep = np.unique(np.concatenate([starts + low, starts + high]))
    return Decimated(step[keep], values[keep], n, bucket)


def run_colors(count: int) -> list[str]:
    """Distinct colours for ``count`` runs (the same run keeps its colour in every figure)."""
    palette = qualitative.D3
    return [palette[i % len(palette)] for i in range(count)]


def y_scale(log: bool, *values: ArrayLike) -> dict[str, str]:
    """A y axis's scale, linear or log over ``values`` (what the axis draws).

    Log axes label every tick with its whole value ("20", "50", "100", "0.002"): plotly's
    default labels the ticks between decades with their first digit alone, a "2" under a
    "10" that reads as 2. Under three decades the ticks are 1, 2 and 5 of each (nine labels
    a decade would overlap); above, plotly's decades.
    """
    if not log:
        return {"type": "linear"}
    scale = {"type": "log", "tickformat": ".3~g"}
    drawn = np.concatenate([np.ravel(np.asarray(v, dtype=float)) for v in values] or [[]])
    drawn = drawn[np.isfinite(drawn) & (drawn > 0)]
    if drawn.size and np.log10(drawn.max() / drawn.min()) < 3:
        scale["dtick"] = "D2"
    return scale


def line_figure(
    curves: Sequence[Curve],
    *,
    title: str,
    y_title: str,
    log_y: bool = False,
    window: tuple[float, float] | None = None,
    peaks: Sequence[Peak] = (),
    budget: int = DISPLAY_BUDGET,
) -> go.Figure:
    """Lines over steps, optionally with the fastest-descent window and overshoot peaks.

    Args:
        curves: the lines.
        title: figure title.
        y_title: y-axis title.
        log_y: logarithmic y axis (non-positive values are not drawn).
        window: ``(start_step, end_step)`` of the window of fastest loss reduction, shaded.
        peaks: overshoot peaks, drawn as star markers.
        budget: display budget per trace (see :func:`decimate`).
    """
    figure = go.Figure()
    reduced = [_add_curve(figure, curve, budget) for curve in curves]
    _mark_window(figure, window)
    _mark_peaks(figure, peaks)
    _style(figure, title, reduced)
    figure.update_xaxes(title_text="step")
    figure.update_yaxes(title_text=y_title, **y_scale(log_y, *(c.values for c in curves)))
    return figure


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


def layer_figure(
    step: ArrayLike,
    values: ArrayLike,
    layers: Sequence[str],
    *,
    title: str,
    y_title: str,
    log_y: bool = False,
    window: tuple[float, float] | None = None,
    peaks: Sequence[Peak] = (),
    budget: int = DISPLAY_BUDGET,
) -> go.Figure:
    """One line per layer (columns of ``values``), coloured from the first layer to the last.

    Args:
        step: steps, shape (n,).
        values: shape (n, L), one column per layer.
        layers: the L layer names.
        title: figure title.
        y_title: y-axis title.
        log_y: logarithmic y axis.
        window: shaded window of fastest loss reduction.
        peaks: overshoot peaks to mark.
        budget: display budget per trace.
    """
    values = np.asarray(values)
    colors = _layer_colors(len(layers))
    curves = [
        Curve(layer, np.asarray(step), values[:, j], colors[j]) for j, layer in enumerate(layers)
    ]
    return line_figure(
        curves,
        title=title,
        y_title=y_title,
        log_y=log_y,
        window=window,
        peaks=peaks,
        budget=budget,
    )


def displacement_figure(
    step: ArrayLike,
    total: ArrayLike,
    update: ArrayLike | None = None,
    *,
    budget: int = DISPLAY_BUDGET,
) -> go.Figure:
    """Distance from θ0 (top) and update size per step (bottom, log axis).

    Args:
        step: steps, shape (n,).
        total: ‖θt − θ0‖, shape (n,).
        update: ‖θt+1 − θt‖, shape (n,), or None.
        budget: display budget per trace.
    """
    rows = 1 if update is None else 2
    figure = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=0.08)
    step = np.asarray(step)
    reduced = [
        _add_curve(
            figure, Curve("‖θt − θ0‖", step, np.asarray(total), "#2ca02c"), budget, row=1, col=1
        )
    ]
    figure.update_yaxes(title_text="‖θt − θ0‖", row=1, col=1)
    if update is not None:
        update_curve = Curve("‖θt+1 − θt‖", step, np.asarray(update), "#9467bd")
        reduced.append(_add_curve(figure, update_curve, budget, row=2, col=1))
        figure.update_yaxes(title_text="update size", **y_scale(True, update), row=2, col=1)
    _style(figure, "Parameter displacement and update size", reduced, height=_HEIGHT + 120)
    figure.update_xaxes(title_text="step", row=rows, col=1)
    return figure


def hessian_figure(
    step: ArrayLike,
    eigenvalues: ArrayLike,
    names: Sequence[str],
    *,
    budget: int = DISPLAY_BUDGET,
) -> go.Figure:
    """Top Hessian eigenvalues over steps, one line each (largest first).

    Args:
        step: steps, shape (n,).
        eigenvalues: shape (n, k).
        names: the k column names (``lambda_1`` ...).
        budget: display budget per trace.
    """
    eigenvalues = np.asarray(eigenvalues)
    colors = _layer_colors(len(names))
    curves = [
        Curve(name, np.asarray(step), eigenvalues[:, j], colors[j], markers=len(step) <= 200)
        for j, name in enumerate(names)
    ]
    return line_figure(curves, title="Top Hessian eigenvalues", y_title="eigenvalue", budget=budget)


def plane_figure(
    step: ArrayLike, a: ArrayLike, b: ArrayLike, *, budget: int = DISPLAY_BUDGET
) -> go.Figure:
    """The run's path on a plane of parameter space: coordinates (a, b), coloured by step.

    Args:
        step: steps, shape (n,).
        a: first coordinate, shape (n,).
        b: second coordinate, shape (n,).
        budget: most points drawn; a longer path is thinned evenly (a path has no peaks to
            keep, and min/max of one coordinate would distort the other).
    """
    step, a, b = (np.asarray(x) for x in (step, a, b))
    n = len(step)
    keep = np.unique(np.linspace(0, n - 1, min(n, budget)).round().astype(int)) if n else []
    figure = go.Figure(
        go.Scatter(
            x=a[keep],
            y=b[keep],
            mode="lines+markers",
            name="trajectory",
            marker=dict(size=4, color=step[keep], colorscale="Viridis", showscale=True),
            line=dict(color="rgba(120, 120, 120, 0.5)"),
            text=[f"step {s}" for s in step[keep]],
        )
    )
    figure.update_layout(height=_HEIGHT + 80, template="plotly_white", title="Path on the plane")
    if len(keep) < n:
        figure.update_layout(
            title_subtitle_text=f"thinned for display: {len(keep):,} of {n:,} records drawn"
        )
    figure.update_xaxes(title_text="a")
    figure.update_yaxes(title_text="b", scaleanchor="x")
    return figure


def panels_figure(
    panels: Sequence[tuple[str, np.ndarray, np.ndarray, Sequence[str]]],
    *,
    title: str,
    y_title: str,
    log_y: bool = False,
    budget: int = DISPLAY_BUDGET,
) -> go.Figure:
    """Side-by-side panels sharing the y axis, one per run, one line per column.

    Args:
        panels: ``(panel title, step (n,), values (n, L), column names)`` per panel; a column
            keeps its colour across panels and toggles in all of them from one legend entry.
        title: figure title.
        y_title: y-axis title.
        log_y: logarithmic y axis.
        budget: display budget per trace.
    """
    figure = make_subplots(
        rows=1,
        cols=len(panels),
        shared_yaxes=True,
        horizontal_spacing=0.03,
        subplot_titles=[panel[0] for panel in panels],
    )
    reduced = []
    for col, (_, step, values, columns) in enumerate(panels, start=1):
        colors = _layer_colors(len(columns))
        for j, name in enumerate(columns):
            curve = Curve(name, step, values[:, j], colors[j], group=name, show_legend=col == 1)
            reduced.append(_add_curve(figure, curve, budget, row=1, col=col))
    _style(figure, title, reduced)
    figure.update_yaxes(**y_scale(log_y, *(panel[2] for panel in panels)))
    figure.update_yaxes(title_text=y_title, col=1)
    figure.update_xaxes(title_text="step")
    return figure


def view_figure(
    series: Sequence[SeriesView],
    *,
    title: str | None = None,
    window: tuple[float, float] | None = None,
    budget: int = DISPLAY_BUDGET,
) -> go.Figure:
    """One run's series, each drawn as its view says; several stack, sharing the step axis.

    Kinds: ``scalar``, one line; ``lines``, one line per column; ``panels``, one small panel
    per column; ``heatmap``, steps × columns as colour. A series of one value per step is drawn
    as a line whatever its kind, one of several values as lines when its kind is ``scalar``.
    Title, value-axis label, units and log scale come from the view.

    Args:
        series: the series, in drawing order (e.g. those of one group).
        title: the figure's title when it draws several series (one series is titled by its
            view); default: their views' titles.
        window: ``(start_step, end_step)`` shaded in every panel (fastest loss descent).
        budget: display budget per trace (see :func:`decimate`) and steps per heatmap.
    """
    blocks = _view_blocks({"": series}, [_SINGLE_COLOR], budget)
    return _blocks_figure(blocks, title, window, budget)


def compared_view_figure(
    runs: Mapping[str, Sequence[SeriesView]],
    *,
    title: str | None = None,
    colors: Sequence[str] | None = None,
    budget: int = DISPLAY_BUDGET,
) -> go.Figure:
    """Several runs' series, as their views say, overlaid or side by side.

    Series are matched across runs by name and drawn as the first run's view says:
    ``scalar``, one line per run; ``lines``, one panel per run; ``panels``, one panel per
    column (matched by name), one line per run; ``heatmap``, one panel per run on one colour
    scale. A run keeps its colour in every panel.

    Args:
        runs: ``{run label: its series}``, the reference first.
        title: as in :func:`view_figure`.
        colors: one colour per run; default :func:`run_colors`.
        budget: as in :func:`view_figure`.
    """
    colors = list(colors) if colors is not None else run_colors(len(runs))
    return _blocks_figure(_view_blocks(runs, colors, budget), title, None, budget)


def density_figure(
    runs: Mapping[str, tuple[ArrayLike, ArrayLike, ArrayLike]],
    *,
    grid_points: int = 200,
    budget: int = DISPLAY_BUDGET,
) -> go.Figure:
    """The Hessian's spectral density over steps, one heatmap per run on one grid and scale.

    Each row's stochastic Lanczos quadrature (nodes and weights of shape (runs, steps), as
    :class:`~dynamics.callbacks.HessianSpectrum` records them) is broadened by a Gaussian of
    width 1 % of the spread of every recorded node (the default of
    :func:`dynamics.curvature.spectral_density`), so all steps and runs share one eigenvalue
    grid. Colour is log10 of the density, floored at 1e-6 of its maximum so that outliers stay
    visible beside the bulk; a row whose measurement failed (NaN) stays empty.

    Args:
        runs: ``{run label: (step (n,), nodes (n, runs, steps), weights (n, runs, steps))}``;
            one run is drawn without a panel title.
        grid_points: eigenvalue grid points.
        budget: most steps drawn per run (evenly thinned).

    Raises:
        ValueError: no run holds a finite node of positive weight.
    """
    data = {label: [np.asarray(x, dtype=float) for x in arrays] for label, arrays in runs.items()}
    live = np.concatenate([n[np.isfinite(n) & (w > 0)] for _, n, w in data.values()])
    if not live.size:
        raise ValueError("no finite spectral-density node to draw")
    spread = live.max() - live.min()
    sigma = 0.01 * (spread if spread > 0 else max(abs(live.max()), 1.0))
    grid = np.linspace(live.min() - 6 * sigma, live.max() + 6 * sigma, grid_points)
    heats = {}
    for label, (step, nodes, weights) in data.items():
        keep = _evenly(len(step), budget)
        density = np.full((len(keep), grid_points), np.nan)
        for row, i in enumerate(keep):
            if np.isfinite(nodes[i]).all():
                density[row] = broadened_density(nodes[i], weights[i], grid, sigma)
        heats[label] = _Heat(step[keep], grid, density.T, len(step))
    floor = 1e-6 * max(np.nanmax(h.z, initial=0.0) for h in heats.values())
    panels = tuple(
        _Panel(
            "" if len(runs) == 1 else _whose(label),
            heat=_Heat(h.step, h.y, np.log10(np.maximum(h.z, floor)), h.original),
        )
        for label, h in heats.items()
    )
    block = _Block("Hessian spectral density", "eigenvalue", panels, colour_title="log10 density")
    return _blocks_figure([block], None, None, budget)


# --- Views of runs: what `dynamics report` and `dynamics compare` draw, one call each ---


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
    """
    opened = _open_runs(runs)
    for run in opened:
        if run.train_loss() is None and run.heldout_loss() is None:
            raise DynamicsError(f"{run.path}: no training or held-out loss recorded")
    if len(opened) == 1:
        run = opened[0]
        train, heldout = run.train_loss(), run.heldout_loss()
        return loss_figure(
            None if train is None else (train.step, train.values),
            None if heldout is None else (heldout.step, heldout.values),
            heldout_name=None if heldout is None else heldout.name,
            window=loss_window(run_overshoot(run)),
        )
    curves = []
    for run, label, color in zip(opened, _labels(opened, labels), run_colors(len(opened))):
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
    """
    opened = _open_runs(runs)
    rows = [density_rows(run) for run in opened]
    for run, density in zip(opened, rows):
        if density is None:
            raise DynamicsError(f"{run.path}: no spectral density recorded")
    titles = [""] if len(opened) == 1 else _labels(opened, labels)
    return density_figure(dict(zip(titles, rows)))


def plane_path(
    runs: RunLike | Sequence[RunLike], *, labels: Sequence[str] | None = None
) -> go.Figure:
    """The path on the plane of initial gradients: the coordinates ``(a, b)`` of θt − θ0
    recorded by :class:`~dynamics.callbacks.GradientPlane`.

    One run: coloured by step, as its report draws it. Several runs (recorded on one plane,
    ``GradientPlane(partner=...)``): one colour per run, as the plane page draws them, the
    start an open circle and the end a star.

    Args:
        runs: a run (a :class:`~dynamics.store.Run` or the path of its file), or several.
        labels: the legend names of several runs; default their names.

    Raises:
        DynamicsError: a run recorded no plane coordinates, or the runs' coordinates are on
            different planes (their stored bases differ, or one stores none).
    """
    opened = _open_runs(runs)
    planes = [_plane_rows(run, (names.PLANE_A, names.PLANE_B)) for run in opened]
    if len(opened) == 1:
        return plane_figure(planes[0].step, planes[0][names.PLANE_A], planes[0][names.PLANE_B])
    _check_one_plane(opened)
    paths = [
        (label, plane.step, plane[names.PLANE_A], plane[names.PLANE_B])
        for label, plane in zip(_labels(opened, labels), planes)
    ]
    return plane_paths_figure(paths)


def plane_paths_figure(
    paths: Sequence[tuple[str, ArrayLike, ArrayLike, ArrayLike]], *, budget: int = DISPLAY_BUDGET
) -> go.Figure:
    """Several runs' paths on one plane: ``(label, step, a, b)`` each, one colour per run on
    its line, markers and legend entry; each path thinned evenly to ``budget`` points."""
    figure = go.Figure()
    thinned = False
    for (label, step, a, b), color in zip(paths, run_colors(len(paths))):
        step, a, b = (np.asarray(x) for x in (step, a, b))
        n = len(step)
        keep = np.unique(np.linspace(0, n - 1, min(n, budget)).round().astype(int)) if n else []
        thinned |= len(keep) < n
        figure.add_trace(
            go.Scatter(
                x=a[keep],
                y=b[keep],
                mode="lines+markers",
                name=label,
                legendgroup=label,
                line=dict(color=color, width=2),
                marker=dict(size=4, color=color),
                text=[f"{label} step {s}" for s in step[keep]],
            )
        )
        if n:
            figure.add_trace(
                go.Scatter(
                    x=[a[0], a[-1]],
                    y=[b[0], b[-1]],
                    mode="markers",
                    legendgroup=label,
                    showlegend=False,
                    marker=dict(symbol=["circle-open", "star"], size=12, color=color),
                    hoverinfo="skip",
                )
            )
    figure.update_layout(height=_HEIGHT + 80, template="plotly_white", title="Paths on the plane")
    if thinned:
        figure.update_layout(title_subtitle_text="thinned for display")
    figure.update_xaxes(title_text="a")
    figure.update_yaxes(title_text="b", scaleanchor="x")
    return figure


def _check_one_plane(runs: list[Run]) -> None:
    """Coordinates of several runs are comparable only on one plane (the same stored u, v)."""
    first = runs[0]
    for run in runs[1:]:
        for basis in (names.PLANE_U, names.PLANE_V):
            mine, theirs = first.vector(basis), run.vector(basis)
            if mine is None or theirs is None or not np.array_equal(mine, theirs):
                raise DynamicsError(
                    f"{run.path.name} and {first.path.name} recorded their coordinates on "
                    "different planes (or one stores no basis): record the second with "
                    f"GradientPlane(partner={first.path.name!r}) to draw them together"
                )


def plane_share(run: RunLike) -> go.Figure:
    """The share of the displacement inside the plane of initial gradients,
    (a² + b²) / ‖θt − θ0‖², where ‖θt − θ0‖² = a² + b² + r² and r is the recorded norm of the
    displacement's part orthogonal to the plane (NaN before the run has moved).

    Raises:
        DynamicsError: the run recorded no plane coordinates with their orthogonal norm.
    """
    plane = _plane_rows(run, (names.PLANE_A, names.PLANE_B, names.PLANE_R))
    a, b, r = (plane[n].astype(float) for n in (names.PLANE_A, names.PLANE_B, names.PLANE_R))
    inside = a**2 + b**2
    total = inside + r**2
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(total > 0, inside / total, np.nan)
    curve = Curve("(a² + b²) / ‖θt − θ0‖²", plane.step, share, "#8c564b")
    return line_figure(
        [curve], title="Share of the displacement inside the plane", y_title="share of ‖θt − θ0‖²"
    )


def _open_runs(runs: RunLike | Sequence[RunLike]) -> list[Run]:
    if isinstance(runs, Run | str | os.PathLike):
        runs = [runs]
    opened = [run if isinstance(run, Run) else open_run(run) for run in runs]
    if not opened:
        raise DynamicsError("no run given")
    return opened


def _labels(runs: list[Run], labels: Sequence[str] | None) -> list[str]:
    if labels is None:
        return run_labels(runs)
    if len(labels) != len(runs):
        raise DynamicsError(f"{len(labels)} labels for {len(runs)} runs")
    return list(labels)


def _group_views(
    runs: RunLike | Sequence[RunLike],
    name: str,
    labels: Sequence[str] | None,
    only: str | None = None,
) -> go.Figure:
    """The group's series (or only the series ``only``) of one run, or of several compared."""
    opened = _open_runs(runs)
    alone = len(opened) == 1
    # One run's norms carry its overshoot verdicts, as in its report.
    overshoot = run_overshoot(opened[0]) if alone and name == names.HIDDEN_NORMS else None
    drawn = []
    for run in opened:
        series = series_views(run, name, overshoot_peaks(overshoot) if overshoot else None)
        series = [s for s in series if only is None or s.name == only]
        if not series:
            raise DynamicsError(f"{run.path}: {_not_drawn(run, name, only)}")
        drawn.append(series)
    title = None if only else group_title(name)
    if alone:
        return view_figure(drawn[0], title=title, window=loss_window(overshoot))
    return compared_view_figure(dict(zip(_labels(opened, labels), drawn)), title=title)


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


def _plane_rows(run: RunLike, needed: tuple[str, ...]) -> Series:
    opened = _open_runs(run)
    if len(opened) != 1:
        raise DynamicsError("the plane is drawn for one run at a time")
    plane = opened[0].recorded(names.PLANE)
    if plane is None or not all(n in plane.values for n in needed):
        raise DynamicsError(
            f"{opened[0].path}: no plane coordinates ({', '.join(needed)}) recorded"
        )
    return plane


@dataclass(frozen=True)
class _Heat:
    """Values over steps as colour: ``z`` has one row per ``y`` and one column per step."""

    step: np.ndarray
    y: Sequence
    z: np.ndarray
    original: int  # steps before thinning for display


@dataclass(frozen=True)
class _Panel:
    """One subplot: lines (with overshoot peaks), or one heatmap."""

    title: str
    curves: tuple[Curve, ...] = ()
    heat: _Heat | None = None
    peaks: tuple[Peak, ...] = ()


@dataclass(frozen=True, eq=False)
class _Block:
    """One series' panels (a row of them, wrapped), sharing a value axis or colour scale."""

    title: str
    y_title: str
    panels: tuple[_Panel, ...]
    log_y: bool = False
    colour_title: str = ""


def _view_blocks(
    runs: Mapping[str, Sequence[SeriesView]], colors: Sequence[str], budget: int
) -> list[_Block]:
    """One block per series name, matched across runs; the run label "" draws a lone run."""
    found: dict[str, list[tuple[str, str, SeriesView]]] = {}
    for (label, series), color in zip(runs.items(), colors):
        for one in series:
            found.setdefault(one.name, []).append((label, color, one))
    legend: set[str] = set()
    return [_view_block(entries, legend, budget) for entries in found.values()]


def _view_block(
    entries: list[tuple[str, str, SeriesView]], legend: set[str], budget: int
) -> _Block:
    view = entries[0][2].view
    tables = [(label, color, one, *_table(one)) for label, color, one in entries]
    # The shape wins over a kind it cannot fill: one value per step is a line, several values
    # of a "scalar" series are lines.
    wide = any(values.shape[1] > 1 for *_, values, _ in tables)
    kind = view.kind if wide else "scalar"
    if wide and kind == "scalar":
        kind = "lines"

    def in_legend(key: str) -> bool:
        # One legend entry per run or column in a figure; its traces toggle together.
        new = key not in legend
        legend.add(key)
        return new

    def curve(name: str, one: SeriesView, values: np.ndarray, color: str, key: str) -> Curve:
        return Curve(
            name,
            one.step,
            values,
            color,
            markers=len(one.step) <= 100,  # sparse records (an evaluation every n steps)
            group=key or None,
            show_legend=bool(key) and in_legend(key),
        )

    if kind == "scalar":
        curves = tuple(
            curve(label or view.title, one, v[:, 0], color, label and f"run {label}")
            for label, color, one, v, _ in tables
        )
        peaks = tuple(p for *_, one, _, _ in tables for p in one.peaks)
        panels: tuple[_Panel, ...] = (_Panel("", curves, peaks=peaks),)
    elif kind == "panels":
        order = dict.fromkeys(c for *_, columns in tables for c in columns)
        panels = tuple(
            _Panel(
                column,
                tuple(
                    curve(label or column, one, v[:, i], color, label and f"run {label}")
                    for label, color, one, v, cols in tables
                    for i in range(len(cols))
                    if cols[i] == column
                ),
                peaks=tuple(p for *_, one, _, _ in tables for p in one.peaks if p.name == column),
            )
            for column in order
        )
    elif kind == "lines":
        panels = tuple(
            _Panel(
                _whose(label),
                tuple(
                    curve(column, one, v[:, j], color, f"column {column}")
                    for j, (column, color) in enumerate(zip(cols, _layer_colors(len(cols))))
                ),
                peaks=tuple(one.peaks),
            )
            for label, _, one, v, cols in tables
        )
    else:  # heatmap
        panels = tuple(
            _Panel(
                _whose(label), heat=_heat(one.step, cols, _log10(v) if view.log_y else v, budget)
            )
            for label, _, one, v, cols in tables
        )
    axis = f"{view.y_label} [{view.units}]".strip() if view.units else view.y_label
    if kind == "heatmap":
        return _Block(view.title, "", panels, colour_title=f"log10 {axis}" if view.log_y else axis)
    return _Block(view.title, axis, panels, log_y=view.log_y)


def _whose(label: str) -> str:
    """The title of a panel drawing one run's data side by side with others: whose it is."""
    return f"run {label}" if label else ""


def _table(one: SeriesView) -> tuple[np.ndarray, list[str]]:
    """The series' values as (n, columns) and a name for every column."""
    values = np.asarray(one.values, dtype=float).reshape(len(one.step), -1)
    columns = list(one.columns)
    if len(columns) != values.shape[1]:
        width = values.shape[1]
        columns = [one.name] if width == 1 else [f"{one.name}_{j}" for j in range(width)]
    return values, columns


def _heat(step: np.ndarray, columns: list[str], values: np.ndarray, budget: int) -> _Heat:
    keep = _evenly(len(step), budget)
    return _Heat(np.asarray(step)[keep], columns, values[keep].T, len(step))


def _log10(values: np.ndarray) -> np.ndarray:
    positive = values > 0
    return np.where(positive, np.log10(np.where(positive, values, 1.0)), np.nan)


def _evenly(n: int, budget: int) -> np.ndarray:
    """Indices of at most ``budget`` of ``n`` records, evenly spread, first and last kept."""
    return np.unique(np.linspace(0, n - 1, min(n, budget)).round().astype(int))


def _blocks_figure(
    blocks: Sequence[_Block],
    title: str | None,
    window: tuple[float, float] | None,
    budget: int,
) -> go.Figure:
    """Blocks stacked in rows of at most :data:`_COLUMNS` panels, on one step axis."""
    columns = min(max(len(b.panels) for b in blocks), _COLUMNS)
    specs: list[list[dict | None]] = []
    titles, cells = [], []
    for block in blocks:
        for i, panel in enumerate(block.panels):
            col = i % columns
            if col == 0:  # a new row; a lone panel spans it
                left = len(block.panels) - i
                row = [{} if c < left else None for c in range(columns)]
                specs.append([{"colspan": columns}] + row[1:] if len(block.panels) == 1 else row)
            cells.append((block, panel, len(specs), col + 1))
            titles.append(_panel_title(block, panel, alone=len(blocks) == 1))
    rows = len(specs)
    height = _HEIGHT if rows == 1 else 140 + _ROW_HEIGHT * rows
    figure = make_subplots(
        rows=rows,
        cols=columns,
        specs=specs,
        subplot_titles=titles,
        horizontal_spacing=0.06 if columns > 1 else 0.02,
        vertical_spacing=min(0.3, 90 / height) if rows > 1 else 0.0,
    )
    reduced, thinned, scales = [], [], {}
    for block, panel, row, col in cells:
        for line in panel.curves:
            reduced.append(_add_curve(figure, line, budget, row=row, col=col))
        _mark_peaks(figure, panel.peaks, row=row, col=col)
        if panel.heat is None:
            drawn = (c.values for c in panel.curves)
            figure.update_yaxes(**y_scale(block.log_y, *drawn), row=row, col=col)
        else:
            scale = scales.setdefault(block, f"coloraxis{len(scales) + 1}")
            heat = panel.heat
            trace = go.Heatmap(x=heat.step, y=heat.y, z=heat.z, coloraxis=scale, name=block.title)
            figure.add_trace(trace, row=row, col=col)
            if len(heat.step) < heat.original:
                thinned.append((len(heat.step), heat.original))
        if col == 1:
            figure.update_yaxes(title_text=block.y_title, row=row, col=col)
    for block, scale in scales.items():
        # One colour bar per heatmap block, beside its rows.
        domains = [figure.get_subplot(r, c).yaxis.domain for b, _, r, c in cells if b is block]
        low, high = min(d[0] for d in domains), max(d[1] for d in domains)
        bar = dict(title=block.colour_title, y=(low + high) / 2, len=high - low, x=1.02)
        figure.update_layout({scale: dict(colorscale="Viridis", colorbar=bar)})
    _mark_window(figure, window, [(r, c) for _, p, r, c in cells if p.curves])
    if len(blocks) == 1:
        title = blocks[0].title
    elif title is None:
        title = " · ".join(dict.fromkeys(b.title for b in blocks))
    _style(figure, title, reduced, height, thinned)
    # Zooming one panel zooms all: they share the steps (the first axis matches no other).
    figure.update_xaxes(matches="x")
    figure.layout.xaxis.matches = None
    figure.update_xaxes(title_text="step", row=rows)
    if scales:  # the colour bars take the right margin: the legend goes below
        legend = dict(orientation="h", yref="container", y=0, yanchor="bottom")
        figure.update_layout(legend=legend, margin_b=90)
    return figure


def _panel_title(block: _Block, panel: _Panel, alone: bool) -> str:
    # A figure of one block is titled by it, so its panels only say what tells them apart.
    if alone:
        return panel.title
    return f"{block.title}: {panel.title}" if panel.title else block.title


def _add_curve(
    figure: go.Figure, curve: Curve, budget: int, row: int | None = None, col: int | None = None
) -> Decimated:
    reduced = decimate(curve.step, curve.values, budget)
    figure.add_trace(
        go.Scatter(
            x=reduced.step,
            y=reduced.values,
            name=curve.name,
            mode="lines+markers" if curve.markers else "lines",
            line=dict(color=curve.color, dash=curve.dash, width=1.5),
            marker=dict(size=5),
            legendgroup=curve.group,
            showlegend=curve.show_legend,
        ),
        row=row,
        col=col,
    )
    return reduced


def _mark_window(
    figure: go.Figure,
    window: tuple[float, float] | None,
    cells: Sequence[tuple[int, int]] = (),
) -> None:
    """Shade the window in the figure, or in each subplot ``(row, col)`` of ``cells``."""
    if window is None:
        return
    start, end = window
    label = dict(
        annotation_text="fastest loss descent",
        annotation_position="top left",
        annotation_font_size=10,
    )
    for i, (row, col) in enumerate(cells or [(None, None)]):
        figure.add_vrect(
            x0=start,
            x1=end,
            fillcolor=_WINDOW_COLOR,
            line_width=0,
            layer="below",
            row=row,
            col=col,
            **(label if i == 0 else {}),  # named once per figure
        )


def _mark_peaks(
    figure: go.Figure, peaks: Sequence[Peak], row: int | None = None, col: int | None = None
) -> None:
    if not peaks:
        return
    named = any(t.name == "overshoot peak" for t in figure.data)
    figure.add_trace(
        go.Scatter(
            x=[p.step for p in peaks],
            y=[p.value for p in peaks],
            mode="markers",
            name="overshoot peak",
            legendgroup="overshoot peak",
            showlegend=not named,
            marker=dict(symbol="star", size=13, color="#ff7f0e", line=dict(width=1, color="black")),
            text=[f"{p.name}: peak {p.value:.4g} at step {p.step}" for p in peaks],
            hoverinfo="text",
        ),
        row=row,
        col=col,
    )


def _style(
    figure: go.Figure,
    title: str,
    reduced: Sequence[Decimated],
    height: int = _HEIGHT,
    thinned: Sequence[tuple[int, int]] = (),
) -> None:
    figure.update_layout(
        title_text=title,
        height=height,
        template="plotly_white",
        hovermode="x unified",
        margin=dict(t=80, b=50, l=70, r=30),
    )
    # Never silent: the reader must know when lines are envelopes or steps were left out.
    notes = []
    decimated = [r for r in reduced if r.decimated]
    if decimated:
        most = max(r.original for r in decimated)
        bucket = max(r.bucket for r in decimated)
        notes.append(
            f"decimated for display: min and max of every {bucket:,} records kept "
            f"({most:,} records → at most {max(len(r.step) for r in decimated):,} "
            f"points per line)"
        )
    if thinned:
        kept, original = max(thinned, key=lambda pair: pair[1])
        notes.append(f"thinned for display: {kept:,} of {original:,} steps drawn")
    if notes:
        figure.update_layout(title_subtitle_text="; ".join(notes))


def _layer_colors(count: int) -> list[str]:
    # Layers are ordered, so a sequential scale reads first-to-last at a glance.
    if count == 1:
        return ["#1f77b4"]
    return sample_colorscale("Viridis", [0.9 * i / (count - 1) for i in range(count)])
