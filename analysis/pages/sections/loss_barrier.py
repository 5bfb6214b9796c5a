"""The comparison page's section of loss barriers: the heights as a table with the remarks, and
the figure of loss against α."""

from __future__ import annotations

import html
from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go

from dynamics.analysis.figures.lines import run_colors
from dynamics.analysis.figures.loss_barrier import barrier_figure
from dynamics.analysis.measures.loss_barrier import Barriers
from dynamics.analysis.pages.page import figure_html, html_table

__all__ = ["barrier_html", "barrier_section"]


def barrier_section(
    barriers: Barriers, labels: Sequence[str], index: int
) -> tuple[str, go.Figure | None]:
    """The comparison page's section: the barrier heights as a table with the remarks, and
    the figure of loss against α (None: no line), drawn as the page's figure ``index``."""
    colors = dict(zip(labels, run_colors(len(labels))))
    figure = barrier_figure(barriers, colors)
    section = "<h2>Loss barriers</h2>" + barrier_html(barriers)
    if figure is not None:
        section += figure_html(figure, index)
    return section, figure


def barrier_html(barriers: Barriers) -> str:
    """The barrier heights as a table, the note on how they are measured, and the remarks."""
    rows = [
        (
            line.name,
            f"{line.losses[0]:.5g}",
            f"{line.losses[-1]:.5g}",
            f"{np.max(line.losses):.5g} (α = {line.peak_alpha:.2f})",
            f"{line.above_chord:.4g}",
            f"{line.barrier:.4g}",
            line.batch,
        )
        for line in barriers.lines
    ]
    parts = []
    if rows:
        header = (
            "line",
            "loss at α = 0",
            "loss at α = 1",
            "max",
            "barrier (height above the chord)",
            "max − mean of the ends",
            "batch",
        )
        parts.append(html_table(header, rows))
        notes = dict.fromkeys(line.buffers for line in barriers.lines if line.buffers)
        parts.append(
            "<p class='note'>Loss at (1 − α)·start + α·end, the model rebuilt from the run "
            "file in eval mode on the batch named in the table (a run's stored probe batch, "
            "with that run's model, or a held-out batch); barrier: the largest height of "
            "the loss above the straight line joining its ends' losses (0: no bump between "
            "them); max − mean of the ends: the other common definition, which is half the "
            "ends' difference on a line that only falls, with no bump at all. "
            + " ".join(html.escape(note) for note in notes)
            + "</p>"
        )
    parts += [f"<p class='note'>{html.escape(remark)}</p>" for remark in barriers.remarks]
    return "".join(parts)
