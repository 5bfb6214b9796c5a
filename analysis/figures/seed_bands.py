"""Bands over seeds: each group's mean over its seeds and the min–max envelope (not a confidence
interval), per measure (:func:`~dynamics.analysis.measures.seed_groups.seed_band`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import plotly.graph_objects as go

from dynamics.analysis.figures.lines import run_colors, y_scale
from dynamics.analysis.measures.run_comparison import top_eigenvalue
from dynamics.analysis.measures.seed_groups import Group, seed_band
from dynamics.store import Metric, Run

__all__ = ["seed_band_figures"]


def seed_band_figures(groups: Sequence[Group]) -> list[tuple[str, go.Figure]]:
    """Per measure (training loss, held-out loss, λ1), each group's mean over seeds and its
    min–max band; the measures every seed of some group recorded.

    Example::

        seed_band_figures(load_groups([("base", "runs/base"), ("shift", "runs/shift")]))
    """
    figures = []
    for key, title, y_title, read, log_y in _BANDS:
        figure = go.Figure()
        drawn = False
        for group, color in zip(groups, run_colors(len(groups))):
            band = seed_band([read(run) for run in group.runs.values()])
            if band is None:
                continue
            drawn = True
            _add_band(figure, group.name, color, *band)
        if drawn:
            figure.update_layout(title=title, height=420, template="plotly_white")
            figure.update_xaxes(title_text="step")
            drawn_values = [trace.y for trace in figure.data if trace.y is not None]
            figure.update_yaxes(title_text=y_title, **y_scale(log_y, *drawn_values))
            figures.append((key, figure))
    return figures


_BANDS: tuple[tuple[str, str, str, Callable[[Run], Metric | None], bool], ...] = (
    ("train-loss", "Training loss over seeds", "loss", Run.train_loss, True),
    ("heldout-loss", "Held-out loss over seeds", "held-out loss", Run.heldout_loss, True),
    ("top-eigenvalue", "Top Hessian eigenvalue λ1 over seeds", "λ1", top_eigenvalue, True),
)


def _add_band(
    figure: go.Figure,
    name: str,
    color: str,
    steps: np.ndarray,
    mean: np.ndarray,
    low: np.ndarray,
    high: np.ndarray,
) -> None:
    figure.add_trace(
        go.Scatter(
            x=np.concatenate([steps, steps[::-1]]),
            y=np.concatenate([high, low[::-1]]),
            fill="toself",
            fillcolor=color,
            opacity=0.2,
            line={"color": color, "width": 0.5},
            name=f"{name} min–max",
            legendgroup=name,
            hoverinfo="skip",
        )
    )
    figure.add_trace(
        go.Scatter(x=steps, y=mean, name=f"{name} mean", line={"color": color}, legendgroup=name)
    )
