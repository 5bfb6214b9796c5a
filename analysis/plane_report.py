"""Interactive HTML of plane views: heatmaps with trajectories, and real vs on-plane losses.

The page comes from the kit of :mod:`dynamics.analysis.page`, as the report's and the
comparison's do: same look, plotly.js embedded once, the same static export.
"""

from __future__ import annotations

import html
import os
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dynamics import __version__
from dynamics.analysis.page import Written, figure_html, html_page, html_table, write_page
from dynamics.analysis.plane_views import plane_label
from dynamics.geometry.landscape import PlaneView

_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")


def _run_colors(views: list[PlaneView]) -> dict[str, str]:
    """Each run's colour, the same in every figure of the page and on every part of a trace
    (line, markers, legend entry)."""
    runs = sorted({t.run for v in views for t in v.trajectories})
    return {run: _COLORS[i % len(_COLORS)] for i, run in enumerate(runs)}


def heatmap_figure(views: list[PlaneView]) -> go.Figure:
    """One heatmap per view (log10 loss of that view's model), trajectories drawn over it."""
    columns = 2
    rows = -(-len(views) // columns)
    figure = make_subplots(
        rows=rows,
        cols=columns,
        subplot_titles=[v.title for v in views],
        horizontal_spacing=0.12,
        vertical_spacing=0.12,
    )
    color = _run_colors(views)
    # One color scale for every panel, so the single colorbar reads right on all of them.
    logs = [np.log10(view.losses) for view in views]
    coarse = [None if v.coarse_losses is None else np.log10(v.coarse_losses) for v in views]
    shown = [z for z in logs + coarse if z is not None and np.isfinite(z).any()]
    zmin = min(np.nanmin(z) for z in shown)
    zmax = max(np.nanmax(z) for z in shown)
    for index, view in enumerate(views):
        row, col = index // columns + 1, index % columns + 1
        if view.coarse_grid is not None:  # the coarse grid underneath, the refined points on top
            figure.add_trace(  # a heatmap too: plotly draws contours above every heatmap
                go.Heatmap(
                    x=view.coarse_grid.alphas,
                    y=view.coarse_grid.betas,
                    z=coarse[index],
                    zmin=zmin,
                    zmax=zmax,
                    zsmooth="best",
                    colorscale="Viridis",
                    showscale=False,
                    name=f"loss of {view.run}, coarse grid",
                    hovertemplate="a=%{x:.3g}<br>b=%{y:.3g}<br>log10 loss=%{z:.3f}"
                    "<extra>coarse</extra>",
                ),
                row=row,
                col=col,
            )
        kind = go.Contour if view.refine is None else go.Heatmap  # a heatmap leaves gaps
        figure.add_trace(
            kind(
                x=view.grid.alphas,
                y=view.grid.betas,
                z=logs[index],
                zmin=zmin,
                zmax=zmax,
                colorscale="Viridis",
                showscale=index == 0,
                colorbar={"title": "log10 loss"},
                name=f"loss of {view.run}",
                hovertemplate="a=%{x:.3g}<br>b=%{y:.3g}<br>log10 loss=%{z:.3f}<extra></extra>",
                **({"ncontours": 30} if view.refine is None else {"hoverongaps": False}),
            ),
            row=row,
            col=col,
        )
        _mark_buffer_switches(figure, view, row, col, first=index == 0)
        for t in view.trajectories:
            figure.add_trace(
                go.Scatter(
                    x=t.a,
                    y=t.b,
                    mode="lines+markers",
                    name=t.run,
                    legendgroup=t.run,
                    showlegend=index == 0,
                    line={"color": color[t.run], "width": 2},
                    marker={"size": 4, "color": color[t.run]},
                    customdata=np.stack([t.step, t.loss, t.plane_loss], -1),
                    hovertemplate=(
                        f"{t.run} step %{{customdata[0]}}<br>loss %{{customdata[1]:.4g}}"
                        "<br>on-plane loss %{customdata[2]:.4g}<extra></extra>"
                    ),
                ),
                row=row,
                col=col,
            )
            figure.add_trace(
                go.Scatter(
                    x=[t.a[0], t.a[-1]],
                    y=[t.b[0], t.b[-1]],
                    mode="markers",
                    showlegend=False,
                    marker={"symbol": ["circle-open", "star"], "size": 12, "color": color[t.run]},
                    hoverinfo="skip",
                ),
                row=row,
                col=col,
            )
        if view.refine is not None:  # heatmap cells reach half a cell past the grid
            figure.update_xaxes(range=[view.grid.alphas[0], view.grid.alphas[-1]], row=row, col=col)
            figure.update_yaxes(range=[view.grid.betas[0], view.grid.betas[-1]], row=row, col=col)
        second = view.plane.kind == "out-of-plane"
        figure.update_xaxes(
            title_text="p̂ (in-plane direction)" if second else "u (a)", row=row, col=col
        )
        figure.update_yaxes(title_text="w (out of plane)" if second else "v (b)", row=row, col=col)
    figure.update_layout(
        height=480 * rows,
        template="plotly_white",
        title="Loss landscapes on parameter planes",
        legend={"orientation": "h", "y": -0.08},
    )
    return figure


def _mark_buffer_switches(figure: go.Figure, view: PlaneView, row: int, col: int, first: bool):
    """Dotted white lines where the points switch to another stored state's buffers
    (BatchNorm statistics): the heatmap's seams there are that switch, not the loss's shape."""
    regions = view.buffer_regions
    if regions is None or np.unique(regions).size < 2:
        return
    # A contour at every half-integer of the state index is a line between two regions; the
    # states are relabelled 0..k-1 so that no level falls between two states no point uses.
    _, labels = np.unique(regions, return_inverse=True)
    labels = labels.reshape(regions.shape)
    figure.add_trace(
        go.Contour(
            x=view.grid.alphas,
            y=view.grid.betas,
            z=labels,
            contours={"coloring": "none", "start": 0.5, "end": labels.max() - 0.5, "size": 1},
            line={"color": "white", "width": 1.5, "dash": "dot"},
            showscale=False,
            showlegend=first,
            name="buffers switch (nearest stored state)",
            legendgroup="buffers switch",
            hoverinfo="skip",
        ),
        row=row,
        col=col,
    )


def checkpoint_loss_figure(views: list[PlaneView]) -> go.Figure:
    """Loss at each real checkpoint against the loss read off the (first) plane."""
    figure = go.Figure()
    color = _run_colors(views)
    for view in views:
        if view.plane.kind == "out-of-plane":
            continue
        for t in view.trajectories:
            if t.run != view.run:
                continue
            figure.add_trace(
                go.Scatter(
                    x=t.step, y=t.loss, name=f"{t.run}: checkpoint θt", line={"color": color[t.run]}
                )
            )
            figure.add_trace(
                go.Scatter(
                    x=t.step,
                    y=t.plane_loss,
                    name=f"{t.run}: projection on the plane",
                    line={"dash": "dot", "color": color[t.run]},
                )
            )
    figure.update_layout(
        title="Loss at real checkpoints vs loss read off the plane",
        xaxis_title="step",
        yaxis_title="loss (probe batch)",
        yaxis_type="log",
        height=420,
        template="plotly_white",
    )
    return figure


def write_plane_html(
    views: list[PlaneView],
    out: Path,
    remarks: list[str] = (),
    *,
    static_dir: str | os.PathLike | None = None,
    static_format: str = "png",
    overwrite: bool = False,
) -> Written:
    """A self-contained HTML page (plotly.js embedded once) of ``views``, written atomically.

    The caller checks ``out`` first (:func:`dynamics.analysis.output.check_output`), before the
    grids are computed.

    Args:
        views: the plane views, evaluated (see :mod:`dynamics.analysis.plane_views`).
        out: the HTML file.
        remarks: lines shown above the figures (how the plane was chosen, what is missing).
        static_dir: also export both figures into this folder (see
            :func:`dynamics.analysis.page.write_page`).
        static_format: ``"png"`` or ``"svg"``.
        overwrite: replace existing static files.

    Returns:
        What was written.
    """
    notes = {k: v for view in views for k, v in view.notes.items()}
    figures = [
        ("plane-heatmaps", heatmap_figure(views)),
        ("plane-checkpoint-loss", checkpoint_loss_figure(views)),
    ]
    first = next((v.plane for v in views if v.plane.kind != "out-of-plane"), None)
    heading = plane_label(first) if first is not None else "plane"
    body = "".join(
        [
            f"<h1>{html.escape(heading[0].upper() + heading[1:])} and out-of-plane views</h1>",
            f"<p class='meta'>{html.escape(', '.join(dict.fromkeys(v.run for v in views)))}"
            f" · dynamics {__version__}</p>",
            *(f"<p class='note'>{html.escape(remark)}</p>" for remark in remarks),
            "<h2>Loss landscapes</h2>",
            "<p class='note'>Each panel: log10 of the loss of the run it names, on that run's "
            "stored probe batch, at θ0 + a·u + b·v; every run's path is drawn over it. Circles "
            "mark θ0, stars θT.</p>",
            html_table(("heatmap", "evaluated"), [(v.title, v.source) for v in views]),
            *(
                f"<p class='note'>Buffers: {html.escape(note)}.</p>"
                for note in dict.fromkeys(v.buffers for v in views if v.buffers)
            ),
            figure_html(figures[0][1], 0),
            "<h2>Real checkpoints against the plane</h2>",
            figure_html(figures[1][1], 1),
            "<h2>Notes</h2>",
            html_table(("note", "value"), sorted(notes.items())),
        ]
    )
    page = html_page("dynamics plane views", body)
    return write_page(Path(out), page, figures, static_dir, static_format, overwrite)
