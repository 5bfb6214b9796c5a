"""One self-contained HTML report for one or more run files, one section per run.

A section holds the run's loss, every recorded series drawn as its view says (one figure per
group) with what the group's dedicated view adds (:mod:`dynamics.analysis.figures.dedicated_views`:
overshoot peaks on the hidden-state norms, the Hessian's spectral density, the path on the plane
of initial gradients, decoded images), the overshoot verdicts against the training loss, the bias
audit when the run recorded one, and what the run was (module class and init args, layout,
optimizer, scheduler, precision, data, probes), its config and metadata. Standard groups a run
did not record are listed, not drawn. The page comes from the kit of
:mod:`dynamics.analysis.pages.page`.
"""

from __future__ import annotations

import dataclasses
import html
import json
import os
from collections.abc import Sequence
from shlex import quote

import plotly.graph_objects as go

from dynamics import __version__
from dynamics.analysis.figures.dedicated_views import (
    Marks,
    dedicated_view,
    descent_window,
    drawn_series,
    run_marks,
)
from dynamics.analysis.figures.runs import run_loss_figure
from dynamics.analysis.figures.series import view_figure
from dynamics.analysis.measures.bias_audit import recorded_audit
from dynamics.analysis.measures.overshoot import OvershootReport
from dynamics.analysis.measures.run_series import (
    STANDARD_GROUPS,
    drawn_groups,
    group_title,
    run_overshoot,
)
from dynamics.analysis.measures.run_setup import setup_rows
from dynamics.analysis.output import check_output, slug
from dynamics.analysis.pages.page import Written, figure_html, html_page, html_table, write_page
from dynamics.analysis.pages.sections.bias_audit import bias_audit_html
from dynamics.analysis.pages.sections.overshoot import overshoot_html
from dynamics.analysis.pages.sections.weight_spectra import weight_spectra_html
from dynamics.errors import DynamicsError
from dynamics.store import Run, names, open_run, run_files

__all__ = ["write_report"]


def write_report(
    run_paths: Sequence[str | os.PathLike],
    out_path: str | os.PathLike,
    overwrite: bool = False,
    *,
    static_dir: str | os.PathLike | None = None,
    static_format: str = "png",
) -> Written:
    """Write one self-contained HTML report of the runs, one section per run.

    Args:
        run_paths: run files, in the order of the sections, or directories of them (their
            ``*.h5`` files by name).
        out_path: the HTML file to write (atomically: a reader never sees half a report).
        overwrite: replace an existing ``out_path`` (and existing static files).
        static_dir: also export every figure as ``static_format`` into this folder, when
            kaleido and a Chromium are installed; skipped with a reason otherwise.
        static_format: ``"png"`` or ``"svg"``.

    Returns:
        What was written.

    Raises:
        DynamicsError: no run given, a file that is not a readable run file, a run with
            nothing to draw, an output in a missing or unwritable folder, an existing output
            without ``overwrite``, or an output that is one of the inputs. Nothing is written
            then.

    Example::

        written = write_report(["runs/demo/unshifted.h5", "runs/demo/shifted.h5"],
                               "runs/demo/report.html", overwrite=True)
        print(written.path, written.figures)
    """
    run_paths = run_files(run_paths)  # a directory gives its run files
    if not run_paths:
        raise DynamicsError("report needs at least one run file")
    out = check_output(out_path, overwrite, run_paths)
    runs = [open_run(path) for path in run_paths]
    overshoots = [run_overshoot(run) for run in runs]
    per_run = [_run_figures(run) for run in runs]
    empty = [run for run, run_figures in zip(runs, per_run) if not run_figures]
    why = "no series to report (none declares a view, and no loss or plane)"
    if len(empty) == len(runs):
        raise DynamicsError(f"{empty[0].path}: {why}")
    # A folder of runs with one empty file (a fit that crashed before its first row) reports
    # the others and names the ones left out.
    skipped = f"skipped {', '.join(str(r.path) for r in empty)}: {why}" if empty else None
    kept = [i for i, run_figures in enumerate(per_run) if run_figures]
    runs, overshoots, per_run = ([items[i] for i in kept] for items in (runs, overshoots, per_run))
    sections, figures = [], []
    for index, (run, overshoot, run_figures) in enumerate(zip(runs, overshoots, per_run)):
        sections.append(_run_section(run, index, overshoot, run_figures, len(figures)))
        figures += [(f"{index}-{slug(run.name)}-{key}", figure) for key, figure in run_figures]
    nav = "".join(f'<a href="#run-{i}">{html.escape(r.name)}</a>' for i, r in enumerate(runs))
    note = f" · {html.escape(skipped)}" if skipped else ""
    header = (
        f"<h1>dynamics report</h1><p class='meta'>{len(runs)} run(s) · dynamics {__version__}"
        f"{note}</p><nav>{nav}</nav>"
    )
    title = "dynamics report: " + ", ".join(run.name for run in runs)
    page = html_page(title, header + "".join(sections))
    written = write_page(out, page, figures, static_dir, static_format, overwrite)
    running = tuple(run.path for run in runs if run.status().state == names.RUNNING)
    return dataclasses.replace(written, skipped=skipped, running=running)


