"""Side-by-side comparison of runs as one HTML page: the first run is the reference.

The page holds a summary (final and best losses, crossover, λ1 ratio), the comparability
checks with one verdict per pair, each run's setup (module class and init args, layout,
optimizer, scheduler, precision, data, probes), the overlaid loss and its smoothed difference
with the crossover marked, λ1 and its ratio, every recorded series drawn as its view says
(each side-by-side panel titled by the run whose data it shows) with what the group's
dedicated view adds (:mod:`dynamics.analysis.figures.dedicated_views`: spectral densities side
by side, eigenspace overlap, decoded images), the loss barriers between the runs' parameters
(:mod:`dynamics.analysis.measures.loss_barrier`), the overshoot verdicts and the configs. The
numbers come from :mod:`dynamics.analysis.measures.run_comparison`; the page from
:mod:`dynamics.analysis.pages.page`.
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import plotly.graph_objects as go

from dynamics import __version__
from dynamics.analysis.figures.dedicated_views import dedicated_view, drawn_series
from dynamics.analysis.figures.displacement_geometry import displacement_figures
from dynamics.analysis.figures.lines import run_colors
from dynamics.analysis.figures.run_comparison import (
    eigenvalue_ratio_figure,
    loss_difference_figure,
    top_eigenvalue_figure,
)
from dynamics.analysis.figures.runs import loss
from dynamics.analysis.figures.series import compared_view_figure
from dynamics.analysis.measures.displacement_geometry import (
    DisplacementGeometry,
    displacement_geometry,
)
from dynamics.analysis.measures.loss_barrier import (
    POINTS,
    HeldOutBatch,
    check_barrier_points,
    loss_barriers,
)
from dynamics.analysis.measures.overshoot import OvershootReport
from dynamics.analysis.measures.run_comparison import (
    DIFFERS,
    IGNORED_CONFIG_KEYS,
    NOT_RECORDED,
    SAME,
    SMOOTH_FRACTION,
    Check,
    Crossover,
    comparability,
    crossing_text,
    differing_keys,
    eigenvalue_ratio,
    finite,
    loss_crossover,
    smooth,
    verdict,
)
from dynamics.analysis.measures.run_series import (
    drawn_groups,
    group_title,
    run_labels,
    run_overshoot,
)
from dynamics.analysis.measures.run_setup import setup_rows
from dynamics.analysis.output import check_output, slug
from dynamics.analysis.pages.page import Written, figure_html, html_page, html_table, write_page
from dynamics.analysis.pages.sections.displacement_geometry import (
    DISPLACEMENT_NOTE,
    displacement_cells,
)
from dynamics.analysis.pages.sections.loss_barrier import barrier_section
from dynamics.analysis.pages.sections.overshoot import overshoot_html
from dynamics.errors import DynamicsError
from dynamics.store import Metric, Run, open_run, run_files

if TYPE_CHECKING:
    from dynamics.model.rebuild import RunInitArgs

__all__ = ["write_comparison"]


def write_comparison(
    run_paths: Sequence[str | os.PathLike],
    out_path: str | os.PathLike,
    overwrite: bool = False,
    *,
    static_dir: str | os.PathLike | None = None,
    static_format: str = "png",
    barrier_points: int = POINTS,
    model: str | None = None,
    init_args: dict | RunInitArgs | None = None,
    trust_recorded_model: bool = False,
    barrier_batch: HeldOutBatch | None = None,
) -> Written:
    """Write one self-contained HTML page comparing runs with the first one.

    Args:
        run_paths: two or more run files, or directories of them (their ``*.h5`` files
            by name); the first is the reference.
        out_path: the HTML file to write (atomically).
        overwrite: replace an existing ``out_path`` (and existing static files).
        static_dir: also export every figure into this folder (see
            :func:`dynamics.analysis.pages.run_report.write_report`).
        static_format: ``"png"`` or ``"svg"``.
        barrier_points: points along each line of the loss barriers (0: none evaluated);
            see :mod:`dynamics.analysis.measures.loss_barrier`. A run whose model cannot be rebuilt
            gets a one-line remark instead.
        model: build the runs' models with this class or factory instead of the recorded one
            (see :func:`~dynamics.model.rebuild.rebuild_module`).
        init_args: init args of the loss barriers' rebuilt models (see
            :func:`~dynamics.analysis.measures.loss_barrier.loss_barriers`).
        trust_recorded_model: import a recorded class from outside the installed packages.
        barrier_batch: evaluate the loss barriers on this batch (see
            :func:`~dynamics.analysis.measures.loss_barrier.load_batch`) instead of the runs' stored
            probe batches.

    Returns:
        What was written.

    Raises:
        DynamicsError: fewer than two runs, a file that is not a readable run file, a run
            without a training or held-out loss, an output in a missing or unwritable folder,
            an existing output without ``overwrite``, an output that is one of the inputs, or
            a ``barrier_batch`` a rebuilt model cannot take. Nothing is written then.

    Example::

        write_comparison(["runs/demo/unshifted.h5", "runs/demo/shifted.h5"],
                         "runs/demo/compare.html", barrier_points=0)
    """
    check_barrier_points(barrier_points)
    run_paths = run_files(run_paths)  # a directory gives its run files
    if len(run_paths) < 2:
        raise DynamicsError("compare needs at least two run files")
    inputs = [*run_paths, *([barrier_batch.path] if barrier_batch and barrier_batch.path else [])]
    out = check_output(out_path, overwrite, inputs)
    runs = [open_run(path) for path in run_paths]
    for run in runs:
        if run.train_loss() is None and run.heldout_loss() is None:
            raise DynamicsError(f"{run.path}: no training or held-out loss series to compare")
    labels = run_labels(runs)
    overshoots = [run_overshoot(run) for run in runs]
    pairs = _checks(runs, labels)
    geometries = [displacement_geometry(runs[0], run) for run in runs[1:]]
    figures = _figures(runs, labels, geometries)
    body = [
        "<h1>dynamics comparison</h1>",
        f"<p class='meta'>reference: {html.escape(labels[0])} · dynamics {__version__}</p>",
        "<h2>Summary</h2>",
        _summary_html(runs, labels, overshoots, _warnings(pairs), geometries),
        "<h2>Comparability</h2>",
        _comparability_html(pairs),
        "<h2>Setup</h2>",
        _setup_html(runs, labels),
        "<h2>Overlaid</h2>",
    ]
    body += [figure_html(figure, i) for i, (_, figure) in enumerate(figures)]
    if barrier_points:
        barriers = loss_barriers(
            runs,
            labels,
            barrier_points,
            model=model,
            init_args=init_args,
            trust_recorded_model=trust_recorded_model,
            held_out=barrier_batch,
        )
        section, figure = barrier_section(barriers, labels, len(figures))
        body.append(section)
        if figure is not None:
            figures.append(("loss-barrier", figure))
    body.append("<h2>Overshoot verdicts</h2>")
    for label, report in zip(labels, overshoots):
        body.append(f"<h3>{html.escape(label)}</h3>{overshoot_html(report)}")
    body.append("<h2>Config</h2>" + _config_html(runs, labels))
    page = html_page("dynamics comparison: " + " vs ".join(labels), "".join(body))
    return write_page(out, page, figures, static_dir, static_format, overwrite)


def _summary_html(
    runs: list[Run],
    labels: list[str],
    overshoots: list[OvershootReport | None],
    warnings: list[tuple[str, str]],
    geometries: list[DisplacementGeometry | str],
) -> str:
    rows = [
        (
            label,
            run.config.get("variant"),
            *_final_and_best(run.train_loss(), run.diverged_at),
            *_final_and_best(run.heldout_loss(), run.diverged_at),
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
    for run, label, geometry in zip(runs[1:], labels[1:], geometries):
        result = loss_crossover(runs[0], run, (labels[0], label))
        ratio = eigenvalue_ratio(runs[0], run)
        pairs.append(
            (
                f"{label} vs {labels[0]}",
                *_diverged_crossover(_crossover_cells(result), (runs[0], run), (labels[0], label)),
                *(_ratio_cells(ratio) if ratio is not None else ("not recorded",) * 3),
                *displacement_cells(geometry),
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
        "displacement angle, final",
        "in-plane share, run",
        "in-plane share, reference",
    )
    note = (
        f"<p class='note'>Losses smoothed by a centred moving average over 2h+1 records, "
        f"h = round({SMOOTH_FRACTION} × records). λ1 ratio: the run's top Hessian eigenvalue "
        f"over the reference's at the same step. {DISPLACEMENT_NOTE}</p>"
    )
    warning_table = ""
    if warnings:
        warning_table = html_table(("warning", "details"), warnings, ["warning"] * len(warnings))
    return warning_table + html_table(header, rows) + html_table(pair_header, pairs) + note


def _checks(runs: list[Run], labels: list[str]) -> list[tuple[str, list[Check]]]:
    """``(pair, its comparability checks)`` of every run against the reference; the run comes
    first, as in the pair's name and in every ``a vs b`` of the details."""
    return [
        (f"{label} vs {labels[0]}", comparability(run, runs[0], (label, labels[0])))
        for run, label in zip(runs[1:], labels[1:])
    ]


