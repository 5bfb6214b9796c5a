"""Two runs' displacements θt − θ0 over time: the angle between them, and how much of each
lies in the plane of the two runs' initial gradients.

The paper's "nearly orthogonal trajectories" as a number: at every step both runs stored θt
(ParameterDisplacement's snapshots, then θT), the angle between θt − θ0 of the reference and
of the other run, which must share θ0 and the parameter layout. The in-plane share of run x at
step t is (a² + b²) / ‖θt − θ0‖², with a, b its coordinates on the plane spanned by the two
runs' initial gradients (the plane ``dynamics plane`` draws): near 1 when the run moves inside
that plane, near 0 when it leaves it.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go

from dynamics.analysis.figures import Curve, line_figure
from dynamics.errors import DynamicsError
from dynamics.store import Run, names


@dataclass(frozen=True)
class DisplacementGeometry:
    """The geometry of one run's displacement against the reference's.

    Attributes:
        steps: the steps at which both runs stored θt.
        cosine: the cosine between the two displacements θt − θ0 at each of ``steps`` (NaN
            where either run has not moved).
        in_plane: ``(steps, share)`` of the reference (first) and the other run, on the plane
            of their initial gradients; empty when the plane cannot be built.
        plane_remark: why the in-plane shares are missing; empty when they are there.
    """

    steps: np.ndarray
    cosine: np.ndarray
    in_plane: tuple[tuple[np.ndarray, np.ndarray], ...]
    plane_remark: str = ""

    @property
    def angle_deg(self) -> np.ndarray:
        """The angle between the displacements at each of ``steps``, in degrees."""
        return np.degrees(np.arccos(np.clip(self.cosine, -1.0, 1.0)))


def displacement_geometry(reference: Run, run: Run) -> DisplacementGeometry | str:
    """The angle between the runs' displacements over time and their in-plane shares.

    Returns:
        The geometry, or one line saying why it cannot be measured (the runs do not share θ0
        or their parameters, or either stored no snapshots or θT).
    """
    if not reference.shares_theta0(run):
        return "the runs do not share θ0"
    # The stored layouts as text: equal text, one parameter vector space.
    if reference.attrs.get(names.ATTR_LAYOUT) != run.attrs.get(names.ATTR_LAYOUT):
        return "the runs' parameter layouts differ"
    theta0 = reference.vector(names.THETA0)
    if theta0 is None or not np.isfinite(theta0).all():
        return f"{reference.path.name}: θ0 not stored or not finite"
    for each in (reference, run):
        if each.recorded(names.SNAPSHOTS) is None or each.vector(names.THETA_FINAL) is None:
            return f"{each.path.name}: no parameter snapshots or θT (ParameterDisplacement)"
    # Imported only now: they import torch, which a compare of runs without snapshots, like
    # every offline view, never loads.
    from dynamics.analysis.plane_views import choose_plane, stored_checkpoints
    from dynamics.geometry.plane import in_plane_shares, project

    (steps_a, thetas_a), (steps_b, thetas_b) = map(stored_checkpoints, (reference, run))
    steps, ia, ib = np.intersect1d(steps_a, steps_b, return_indices=True)
    if not len(steps):
        return "the runs stored θt at no common step"
    da = thetas_a[ia].astype(np.float64) - theta0
    db = thetas_b[ib].astype(np.float64) - theta0
    with np.errstate(invalid="ignore", divide="ignore"):
        cosine = np.einsum("ij,ij->i", da, db) / (
            np.linalg.norm(da, axis=1) * np.linalg.norm(db, axis=1)
        )
    try:
        plane = choose_plane(reference, run, kind="gradients").plane
    except DynamicsError as error:
        return DisplacementGeometry(steps, cosine, (), f"no in-plane share: {error}")
    in_plane = tuple(
        (s, in_plane_shares(*project(plane, thetas)))
        for s, thetas in ((steps_a, thetas_a), (steps_b, thetas_b))
    )
    return DisplacementGeometry(steps, cosine, in_plane)


def displacement_cells(geometry: DisplacementGeometry | str) -> tuple[str, str, str]:
    """The comparison table's cells: the final angle, and the run's and the reference's final
    in-plane shares (or why they are missing)."""
    if isinstance(geometry, str):
        return (geometry, "", "")
    angle = f"{geometry.angle_deg[-1]:.1f}° (step {geometry.steps[-1]})"
    if not geometry.in_plane:
        return (angle, geometry.plane_remark, "")
    (_, reference), (_, run) = geometry.in_plane
    return (angle, f"{run[-1]:.3g}", f"{reference[-1]:.3g}")


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


DISPLACEMENT_NOTE = html.escape(
    "Displacement angle: between θt − θ0 of the run and of the reference at the last step both "
    "stored θt (90° = orthogonal). In-plane share: (a² + b²)/‖θT − θ0‖² on the plane of the two "
    "runs' initial gradients."
)