def _run_section(
    run: Run,
    index: int,
    overshoot: OvershootReport | None,
    figures: list[tuple[str, go.Figure]],
    first_figure: int,
) -> str:
    missing = [g for g in STANDARD_GROUPS if run.recorded(g) is None]
    parts = [f"<section id='run-{index}'><h2>{html.escape(run.name)}</h2>"]
    setup = dict(setup_rows(run))
    parts.append(
        f"<p class='meta'>{html.escape(str(run.path))} · module {html.escape(setup['module'])}"
        f" · init args {html.escape(setup['init args'])}</p>"
    )
    status = run.status()
    if status.state == names.RUNNING:
        parts.append(
            f"<p class='note'>Still running (step {status.last_step}) when this report was "
            f"written: follow it live with <code>dynamics watch {html.escape(quote(str(run.path)))}"
            "</code>.</p>"
        )
    if missing:
        parts.append(f"<p class='note'>Not recorded: {html.escape(', '.join(missing))}.</p>")
    parts.append("<h3>Overshoot</h3>" + overshoot_html(overshoot))
    audit = recorded_audit(run)
    if audit is not None:  # recorded by the BiasAudit probe
        parts.append("<h3>Bias audit</h3>" + bias_audit_html(audit))
    if names.SNAPSHOTS in run.groups:  # ParameterDisplacement's snapshots: states to measure
        parts.append("<h3>Weight spectra</h3>" + weight_spectra_html(run))
    parts.append("<h3>Figures</h3>")
    parts += [figure_html(fig, first_figure + i) for i, (_, fig) in enumerate(figures)]
    parts.append("<h3>Run</h3>" + _metadata_html(run) + "</section>")
    return "".join(parts)


def _run_figures(run: Run) -> list[tuple[str, go.Figure]]:
    """The figures of one run, ``(file-name key, figure)``: the loss, then group by group, each
    group's figure followed by its dedicated view's."""
    figures = []
    marks = run_marks(run)
    if run.train_loss() is not None or run.heldout_loss() is not None:
        figures.append(("loss", run_loss_figure(run, descent_window(marks))))
    for group in drawn_groups([run]):
        mark = marks.get(group, Marks())
        drawn = drawn_series(run, group, mark)
        if drawn:
            title = group_title(group)
            figures.append((slug(group), view_figure(drawn, title=title, window=mark.window)))
        figures += dedicated_view(group).run_figures(run)
    return figures


def _metadata_html(run: Run) -> str:
    attrs = run.attrs
    rows = [
        ("file", str(run.path)),
        ("run name", run.name),
        ("schema version", attrs.get("schema_version")),
        *setup_rows(run),
        ("versions", json.dumps(attrs.get(names.ATTR_VERSIONS), sort_keys=True)),
    ]
    groups = []
    for group in run.groups:
        # Groups without a view (parameter snapshots) can hold gigabytes: not read.
        drawn = group in STANDARD_GROUPS or run.views(group)
        recorded = run.recorded(group) if drawn else None
        if recorded is None:
            groups.append((group, "—", "—", "empty" if drawn else "not drawn"))
            continue
        shapes = ", ".join(f"{n}{v.shape[1:] or ''}" for n, v in recorded.values.items())
        steps = f"{recorded.step[0]}–{recorded.step[-1]}"
        groups.append((group, len(recorded), steps, shapes))
    config = json.dumps(run.config, indent=2, sort_keys=True, default=str)
    return (
        html_table(("field", "value"), rows)
        + "<h4>Series</h4>"
        + html_table(("group", "rows", "steps", "series"), groups)
        + f"<h4>Config</h4><pre>{html.escape(config)}</pre>"
    )