def _comparability_html(pairs: list[tuple[str, list[Check]]]) -> str:
    verdicts = html_table(
        ("pair", "verdict"),
        [(pair, verdict(checks)) for pair, checks in pairs],
        [_STATUS_CLASS.get(_worst(checks), "") for _, checks in pairs],
    )
    rows, classes = [], []
    for pair, checks in pairs:
        for check in checks:
            rows.append((pair, check.name, check.status, check.details))
            classes.append(_STATUS_CLASS.get(check.status, ""))
    note = (
        "<p class='note'>Each check compares what both runs recorded at their first training "
        "batch. <b>not recorded</b>: one run or both did not record it, so nothing is claimed; "
        "<b>variant</b>: they differ only in keys that name the variant "
        f"({html.escape(', '.join(sorted(IGNORED_CONFIG_KEYS)))}). Equal data descriptions "
        "do not mean equal samples.</p>"
    )
    return verdicts + html_table(("pair", "check", "status", "details"), rows, classes) + note


def _warnings(pairs: list[tuple[str, list[Check]]]) -> list[tuple[str, str]]:
    return [
        (f"⚠ {check.name} differs: {pair}", check.details)
        for pair, checks in pairs
        for check in checks
        if check.differs
    ]


def _worst(checks: list[Check]) -> str:
    statuses = {check.status for check in checks}
    return next((s for s in (DIFFERS, NOT_RECORDED) if s in statuses), SAME)


