"""Figures of runs compared with a reference (:mod:`dynamics.analysis.measures.run_comparison`):
the smoothed loss difference with the crossover marked, λ1 of every run, and the λ1 ratio."""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from dynamics.analysis.figures.lines import Curve, line_figure
from dynamics.analysis.measures.run_comparison import (
    align,
    compared_loss,
    crossing_text,
    eigenvalue_ratio,
    finite,
    loss_crossover,
    smooth,
    top_eigenvalue,
)
from dynamics.store import Run

__all__ = ["eigenvalue_ratio_figure", "loss_difference_figure", "top_eigenvalue_figure"]


def top_eigenvalue_figure(
    runs: Sequence[Run], labels: Sequence[str], colors: Sequence[str]
) -> go.Figure | None:
    """Every run's top Hessian eigenvalue λ1 over steps, one colour each; None when no run
    recorded one."""
    top = [(label, color, top_eigenvalue(run)) for run, label, color in zip(runs, labels, colors)]
    curves = [Curve(label, m.step, m.values, color) for label, color, m in top if m is not None]
    if not curves:
        return None
    return line_figure(curves, title="Top Hessian eigenvalue λ1", y_title="λ1", log_y=True)


def loss_difference_figure(
    runs: Sequence[Run], labels: Sequence[str], colors: Sequence[str]
) -> go.Figure | None:
    """Each run's smoothed loss minus the reference's (the first run's), with the step where it
    overtakes the reference marked; None when no run shares a loss with the reference."""
    curves, crossings = [], []
    for run, label, color in zip(runs[1:], labels[1:], colors[1:]):
        loss = compared_loss(runs[0], run)
        if loss is None:
            continue
        (sa, a), (sb, b) = (finite(m.step, m.values) for m in (loss.reference, loss.other))
        steps, a, b = align(sa, smooth(a), sb, smooth(b))
        curves.append(Curve(f"{label} − {labels[0]} ({loss.metric})", steps, b - a, color))
        result = loss_crossover(runs[0], run, (labels[0], label))
        if result is not None and result.step is not None:
            crossings.append((result, color, label))
    if not curves:
        return None
    figure = line_figure(
        curves,
        title="Smoothed loss difference (below zero: ahead of the reference)",
        y_title="Δ loss",
    )
    figure.add_hline(y=0, line_color="black", line_width=1)
    for result, color, label in crossings:
        lo, hi = result.bracket
        where = crossing_text(result)
        if hi - lo > 1:  # the records' interval, where the crossing lies
            figure.add_vrect(x0=lo, x1=hi, fillcolor=color, opacity=0.12, line_width=0)
        else:
            where = f"at {where}"
        figure.add_vline(
            x=result.step,
            line_dash="dot",
            line_color=color,
            annotation_text=f"{label} overtakes {where}",
            annotation_font_size=10,
        )
    return figure


def eigenvalue_ratio_figure(
    runs: Sequence[Run], labels: Sequence[str], colors: Sequence[str]
) -> go.Figure | None:
    """Each run's top Hessian eigenvalue over the reference's at the same steps; None when no
    run shares one with the reference."""
    curves = []
    for run, label, color in zip(runs[1:], labels[1:], colors[1:]):
        ratio = eigenvalue_ratio(runs[0], run)
        if ratio is not None:
            curves.append(Curve(f"{label} / {labels[0]}", *ratio, color))
    if not curves:
        return None
    figure = line_figure(
        curves,
        title="Ratio of top Hessian eigenvalues over time",
        y_title="λ1 ratio",
        log_y=True,
    )
    figure.add_hline(y=1, line_color="black", line_width=1)
    return figure
