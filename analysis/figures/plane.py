"""Figures of the plane of parameter space through θ0: a run's path on it, the share of its
displacement inside it, and the loss heatmaps of the plane views with trajectories over them.

:func:`plane_path` and :func:`plane_share` draw what :class:`~dynamics.callbacks.GradientPlane`
recorded during training; :func:`heatmap_figure` and :func:`checkpoint_loss_figure` draw the
views :mod:`dynamics.analysis.measures.plane_grid` evaluated (``dynamics plane``, or
``GradientPlane(at_end=True)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import plotly.graph_objects as go
from numpy.typing import ArrayLike
from plotly.subplots import make_subplots

from dynamics.analysis.figures.lines import (
    DISPLAY_BUDGET,
    FIGURE_HEIGHT,
    Curve,
    line_figure,
    run_colors,
)
from dynamics.analysis.measures.run_series import RunLike, given_labels, open_runs
from dynamics.errors import DynamicsError
from dynamics.store import Run, Series, names

if TYPE_CHECKING:  # the plane views import torch, which the figures of a recorded run never do
    from dynamics.geometry.landscape import PlaneView

__all__ = [
    "checkpoint_loss_figure",
    "heatmap_figure",
    "plane_figure",
    "plane_path",
    "plane_paths_figure",
    "plane_share",
]

_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")


def _run_colors(views: list[PlaneView]) -> dict[str, str]:
    """Each run's colour, the same in every figure of the page and on every part of a trace
    (line, markers, legend entry)."""
    runs = sorted({t.run for v in views for t in v.trajectories})
    return {run: _COLORS[i % len(_COLORS)] for i, run in enumerate(runs)}


def heatmap_figure(views: list[PlaneView]) -> go.Figure:
    """One heatmap per view (log10 loss of that view's model), trajectories drawn over it.

    Example::

        heatmap_figure(recorded_views(open_run("runs/at_end.h5"))).show()
    """
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
    """Loss at each real checkpoint against the loss read off the (first) plane.

    Example::

        checkpoint_loss_figure(views).show()  # views evaluated by evaluate_views
    """
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

    Example::

        figures.plane_path("runs/demo/shifted.h5").show()
    """
    opened = open_runs(runs)
    planes = [_plane_rows(run, (names.PLANE_A, names.PLANE_B)) for run in opened]
    if len(opened) == 1:
        return plane_figure(planes[0].step, planes[0][names.PLANE_A], planes[0][names.PLANE_B])
    _check_one_plane(opened)
    paths = [
        (label, plane.step, plane[names.PLANE_A], plane[names.PLANE_B])
        for label, plane in zip(given_labels(opened, labels), planes)
    ]
    return plane_paths_figure(paths)


def plane_share(run: RunLike) -> go.Figure:
    """The share of the displacement inside the plane of initial gradients,
    (a² + b²) / ‖θt − θ0‖², where ‖θt − θ0‖² = a² + b² + r² and r is the recorded norm of the
    displacement's part orthogonal to the plane (NaN before the run has moved).

    Raises:
        DynamicsError: the run recorded no plane coordinates with their orthogonal norm.

    Example::

        figures.plane_share("runs/demo/shifted.h5").show()
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

    Example::

        plane_figure(steps, a, b).show()
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
    figure.update_layout(
        height=FIGURE_HEIGHT + 80, template="plotly_white", title="Path on the plane"
    )
    if len(keep) < n:
        figure.update_layout(
            title_subtitle_text=f"thinned for display: {len(keep):,} of {n:,} records drawn"
        )
    figure.update_xaxes(title_text="a")
    figure.update_yaxes(title_text="b", scaleanchor="x")
    return figure


def plane_paths_figure(
    paths: Sequence[tuple[str, ArrayLike, ArrayLike, ArrayLike]], *, budget: int = DISPLAY_BUDGET
) -> go.Figure:
    """Several runs' paths on one plane: ``(label, step, a, b)`` each, one colour per run on
    its line, markers and legend entry; each path thinned evenly to ``budget`` points.

    Example::

        plane_paths_figure([("a", steps, a1, b1), ("b", steps, a2, b2)]).show()
    """
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
    figure.update_layout(
        height=FIGURE_HEIGHT + 80, template="plotly_white", title="Paths on the plane"
    )
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


def _plane_rows(run: RunLike, needed: tuple[str, ...]) -> Series:
    opened = open_runs(run)
    if len(opened) != 1:
        raise DynamicsError("the plane is drawn for one run at a time")
    plane = opened[0].recorded(names.PLANE)
    if plane is None or not all(n in plane.values for n in needed):
        raise DynamicsError(
            f"{opened[0].path}: no plane coordinates ({', '.join(needed)}) recorded"
        )
    return plane
