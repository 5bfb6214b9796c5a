"""The one table of the series groups that have a dedicated view: what draws them besides, or
instead of, the views their series were recorded with.

A group absent from :data:`DEDICATED_VIEWS` is drawn from its views alone (that of a user's
probe included). A dedicated view may draw some of the group's series itself (they are then not
drawn from their views), mark one run's figure of the group (the overshoot peaks on the
hidden-state norms, and the window of fastest loss descent they are judged against), and add
figures after the group's: of one run (the report) or of runs compared with the first (the
comparison). Pages and the views of runs look a group up here (:func:`dedicated_view`), never
by its name; a new dedicated view is one entry.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import plotly.graph_objects as go

from dynamics.analysis.figures.decoded_images import decoded_images_figure
from dynamics.analysis.figures.eigenspace_overlap import eigenspace_overlap_figure
from dynamics.analysis.figures.plane import plane_path, plane_share
from dynamics.analysis.figures.series import density_figure
from dynamics.analysis.figures.weight_spectra import (
    compared_run_spectra_figures,
    run_spectra_figures,
)
from dynamics.analysis.measures.decoded_images import decoded_images
from dynamics.analysis.measures.run_series import (
    Peak,
    SeriesView,
    density_rows,
    loss_window,
    overshoot_peaks,
    run_overshoot,
    series_views,
)
from dynamics.analysis.output import slug
from dynamics.store import Run, names

__all__ = [
    "DEDICATED_VIEWS",
    "DedicatedView",
    "Marks",
    "Named",
    "dedicated_view",
    "descent_window",
    "drawn_series",
    "run_marks",
]

#: A figure with the key its static export is named by, e.g. ``("spectral-density", figure)``.
Named = tuple[str, go.Figure]


@dataclass(frozen=True)
class Marks:
    """What one run's figure of a group is marked with.

    Attributes:
        peaks: ``{series: peaks}`` starred on the series.
        window: ``(start, end)`` step shaded: the window of fastest loss descent.
    """

    peaks: Mapping[str, Sequence[Peak]] = field(default_factory=dict)
    window: tuple[float, float] | None = None


def _no_series(run: Run) -> Collection[str]:
    return ()


def _no_marks(run: Run) -> Marks:
    return Marks()


def _no_figures(run: Run) -> list[Named]:
    return []


def _no_compared(runs: Sequence[Run], labels: Sequence[str], colors: Sequence[str]) -> list[Named]:
    return []


@dataclass(frozen=True)
class DedicatedView:
    """How one group is drawn besides its recorded views (every part optional).

    Attributes:
        own_series: the group's series of a run it draws itself, not from their views.
        marks: what one run's figure of the group is marked with.
        run_figures: its figures of one run, after the group's own figure.
        compared_figures: its figures of runs ``(runs, labels, colours)`` compared with the
            first, after the group's own figure.
    """

    own_series: Callable[[Run], Collection[str]] = _no_series
    marks: Callable[[Run], Marks] = _no_marks
    run_figures: Callable[[Run], list[Named]] = _no_figures
    compared_figures: Callable[[Sequence[Run], Sequence[str], Sequence[str]], list[Named]] = (
        _no_compared
    )


def dedicated_view(group: str) -> DedicatedView:
    """The dedicated view of ``group``; one that adds nothing for a group without one.

    Example::

        dedicated_view("hidden_norms").marks(run).window  # (start, end) of fastest descent
    """
    return DEDICATED_VIEWS.get(group, _GENERIC)


def run_marks(run: Run) -> dict[str, Marks]:
    """``{group: marks}`` of one run's figures, for each recorded group with a dedicated view
    (computed once: judging overshoot takes seconds on a long run).

    Example::

        marks = run_marks(open_run("runs/demo/shifted.h5"))
        marks["hidden_norms"].peaks  # {'norm': [Peak('block1', 120, 3.2)]}
    """
    return {g: view.marks(run) for g, view in DEDICATED_VIEWS.items() if g in run.groups}


def descent_window(marks: Mapping[str, Marks]) -> tuple[float, float] | None:
    """The window of fastest loss descent among one run's marks (the one the hidden-state
    norms' overshoot verdicts are judged against), which its loss figure shades too."""
    return next((m.window for m in marks.values() if m.window is not None), None)


def drawn_series(run: Run, group: str, marks: Marks | None = None) -> list[SeriesView]:
    """The series of ``group`` drawn from their views (those its dedicated view does not draw
    itself), with ``marks``' peaks on them.

    Example::

        view_figure(drawn_series(run, "hessian"), title="Hessian")
    """
    skip = dedicated_view(group).own_series(run)
    return series_views(run, group, None if marks is None else marks.peaks, skip=skip)


