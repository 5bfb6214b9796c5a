"""Planes, projections, the out-of-plane view and grids (dynamics.geometry.plane)."""

import numpy as np
import pytest
import torch

from dynamics.geometry.plane import (
    Grid,
    Plane,
    covering_grid,
    out_of_plane_view,
    pca_plane,
    plane_from_gradients,
    project,
    random_filter_normalized_plane,
)
from dynamics.params.layout import ParameterLayout

N = 500


def _gram(plane: Plane) -> np.ndarray:
    return np.array(
        [[plane.u @ plane.u, plane.u @ plane.v], [plane.v @ plane.u, plane.v @ plane.v]]
    )


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


@pytest.fixture
def gradient_plane(rng: np.random.Generator) -> Plane:
    return plane_from_gradients(
        rng.standard_normal(N), rng.standard_normal(N), rng.standard_normal(N) * 1e-3
    )


def test_gradient_plane_is_orthonormal_and_spans_both_gradients(rng):
    theta0, g_a = rng.standard_normal(N), rng.standard_normal(N).astype(np.float32)
    g_b = (0.9 * g_a + 0.1 * rng.standard_normal(N)).astype(np.float32)  # nearly parallel
    plane = plane_from_gradients(theta0, torch.from_numpy(g_a), g_b)

    np.testing.assert_allclose(_gram(plane), np.eye(2), atol=1e-12)
    np.testing.assert_allclose(plane.u, g_a / np.linalg.norm(g_a.astype(np.float64)), atol=1e-15)
    _, _, r_b = project(plane, theta0 + g_b)
    assert r_b < 1e-12 * np.linalg.norm(g_b)
    assert plane.metadata["cosine"] > 0.99
    assert plane.origin.dtype == np.float64 and not plane.u.flags.writeable


@pytest.mark.parametrize(
    ("g_a", "g_b", "message"),
    [
        (np.ones(N), -3 * np.ones(N), "collinear"),
        (np.zeros(N), np.ones(N), "g_a is zero"),
        (np.ones(N), np.ones(N + 1), "sizes differ"),
    ],
)
def test_gradient_plane_rejects_degenerate_gradients(g_a, g_b, message):
    with pytest.raises(ValueError, match=message):
        plane_from_gradients(np.zeros(N), g_a, g_b)


def test_plane_rejects_a_basis_that_is_not_orthonormal():
    e = np.eye(3)
    with pytest.raises(ValueError, match="not orthonormal"):
        Plane(np.zeros(3), e[0], e[0] + 1e-3 * e[1], "manual")


def test_filter_normalized_directions_have_the_filter_norms_of_theta0(rng):
    layout = ParameterLayout(
        ("conv.weight", "conv.bias", "linear.weight", "norm.weight"),
        ((4, 3, 2, 2), (4,), (5, 6), (5,)),
    )
    theta0 = rng.standard_normal(layout.size)
    conv_end = 4 * 3 * 2 * 2
    theta0[conv_end + 4 : conv_end + 4 + 6] = 0.0  # first filter of linear.weight is dead
    plane = random_filter_normalized_plane(theta0, layout, seed=7)

    coords = np.array(plane.metadata["direction_coordinates"])
    d1 = coords[0, 0] * plane.u + coords[0, 1] * plane.v
    d2 = coords[1, 0] * plane.u + coords[1, 1] * plane.v
    for direction in (d1, d2):
        blocks = np.split(direction, np.cumsum(layout.numels)[:-1])
        weights = np.split(theta0, np.cumsum(layout.numels)[:-1])
        for block, weight, shape in zip(blocks, weights, layout.shapes):
            if len(shape) == 1:
                assert np.all(block == 0.0)
            else:
                np.testing.assert_allclose(
                    np.linalg.norm(block.reshape(shape[0], -1), axis=1),
                    np.linalg.norm(weight.reshape(shape[0], -1), axis=1),
                    rtol=1e-10,
                    atol=1e-12,
                )
    np.testing.assert_allclose(_gram(plane), np.eye(2), atol=1e-12)
    again = random_filter_normalized_plane(theta0, layout, seed=7)
    assert np.array_equal(again.u, plane.u) and np.array_equal(again.v, plane.v)


def test_filter_normalized_plane_rejects_a_layout_mismatch(rng):
    layout = ParameterLayout(("w",), ((4, 5),))
    with pytest.raises(ValueError, match="theta0 has 21 entries, layout has 20"):
        random_filter_normalized_plane(rng.standard_normal(21), layout, seed=0)


def test_pca_plane_recovers_the_subspace_snapshots_lie_in(rng):
    basis, _ = np.linalg.qr(rng.standard_normal((N, 2)))
    theta0 = rng.standard_normal(N)
    coefficients = np.cumsum(rng.standard_normal((12, 2)), axis=0)
    snapshots = theta0 + coefficients @ basis.T
    plane = pca_plane(theta0, snapshots.astype(np.float64))

    projector = np.outer(plane.u, plane.u) + np.outer(plane.v, plane.v)
    np.testing.assert_allclose(projector, basis @ basis.T, atol=1e-10)
    _, _, r = project(plane, snapshots)
    assert np.max(r) < 1e-10 * np.max(np.linalg.norm(snapshots - theta0, axis=1))
    assert sum(plane.metadata["explained_variance_ratio"]) == pytest.approx(1.0, abs=1e-12)
    a, b, _ = project(plane, snapshots[-1])
    assert a >= 0 and b >= 0


