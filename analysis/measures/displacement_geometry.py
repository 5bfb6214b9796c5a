"""Two runs' displacements θt − θ0 over time: the angles between them, and how much of each
lies in the plane of the two runs' initial gradients.

The paper's "nearly orthogonal trajectories" (seed 002, §2.3, Fig. 3) as numbers. It can be
read three ways, which need not agree, and each is taken at every step both runs stored θt
(ParameterDisplacement's snapshots, then θT); the runs must share θ0 and the parameter layout:

1. the angle between the whole displacements θt − θ0 of the reference and of the other run;
2. the angle between their in-plane paths, the parts of θt − θ0 inside the plane spanned by the
   two runs' initial gradients (the plane ``dynamics plane`` draws) — in the plane's
   orthonormal coordinates (a, b), and in the oblique coordinates (α, β) of the two unit
   initial gradients, p = α ĝ1 + β ĝ2;
3. the angle between the two initial gradients g0 themselves (one number).

With u = ĝ1 and v the unit part of ĝ2 orthogonal to it, ĝ2 = c u + s v where c = cos∠(g1, g2)
and s = √(1 − c²), so the point a u + b v has β = b / s and α = a − c b / s. The in-plane share
of run x at step t is (a² + b²) / ‖θt − θ0‖²: near 1 when the run moves inside the plane, near
0 when it leaves it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
        plane_remark: why the in-plane readings are missing; empty when they are there.
        path_cosine: the cosine between the two in-plane paths in the plane's orthonormal
            coordinates (a, b) at each of ``steps``; None without the plane.
        oblique_cosine: the same in the unit initial gradients' coordinates (α, β).
        gradient_cosine: the cosine between the two runs' initial gradients.
    """

    steps: np.ndarray
    cosine: np.ndarray
    in_plane: tuple[tuple[np.ndarray, np.ndarray], ...]
    plane_remark: str = ""
    path_cosine: np.ndarray | None = None
    oblique_cosine: np.ndarray | None = None
    gradient_cosine: float | None = None

    @property
    def angle_deg(self) -> np.ndarray:
        """The angle between the displacements at each of ``steps``, in degrees."""
        return np.degrees(np.arccos(np.clip(self.cosine, -1.0, 1.0)))


def displacement_geometry(reference: Run, run: Run) -> DisplacementGeometry | str:
    """The angle between the runs' displacements over time and their in-plane shares.

    Returns:
        The geometry, or one line saying why it cannot be measured (the runs do not share θ0
        or their parameters, or either stored no snapshots or θT).

    Example::

        geometry = displacement_geometry(open_run("runs/a.h5"), open_run("runs/b.h5"))
        geometry.angle_deg[-1] if not isinstance(geometry, str) else geometry
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
    from dynamics.analysis.measures.plane_grid import choose_plane, stored_checkpoints
    from dynamics.geometry.plane import in_plane_shares, project

    (steps_a, thetas_a), (steps_b, thetas_b) = map(stored_checkpoints, (reference, run))
    steps, ia, ib = np.intersect1d(steps_a, steps_b, return_indices=True)
    if not len(steps):
        return "the runs stored θt at no common step"
    da = thetas_a[ia].astype(np.float64) - theta0
    db = thetas_b[ib].astype(np.float64) - theta0
    cosine = _row_cosines(da, db)
    try:
        plane = choose_plane(reference, run, kind="gradients").plane
    except DynamicsError as error:
        return DisplacementGeometry(steps, cosine, (), f"no in-plane share: {error}")
    in_plane = tuple(
        (s, in_plane_shares(*project(plane, thetas)))
        for s, thetas in ((steps_a, thetas_a), (steps_b, thetas_b))
    )
    paths = [
        np.stack(project(plane, thetas)[:2], axis=1) for thetas in (thetas_a[ia], thetas_b[ib])
    ]
    c = float(plane.metadata["cosine"])
    s = np.sqrt(1.0 - c * c)  # > 0: the plane refuses collinear gradients
    to_oblique = np.array([[1.0, -c / s], [0.0, 1.0 / s]])  # (a, b) ↦ (α, β)
    oblique = [path @ to_oblique.T for path in paths]
    return DisplacementGeometry(
        steps,
        cosine,
        in_plane,
        path_cosine=_row_cosines(*paths),
        oblique_cosine=_row_cosines(*oblique),
        gradient_cosine=c,
    )


def _row_cosines(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """cos∠(x_t, y_t) of each row pair; NaN where either row is zero (a run that has not moved)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.einsum("ij,ij->i", x, y) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))