def _setup_html(runs: list[Run], labels: list[str]) -> str:
    """What each run was (module class and init args, optimizer, data, ...), side by side."""
    columns = [setup_rows(run) for run in runs]
    rows = [(field, *(col[i][1] for col in columns)) for i, (field, _) in enumerate(columns[0])]
    classes = ["flag" if len(set(row[1:])) > 1 else "" for row in rows]
    return html_table(("field", *labels), rows, classes)


def _config_html(runs: list[Run], labels: list[str]) -> str:
    missing = [label for run, label in zip(runs, labels) if not run.config]
    if len(missing) == len(runs):
        return (
            "<p>No run recorded a config (the recorder's <code>config=</code>); see Setup and "
            "Comparability for what they recorded about themselves.</p>"
        )
    parts = []
    if missing:
        parts.append(
            f"<p class='note'>No config recorded by: {html.escape(', '.join(missing))}.</p>"
        )
    recorded = [(run, label) for run, label in zip(runs, labels) if run.config]
    differing = differing_keys([run.config for run, _ in recorded])
    if not differing:
        parts.append("<p>The recorded configs agree key by key.</p>")
    else:
        rows = [(key, *values) for key, values in differing.items()]
        classes = [
            "" if key.rsplit(".", 1)[-1] in IGNORED_CONFIG_KEYS else "warning" for key in differing
        ]
        header = ("key", *(label for _, label in recorded))
        parts.append("<p>Keys that differ:</p>" + html_table(header, rows, classes))
    first, first_label = recorded[0]
    reference = json.dumps(first.config, indent=2, sort_keys=True, default=str)
    parts.append(
        f"<h4>Config of {html.escape(first_label)}</h4><pre>{html.escape(reference)}</pre>"
    )
    return "".join(parts)


_STATUS_CLASS = {DIFFERS: "warning", NOT_RECORDED: "flag"}


def _figures(
    runs: list[Run], labels: list[str], geometries: list[DisplacementGeometry | str]
) -> list[tuple[str, go.Figure]]:
    colors = run_colors(len(runs))
    figures = [("loss", loss(runs, labels=labels))]
    compared = (
        ("loss-difference", loss_difference_figure(runs, labels, colors)),
        *displacement_figures(geometries, labels, colors),
        ("top-eigenvalue", top_eigenvalue_figure(runs, labels, colors)),
        ("eigenvalue-ratio", eigenvalue_ratio_figure(runs, labels, colors)),
    )
    figures += [(key, figure) for key, figure in compared if figure is not None]
    for group in drawn_groups(runs):
        drawn = [
            (label, color, drawn_series(run, group))
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
        figures += dedicated_view(group).compared_figures(runs, labels, colors)
    return figures


def _final_and_best(metric: Metric | None, diverged_at: int | None) -> tuple[str, str]:
    """The final and best smoothed loss; a diverged run has no final loss, and its best is of
    the finite losses before it diverged."""
    if metric is None:
        return "not recorded", "not recorded"
    steps, values = finite(metric.step, metric.values)
    if diverged_at is not None:
        steps, values = steps[steps < diverged_at], values[steps < diverged_at]
    final = None if diverged_at is None else f"diverged at step {diverged_at}"
    if not len(values):
        return final or "no finite value", "no finite value"
    smoothed = smooth(values)
    best = int(np.argmin(smoothed))
    return final or f"{smoothed[-1]:.5g}", f"{smoothed[best]:.5g} ({steps[best]:g})"


def _diverged_crossover(
    cells: tuple[str, ...], runs: tuple[Run, Run], labels: tuple[str, str]
) -> tuple[str, ...]:
    """The crossover cells of a pair in which a run diverged: compared on the finite losses
    only, and the run that did not diverge ends ahead (by no finite gap)."""
    diverged = [
        f"{label} diverged at step {run.diverged_at}"
        for run, label in zip(runs, labels)
        if run.diverged_at is not None
    ]
    if not diverged or cells[1:] == ("—",) * 4:
        return cells
    others = [label for run, label in zip(runs, labels) if run.diverged_at is None]
    winner = others[0] if others else "neither (both diverged)"
    return (f"{cells[0]}, finite values", cells[1], cells[2], winner, "; ".join(diverged))


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
        overtaken = crossing_text(result)
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
