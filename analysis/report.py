"""One self-contained HTML report for one or more run files.

The page opens offline: plotly.js is embedded once in the page head and every figure is a
``<div>`` drawn by it, so a report of many runs costs one copy of the library. Each run gets a
section with its figures (:mod:`dynamics.analysis.figures`), its overshoot verdicts
(:func:`dynamics.analysis.overshoot.detect_overshoot` on the hidden-state norms against the
training loss), and its config and metadata. Groups a run did not record are listed, not drawn.

The helpers that read what the views need from a run, check an output path and write a page
atomically are shared with :mod:`dynamics.analysis.compare`.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from dynamics import __version__
from dynamics.analysis.figures import (
    Curve,
    Peak,
    displacement_figure,
    hessian_figure,
    layer_figure,
    line_figure,
    loss_figure,
    plane_figure,
)
from dynamics.analysis.output import check_output, write_atomically
from dynamics.analysis.overshoot import OvershootReport, detect_overshoot
from dynamics.errors import DynamicsError
from dynamics.store import Run, Series, open_run

__all__ = [
    "REPORT_GROUPS",
    "Written",
    "figure_html",
    "finish",
    "heldout_loss",
    "html_page",
    "html_table",
    "open_runs",
    "overshoot_html",
    "run_overshoot",
    "series",
    "train_loss",
    "write_report",
]

#: The series groups a report draws; a run must hold at least one figure's worth of them.
REPORT_GROUPS = (
    "loss",
    "validation",
    "hidden_norms",
    "activation_bias",
    "displacement",
    "hessian",
    "plane",
)
_STATIC_FORMATS = ("png", "svg")
_BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
_PLOT_CONFIG = {"displaylogo": False, "responsive": True}


@dataclass(frozen=True)
class Written:
    """What a report or comparison wrote.

    Attributes:
        path: the HTML file.
        size_bytes: its size.
        figures: how many figures it holds.
        static_files: PNG/SVG files written next to it (with ``static_dir``).
        static_skipped: why static export was skipped, or None.
    """

    path: Path
    size_bytes: int
    figures: int
    static_files: tuple[Path, ...] = ()
    static_skipped: str | None = None


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
        run_paths: run files, in the order of the sections.
        out_path: the HTML file to write (atomically: a reader never sees half a report).
        overwrite: replace an existing ``out_path`` (and existing static files).
        static_dir: also export every figure as ``static_format`` into this folder, when
            kaleido and a Chromium are installed; skipped with a reason otherwise.
        static_format: ``"png"`` or ``"svg"``.

    Returns:
        What was written.

    Raises:
        DynamicsError: no run given, a file that is not a readable run file, a run with nothing
            to draw from :data:`REPORT_GROUPS`, an output in a missing or unwritable folder, an
            existing output without ``overwrite``, or an output that is one of the inputs.
            Nothing is written then.
    """
    if not run_paths:
        raise DynamicsError("report needs at least one run file")
    out = check_output(out_path, overwrite, run_paths)
    runs = open_runs(run_paths)
    overshoots = [run_overshoot(run) for run in runs]
    per_run = [_run_figures(run, overshoot) for run, overshoot in zip(runs, overshoots)]
    for run, run_figures in zip(runs, per_run):
        if not run_figures:
            raise DynamicsError(
                f"{run.path}: no series to report (needs one of {', '.join(REPORT_GROUPS)})"
            )
    sections, figures = [], []
    for index, (run, overshoot, run_figures) in enumerate(zip(runs, overshoots, per_run)):
        sections.append(_run_section(run, index, overshoot, run_figures, len(figures)))
        figures += [(f"{index}-{_slug(run.name)}-{key}", figure) for key, figure in run_figures]
    nav = "".join(f'<a href="#run-{i}">{html.escape(r.name)}</a>' for i, r in enumerate(runs))
    header = (
        f"<h1>dynamics report</h1><p class='meta'>{len(runs)} run(s) · dynamics {__version__}"
        f"</p><nav>{nav}</nav>"
    )
    title = "dynamics report: " + ", ".join(run.name for run in runs)
    page = html_page(title, header + "".join(sections))
    return finish(out, page, figures, static_dir, static_format, overwrite)


