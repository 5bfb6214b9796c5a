"""The angle between each run's displacement θt − θ0 and the reference's over time, and their
in-plane shares (:mod:`dynamics.analysis.measures.displacement_geometry`)."""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from dynamics.analysis.figures.lines import Curve, line_figure
from dynamics.analysis.measures.displacement_geometry import DisplacementGeometry

__all__ = ["displacement_figures"]


def displacement_figures(
    geometries: Sequence[DisplacementGeometry | str],
    labels: Sequence[str],
    colors: Sequence[str],
) -> list[tuple[str, go.Figure]]:
    """The angle between each run's displacement and the reference's over time, and the
    in-plane shares over time; the figures that have any curve.

    Args:
        geometries: :func:`displacement_geometry` of each run after the reference.
        labels: the runs' labels, the reference's first.
        colors: the runs' colours, the reference's first.

    Example::

        geometries = [displacement_geometry(runs[0], run) for run in runs[1:]]
        displacement_figures(geometries, labels, run_colors(len(runs)))
    """
    angles, shares = [], []
    for geometry, label, color in zip(geometries, labels[1:], colors[1:]):
        if isinstance(geometry, str):
            continue
        angles.append(Curve(f"{label} vs {labels[0]}", geometry.steps, geometry.angle_deg, color))
        plane = f"plane of {labels[0]}'s and {label}'s g0"
        for (steps, share), who, shade in zip(
            geometry.in_plane, (labels[0], label), (colors[0], color)
        ):
            dash = "solid" if who == label else "dot"
            shares.append(Curve(f"{who} ({plane})", steps, share, shade, dash=dash, markers=True))
    figures = []
    if angles:
        figures.append(
            (
                "displacement-angle",
                line_figure(
                    angles,
                    title="Angle between the runs' displacements θt − θ0",
                    y_title="angle (degrees)",
                ),
            )
        )
    if shares:
        figures.append(
            (
                "in-plane-share",
                line_figure(
                    shares,
                    title="In-plane share of ‖θt − θ0‖² on the initial-gradient plane",
                    y_title="(a² + b²) / ‖θt − θ0‖²",
                ),
            )
        )
    return figures
