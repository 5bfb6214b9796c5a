"""The kit every figure is drawn with: lines over steps, display decimation, colours, axes.

:func:`line_figure` draws :class:`Curve` bundles over steps, optionally with the window of
fastest loss descent shaded and overshoot peaks starred. A trace longer than the display budget
is decimated by :func:`decimate`, which keeps the minimum and the maximum of each bucket of
consecutive records, so an overshoot peak or a loss spike is never smoothed away; a figure
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

from dynamics.analysis.measures.run_series import Peak

__all__ = [
    "DISPLAY_BUDGET",
    "FIGURE_HEIGHT",
    "Curve",
    "Decimated",
    "add_curve",
    "decimate",
    "evenly",
    "layer_colors",
    "line_figure",
    "mark_peaks",
    "mark_window",
    "run_colors",
    "style_figure",
    "y_scale",
]

#: Points per trace above which a trace is decimated for display. 2,000 points is more than a
#: figure's pixel width, so the min/max envelope looks the same as the full series, and keeps a
#: report with dozens of traces to a few hundred kilobytes of data.
DISPLAY_BUDGET = 2000
#: Height in pixels of a figure of one row.
FIGURE_HEIGHT = 380
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
        source: what the curve draws, kept as the trace's ``meta`` (``{"run", "series",
            "column"}`` for a recorded series), so a live page can extend it as rows arrive.
    """

    name: str
    step: np.ndarray
    values: np.ndarray
    color: str | None = None
    dash: str = "solid"
    markers: bool = False
    group: str | None = None
    show_legend: bool = True
    source: dict | None = None


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

    Example::

        reduced = decimate(np.arange(100_000), values, budget=2000)
        reduced.decimated, len(reduced.step)  # (True, 2000)
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
    """Distinct colours for ``count`` runs (the same run keeps its colour in every figure).

    Example::

        run_colors(3)  # ['#1F77B4', '#FF7F0E', '#2CA02C']
    """
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

    Example::

        line_figure([Curve("λ1", steps, lam1)], title="λ1", y_title="λ1", log_y=True).show()
    """
    figure = go.Figure()
    reduced = [add_curve(figure, curve, budget) for curve in curves]
    mark_window(figure, window)
    mark_peaks(figure, peaks)
    style_figure(figure, title, reduced)
    figure.update_xaxes(title_text="step")
    figure.update_yaxes(title_text=y_title, **y_scale(log_y, *(c.values for c in curves)))
    return figure


def evenly(n: int, budget: int) -> np.ndarray:
    """Indices of at most ``budget`` of ``n`` records, evenly spread, first and last kept."""
    return np.unique(np.linspace(0, n - 1, min(n, budget)).round().astype(int))


def add_curve(
    figure: go.Figure, curve: Curve, budget: int, row: int | None = None, col: int | None = None
) -> Decimated:
    """Add ``curve`` to the figure (or its subplot ``row``, ``col``), decimated to ``budget``;
    returns what was drawn, for :func:`style_figure` to say so."""
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
            meta=curve.source,
        ),
        row=row,
        col=col,
    )
    return reduced


def mark_window(
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


def mark_peaks(
    figure: go.Figure, peaks: Sequence[Peak], row: int | None = None, col: int | None = None
) -> None:
    """Star overshoot ``peaks`` on the figure (or its subplot), named once in the legend."""
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


def style_figure(
    figure: go.Figure,
    title: str,
    reduced: Sequence[Decimated],
    height: int = FIGURE_HEIGHT,
    thinned: Sequence[tuple[int, int]] = (),
) -> None:
    """Title, height and look of a figure; its subtitle says which lines are decimated and
    which heatmaps thinned (never silent)."""
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


def layer_colors(count: int) -> list[str]:
    """Colours of ``count`` ordered layers, from the first to the last on one sequential scale."""
    # Layers are ordered, so a sequential scale reads first-to-last at a glance.
    if count == 1:
        return ["#1f77b4"]
    return sample_colorscale("Viridis", [0.9 * i / (count - 1) for i in range(count)])
