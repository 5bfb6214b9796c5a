"""Each run's top-k Hessian eigenspace overlap with the reference's, over the steps both stored
their eigenvectors (:mod:`dynamics.analysis.measures.eigenspace_overlap`)."""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from dynamics.analysis.figures.lines import Curve, line_figure
from dynamics.analysis.measures.eigenspace_overlap import eigenspace_overlap
from dynamics.store import Run

__all__ = ["eigenspace_overlap_figure"]


def eigenspace_overlap_figure(
    runs: Sequence[Run], labels: Sequence[str], colors: Sequence[str]
) -> go.Figure | None:
    """Each run's eigenspace overlap with the first run's at matching steps; None if none.

    Example::

        eigenspace_overlap_figure(runs, ["a", "b"], run_colors(2))
    """
    curves = []
    for run, label, color in zip(runs[1:], labels[1:], colors[1:]):
        overlap = eigenspace_overlap(runs[0], run)
        if overlap is not None:
            curves.append(Curve(f"{label} vs {labels[0]}", *overlap, color, markers=True))
    if not curves:
        return None
    return line_figure(
        curves,
        title="Overlap of the runs' top-k Hessian eigenspaces at matching steps",
        y_title="‖V_aᵀ V_b‖²_F / k",
    )
