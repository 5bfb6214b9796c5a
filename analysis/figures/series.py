"""Any recorded series drawn as the :class:`~dynamics.store.View` it was recorded with says.

:func:`view_figure` draws one run's series, :func:`compared_view_figure` several runs' side by
side; the kinds are ``scalar`` (one line), ``lines`` (one line per column), ``panels`` (one
small panel per column) and ``heatmap`` (steps × columns as colour). :func:`density_figure`
draws the Hessian's spectral density on the same machinery, as heatmaps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go
from numpy.typing import ArrayLike
from plotly.subplots import make_subplots

from dynamics.analysis.figures.lines import (
    DISPLAY_BUDGET,
    FIGURE_HEIGHT,
    Curve,
    add_curve,
    evenly,
    layer_colors,
    mark_peaks,
    mark_window,
    run_colors,
    style_figure,
    y_scale,
)
from dynamics.analysis.measures.run_series import Peak, SeriesView
from dynamics.curvature.broadening import broadened_density

__all__ = ["compared_view_figure", "density_figure", "view_figure"]

_ROW_HEIGHT = 250  # of one row of panels in a figure of several rows
_COLUMNS = 4  # most panels side by side; more wrap onto further rows
_SINGLE_COLOR = "#1f77b4"


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

    Example::

        run = open_run("runs/demo/shifted.h5")
        view_figure(series_views(run, "hessian"), title="Hessian").show()
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

    Example::

        runs = [open_run(p) for p in ("runs/a.h5", "runs/b.h5")]
        compared_view_figure({r.name: series_views(r, "displacement") for r in runs}).show()
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

    Example::

        density_figure({"": density_rows(open_run("runs/demo/shifted.h5"))}).show()
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
        keep = evenly(len(step), budget)
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
    source: dict | None = None  # of a heatmap: the trace's meta, as :class:`Curve` keeps it


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

    def curve(
        name: str, label: str, one: SeriesView, values: np.ndarray, j: int, color: str, key: str
    ) -> Curve:
        return Curve(
            name,
            one.step,
            values[:, j],
            color,
            markers=len(one.step) <= 100,  # sparse records (an evaluation every n steps)
            group=key or None,
            show_legend=bool(key) and in_legend(key),
            source={"run": label, "series": one.name, "column": j},
        )

    if kind == "scalar":
        curves = tuple(
            curve(label or view.title, label, one, v, 0, color, label and f"run {label}")
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
                    curve(label or column, label, one, v, i, color, label and f"run {label}")
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
                    curve(column, label, one, v, j, color, f"column {column}")
                    for j, (column, color) in enumerate(zip(cols, layer_colors(len(cols))))
                ),
                peaks=tuple(one.peaks),
            )
            for label, _, one, v, cols in tables
        )
    else:  # heatmap
        panels = tuple(
            _Panel(
                _whose(label),
                heat=_heat(one.step, cols, _log10(v) if view.log_y else v, budget),
                source={"run": label, "series": one.name, "log10": view.log_y},
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
    keep = evenly(len(step), budget)
    return _Heat(np.asarray(step)[keep], columns, values[keep].T, len(step))


def _log10(values: np.ndarray) -> np.ndarray:
    positive = values > 0
    return np.where(positive, np.log10(np.where(positive, values, 1.0)), np.nan)


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
    height = FIGURE_HEIGHT if rows == 1 else 140 + _ROW_HEIGHT * rows
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
            reduced.append(add_curve(figure, line, budget, row=row, col=col))
        mark_peaks(figure, panel.peaks, row=row, col=col)
        if panel.heat is None:
            drawn = (c.values for c in panel.curves)
            figure.update_yaxes(**y_scale(block.log_y, *drawn), row=row, col=col)
        else:
            scale = scales.setdefault(block, f"coloraxis{len(scales) + 1}")
            heat = panel.heat
            trace = go.Heatmap(
                x=heat.step,
                y=heat.y,
                z=heat.z,
                coloraxis=scale,
                name=block.title,
                meta=panel.source,
            )
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
    mark_window(figure, window, [(r, c) for _, p, r, c in cells if p.curves])
    if len(blocks) == 1:
        title = blocks[0].title
    elif title is None:
        title = " · ".join(dict.fromkeys(b.title for b in blocks))
    style_figure(figure, title, reduced, height, thinned)
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
