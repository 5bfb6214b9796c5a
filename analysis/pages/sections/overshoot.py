"""The overshoot verdict table of one run, with the loss window it was judged against: a
section of the report and of the comparison."""

from __future__ import annotations

import html

from dynamics.analysis.measures.overshoot import OvershootReport
from dynamics.analysis.pages.page import html_table

__all__ = ["overshoot_html"]


def overshoot_html(report: OvershootReport | None) -> str:
    """The overshoot verdict table of one run, with the loss window it was judged against."""
    if report is None:
        return "<p class='note'>No hidden-state norms recorded: no overshoot verdict.</p>"
    window = report.loss_window
    if window is None:
        where = "No training loss recorded, so no window of fastest loss reduction."
    elif window.found:
        where = (
            f"Window of fastest loss reduction ({window.scale} loss): steps "
            f"{window.start_step}–{window.end_step}, steepest at step {window.steepest_step}."
        )
    else:
        where = f"No window of fastest loss reduction: {window.reason}."
    rows = [
        (
            layer.name,
            layer.verdict,
            layer.signature,
            layer.peak_step,
            layer.peak_over_plateau,
            layer.peak_over_start,
            layer.nonmonotonicity,
            layer.residual_area,
            layer.snr,
            layer.peak_in_window,
            layer.reason,
        )
        for layer in report.layers
    ]
    classes = ["flag" if layer.overshoot else "" for layer in report.layers]
    header = (
        "layer",
        "verdict",
        "paper signature",
        "peak step",
        "peak / plateau",
        "peak / start",
        "non-monotonicity",
        "isotonic residual area",
        "SNR",
        "peak in window",
        "reason",
    )
    thresholds = ", ".join(f"{k}={v}" for k, v in report.to_dict()["thresholds"].items())
    return (
        f"<p>{html.escape(where)}</p>{html_table(header, rows, classes)}"
        "<p class='note'>Magnitudes, whatever the verdict: peak / plateau and peak / start of "
        "the smoothed norm, and the isotonic residual area (∫ |smoothed − best monotone fit| "
        "over steps, in norm × steps; 0 for a monotone series).</p>"
        f"<p class='note'>Thresholds: {html.escape(thresholds)}.</p>"
    )
