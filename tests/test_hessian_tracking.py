"""The tracking eigensolver and HessianSpectrum's tracking mode against dense Hessians and the
cold Lanczos, over a few records of a moving model."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from dynamics.callbacks.hessian_spectrum import HessianSpectrum
from dynamics.curvature import (
    HessianOperator,
    eigenvalue_error_bounds,
    lanczos,
    track_eigenpairs,
)
from dynamics.curvature.krylov import project_off
from dynamics.params.vectors import flatten
from tests.test_hessian_spectrum import _dense, _tiny, _tiny_loss_of_flat


class DenseOperator:
    """A symmetric matrix as a :class:`~dynamics.curvature.LinearOperator`."""

    def __init__(self, matrix: torch.Tensor) -> None:
        self.matrix = matrix
        self.n_hvp = 0

    @property
    def size(self) -> int:
        return self.matrix.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.matrix.dtype

    @property
    def device(self) -> torch.device:
        return self.matrix.device

    def matvec(self, vector: torch.Tensor) -> torch.Tensor:
        self.n_hvp += 1
        return self.matrix @ vector


def _mlp_problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)).double()
    x, y = torch.randn(48, 6, dtype=torch.float64), torch.randn(48, 3, dtype=torch.float64)
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    numels = [p.numel() for p in model.parameters()]

    def loss_of_flat(theta: torch.Tensor) -> torch.Tensor:
        tensors = dict(zip(names, (c.view(s) for c, s in zip(theta.split(numels), shapes))))
        return F.mse_loss(torch.func.functional_call(model, tensors, (x,)), y)

    return model, x, y, loss_of_flat


def test_tracking_matches_dense_and_cold_over_records_and_costs_fewer_products() -> None:
    model, x, y, loss_of_flat = _mlp_problem()
    params = list(model.parameters())
    previous = None
    tracked_cost = cold_cost = 0
    for _ in range(4):
        operator = HessianOperator(lambda: F.mse_loss(model(x), y), params)
        cold = lanczos(HessianOperator(lambda: F.mse_loss(model(x), y), params), 3, 1e-8)
        pairs = (  # the top 3 and two guards
            lanczos(operator, 5, 1e-8)
            if previous is None
            else track_eigenpairs(operator, previous, 1e-6, k=3)
        )
        hessian = torch.autograd.functional.hessian(loss_of_flat, flatten(params))
        exact = torch.linalg.eigvalsh(hessian).flip(0)[:3]
        top = pairs.eigenvalues[:3]
        assert ((top - exact).abs() / exact).max() <= 1e-10
        assert ((top - cold.eigenvalues).abs() / exact).max() <= 1e-10
        # The reported residual is the true one, recomputed with the dense Hessian.
        direct = torch.linalg.vector_norm(
            pairs.eigenvectors @ hessian - pairs.eigenvalues[:, None] * pairs.eigenvectors, dim=1
        )
        np.testing.assert_allclose(pairs.residuals, direct, atol=1e-10)
        assert pairs.converged and operator.n_hvp == pairs.n_hvp
        if previous is not None:
            assert not pairs.restarted
            tracked_cost += pairs.n_hvp
            cold_cost += cold.n_hvp
        previous = pairs.eigenvectors
        with torch.no_grad():  # a training step's worth of movement
            for p in params:
                p.add_(1e-4 * torch.randn_like(p))
    assert tracked_cost < cold_cost


def test_an_abrupt_change_of_spectrum_restarts_cold_and_still_finds_the_top() -> None:
    """The eigenvectors turn to unrelated directions: the tracked ones are far from any."""
    torch.manual_seed(1)
    basis = torch.linalg.qr(torch.randn(40, 40, dtype=torch.float64)).Q
    values = torch.linspace(1.0, 10.0, 40, dtype=torch.float64)
    before = basis @ torch.diag(values) @ basis.T
    previous = basis[:, -3:].T  # the top 3 of before
    turned = torch.linalg.qr(torch.randn(40, 40, dtype=torch.float64)).Q
    after = DenseOperator(turned @ torch.diag(values) @ turned.T)
    pairs = track_eigenpairs(after, previous, 1e-8, max_basis=6)
    assert pairs.restarted and pairs.converged
    np.testing.assert_allclose(pairs.eigenvalues, values.flip(0)[:3], rtol=1e-8)
    assert pairs.n_hvp == after.n_hvp
    # The same subspace for the unchanged matrix: no restart, a single block of products.
    same = DenseOperator(before)
    unchanged = track_eigenpairs(same, previous, 1e-8)
    assert not unchanged.restarted and unchanged.n_hvp == 3
    np.testing.assert_allclose(unchanged.eigenvalues, values.flip(0)[:3], rtol=1e-12)


def test_probe_tracking_mode_rows_match_dense_and_the_cold_mode() -> None:
    module, batch = _tiny()
    tracking = HessianSpectrum(k=3, tol=1e-6, batch=batch, solver="tracking")
    cold = HessianSpectrum(k=3, tol=1e-6, batch=batch, warm_start=False)
    for probe in (tracking, cold):
        probe.setup(SimpleNamespace(strategy=None), module, batch)
    # The run file says which solver measured the rows.
    assert tracking.settings()["solver"] == "tracking"
    assert cold.settings()["solver"] == "lanczos"
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        row = tracking.measure(module, step)
        reference = cold.measure(module, step)
        hessian = _dense(module, _tiny_loss_of_flat(module, [batch]))
        exact = torch.linalg.eigvalsh(hessian).flip(0)[:3].numpy()
        np.testing.assert_allclose(row["eigenvalues"], exact, rtol=1e-5)
        np.testing.assert_allclose(row["eigenvalues"], reference["eigenvalues"], rtol=1e-5)
        vectors = tracking._ritz[:3]  # the top 3; two guards follow
        direct = torch.linalg.vector_norm(
            vectors @ hessian - torch.from_numpy(row["eigenvalues"]).double()[:, None] * vectors,
            dim=1,
        )
        # The stored bound is the residual of the stored (float32) eigenvalue's pair.
        np.testing.assert_allclose(row["residuals"], direct, atol=1e-5 * exact[0])
        if step:
            assert row["n_hvp"] < reference["n_hvp"]
        with torch.no_grad():
            for p in module.parameters():
                p.add_(1e-4 * torch.randn(p.shape, generator=generator, dtype=p.dtype))


def test_bad_tracking_arguments_get_one_clear_error() -> None:
    operator = DenseOperator(torch.eye(5, dtype=torch.float64))
    with pytest.raises(ValueError, match="previous must have shape"):
        track_eigenpairs(operator, torch.ones(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="max_basis"):
        track_eigenpairs(operator, torch.ones(2, 5, dtype=torch.float64), max_basis=1)
    with pytest.raises(ValueError, match="solver"):
        HessianSpectrum(solver="arnoldi")


def test_a_resumed_tracking_probe_continues_as_an_uninterrupted_one() -> None:
    module, batch = _tiny()
    first, resumed = (
        HessianSpectrum(k=2, tol=1e-4, batch=batch, solver="tracking", eigenspace_overlap=True)
        for _ in range(2)
    )
    first.setup(SimpleNamespace(strategy=None), module, batch)
    first.measure(module, 0)
    resumed.load_state_dict(first.state_dict())
    resumed.setup(SimpleNamespace(strategy=None), module, batch)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1e-3)
    expected, row = first.measure(module, 1), resumed.measure(module, 1)
    assert row.keys() == expected.keys()
    for name in row:
        np.testing.assert_array_equal(row[name], expected[name])


def _perturbed_ritz_pairs(noise: float):
    """Ritz pairs of a known spectrum from a subspace near its top 4 eigenvectors."""
    torch.manual_seed(2)
    basis = torch.linalg.qr(torch.randn(60, 60, dtype=torch.float64)).Q
    values = torch.cat(
        [torch.tensor([10.0, 7.0, 5.0, 4.0], dtype=torch.float64), torch.linspace(0, 3, 56)]
    )
    matrix = basis @ torch.diag(values) @ basis.T
    rows = basis[:, :4].T + noise * torch.randn(4, 60, dtype=torch.float64)
    q = torch.linalg.qr(rows.T).Q
    theta, mixing = torch.linalg.eigh(q.T @ matrix @ q)
    theta, vectors = theta.flip(0), (q @ mixing).T.flip(0)
    residuals = torch.linalg.vector_norm(vectors @ matrix - theta[:, None] * vectors, dim=1)
    return values[:4], theta, residuals, matrix


def test_error_bounds_hold_on_a_known_spectrum_and_are_far_below_the_residual() -> None:
    exact, theta, residuals, _ = _perturbed_ritz_pairs(noise=2e-3)
    bounds = eigenvalue_error_bounds(theta, residuals)
    assert bounds[-1].isnan()  # no known neighbour below the last pair
    error = (theta - exact).abs()[:3]
    assert (error <= bounds[:3]).all()
    # Hand-computed for the top pair: ‖r₁‖² / (θ₁ − θ₂ − ‖r₂‖).
    top = residuals[0] ** 2 / (theta[0] - theta[1] - residuals[1])
    assert bounds[0].item() == pytest.approx(top.item(), rel=1e-12)
    assert (bounds[:3] < 0.05 * residuals[:3]).all()
    # A gap the residuals do not resolve: no bound.
    unresolved = eigenvalue_error_bounds(theta, torch.full_like(residuals, 5.0))
    assert unresolved.isnan().all()


def test_probe_rows_store_error_bounds_that_hold_against_the_dense_hessian() -> None:
    module, batch = _tiny()
    tracking = HessianSpectrum(k=3, tol=1e-3, batch=batch, solver="tracking")
    cold = HessianSpectrum(k=3, tol=1e-3, batch=batch, warm_start=False)
    for probe in (tracking, cold):
        probe.setup(SimpleNamespace(strategy=None), module, batch)
    generator = torch.Generator().manual_seed(0)
    for step in range(4):
        row, reference = tracking.measure(module, step), cold.measure(module, step)
        hessian = _dense(module, _tiny_loss_of_flat(module, [batch]))
        exact = torch.linalg.eigvalsh(hessian).flip(0)[:3].numpy()
        bounds = row["error_bounds"]
        assert np.isfinite(bounds).all()  # the guards give the 3rd pair a gap
        # float32 storage: the bound plus the stored value's rounding.
        assert (np.abs(row["eigenvalues"] - exact) <= bounds + 1e-6 * exact).all()
        # Far tighter than the residual, which alone only says "within ‖r‖ of some eigenvalue".
        assert (bounds < 0.1 * row["residuals"]).all()
        assert np.isnan(reference["error_bounds"][-1])  # Lanczos: no pair below the k-th
        assert np.isfinite(reference["error_bounds"][:-1]).all()
        with torch.no_grad():
            for p in module.parameters():
                p.add_(1e-4 * torch.randn(p.shape, generator=generator, dtype=p.dtype))


def test_cold_every_makes_every_nth_record_a_cold_lanczos() -> None:
    module, batch = _tiny()
    guarded = HessianSpectrum(
        k=2, every_n_steps=10, tol=1e-6, batch=batch, solver="tracking", cold_every=2
    )
    plain = HessianSpectrum(k=2, every_n_steps=10, tol=1e-6, batch=batch, solver="tracking")
    cold = HessianSpectrum(k=2, every_n_steps=10, tol=1e-6, batch=batch, warm_start=False)
    for probe in (guarded, plain, cold):
        probe.setup(SimpleNamespace(strategy=None), module, batch)
    assert guarded.settings()["cold_every"] == 2
    for step in (0, 10, 20, 30):
        rows = [probe.measure(module, step) for probe in (guarded, plain, cold)]
        if step in (0, 20):  # a cold Lanczos of the top 2 and the guards: as costly as cold
            assert rows[0]["n_hvp"] > rows[1]["n_hvp"] or step == 0
        else:  # tracked: the same solve as without the safeguard
            np.testing.assert_array_equal(rows[0]["eigenvalues"], rows[1]["eigenvalues"])
            assert rows[0]["n_hvp"] == rows[1]["n_hvp"]
        np.testing.assert_allclose(rows[0]["eigenvalues"], rows[2]["eigenvalues"], rtol=1e-5)
        with torch.no_grad():
            for p in module.parameters():
                p.add_(1e-4)
    with pytest.raises(ValueError, match="cold_every"):
        HessianSpectrum(cold_every=-1)


class _CountedMatmuls(TorchFunctionMode):
    """Counts matrix products, i.e. passes over the rows a vector block is projected on."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_projecting_off_the_basis_takes_a_second_pass_only_where_the_first_removed_most() -> None:
    generator = torch.Generator().manual_seed(3)
    rows = torch.linalg.qr(torch.randn(200, 6, dtype=torch.float64, generator=generator)).Q.T
    outside = torch.randn(200, dtype=torch.float64, generator=generator)
    outside -= rows.T @ (rows @ outside)
    outside /= torch.linalg.vector_norm(outside)
    # A Ritz residual: orthogonal to the basis up to rounding. One pass (two products) does.
    nearly = (outside + 1e-14 * rows[0])[None].clone()
    with _CountedMatmuls() as counted:
        project_off(nearly, rows)
    assert counted.count == 2
    assert (rows @ nearly[0]).abs().max() <= 1e-15
    # A vector all but inside the span: after one pass its remainder (1e-9 of it) still
    # carries rounding of the whole vector, ~1e-7 of the remainder; the second pass removes it.
    inside = (rows.T @ torch.ones(6, dtype=torch.float64) + 1e-9 * outside)[None].clone()
    with _CountedMatmuls() as counted:
        project_off(inside, rows)
    assert counted.count == 4
    remainder = inside[0] / torch.linalg.vector_norm(inside[0])
    assert (rows @ remainder).abs().max() <= 1e-12
    assert torch.dot(remainder, outside) == pytest.approx(1.0, abs=1e-12)