def open_runs(paths: Iterable[str | os.PathLike]) -> list[Run]:
    """Open every run file, failing on the first that is not one (a one-line DynamicsError)."""
    return [open_run(path) for path in paths]


def series(run: Run, group: str) -> Series | None:
    """A run's series group, or None when it was not recorded or holds no row.

    Raises:
        DynamicsError: the group exists but its data cannot be read (a damaged file).
    """
    if group not in run.groups:
        return None
    try:
        rows = run.series(group)
    except OSError as error:
        raise DynamicsError(
            f"{run.path}: cannot read series {group!r} (truncated or corrupted?)"
        ) from error
    return rows if len(rows) else None


def train_loss(run: Run) -> tuple[np.ndarray, np.ndarray] | None:
    """``(step, loss)`` of the training loss (group ``loss``, series ``train``), or None."""
    rows = series(run, "loss")
    if rows is None or "train" not in rows.values:
        return None
    return rows.step, rows["train"]


def heldout_loss(run: Run) -> tuple[np.ndarray, np.ndarray, str] | None:
    """``(step, loss, name)`` of the held-out loss, or None.

    The held-out loss is the ``validation`` group's ``val_loss`` (what the teacher–student
    module logs), else its first series whose name contains ``loss``: a module's own logging
    names vary.
    """
    rows = series(run, "validation")
    if rows is None:
        return None
    names = [n for n in rows.values if n == "val_loss"] or [n for n in rows.values if "loss" in n]
    return (rows.step, rows[names[0]], names[0]) if names else None


def run_overshoot(run: Run) -> OvershootReport | None:
    """Overshoot verdicts of every recorded layer's hidden-state norm, or None without norms.

    The loss window comes from the training loss when the run recorded one.
    """
    norms = series(run, "hidden_norms")
    if norms is None or "norm" not in norms.values:
        return None
    loss = train_loss(run)
    try:
        return detect_overshoot(
            norms.step,
            norms["norm"],
            loss_steps=None if loss is None else loss[0],
            loss=None if loss is None else loss[1],
            layer_names=_columns(norms, "norm"),
        )
    except ValueError as error:
        raise DynamicsError(f"{run.path}: cannot judge overshoot: {error}") from error


def html_page(title: str, body: str) -> str:
    """A complete page with plotly.js embedded once in its head."""
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style>"
        "<script>window.PlotlyConfig = {MathJaxConfig: 'local'};</script>"
        f"<script charset='utf-8'>{get_plotlyjs()}</script></head>"
        f"<body>{body}</body></html>\n"
    )


def html_table(
    header: Sequence[str], rows: Iterable[Sequence[object]], classes: Sequence[str] = ()
) -> str:
    """An HTML table of escaped cells; ``classes[i]`` is the class of row ``i`` (e.g. warning)."""
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = []
    for i, row in enumerate(rows):
        css = f" class='{classes[i]}'" if i < len(classes) and classes[i] else ""
        cells = "".join(f"<td>{html.escape(_cell(value))}</td>" for value in row)
        body.append(f"<tr{css}>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def figure_html(figure: go.Figure, index: int) -> str:
    """A figure as a ``<div>`` drawn by the page's plotly.js (no library copy of its own)."""
    return (
        "<div class='figure'>"
        + figure.to_html(
            full_html=False,
            include_plotlyjs=False,
            div_id=f"figure-{index}",
            config=_PLOT_CONFIG,
            default_height=f"{figure.layout.height}px",
        )
        + "</div>"
    )


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
        "SNR",
        "peak in window",
        "reason",
    )
    thresholds = ", ".join(f"{k}={v}" for k, v in report.to_dict()["thresholds"].items())
    return (
        f"<p>{html.escape(where)}</p>{html_table(header, rows, classes)}"
        f"<p class='note'>Thresholds: {html.escape(thresholds)}.</p>"
    )