def test_pca_plane_rejects_snapshots_along_one_line(rng):
    theta0, direction = rng.standard_normal(N), rng.standard_normal(N)
    snapshots = theta0 + np.outer([1.0, 2.0, 3.0, 5.0], direction)
    with pytest.raises(ValueError, match="fewer than two directions"):
        pca_plane(theta0, snapshots)


def test_projection_splits_the_squared_displacement_exactly(gradient_plane, rng):
    thetas = (gradient_plane.origin + rng.standard_normal((7, N))).astype(np.float32)
    a, b, r = project(gradient_plane, torch.from_numpy(thetas))

    squared = np.sum((thetas.astype(np.float64) - gradient_plane.origin) ** 2, axis=1)
    np.testing.assert_allclose(a**2 + b**2 + r**2, squared, rtol=1e-5)
    displacement = thetas[3].astype(np.float64) - gradient_plane.origin
    assert a[3] == pytest.approx(displacement @ gradient_plane.u, rel=1e-12)
    assert a.shape == b.shape == r.shape == (7,)


def test_projection_of_a_point_of_the_plane_returns_its_coordinates(gradient_plane):
    a, b, r = project(gradient_plane, gradient_plane.point(-1.5, 0.25))
    assert a.shape == ()
    assert (float(a), float(b)) == pytest.approx((-1.5, 0.25), abs=1e-12)
    assert r < 1e-12


def test_projection_rejects_vectors_of_another_layout(gradient_plane):
    with pytest.raises(ValueError, match="sizes differ"):
        project(gradient_plane, np.zeros((2, N + 3)))


def test_out_of_plane_view_is_orthonormal_and_contains_the_final_point(gradient_plane, rng):
    plane = gradient_plane
    outside = rng.standard_normal(N)
    outside -= (outside @ plane.u) * plane.u + (outside @ plane.v) * plane.v
    outside *= 3 / np.linalg.norm(outside)
    theta_final = plane.point(2.0, -1.0) + outside

    view, share = out_of_plane_view(plane, theta_final)

    basis = np.stack([view.u, view.v, plane.u, plane.v])
    np.testing.assert_allclose(_gram(view), np.eye(2), atol=1e-6)
    np.testing.assert_allclose(basis[1] @ basis[2:].T, 0.0, atol=1e-6)  # w ⊥ the first plane
    assert share == pytest.approx(5 / 14, rel=1e-12)
    assert view.metadata["in_plane_share"] == share
    a, b, r = project(view, theta_final)
    assert (float(a), float(b), float(r)) == pytest.approx((np.sqrt(5), 3.0, 0.0), abs=1e-10)
    np.testing.assert_allclose(view.metadata["in_plane_direction"], np.array([2, -1]) / np.sqrt(5))


@pytest.mark.parametrize(
    ("displacement", "message"),
    [("zero", "no displacement"), ("inside", "no out-of-plane part"), ("normal", "no in-plane")],
)
def test_out_of_plane_view_rejects_degenerate_displacements(gradient_plane, displacement, message):
    plane = gradient_plane
    normal = np.zeros(N)
    normal[0] = 1.0
    normal -= (normal @ plane.u) * plane.u + (normal @ plane.v) * plane.v
    theta_final = {
        "zero": plane.origin,
        "inside": plane.point(1.0, 2.0),
        "normal": plane.origin + normal,
    }[displacement]
    with pytest.raises(ValueError, match=message):
        out_of_plane_view(plane, theta_final)


def test_covering_grid_covers_trajectories_with_margin_on_a_non_square_grid():
    run_a = (np.array([0.0, 1.0, 4.0]), np.array([0.0, -0.5, -1.0]))
    run_b = (np.array([0.0, -2.0]), np.array([0.0, 0.5]))
    grid = covering_grid([run_a, run_b], num_alphas=7, num_betas=4, margin=0.5)

    assert grid.shape == (4, 7)
    np.testing.assert_allclose(grid.alphas[[0, -1]], [-2.0 - 3.0, 4.0 + 3.0])
    np.testing.assert_allclose(grid.betas[[0, -1]], [-1.0 - 0.75, 0.5 + 0.75])


def test_covering_grid_gives_a_motionless_axis_the_other_axis_range():
    grid = covering_grid([(np.array([0.0, 2.0]), np.zeros(2))], num_alphas=3, num_betas=5, margin=0)
    np.testing.assert_allclose(grid.alphas, [0.0, 1.0, 2.0])
    np.testing.assert_allclose(grid.betas[[0, -1]], [-1.0, 1.0])


@pytest.mark.parametrize(
    ("alphas", "betas", "message"),
    [
        ([0.0], [0.0, 1.0], "at least 2 alphas"),
        ([0.0, 1.0], [[0.0, 1.0]], "at least 2 betas"),
        ([0.0, 1.0, 1.0], [0.0, 1.0], "strictly increasing"),
    ],
)
def test_grid_rejects_too_few_or_unordered_points(alphas, betas, message):
    with pytest.raises(ValueError, match=message):
        Grid(np.array(alphas), np.array(betas))


def test_covering_grid_rejects_a_grid_of_one_point():
    with pytest.raises(ValueError, match="at least 2 betas"):
        covering_grid([(np.array([0.0, 1.0]), np.array([0.0, 1.0]))], num_betas=1)
