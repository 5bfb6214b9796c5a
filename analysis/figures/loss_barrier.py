"""The loss along the straight lines between compared runs' parameters, against α
(:mod:`dynamics.analysis.measures.loss_barrier`)."""

from __future__ import annotations

import plotly.graph_objects as go

from dynamics.analysis.figures.lines import Curve, line_figure
from dynamics.analysis.measures.loss_barrier import Barriers

__all__ = ["barrier_figure"]


def barrier_figure(barriers: Barriers, colors: dict[str, str]) -> go.Figure | None:
    """Loss against the interpolation coefficient α, one curve per line; None: no line.

    ``colors`` maps a run's label to its colour; lines between two runs are dashed.
    """
    if not barriers.lines:
        return None
    curves = [
        Curve(
            line.name,
            line.alphas,
            line.losses,
            colors.get(line.run),
            dash="dash" if line.between_runs else "solid",
            markers=True,
        )
        for line in barriers.lines
    ]
    title = "Loss along straight lines between parameters"
    batches = {line.batch for line in barriers.lines}
    if len(batches) == 1:  # a held-out batch, or one run's probe batch
        title += f", on the {batches.pop()}"
    figure = line_figure(curves, title=title, y_title="loss")
    figure.update_xaxes(title_text="α (0: start, 1: end)")
    return figure