def test_float32_tracking_at_a_tight_tol_stays_orthonormal_and_accurate_to_rounding() -> None:
    """One projection pass per round (a second only where needed) is enough in float32 too:
    at tol 1e-5 the residuals are 1e-5 of ‖H v‖, so the rounding left along the basis by
    forming them is ~1e-2 of them and the first pass removes it."""
    generator = torch.Generator().manual_seed(4)
    q = torch.linalg.qr(torch.randn(400, 400, dtype=torch.float64, generator=generator)).Q
    top = torch.tensor([10.0, 9.9, 9.7, 9.6, 9.5, 9.4, 9.3], dtype=torch.float64)
    values = torch.cat([top, 5 * torch.rand(393, dtype=torch.float64, generator=generator)])
    hessian = q @ torch.diag(values) @ q.T
    moved = q[:, :7].T + 3e-3 * torch.randn(7, 400, dtype=torch.float64, generator=generator)
    pairs = track_eigenpairs(DenseOperator(hessian.float()), moved.float(), 1e-5, k=5)
    assert pairs.converged and not pairs.restarted
    np.testing.assert_allclose(pairs.eigenvalues[:5], top[:5], rtol=1e-6)
    vectors = pairs.eigenvectors.double()
    np.testing.assert_allclose(vectors @ vectors.T, torch.eye(7, dtype=torch.float64), atol=1e-6)
    direct = torch.linalg.vector_norm(
        vectors @ hessian - pairs.eigenvalues[:, None] * vectors, dim=1
    )
    np.testing.assert_allclose(pairs.residuals, direct, atol=1e-6 * top[0].item())
    assert (pairs.residuals[:5] <= 1e-5 * pairs.eigenvalues[:5]).all()