def _run_section(
    run: Run,
    index: int,
    overshoot: OvershootReport | None,
    figures: list[tuple[str, go.Figure]],
    first_figure: int,
) -> str:
    missing = [g for g in REPORT_GROUPS if series(run, g) is None]
    parts = [f"<section id='run-{index}'><h2>{html.escape(run.name)}</h2>"]
    parts.append(f"<p class='meta'>{html.escape(str(run.path))}</p>")
    if missing:
        parts.append(f"<p class='note'>Not recorded: {html.escape(', '.join(missing))}.</p>")
    parts.append("<h3>Overshoot</h3>" + overshoot_html(overshoot))
    parts.append("<h3>Figures</h3>")
    parts += [figure_html(fig, first_figure + i) for i, (_, fig) in enumerate(figures)]
    parts.append("<h3>Run</h3>" + _metadata_html(run) + "</section>")
    return "".join(parts)


def _run_figures(run: Run, overshoot: OvershootReport | None) -> list[tuple[str, go.Figure]]:
    """The figures of one run, ``(file-name key, figure)``, for the groups it recorded."""
    window = _window(overshoot)
    figures = []
    train, heldout = train_loss(run), heldout_loss(run)
    if train is not None or heldout is not None:
        figures.append(("loss", loss_figure(train, heldout and heldout[:2], window=window)))
    norms = _with(series(run, "hidden_norms"), "norm")
    if norms is not None:
        layers = overshoot.layers if overshoot else ()
        peaks = [Peak(x.name, x.peak_step, x.peak_value) for x in layers if x.overshoot]
        figure = layer_figure(
            norms.step,
            norms["norm"],
            _columns(norms, "norm"),
            title="Hidden-state norm per layer",
            y_title="mean ‖h‖",
            window=window,
            peaks=peaks,
        )
        figures.append(("hidden-norms", figure))
    bias = _with(series(run, "activation_bias"), "mean")
    if bias is not None:
        figure = layer_figure(
            bias.step,
            bias["mean"],
            _columns(bias, "mean"),
            title="Activation bias per layer (mean post-activation output)",
            y_title="mean φ(z)",
        )
        figures.append(("activation-bias", figure))
    moved = _with(series(run, "displacement"), "total")
    if moved is not None:
        figure = displacement_figure(moved.step, moved["total"], moved.values.get("update"))
        figures.append(("displacement", figure))
    hessian = _with(series(run, "hessian"), "eigenvalues")
    if hessian is not None:
        eigenvalues = hessian["eigenvalues"]
        figure = hessian_figure(hessian.step, eigenvalues, _columns(hessian, "eigenvalues"))
        figures.append(("hessian", figure))
    figures += _plane_figures(series(run, "plane"))
    return figures


def _with(rows: Series | None, name: str) -> Series | None:
    """``rows`` when it holds the series ``name``, else None."""
    return rows if rows is not None and name in rows.values else None


def _plane_figures(plane: Series | None) -> list[tuple[str, go.Figure]]:
    # The GradientPlane probe records the coordinates (a, b) of θt − θ0 on the plane of initial
    # gradients and the norm r of its part orthogonal to the plane.
    if plane is None or "a" not in plane.values or "b" not in plane.values:
        return []
    a, b = plane["a"], plane["b"]
    figures = [("plane-path", plane_figure(plane.step, a, b))]
    if "r" in plane.values:
        inside = a.astype(float) ** 2 + b.astype(float) ** 2
        total = inside + plane["r"].astype(float) ** 2
        with np.errstate(invalid="ignore", divide="ignore"):
            share = np.where(total > 0, inside / total, np.nan)
        curve = Curve("(a² + b²) / ‖θt − θ0‖²", plane.step, share, "#8c564b")
        figures.append(
            (
                "plane-share",
                line_figure(
                    [curve],
                    title="Share of the displacement inside the plane",
                    y_title="share of ‖θt − θ0‖²",
                ),
            )
        )
    return figures