def _overshoot_marks(run: Run) -> Marks:
    """The peaks of the layers judged to overshoot, and the loss window they were judged in."""
    report = run_overshoot(run)
    return Marks(overshoot_peaks(report), loss_window(report))


def _heldout_series(run: Run) -> Collection[str]:
    heldout = run.heldout_loss()
    return () if heldout is None else (heldout.name,)


def _plane_series(run: Run) -> Collection[str]:
    return tuple(run.views(names.PLANE))


def _plane_figures(run: Run) -> list[Named]:
    """The path on the plane of initial gradients, the share of the displacement inside it,
    and the views the run evaluated at the end of its fit."""
    # The GradientPlane probe records the coordinates (a, b) of θt − θ0 on the plane of initial
    # gradients and the norm r of its part orthogonal to the plane.
    plane = run.recorded(names.PLANE)
    if plane is None or names.PLANE_A not in plane.values or names.PLANE_B not in plane.values:
        return []
    figures = [("plane-path", plane_path(run))]
    if names.PLANE_R in plane.values:
        figures.append(("plane-share", plane_share(run)))
    if names.PLANE_END_STEPS in run.vector_names:  # GradientPlane(at_end=True); needs torch
        from dynamics.analysis.figures.plane import heatmap_figure
        from dynamics.analysis.measures.plane_grid import recorded_views

        views = recorded_views(run)
        figures += [("plane-heatmaps", heatmap_figure(views))] if views else []
    return figures


def _decoded_images_figures(run: Run) -> list[Named]:
    """One run's decoded examples, a panel per layer."""
    images = decoded_images(run)
    if images is None:
        return []
    panels = {layer: (images, layer) for layer in images.layers}
    title = "Decoded examples: full, bias-only and remainder-only, per layer"
    return [("decoded-images", decoded_images_figure(panels, title=title))]


def _compared_decoded_images(
    runs: Sequence[Run], labels: Sequence[str], colors: Sequence[str]
) -> list[Named]:
    """Per layer, the runs' decoded examples side by side."""
    stored = [(label, decoded_images(run)) for run, label in zip(runs, labels)]
    stored = [(label, images) for label, images in stored if images is not None]
    layers = dict.fromkeys(layer for _, images in stored for layer in images.layers)
    return [
        (
            f"decoded-images-{slug(layer)}",
            decoded_images_figure(
                {label: (images, layer) for label, images in stored if layer in images.layers},
                title=f"Decoded examples at {layer}: full, bias-only and remainder-only",
            ),
        )
        for layer in layers
    ]


def _density_figures(run: Run) -> list[Named]:
    density = density_rows(run)
    return [] if density is None else [("spectral-density", density_figure({"": density}))]


def _compared_hessian(
    runs: Sequence[Run], labels: Sequence[str], colors: Sequence[str]
) -> list[Named]:
    """The runs' spectral densities side by side, and their eigenspaces' overlap with the
    reference's."""
    figures = []
    densities = {label: density_rows(run) for run, label in zip(runs, labels)}
    densities = {label: rows for label, rows in densities.items() if rows is not None}
    if densities:
        figures.append(("spectral-density", density_figure(densities)))
    overlap = eigenspace_overlap_figure(runs, labels, colors)
    if overlap is not None:
        figures.append(("eigenspace-overlap", overlap))
    return figures


_GENERIC = DedicatedView()

#: ``{group: its dedicated view}``: every group drawn otherwise than from its views alone.
DEDICATED_VIEWS: Mapping[str, DedicatedView] = {
    # The loss figure draws the training and held-out loss (with the crossover in a comparison).
    names.LOSS: DedicatedView(own_series=lambda run: (names.LOSS_TRAIN,)),
    names.VALIDATION: DedicatedView(own_series=_heldout_series),
    # The overshoot verdicts of every layer's norm, starred where a layer overshoots.
    names.HIDDEN_NORMS: DedicatedView(marks=_overshoot_marks),
    names.PLANE: DedicatedView(own_series=_plane_series, run_figures=_plane_figures),
    names.BIAS_COMPONENT: DedicatedView(
        run_figures=_decoded_images_figures, compared_figures=_compared_decoded_images
    ),
    names.HESSIAN: DedicatedView(run_figures=_density_figures, compared_figures=_compared_hessian),
    # The weight matrices' spectra at each stored state (θ0, the snapshots, θT), offline.
    names.SNAPSHOTS: DedicatedView(
        run_figures=run_spectra_figures, compared_figures=compared_run_spectra_figures
    ),
}
