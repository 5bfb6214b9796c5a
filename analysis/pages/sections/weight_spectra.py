"""The weight spectra of one run at its last stored state, a table per matrix: a section of
the report (the figures over steps come with the parameter snapshots' dedicated view)."""

from __future__ import annotations

import html
import os

from dynamics.analysis.figures.weight_spectra import MAX_STATES, spectra_figures
from dynamics.analysis.measures.weight_spectra import WeightSpectra, weight_spectra
from dynamics.analysis.output import check_output
from dynamics.analysis.pages.page import Written, figure_html, html_page, html_table, write_page
from dynamics.errors import DynamicsError
from dynamics.store import Run, open_run

__all__ = ["weight_spectra_html", "write_spectra_page"]


def weight_spectra_html(run: Run) -> str:
    """The table of the run's weight matrices at its last stored state, or why there is none.

    Example::

        weight_spectra_html(open_run("runs/demo/shifted.h5"))
    """
    try:
        spectra = weight_spectra(run, last_only=True)
    except DynamicsError as error:
        return f"<p class='note'>No weight spectra: {html.escape(str(error))}.</p>"
    return _table_html(spectra)


def write_spectra_page(
    run_path: str | os.PathLike,
    out_path: str | os.PathLike,
    overwrite: bool = False,
    *,
    static_dir: str | os.PathLike | None = None,
    static_format: str = "png",
) -> Written:
    """Write one page of a run's weight spectra: the table at the last stored state and the
    measures over steps (at most :data:`MAX_STATES` states, evenly spread), one line per
    matrix.

    Raises:
        DynamicsError: an output that cannot be written (checked before the run is read), a
            file that is not a run, or a run without θ0, layout or weight matrices.

    Example::

        write_spectra_page("runs/demo/shifted.h5", "spectra.html", overwrite=True)
    """
    out = check_output(out_path, overwrite, [run_path])
    run = open_run(run_path)
    spectra = weight_spectra(run, max_states=MAX_STATES)
    figures = spectra_figures(spectra)
    body = (
        f"<h1>Weight spectra: {html.escape(run.name)}</h1>"
        f"<p class='meta'>{html.escape(str(run.path))}</p>"
        + _table_html(spectra)
        + "".join(figure_html(figure, i) for i, (_, figure) in enumerate(figures))
    )
    page = html_page(f"dynamics spectra: {run.name}", body)
    return write_page(out, page, figures, static_dir, static_format, overwrite)


def _table_html(spectra: WeightSpectra) -> str:
    header, rows = spectra.table()
    return (
        f"<p>At step {spectra.steps[-1]} (the last stored state); ΔW = Wt − W0.</p>"
        + html_table(header, rows)
        + "<p class='note'>A tensor (out, in, k…) is the matrix (out, in·k…). α: the exponent "
        "of the eigenvalue density of WᵀW above x_min, fitted as WeightWatcher does (continuous "
        "maximum likelihood, x_min by least Kolmogorov–Smirnov distance D, eigenvalues ≤ 1e-5 "
        "left out, none for a matrix whose smaller side is under 8).</p>"
    )
