"""Planes through parameter space and the coordinates of parameter vectors on them.

A :class:`Plane` is an origin θ0 and an orthonormal pair (u, v) of flat parameter vectors (in a
run's :class:`~dynamics.params.layout.ParameterLayout` order). The paper's Fig. 3 (seed 002, §2.3)
uses the plane of two students' initial gradients and, for the out-of-plane view, the plane of
a student's in-plane direction and the normalized part of its displacement orthogonal to the
first plane. Runs whose initial gradients coincide (one model at two learning rates) get the
plane of the initial gradient and the direction between their endpoints instead. Random
filter-normalized planes (Li et al. 2018) and PCA planes of snapshots are built the same way,
so the views can be compared.

All arithmetic is float64 whatever the dtype of the vectors given, and nothing given is mutated.
Bad vectors raise :class:`~dynamics.errors.DynamicsError` (a ``ValueError``) with one line.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from numpy.typing import ArrayLike

from dynamics.errors import DynamicsError
from dynamics.params.layout import ParameterLayout
from dynamics.store import Run, names

#: Largest deviation of a plane's Gram matrix from the identity that still counts as orthonormal.
ORTHONORMAL_TOLERANCE = 1e-6
#: Below this sine of the angle between two directions they are treated as one direction.
COLLINEAR_TOLERANCE = 1e-6
#: Below this fraction of a displacement's norm a component counts as absent.
NEGLIGIBLE_FRACTION = 1e-12


class CollinearGradients(DynamicsError):
    """Two initial gradients point along one direction, so they span no plane."""


@dataclass(frozen=True, eq=False)
class Plane:
    """The affine plane θ0 + a·u + b·v of parameter space.

    Example::

        plane = plane_from_gradients(theta0, g_a, g_b)
        plane.point(0.5, -0.2)  # θ0 + 0.5·u − 0.2·v

    Attributes:
        origin: θ0, a flat float64 parameter vector.
        u: first unit basis vector (the heatmap's horizontal axis, coordinate ``a``).
        v: second unit basis vector, orthogonal to ``u`` (vertical axis, coordinate ``b``).
        kind: how the plane was built: ``"gradients"``, ``"gradient-endpoints"``,
            ``"random-filter-normalized"``, ``"pca"``, ``"out-of-plane"``, or anything a caller
            chooses.
        metadata: JSON-compatible facts about the construction (see each constructor).

    The vectors are stored as read-only float64 copies; construction raises ``DynamicsError`` if
    their sizes differ, an entry is not finite, or (u, v) is not orthonormal to
    :data:`ORTHONORMAL_TOLERANCE`.
    """

    origin: np.ndarray
    u: np.ndarray
    v: np.ndarray
    kind: str
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        vectors = {name: _as_vector(getattr(self, name), name) for name in ("origin", "u", "v")}
        _check_sizes(**vectors)
        u, v = vectors["u"], vectors["v"]
        gram = np.array([[u @ u, u @ v], [u @ v, v @ v]])
        deviation = float(np.max(np.abs(gram - np.eye(2))))
        if deviation > ORTHONORMAL_TOLERANCE:
            raise DynamicsError(
                f"plane basis is not orthonormal: its Gram matrix is {deviation:.3g} from identity"
            )
        for name, vector in vectors.items():
            vector.setflags(write=False)
            object.__setattr__(self, name, vector)
        object.__setattr__(self, "metadata", MappingProxyType(dict(self.metadata)))

    @property
    def size(self) -> int:
        """Length of the flat parameter vectors."""
        return self.origin.size

    def point(self, a: float, b: float) -> np.ndarray:
        """The parameter vector θ0 + a·u + b·v (float64)."""
        return self.origin + a * self.u + b * self.v


@dataclass(frozen=True, eq=False)
class Grid:
    """Plane coordinates at which a heatmap is evaluated.

    A heatmap over a grid is an array of shape :attr:`shape` = ``(len(betas), len(alphas))``:
    rows (axis 0) follow ``betas``, the coordinate along ``v``; columns (axis 1) follow
    ``alphas``, the coordinate along ``u``. ``heatmap[i, j]`` is the loss at
    θ0 + alphas[j]·u + betas[i]·v, the orientation image and plotly heatmaps draw with
    ``u`` horizontal.

    Example::

        grid = Grid(np.linspace(-1, 1, 41), np.linspace(-1, 1, 41))
        grid.shape  # (41, 41): rows are betas, columns alphas

    Attributes:
        alphas: strictly increasing coordinates along ``u``, at least 2.
        betas: strictly increasing coordinates along ``v``, at least 2.
    """

    alphas: np.ndarray
    betas: np.ndarray

    def __post_init__(self) -> None:
        for name in ("alphas", "betas"):
            axis = np.array(getattr(self, name), dtype=np.float64)
            if axis.ndim != 1 or axis.size < 2:
                raise DynamicsError(
                    f"grid needs at least 2 {name} in a flat sequence, got shape {axis.shape}"
                )
            if not np.all(np.isfinite(axis)) or not np.all(np.diff(axis) > 0):
                raise DynamicsError(f"grid {name} must be finite and strictly increasing")
            axis.setflags(write=False)
            object.__setattr__(self, name, axis)

    @property
    def shape(self) -> tuple[int, int]:
        """``(len(betas), len(alphas))``: the shape of a heatmap over this grid."""
        return (self.betas.size, self.alphas.size)

    @property
    def size(self) -> int:
        """Number of grid points."""
        return self.betas.size * self.alphas.size


def plane_from_gradients(theta0: ArrayLike, g_a: ArrayLike, g_b: ArrayLike) -> Plane:
    """The plane through θ0 spanned by two initial gradients (the paper's Fig. 3 plane).

    u = g_a/‖g_a‖ and v is g_b Gram–Schmidt-orthogonalized against u, then normalized.

    Example::

        plane = plane_from_gradients(run_a.vector("theta0"), run_a.vector("g0"), run_b.vector("g0"))

    Args:
        theta0: the shared initial parameters.
        g_a: run A's initial gradient.
        g_b: run B's initial gradient.

    Returns:
        A plane of kind ``"gradients"``; metadata ``norm_a``, ``norm_b`` (gradient norms) and
        ``cosine`` (cosine of the angle between the gradients).

    Raises:
        DynamicsError: if the sizes differ, or a gradient is zero or not finite.
        CollinearGradients: if the gradients are collinear (sine of their angle below
            :data:`COLLINEAR_TOLERANCE`).
    """
    theta0 = _as_vector(theta0, "theta0")
    g_a, g_b = _as_vector(g_a, "g_a"), _as_vector(g_b, "g_b")
    _check_sizes(theta0=theta0, g_a=g_a, g_b=g_b)
    norm_a, norm_b = float(np.linalg.norm(g_a)), float(np.linalg.norm(g_b))
    for name, norm in (("g_a", norm_a), ("g_b", norm_b)):
        if norm == 0.0:
            raise DynamicsError(f"{name} is zero: a zero gradient spans no direction")
    u = g_a / norm_a
    v, sine = _orthonormalized(g_b, [u])
    cosine = float(g_a @ g_b) / (norm_a * norm_b)
    if sine < COLLINEAR_TOLERANCE:
        raise CollinearGradients(
            f"g_a and g_b are collinear (cosine {cosine:+.9f}): they span no plane"
        )
    return Plane(theta0, u, v, "gradients", {"norm_a": norm_a, "norm_b": norm_b, "cosine": cosine})


def plane_from_gradient_and_endpoints(
    theta0: ArrayLike, g: ArrayLike, theta_a: ArrayLike, theta_b: ArrayLike
) -> Plane:
    """The plane through θ0 of an initial gradient and the direction between two endpoints.

    For two runs whose initial gradients coincide: u = g/‖g‖ and v is θT_b − θT_a
    Gram–Schmidt-orthogonalized against u, then normalized, so the plane still separates where
    the two runs went.

    Example::

        plane = plane_from_gradient_and_endpoints(theta0, g_a, theta_final_a, theta_final_b)

    Args:
        theta0: the shared initial parameters.
        g: the initial gradient (of either run).
        theta_a: run A's final parameters.
        theta_b: run B's final parameters.

    Returns:
        A plane of kind ``"gradient-endpoints"``; metadata ``norm_g``, ``endpoint_distance``
        (‖θT_b − θT_a‖) and ``orthogonal_fraction`` (the share of that distance orthogonal to g).

    Raises:
        DynamicsError: if the sizes differ, an entry is not finite, g is zero, the endpoints
            coincide, or their difference lies along g.
    """
    theta0, g = _as_vector(theta0, "theta0"), _as_vector(g, "g")
    theta_a, theta_b = _as_vector(theta_a, "theta_a"), _as_vector(theta_b, "theta_b")
    _check_sizes(theta0=theta0, g=g, theta_a=theta_a, theta_b=theta_b)
    norm_g = float(np.linalg.norm(g))
    if norm_g == 0.0:
        raise DynamicsError("g is zero: a zero gradient spans no direction")
    between = theta_b - theta_a
    distance = float(np.linalg.norm(between))
    if distance == 0.0:
        raise DynamicsError("the two endpoints coincide: they give no direction")
    u = g / norm_g
    v, fraction = _orthonormalized(between, [u])
    if fraction < COLLINEAR_TOLERANCE:
        raise DynamicsError("the endpoints differ only along the gradient: they span no plane")
    metadata = {"norm_g": norm_g, "endpoint_distance": distance, "orthogonal_fraction": fraction}
    return Plane(theta0, u, v, "gradient-endpoints", metadata)


def random_filter_normalized_plane(theta0: ArrayLike, layout: ParameterLayout, seed: int) -> Plane:
    """A random plane through θ0 with filter-wise normalized directions (Li et al. 2018).

    Two Gaussian directions d1, d2 are drawn (numpy ``default_rng(seed)``, float64). In each
    parameter of two or more dimensions, every filter (row along the first axis: an output
    neuron of a linear layer, an output channel of a convolution) is rescaled to the norm of
    the same filter of θ0, so a filter of θ0 that is zero gets a zero direction. Parameters of
    at most one dimension (biases, norm gains) are set to zero, as Li et al. do with
    ``ignore="biasbn"``: scale-only parameters would otherwise dominate the picture.

    The returned basis is orthonormal, so ``u = d1/‖d1‖`` and ``v`` is d2 Gram–Schmidt-ed
    against u; the plane is the one d1 and d2 span. Metadata ``direction_coordinates`` holds
    the (a, b) coordinates of d1 and d2, so Li et al.'s coordinates (α, β), meaning
    θ0 + α·d1 + β·d2, are ``(a, b) = α·coords[0] + β·coords[1]``.

    Example::

        plane = random_filter_normalized_plane(theta0, ParameterLayout.of(model), seed=0)

    Args:
        theta0: the parameters the plane passes through and whose filter norms scale it.
        layout: the layout of ``theta0``.
        seed: seed of the random directions.

    Raises:
        DynamicsError: if ``theta0`` does not match ``layout``, or every filter of θ0 is zero.
    """
    theta0 = _as_vector(theta0, "theta0")
    if theta0.size != layout.size:
        raise DynamicsError(f"theta0 has {theta0.size} entries, layout has {layout.size}")
    rng = np.random.default_rng(seed)
    d1 = _filter_normalized(rng.standard_normal(layout.size), theta0, layout)
    d2 = _filter_normalized(rng.standard_normal(layout.size), theta0, layout)
    norm_d1 = float(np.linalg.norm(d1))
    if norm_d1 == 0.0:
        raise DynamicsError(
            "theta0 has no nonzero filter of two or more dimensions to normalize by"
        )
    u = d1 / norm_d1
    v, sine = _orthonormalized(d2, [u])
    if sine < COLLINEAR_TOLERANCE:
        raise DynamicsError(
            "the filter-normalized directions are collinear: theta0 has too few weights"
        )
    coordinates = [[norm_d1, 0.0], [float(d2 @ u), float(d2 @ v)]]
    return Plane(
        theta0,
        u,
        v,
        "random-filter-normalized",
        {"seed": seed, "direction_coordinates": coordinates},
    )


def pca_plane(theta0: ArrayLike, snapshots: ArrayLike) -> Plane:
    """The plane through θ0 of the two principal directions of a run's snapshots.

    scikit-learn's PCA is fitted to the displacements θt − θ0 (it centers them, as in Li et
    al. 2018's trajectory plots). Signs are chosen so that the last snapshot has a ≥ 0 and
    b ≥ 0.

    Example::

        plane = pca_plane(run.vector("theta0"), np.stack([s.theta for s in run.stored_states()]))

    Args:
        theta0: the run's initial parameters.
        snapshots: array of shape ``(T, n)``, one parameter vector per row, T ≥ 3.

    Returns:
        A plane of kind ``"pca"``; metadata ``explained_variance_ratio`` (the two components'
        shares of the displacements' variance) and ``num_snapshots``.

    Raises:
        DynamicsError: on a size mismatch, fewer than 3 snapshots, non-finite entries, or
            snapshots that move along fewer than two directions.
    """
    theta0 = _as_vector(theta0, "theta0")
    displacements = _as_matrix(snapshots, "snapshots") - theta0
    if displacements.shape[1] != theta0.size:
        raise DynamicsError(
            f"snapshots have {displacements.shape[1]} entries per row, theta0 has {theta0.size}"
        )
    if displacements.shape[0] < 3:
        raise DynamicsError(f"a PCA plane needs at least 3 snapshots, got {displacements.shape[0]}")
    from sklearn.decomposition import PCA  # ~0.35 s to import; only this plane needs it

    pca = PCA(n_components=2, svd_solver="full").fit(displacements)
    variance = pca.explained_variance_
    if not variance[1] > NEGLIGIBLE_FRACTION * variance[0]:
        raise DynamicsError("snapshots move along fewer than two directions: they span no plane")
    u, _ = _orthonormalized(pca.components_[0], [])
    v, _ = _orthonormalized(pca.components_[1], [u])
    final = displacements[-1]
    u = -u if final @ u < 0 else u
    v = -v if final @ v < 0 else v
    ratio = [float(r) for r in pca.explained_variance_ratio_]
    return Plane(
        theta0,
        u,
        v,
        "pca",
        {"explained_variance_ratio": ratio, "num_snapshots": displacements.shape[0]},
    )


def project(plane: Plane, thetas: ArrayLike) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Coordinates of parameter vectors on a plane, and their distance from it.

    For each θ, with d = θ − θ0: a = d·u, b = d·v and r = ‖d − a·u − b·v‖, all accumulated
    in float64, so a² + b² + r² = ‖d‖² to rounding. Rows are converted one at a time, so an
    h5py dataset of snapshots is read row by row instead of whole.

    Example::

        a, b, r = project(plane, snapshots)  # one row per θt
        in_plane_shares(a, b, r)

    Args:
        plane: the plane.
        thetas: one flat parameter vector, or a sequence of them (array of shape ``(T, n)``,
            tensor, or h5py dataset).

    Returns:
        ``(a, b, r)``, float64 arrays of shape ``thetas.shape[:-1]``.

    Raises:
        DynamicsError: if a vector's size differs from the plane's or an entry is not finite.
    """
    if isinstance(thetas, torch.Tensor):
        thetas = thetas.detach().cpu().numpy()
    if np.ndim(thetas) == 1:
        a, b, r = project(plane, [thetas])
        return a.reshape(()), b.reshape(()), r.reshape(())
    coords = np.empty((len(thetas), 3))
    for t in range(len(thetas)):
        d = _as_vector(thetas[t], f"thetas[{t}]")
        _check_sizes(plane=plane.origin, **{f"thetas[{t}]": d})
        d -= plane.origin
        a, b = d @ plane.u, d @ plane.v
        coords[t] = a, b, np.linalg.norm(d - a * plane.u - b * plane.v)
    return coords[:, 0], coords[:, 1], coords[:, 2]


def in_plane_shares(a: ArrayLike, b: ArrayLike, r: ArrayLike) -> np.ndarray:
    """The share (a² + b²)/(a² + b² + r²) of each displacement inside the plane, from the
    coordinates :func:`project` gives; NaN where θ = θ0.

    Example::

        shares = in_plane_shares(*project(plane, snapshots))  # (a² + b²) / ‖θt − θ0‖² per θt
    """
    a, b, r = (np.asarray(x, dtype=np.float64) for x in (a, b, r))
    inside = a * a + b * b
    with np.errstate(invalid="ignore", divide="ignore"):
        return inside / (inside + r * r)


def out_of_plane_view(plane: Plane, theta_final: ArrayLike) -> tuple[Plane, float]:
    """The paper's second view: the plane of a run's in-plane and out-of-plane motion.

    With d = θT − θ0, p̂ is the normalized projection of d onto ``plane`` and w the
    normalized component of d orthogonal to it (Gram–Schmidt against u and v). The new plane
    (p̂, w) through the same θ0 contains θT exactly.

    Example::

        view, share = out_of_plane_view(plane, theta_final)  # share of ‖θT − θ0‖² in plane

    Args:
        plane: the initial plane (usually the initial-gradient plane).
        theta_final: the run's final parameters θT.

    Returns:
        ``(view, share)``: the plane of kind ``"out-of-plane"`` (metadata ``in_plane_share``,
        ``in_plane_direction`` — the (a, b) coordinates of p̂ on ``plane`` — and
        ``parent_kind``), and the share of ‖θT − θ0‖² inside ``plane``.

    Raises:
        DynamicsError: on a size mismatch, or when the displacement is zero, lies inside the
            plane, or is orthogonal to it (then p̂ or w is undefined).
    """
    d = _as_vector(theta_final, "theta_final")
    _check_sizes(plane=plane.origin, theta_final=d)
    d -= plane.origin
    total = float(d @ d)
    if total == 0.0:
        raise DynamicsError("theta_final equals the plane's origin: there is no displacement")
    a, b = float(d @ plane.u), float(d @ plane.v)
    in_plane_norm = float(np.hypot(a, b))
    w, out_fraction = _orthonormalized(d, [plane.u, plane.v])
    if out_fraction < NEGLIGIBLE_FRACTION:
        raise DynamicsError("the displacement lies inside the plane: it has no out-of-plane part")
    if in_plane_norm < NEGLIGIBLE_FRACTION * np.sqrt(total):
        raise DynamicsError("the displacement is orthogonal to the plane: it has no in-plane part")
    p_hat = (a * plane.u + b * plane.v) / in_plane_norm
    share = (a * a + b * b) / total
    metadata = {
        "in_plane_share": share,
        "in_plane_direction": [a / in_plane_norm, b / in_plane_norm],
        "parent_kind": plane.kind,
    }
    return Plane(plane.origin, p_hat, w, "out-of-plane", metadata), share


def covering_grid(
    trajectories: Iterable[tuple[ArrayLike, ArrayLike]],
    *,
    num_alphas: int = 41,
    num_betas: int = 41,
    margin: float = 0.25,
) -> Grid:
    """An evenly spaced grid that covers trajectories and the origin, with a margin.

    Each axis spans the range of the coordinates on it (including the origin, 0) widened by
    ``margin`` times that range on both sides. An axis along which nothing moves gets the
    other axis's range, centered on its value.

    Example::

        grid = covering_grid([(a, b), (a2, b2)], num_alphas=41, num_betas=41)

    Args:
        trajectories: ``(a, b)`` coordinate arrays, e.g. the first two outputs of
            :func:`project` for each run.
        num_alphas: number of grid columns, along u (coordinate ``a``).
        num_betas: number of grid rows, along v (coordinate ``b``).
        margin: extra fraction of each axis's range added on both sides, ≥ 0.

    Raises:
        DynamicsError: if an axis gets fewer than 2 points, ``margin`` is negative, a coordinate
            is not finite, or nothing moves at all.
    """
    if not margin >= 0:
        raise DynamicsError(f"margin must be >= 0, got {margin}")
    pairs = [(np.ravel(a), np.ravel(b)) for a, b in trajectories]
    a = np.concatenate([[0.0], *(a for a, _ in pairs)]).astype(np.float64)
    b = np.concatenate([[0.0], *(b for _, b in pairs)]).astype(np.float64)
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise DynamicsError("trajectory coordinates must be finite")
    ranges = [(axis.min(), axis.max()) for axis in (a, b)]
    extent = max(hi - lo for lo, hi in ranges)
    if extent == 0.0:
        raise DynamicsError("the trajectories never leave the origin: nothing to cover")
    axes = []
    for (lo, hi), num in zip(ranges, (num_alphas, num_betas)):
        if hi == lo:
            lo, hi = lo - extent / 2, hi + extent / 2
        pad = margin * (hi - lo)
        axes.append(np.linspace(lo - pad, hi + pad, num))
    return Grid(*axes)


def near_paths(
    grid: Grid, paths: Iterable[tuple[ArrayLike, ArrayLike]], radius: float
) -> np.ndarray:
    """Which grid points lie within ``radius`` grid steps of a path: where to refine a grid.

    Each path is the polyline through its ``(a, b)`` points; distances are measured in units of
    each axis's mean grid step, so ``radius=1`` is about one cell.

    Returns:
        A boolean array of shape ``grid.shape``.
    """
    steps = np.array([np.diff(grid.alphas).mean(), np.diff(grid.betas).mean()])
    mesh = np.stack(np.meshgrid(grid.alphas, grid.betas), -1).reshape(-1, 2) / steps
    near = np.zeros(len(mesh), dtype=bool)
    for a, b in paths:
        points = np.stack([np.ravel(a), np.ravel(b)], 1).astype(np.float64) / steps
        for start, end in zip(points, points[1:] if len(points) > 1 else points):
            direction = end - start
            length = float(direction @ direction)
            t = np.clip((mesh - start) @ direction / length, 0, 1) if length > 0 else 0.0
            closest = start + np.multiply.outer(t, direction) if length > 0 else start
            near |= np.linalg.norm(mesh - closest, axis=1) <= radius
    return near.reshape(grid.shape)


def _filter_normalized(
    direction: np.ndarray, theta0: np.ndarray, layout: ParameterLayout
) -> np.ndarray:
    start = 0
    for numel, shape in zip(layout.numels, layout.shapes):
        block = direction[start : start + numel]
        if len(shape) <= 1 or numel == 0:
            block[:] = 0.0
        else:
            filters = block.reshape(shape[0], -1)
            reference = theta0[start : start + numel].reshape(shape[0], -1)
            filters *= (np.linalg.norm(reference, axis=1) / np.linalg.norm(filters, axis=1))[
                :, None
            ]
        start += numel
    return direction


def _orthonormalized(x: np.ndarray, basis: list[np.ndarray]) -> tuple[np.ndarray, float]:
    """``x`` made orthogonal to the orthonormal ``basis`` and normalized, and the fraction
    ‖x⊥‖/‖x‖ that was left (0.0 for a zero or fully spanned ``x``, whose result is zeros)."""
    y = np.array(x, dtype=np.float64)
    # Two Gram–Schmidt passes: one leaves O(eps·‖x‖/‖x⊥‖) of the basis in y, two leave O(eps).
    for _ in range(2):
        for e in basis:
            y -= (y @ e) * e
    norm_x, norm_y = float(np.linalg.norm(x)), float(np.linalg.norm(y))
    if norm_y == 0.0:
        return y, 0.0
    return y / norm_y, norm_y / norm_x


def _as_vector(x: ArrayLike, name: str) -> np.ndarray:
    array = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x
    array = np.array(array, dtype=np.float64)
    if array.ndim != 1:
        raise DynamicsError(f"{name} must be a flat parameter vector, got shape {array.shape}")
    if not np.all(np.isfinite(array)):
        raise DynamicsError(f"{name} has non-finite entries")
    return array


def _as_matrix(x: ArrayLike, name: str) -> np.ndarray:
    array = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x
    array = np.array(array, dtype=np.float64)
    if array.ndim != 2:
        raise DynamicsError(
            f"{name} must have one parameter vector per row, got shape {array.shape}"
        )
    if not np.all(np.isfinite(array)):
        raise DynamicsError(f"{name} has non-finite entries")
    return array


def _check_sizes(**vectors: np.ndarray) -> None:
    sizes = {name: vector.size for name, vector in vectors.items()}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{name} {size}" for name, size in sizes.items())
        raise DynamicsError(f"vector sizes differ ({listed}): not the same parameter layout")


def missing_plane_data(run: Run, what: str) -> DynamicsError:
    """The error for a run that stores no ``what`` (g0, the probe batch) of ``GradientPlane``:
    why the probe stepped aside when it recorded that (e.g. a manually optimized module
    without ``dynamics_loss``), else that it was not attached."""
    why = next(
        (
            f"GradientPlane stepped aside at step {event.step}: {event.message}"
            for event in run.events()
            if event.probe == names.PLANE and event.kind in ("disabled", "error")
        ),
        "record with GradientPlane",
    )
    return DynamicsError(f"{run.path.name}: no {what} stored ({why})")
