"""The one HTML page kit of every offline view: report, comparison and plane pages.

A page opens offline: plotly.js is embedded once in its head and every figure is a ``<div>``
drawn by it, so a page of many figures costs one copy of the library. Pages are written
atomically, and their figures can also be exported as PNG or SVG files through kaleido.
"""

from __future__ import annotations

import contextlib
import html
import os
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from dynamics.analysis.output import PAGE, check_existing_output, replacing, write_atomically
from dynamics.errors import DynamicsError

__all__ = [
    "STATIC_FORMATS",
    "Written",
    "figure_html",
    "html_page",
    "html_table",
    "write_page",
]

#: Formats of the static export.
STATIC_FORMATS = ("png", "svg")
_BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
_PLOT_CONFIG = {"displaylogo": False, "responsive": True}
# Static files are as wide as a page's figures and as tall as each figure's layout says
# (kaleido's default, 700 × 500, would squash figures of several rows of panels).
_STATIC_WIDTH = 1100
_STATIC_HEIGHT = 500


@dataclass(frozen=True)
class Written:
    """What a page wrote.

    Attributes:
        path: the HTML file.
        size_bytes: its size.
        figures: how many figures it holds.
        static_files: PNG/SVG files written next to it (with ``static_dir``).
        static_skipped: why static export was skipped, or None.
        skipped: inputs left out of the page, and why, in one line; or None.
        running: the runs still being written when the page was made (``dynamics watch``
            follows them live).
    """

    path: Path
    size_bytes: int
    figures: int
    static_files: tuple[Path, ...] = ()
    static_skipped: str | None = None
    skipped: str | None = None
    running: tuple[Path, ...] = ()


def html_page(title: str, body: str) -> str:
    """A complete page with the kit's style and plotly.js embedded once in its head."""
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


def write_page(
    out: Path,
    page: str,
    figures: Sequence[tuple[str, go.Figure]],
    static_dir: str | os.PathLike | None = None,
    static_format: str = "png",
    overwrite: bool = False,
) -> Written:
    """Write ``page`` to ``out`` and export ``(file name, figure)`` pairs into ``static_dir``.

    Static targets are checked before the page is written, so a refused one writes nothing.

    Args:
        out: the HTML file, already checked (:func:`dynamics.analysis.output.check_output`).
        page: the page's HTML.
        figures: the page's figures, each with the file name (no suffix) it exports to.
        static_dir: also export every figure as ``static_format`` into this folder, when
            kaleido and a Chromium are installed; skipped with a reason otherwise.
        static_format: one of :data:`STATIC_FORMATS`.
        overwrite: replace existing static files.

    Raises:
        DynamicsError: an unknown static format, a static folder whose parent is missing, or
            an existing static file without ``overwrite``; nothing is written then.
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
    if fmt not in STATIC_FORMATS:
        raise DynamicsError(f"static format must be one of {', '.join(STATIC_FORMATS)}")
    folder = Path(static_dir)
    if not folder.is_dir() and not folder.parent.is_dir():
        raise DynamicsError(f"folder {folder.parent} does not exist")
    targets = [folder / f"{name}.{fmt}" for name, _ in figures]
    for target in targets:
        check_existing_output(target, overwrite, kind=PAGE)
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
        with contextlib.ExitStack() as files:  # each beside its target, renamed into place
            pio.write_images(
                [figure for _, figure in figures],
                [files.enter_context(replacing(target)) for target in targets],
                format=targets[0].suffix.lstrip("."),
                width=_STATIC_WIDTH,
                height=[figure.layout.height or _STATIC_HEIGHT for _, figure in figures],
            )
    # kaleido reports a browser that will not start through several exception types of its
    # own; the HTML is written by now and must stand, so any of them becomes a skip message.
    except Exception as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return f"static export failed: {first}"
    return None


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
