"""Side-by-side comparison of runs as one HTML page: the first run is the reference.

The page holds a summary (final and best losses, crossover, λ1 ratio), the comparability
checks, the overlaid loss and its smoothed difference with the crossover marked, λ1 and its
ratio, every recorded series drawn as its view says (:func:`compared_view_figure`), the
spectral densities side by side, the overshoot verdicts and the configs. The numbers come from
:mod:`dynamics.analysis.comparison`; the page from :mod:`dynamics.analysis.page`.
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go

from dynamics import __version__
from dynamics.analysis.comparison import (
    IGNORED_CONFIG_KEYS,
    SMOOTH_FRACTION,
    Crossover,
    align,
    comparability,
    compared_loss,
    differing_keys,
    eigenvalue_ratio,
    finite,
    loss_crossover,
    smooth,
    top_eigenvalue,
)
from dynamics.analysis.figures import (
    Curve,
    compared_view_figure,
    density_figure,
    line_figure,
    loss,
    run_colors,
)
from dynamics.analysis.output import check_output
from dynamics.analysis.overshoot import OvershootReport
from dynamics.analysis.page import Written, figure_html, html_page, html_table, slug, write_page
from dynamics.analysis.report import overshoot_html
from dynamics.analysis.run_views import (
    density_rows,
    drawn_groups,
    group_title,
    run_labels,
    run_overshoot,
    series_views,
)
from dynamics.errors import DynamicsError
from dynamics.store import Metric, Run, names, open_run

__all__ = ["write_comparison"]


def write_comparison(
    run_paths: Sequence[str | os.PathLike],
    out_path: str | os.PathLike,
    overwrite: bool = False,
    *,
    static_dir: str | os.PathLike | None = None,
    static_format: str = "png",
) -> Written:
    """Write one self-contained HTML page comparing runs with the first one.

    Args:
        run_paths: two or more run files; the first is the reference.
        out_path: the HTML file to write (atomically).
        overwrite: replace an existing ``out_path`` (and existing static files).
        static_dir: also export every figure into this folder (see
            :func:`dynamics.analysis.report.write_report`).
        static_format: ``"png"`` or ``"svg"``.

    Returns:
        What was written.

    Raises:
        DynamicsError: fewer than two runs, a file that is not a readable run file, a run
            without a training or held-out loss, an output in a missing or unwritable folder,
            an existing output without ``overwrite``, or an output that is one of the inputs.
            Nothing is written then.
    """
    if len(run_paths) < 2:
        raise DynamicsError("compare needs at least two run files")
    out = check_output(out_path, overwrite, run_paths)
    runs = [open_run(path) for path in run_paths]
    for run in runs:
        if run.train_loss() is None and run.heldout_loss() is None:
            raise DynamicsError(f"{run.path}: no training or held-out loss series to compare")
    labels = run_labels(runs)
    overshoots = [run_overshoot(run) for run in runs]
    figures = _figures(runs, labels)
    body = [
        "<h1>dynamics comparison</h1>",
        f"<p class='meta'>reference: {html.escape(labels[0])} · dynamics {__version__}</p>",
        "<h2>Summary</h2>",
        _summary_html(runs, labels, overshoots),
        "<h2>Comparability</h2>",
        _comparability_html(runs, labels),
        "<h2>Overlaid</h2>",
    ]
    body += [figure_html(figure, i) for i, (_, figure) in enumerate(figures)]
    body.append("<h2>Overshoot verdicts</h2>")
    for label, report in zip(labels, overshoots):
        body.append(f"<h3>{html.escape(label)}</h3>{overshoot_html(report)}")
    body.append("<h2>Config</h2>" + _config_html(runs, labels))
    page = html_page("dynamics comparison: " + " vs ".join(labels), "".join(body))
    return write_page(out, page, figures, static_dir, static_format, overwrite)


def _summary_html(
    runs: list[Run], labels: list[str], overshoots: list[OvershootReport | None]
) -> str:
    rows = [
        (
            label,
            run.config.get("variant"),
            *_final_and_best(run.train_loss()),
            *_final_and_best(run.heldout_loss()),
            _overshoot_summary(report),
        )
        for label, run, report in zip(labels, runs, overshoots)
    ]
    header = (
        "run",
        "variant",
        "final train (smoothed)",
        "best train (step)",
        "final held-out (smoothed)",
        "best held-out (step)",
        "overshoot",
    )
    pairs = []
    for run, label in zip(runs[1:], labels[1:]):
        result = loss_crossover(runs[0], run, (labels[0], label))
        ratio = eigenvalue_ratio(runs[0], run)
        pairs.append(
            (
                f"{label} vs {labels[0]}",
                *_crossover_cells(result),
                *(_ratio_cells(ratio) if ratio is not None else ("not recorded",) * 3),
            )
        )
    pair_header = (
        "pair",
        "compared on",
        "ahead at start",
        "overtaken at step",
        "ends ahead",
        "by (smoothed)",
        "λ1 ratio, first",
        "λ1 ratio, median",
        "λ1 ratio, last",
    )
    warnings = _warnings(runs, labels)
    note = (
        f"<p class='note'>Losses smoothed by a centred moving average over 2h+1 records, "
        f"h = round({SMOOTH_FRACTION} × records). λ1 ratio: the run's top Hessian eigenvalue "
        f"over the reference's at the same step.</p>"
    )
    warning_table = ""
    if warnings:
        warning_table = html_table(("warning", "details"), warnings, ["warning"] * len(warnings))
    return warning_table + html_table(header, rows) + html_table(pair_header, pairs) + note


def _comparability_html(runs: list[Run], labels: list[str]) -> str:
    rows, classes = [], []
    for run, label in zip(runs[1:], labels[1:]):
        for check in comparability(runs[0], run):
            status = "differs" if check.differs else "same"
            rows.append((f"{label} vs {labels[0]}", check.name, status, check.details))
            classes.append("warning" if check.differs else "")
    return html_table(("pair", "check", "status", "details"), rows, classes)


def _warnings(runs: list[Run], labels: list[str]) -> list[tuple[str, str]]:
    return [
        (f"⚠ {check.name} differs: {label} vs {labels[0]}", check.details)
        for run, label in zip(runs[1:], labels[1:])
        for check in comparability(runs[0], run)
        if check.differs
    ]


def _config_html(runs: list[Run], labels: list[str]) -> str:
    differing = differing_keys([run.config for run in runs])
    if not differing:
        table = "<p>The configs are identical.</p>"
    else:
        rows = [(key, *values) for key, values in differing.items()]
        classes = [
            "" if key.rsplit(".", 1)[-1] in IGNORED_CONFIG_KEYS else "warning" for key in differing
        ]
        table = "<p>Keys that differ:</p>" + html_table(("key", *labels), rows, classes)
    reference = json.dumps(runs[0].config, indent=2, sort_keys=True, default=str)
    return table + f"<h4>Config of {html.escape(labels[0])}</h4><pre>{html.escape(reference)}</pre>"


def _figures(runs: list[Run], labels: list[str]) -> list[tuple[str, go.Figure]]:
    colors = run_colors(len(runs))
    figures = [("loss", loss(runs, labels=labels))]
    difference = _difference_figure(runs, labels, colors)
    if difference is not None:
        figures.append(("loss-difference", difference))
    top = [(label, color, top_eigenvalue(run)) for run, label, color in zip(runs, labels, colors)]
    curves = [Curve(label, m.step, m.values, color) for label, color, m in top if m is not None]
    if curves:
        figure = line_figure(curves, title="Top Hessian eigenvalue λ1", y_title="λ1", log_y=True)
        figures.append(("top-eigenvalue", figure))
    ratio = _ratio_figure(runs, labels, colors)
    if ratio is not None:
        figures.append(("eigenvalue-ratio", ratio))
    for group in drawn_groups(runs):
        drawn = [
            (label, color, series_views(run, group))
            for run, label, color in zip(runs, labels, colors)
        ]
        drawn = [entry for entry in drawn if entry[2]]
        if drawn:
            figure = compared_view_figure(
                {label: series for label, _, series in drawn},
                title=group_title(group),
                colors=[color for _, color, _ in drawn],
            )
            figures.append((slug(group), figure))
        if group == names.HESSIAN:
            densities = {label: density_rows(run) for run, label in zip(runs, labels)}
            densities = {label: rows for label, rows in densities.items() if rows is not None}
            if densities:
                figures.append(("spectral-density", density_figure(densities)))
    return figures


def _difference_figure(runs: list[Run], labels: list[str], colors: list[str]) -> go.Figure | None:
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
            crossings.append((result.step, color, label))
    if not curves:
        return None
    figure = line_figure(
        curves,
        title="Smoothed loss difference (below zero: ahead of the reference)",
        y_title="Δ loss",
    )
    figure.add_hline(y=0, line_color="black", line_width=1)
    for step, color, label in crossings:
        figure.add_vline(
            x=step,
            line_dash="dot",
            line_color=color,
            annotation_text=f"{label} overtakes at {step:.0f}",
            annotation_font_size=10,
        )
    return figure


def _ratio_figure(runs: list[Run], labels: list[str], colors: list[str]) -> go.Figure | None:
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


def _final_and_best(metric: Metric | None) -> tuple[str, str]:
    if metric is None:
        return "not recorded", "not recorded"
    steps, values = finite(metric.step, metric.values)
    if not len(values):
        return "no finite value", "no finite value"
    smoothed = smooth(values)
    best = int(np.argmin(smoothed))
    return f"{smoothed[-1]:.5g}", f"{smoothed[best]:.5g} ({steps[best]:g})"


def _overshoot_summary(report: OvershootReport | None) -> str:
    if report is None:
        return "no hidden-state norms"
    over = [layer.name for layer in report.layers if layer.overshoot]
    signature = [layer.name for layer in report.layers if layer.signature]
    text = f"{len(over)} of {len(report.layers)} layers"
    if over:
        text += f": {', '.join(over)}"
    if signature:
        text += f" (peak in the fastest-descent window: {', '.join(signature)})"
    return text


def _crossover_cells(result: Crossover | None) -> tuple[str, ...]:
    if result is None:
        return ("no overlapping loss", "—", "—", "—", "—")
    if result.winner is None:
        overtaken = "—"
    elif result.step is None:
        overtaken = f"none: {result.winner} ahead throughout"
    else:
        overtaken = f"{result.step:.0f}"
    return (
        result.metric,
        result.first_leader or "tie",
        overtaken,
        result.winner or "tie",
        f"{result.final_gap:.4g} ({result.final_gap_relative:.1%})",
    )


def _ratio_cells(ratio: tuple[np.ndarray, np.ndarray]) -> tuple[str, str, str]:
    steps, values = ratio
    return (
        f"{values[0]:.3g} (step {steps[0]:g})",
        f"{np.median(values):.3g}",
        f"{values[-1]:.3g} (step {steps[-1]:g})",
    )
