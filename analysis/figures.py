"""Plotly figures of recorded series: pure functions of arrays, decimated without losing peaks.

Every builder takes numpy arrays (or :class:`Curve` bundles of them) and returns a
``plotly.graph_objects.Figure``; nothing here reads a run file. A trace longer than the display
budget is decimated by :func:`decimate`, which keeps the minimum and the maximum of each bucket
of consecutive records, so an overshoot peak or a loss spike is never smoothed away; a figure
holding a decimated trace says so in its subtitle.

Traces are SVG scatter traces, not WebGL ones: with a decimated budget of a few thousand points
SVG is fast enough and renders everywhere, headless browsers without a GPU included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go
from numpy.typing import ArrayLike
from plotly.colors import qualitative, sample_colorscale
from plotly.subplots import make_subplots

__all__ = [
    "DISPLAY_BUDGET",
    "Curve",
    "Decimated",
    "Peak",
    "decimate",
    "displacement_figure",
    "hessian_figure",
    "layer_figure",
    "line_figure",
    "loss_figure",
    "panels_figure",
    "plane_figure",
    "run_colors",
]

#: Points per trace above which a trace is decimated for display. 2,000 points is more than a
#: figure's pixel width, so the min/max envelope looks the same as the full series, and keeps a
#: report with dozens of traces to a few hundred kilobytes of data.
DISPLAY_BUDGET = 2000
_HEIGHT = 380
_WINDOW_COLOR = "rgba(255, 165, 0, 0.18)"


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


@dataclass(frozen=True)
class Peak:
    """An overshoot peak to mark: a layer's name, the step and the value of its maximum."""

    name: str
    step: float
    value: float


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
    figure.update_yaxes(title_text=y_title, type="log" if log_y else "linear")
    return figure


def loss_figure(
    train: tuple[ArrayLike, ArrayLike] | None,
    heldout: tuple[ArrayLike, ArrayLike] | None = None,
    *,
    window: tuple[float, float] | None = None,
    budget: int = DISPLAY_BUDGET,
) -> go.Figure:
    """Training and held-out loss on a log axis, with the window of fastest loss reduction.

    Args:
        train: ``(step, loss)`` of the training loss, or None.
        heldout: ``(step, loss)`` of the held-out loss, or None.
        window: ``(start_step, end_step)`` of the window of fastest loss reduction.
        budget: display budget per trace.
    """
    curves = []
    if train is not None:
        curves.append(Curve("train", np.asarray(train[0]), np.asarray(train[1]), "#1f77b4"))
    if heldout is not None:
        step, values = heldout
        curves.append(
            Curve("held-out", np.asarray(step), np.asarray(values), "#d62728", markers=True)
        )
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
        figure.update_yaxes(title_text="update size", type="log", row=2, col=1)
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
    figure.update_yaxes(type="log" if log_y else "linear")
    figure.update_yaxes(title_text=y_title, col=1)
    figure.update_xaxes(title_text="step")
    return figure


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


def _mark_window(figure: go.Figure, window: tuple[float, float] | None) -> None:
    if window is None:
        return
    start, end = window
    figure.add_vrect(
        x0=start,
        x1=end,
        fillcolor=_WINDOW_COLOR,
        line_width=0,
        layer="below",
        annotation_text="fastest loss descent",
        annotation_position="top left",
        annotation_font_size=10,
    )


def _mark_peaks(figure: go.Figure, peaks: Sequence[Peak]) -> None:
    if not peaks:
        return
    figure.add_trace(
        go.Scatter(
            x=[p.step for p in peaks],
            y=[p.value for p in peaks],
            mode="markers",
            name="overshoot peak",
            marker=dict(symbol="star", size=13, color="#ff7f0e", line=dict(width=1, color="black")),
            text=[f"{p.name}: peak {p.value:.4g} at step {p.step}" for p in peaks],
            hoverinfo="text",
        )
    )


def _style(
    figure: go.Figure, title: str, reduced: Sequence[Decimated], height: int = _HEIGHT
) -> None:
    figure.update_layout(
        title_text=title,
        height=height,
        template="plotly_white",
        hovermode="x unified",
        margin=dict(t=80, b=50, l=70, r=30),
    )
    decimated = [r for r in reduced if r.decimated]
    if decimated:
        # Never silent: the reader must know the lines are envelopes, not every record.
        most = max(r.original for r in decimated)
        bucket = max(r.bucket for r in decimated)
        figure.update_layout(
            title_subtitle_text=(
                f"decimated for display: min and max of every {bucket:,} records kept "
                f"({most:,} records → at most {max(len(r.step) for r in decimated):,} "
                f"points per line)"
            )
        )


def _layer_colors(count: int) -> list[str]:
    # Layers are ordered, so a sequential scale reads first-to-last at a glance.
    if count == 1:
        return ["#1f77b4"]
    return sample_colorscale("Viridis", [0.9 * i / (count - 1) for i in range(count)])
