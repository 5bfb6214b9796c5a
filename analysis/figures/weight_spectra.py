"""The weight matrices' spectral measures over steps, one line per layer
(:mod:`dynamics.analysis.measures.weight_spectra`): of one run, and of runs overlaid."""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from dynamics.analysis.figures.lines import Curve, line_figure, run_colors
from dynamics.analysis.measures.weight_spectra import METRICS, WeightSpectra, weight_spectra
from dynamics.errors import DynamicsError
from dynamics.store import Run

__all__ = [
    "MAX_STATES",
    "compared_run_spectra_figures",
    "compared_spectra_figures",
    "run_spectra_figures",
    "spectra_figures",
]

_KINDS = (("weights", "θt", "solid"), ("displacement", "θt − θ0", "dot"))


def spectra_figures(spectra: WeightSpectra) -> list[tuple[str, go.Figure]]:
    """One figure per measure (spectral norm, Frobenius norm, stable rank, α), one line per
    weight matrix of θt (solid) and of θt − θ0 (dotted).

    Example::

        spectra_figures(weight_spectra(open_run("runs/demo/shifted.h5")))
    """
    colors = run_colors(len(spectra.layers))
    return _figures([("", spectra, None)], lambda run, layer: colors[layer])


def compared_spectra_figures(
    spectra: Sequence[WeightSpectra], labels: Sequence[str], colors: Sequence[str]
) -> list[tuple[str, go.Figure]]:
    """The runs' measures overlaid: one figure per measure, a run's lines in its colour, one
    per weight matrix of θt (solid) and of θt − θ0 (dotted).

    Example::

        compared_spectra_figures([weight_spectra(a), weight_spectra(b)], ["a", "b"], colors)
    """
    return _figures(list(zip(labels, spectra, colors)), lambda run, layer: colors[run])


def _figures(runs, color) -> list[tuple[str, go.Figure]]:
    figures = []
    for metric, (title, y_title, log_y) in METRICS.items():
        curves = []
        for r, (label, spectra, _) in enumerate(runs):
            for kind, what, dash in _KINDS:
                values = getattr(spectra, kind)[metric]
                for i, layer in enumerate(spectra.layers):
                    name = f"{label} · {layer} ({what})" if label else f"{layer} ({what})"
                    curves.append(
                        Curve(
                            name,
                            spectra.steps,
                            values[:, i],
                            color(r, i),
                            dash=dash,
                            markers=True,
                            group=label or layer,
                        )
                    )
        key = "weight-" + metric.replace("_", "-")
        figures.append((key, line_figure(curves, title=title, y_title=y_title, log_y=log_y)))
    return figures


def run_spectra_figures(run: Run) -> list[tuple[str, go.Figure]]:
    """:func:`spectra_figures` of a run that stored parameter snapshots, at most
    :data:`MAX_STATES` of its states evenly spread; none when its states cannot be read (the
    report's section says why).

    Example::

        run_spectra_figures(open_run("runs/demo/shifted.h5"))
    """
    spectra = _spectra(run)
    return [] if spectra is None else spectra_figures(spectra)


def compared_run_spectra_figures(
    runs: Sequence[Run], labels: Sequence[str], colors: Sequence[str]
) -> list[tuple[str, go.Figure]]:
    """:func:`compared_spectra_figures` of the runs that stored states to measure.

    Example::

        compared_run_spectra_figures(runs, run_labels(runs), run_colors(len(runs)))
    """
    measured = [(_spectra(run), label, color) for run, label, color in zip(runs, labels, colors)]
    measured = [entry for entry in measured if entry[0] is not None]
    if not measured:
        return []
    spectra, kept_labels, kept_colors = zip(*measured)
    return compared_spectra_figures(spectra, kept_labels, kept_colors)


#: The most stored states a page measures (an SVD and a fit per matrix and state each).
MAX_STATES = 50


def _spectra(run: Run) -> WeightSpectra | None:
    try:
        return weight_spectra(run, max_states=MAX_STATES)
    except DynamicsError:
        return None