def _metadata_html(run: Run) -> str:
    attrs = run.attrs
    module = attrs.get("module") or {}
    probes = attrs.get("probes") or []
    rows = [
        ("file", str(run.path)),
        ("run name", run.name),
        ("schema version", attrs.get("schema_version")),
        ("θ0 sha256", attrs.get("theta0_sha256")),
        ("module", module.get("class_path") if isinstance(module, dict) else module),
        (
            "probes",
            ", ".join(
                f"{p.get('class')} (every {p.get('every_n_steps')})"
                for p in probes
                if isinstance(p, dict)
            ),
        ),
        ("versions", json.dumps(attrs.get("versions"), sort_keys=True)),
    ]
    groups = []
    for group in run.groups:
        # Groups the report does not draw (parameter snapshots) can hold gigabytes: not read.
        recorded = series(run, group) if group in REPORT_GROUPS else None
        if recorded is None:
            groups.append((group, "—", "—", "not drawn" if group not in REPORT_GROUPS else "empty"))
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


def finish(
    out: Path,
    page: str,
    figures: Sequence[tuple[str, go.Figure]],
    static_dir: str | os.PathLike | None,
    static_format: str,
    overwrite: bool,
) -> Written:
    """Write ``page`` to ``out`` and export ``(name, figure)`` pairs into ``static_dir``.

    Static targets are checked before the page is written, so a refused one writes nothing.
    """
    targets = None
    if static_dir is not None:
        targets = _static_targets(figures, static_dir, static_format, overwrite)
    write_atomically(out, page)
    size = out.stat().st_size
    if not targets:
        return Written(out, size, len(figures))
    skipped = _static_export(figures, targets)
    if skipped:
        return Written(out, size, len(figures), static_skipped=skipped)
    return Written(out, size, len(figures), tuple(targets))


def _static_targets(
    figures: Sequence[tuple[str, go.Figure]],
    static_dir: str | os.PathLike,
    fmt: str,
    overwrite: bool,
) -> list[Path]:
    if fmt not in _STATIC_FORMATS:
        raise DynamicsError(f"static format must be one of {', '.join(_STATIC_FORMATS)}")
    folder = Path(static_dir)
    if not folder.is_dir() and not folder.parent.is_dir():
        raise DynamicsError(f"folder {folder.parent} does not exist")
    targets = [folder / f"{name}.{fmt}" for name, _ in figures]
    existing = [t for t in targets if t.exists()]
    if existing and not overwrite:
        raise DynamicsError(f"{existing[0]} exists; pass --overwrite to replace it")
    return targets


def _static_export(figures: Sequence[tuple[str, go.Figure]], targets: list[Path]) -> str | None:
    """Export each figure; returns why it was skipped, or None once every file is written."""
    if find_spec("kaleido") is None:
        return "static export skipped: kaleido is not installed (pip install kaleido)"
    if not os.environ.get("BROWSER_PATH") and not any(shutil.which(b) for b in _BROWSERS):
        return "static export skipped: no Chromium or Chrome found (apt-get install chromium)"
    import plotly.io as pio

    try:
        targets[0].parent.mkdir(exist_ok=True)
        pio.write_images([figure for _, figure in figures], targets)
    # kaleido reports a browser that will not start through several exception types of its
    # own; the HTML is written by now and must stand, so any of them becomes a skip message.
    except Exception as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return f"static export failed: {first}"
    return None


def _window(report: OvershootReport | None) -> tuple[float, float] | None:
    window = report.loss_window if report else None
    return (window.start_step, window.end_step) if window and window.found else None


def _columns(rows: Series, name: str) -> list[str]:
    width = rows[name].shape[1]
    return list(rows.columns.get(name) or [f"{name}_{j}" for j in range(width)])


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "run"


def _cell(value: object) -> str:
    if value is None:
        return "—"
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, (float, np.floating)):
        return f"{value:.4g}"
    return str(value)


_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1200px;color:#222;padding:0 1em}
h1{margin-bottom:.2em} h2{border-bottom:2px solid #ddd;padding-bottom:.2em;margin-top:2em}
nav a{margin-right:1em} .meta{color:#666;font-size:.9em} .note{color:#555;font-size:.9em}
table{border-collapse:collapse;margin:.5em 0;font-size:.88em}
th,td{border:1px solid #ddd;padding:.25em .5em;text-align:left;vertical-align:top}
th{background:#f4f4f4} tr.flag td{background:#fff4e0} tr.warning td{background:#ffe0e0;
font-weight:600} pre{background:#f7f7f7;padding:.6em;overflow:auto;font-size:.85em}
.figure{margin:1em 0}
"""
