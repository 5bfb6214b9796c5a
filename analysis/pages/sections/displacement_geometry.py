"""The displacement geometry's cells in the comparison's summary, and the note under it."""

from __future__ import annotations

import html

from dynamics.analysis.measures.displacement_geometry import DisplacementGeometry

__all__ = ["DISPLACEMENT_NOTE", "displacement_cells"]


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


DISPLACEMENT_NOTE = html.escape(
    "Displacement angle: between θt − θ0 of the run and of the reference at the last step both "
    "stored θt (90° = orthogonal). In-plane share: (a² + b²)/‖θT − θ0‖² on the plane of the two "
    "runs' initial gradients."
)
