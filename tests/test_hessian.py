"""The curvature engine against exact references: dense Hessians and a closed form."""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from dynamics.curvature import (
    HessianOperator,
    broadened_density,
    hutch_plus_plus,
    hutchinson,
    lanczos,
    power_iteration,
    spectral_density,
    top_eigenvalues,
)
from dynamics.params.vectors import flatten


def _mlp(bias: bool) -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, 16, bias=bias),
        nn.Tanh(),
        nn.Linear(16, 16, bias=bias),
        nn.Tanh(),
        nn.Linear(16, 3, bias=bias),
    )


def _conv() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.Tanh(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(16, 3),
    )


def _batchnorm_eval() -> nn.Module:
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))
    net[1].running_mean.normal_()
    net[1].running_var.uniform_(0.5, 2.0)
    return net.eval()


def _problem(name: str):
    """A small float64 model, a batch and a loss of the output: (model, x, y, loss_of_output)."""
    torch.manual_seed(0)
    build = {
        "mlp": lambda: _mlp(True),
        "mlp_no_bias": lambda: _mlp(False),
        "conv": _conv,
        "batchnorm_eval": _batchnorm_eval,
    }[name]
    model = build().double()
    if name == "conv":
        x = torch.randn(32, 2, 6, 6, dtype=torch.float64)
        y = torch.randint(0, 3, (32,))
        return model, x, y, F.cross_entropy
    x, y = torch.randn(64, 8, dtype=torch.float64), torch.randn(64, 3, dtype=torch.float64)
    return model, x, y, F.mse_loss


def _dense_hessian(model: nn.Module, x, y, loss_of_output) -> torch.Tensor:
    """The reference: torch.autograd.functional.hessian of the loss of a flat parameter vector."""
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    shapes = [p.shape for p in params]
    numels = [p.numel() for p in params]

    def loss_of_flat(theta: torch.Tensor) -> torch.Tensor:
        tensors = [c.view(s) for c, s in zip(theta.split(numels), shapes)]
        return loss_of_output(functional_call(model, dict(zip(names, tensors)), (x,)), y)

    return torch.autograd.functional.hessian(loss_of_flat, flatten(params), vectorize=True)


@pytest.fixture(scope="module")
def references() -> dict:
    cache = {}
    for name in ("mlp", "mlp_no_bias", "conv", "batchnorm_eval"):
        model, x, y, loss_of_output = _problem(name)
        hessian = _dense_hessian(model, x, y, loss_of_output)
        cache[name] = (hessian, torch.linalg.eigvalsh(hessian).flip(0))
    return cache


def _closure(model, x, y, loss_of_output):
    return lambda: loss_of_output(model(x), y)


@pytest.mark.parametrize("name", ["mlp", "mlp_no_bias", "conv", "batchnorm_eval"])
@pytest.mark.parametrize("k", [1, 5, 20])
def test_top_k_matches_dense_eigvalsh_in_float64(references, name, k) -> None:
    model, x, y, loss_of_output = _problem(name)
    hessian, exact = references[name]
    params = list(model.parameters())
    pairs = top_eigenvalues(_closure(model, x, y, loss_of_output), params, k=k, tol=1e-6)
    assert pairs.converged
    relative = (pairs.eigenvalues - exact[:k]).abs() / exact[:k].abs()
    assert relative.max() <= 1e-4, relative
    # The reported residuals are the true ones, and they meet the stopping rule.
    true_residuals = torch.linalg.vector_norm(
        pairs.eigenvectors @ hessian - pairs.eigenvalues[:, None] * pairs.eigenvectors, dim=1
    )
    assert torch.allclose(true_residuals, pairs.residuals, rtol=1e-3, atol=1e-10)
    assert (true_residuals <= 1e-6 * pairs.eigenvalues.abs() + 1e-10).all()
    gram = pairs.eigenvectors @ pairs.eigenvectors.T
    assert torch.allclose(gram, torch.eye(k, dtype=gram.dtype), atol=1e-8)
    assert all(p.grad is None for p in params)  # products never touch .grad


def test_float32_operator_matches_the_float64_reference(references) -> None:
    model, x, y, loss_of_output = _problem("mlp")
    model, x, y = model.float(), x.float(), y.float()
    _, exact = references["mlp"]
    pairs = top_eigenvalues(_closure(model, x, y, loss_of_output), list(model.parameters()), k=5)
    assert pairs.eigenvectors.dtype == torch.float32
    assert ((pairs.eigenvalues - exact[:5]).abs() / exact[:5]).max() <= 1e-4


def test_thick_restart_with_a_small_basis_still_converges(references) -> None:
    model, x, y, loss_of_output = _problem("mlp")
    _, exact = references["mlp"]
    operator = HessianOperator(_closure(model, x, y, loss_of_output), list(model.parameters()))
    pairs = lanczos(operator, k=5, tol=1e-7, basis_size=8, max_hvp=2000)
    assert pairs.converged and pairs.n_hvp > 8  # it had to restart
    assert ((pairs.eigenvalues - exact[:5]).abs() / exact[:5]).max() <= 1e-6
    assert operator.n_hvp == pairs.n_hvp


def _linear_problem(n_dims: int, mean: float, std, batch: int, outputs: int = 1):
    torch.manual_seed(0)
    x = mean + std * torch.randn(batch, n_dims, dtype=torch.float64)
    y = torch.randn(batch, outputs, dtype=torch.float64)
    model = nn.Linear(n_dims, outputs, bias=False).to(torch.float64)
    return model, x, lambda: 0.5 * ((model(x) - y) ** 2).sum(1).mean()


def test_lecun_kanter_solla_mean_input_eigenvalue() -> None:
    """λmax of a linear model under ½·MSE is that of the input second moment, → σ² + N·m²."""
    n_dims, mean, std, batch = 20, 1.0, 0.5, 2000
    model, x, loss_fn = _linear_problem(n_dims, mean, std, batch)
    pairs = top_eigenvalues(loss_fn, list(model.parameters()), k=1, tol=1e-9)
    empirical = torch.linalg.eigvalsh(x.T @ x / batch)[-1]
    assert abs(pairs.eigenvalues[0] - empirical) / empirical <= 1e-6
    # λmax ≈ mean of (u·x)² with u = 1/√N: variance (4Nm²σ² + 2σ⁴)/batch.
    limit = std**2 + n_dims * mean**2
    stderr = math.sqrt((4 * n_dims * mean**2 * std**2 + 2 * std**4) / batch)
    assert abs(pairs.eigenvalues[0].item() - limit) <= 4 * stderr
    assert abs(pairs.eigenvalues[0].item() - std**2) > 100 * stderr  # the mean term is seen


def test_repeated_eigenvalues_are_all_found() -> None:
    """Two outputs make every eigenvalue of the input second moment double (H = C ⊗ I)."""
    stds = torch.arange(1, 7, dtype=torch.float64)  # well separated: the breakdown is clean
    model, x, loss_fn = _linear_problem(6, 0.0, stds, 200, outputs=2)
    exact = torch.linalg.eigvalsh(x.T @ x / 200).flip(0)
    pairs = top_eigenvalues(loss_fn, list(model.parameters()), k=4, tol=1e-8)
    expected = exact[[0, 0, 1, 1]]
    assert ((pairs.eigenvalues - expected).abs() / expected).max() <= 1e-6


def test_power_iteration_matches_dense_for_a_positive_definite_hessian() -> None:
    model, x, loss_fn = _linear_problem(10, 0.3, 1.0, 500)
    exact = torch.linalg.eigvalsh(x.T @ x / 500).flip(0)
    params = list(model.parameters())
    pairs = top_eigenvalues(loss_fn, params, k=3, tol=1e-7, backend="power", max_hvp=5000)
    assert pairs.converged
    assert ((pairs.eigenvalues - exact[:3]).abs() / exact[:3]).max() <= 1e-4
    operator = HessianOperator(loss_fn, params)
    assert power_iteration(operator, k=3, tol=1e-7, max_hvp=5000).n_hvp == operator.n_hvp


def test_warm_start_from_nearby_eigenvectors_saves_products(references) -> None:
    model, x, y, loss_of_output = _problem("mlp")
    params = list(model.parameters())
    closure = _closure(model, x, y, loss_of_output)
    before = top_eigenvalues(closure, params, k=5, tol=1e-6)
    with torch.no_grad():
        for p in params:
            p.add_(1e-3 * torch.randn_like(p))
    exact = torch.linalg.eigvalsh(_dense_hessian(model, x, y, loss_of_output)).flip(0)[:5]
    cold = top_eigenvalues(closure, params, k=5, tol=1e-6)
    warm = top_eigenvalues(closure, params, k=5, tol=1e-6, warm_start=before.eigenvectors)
    assert ((warm.eigenvalues - exact).abs() / exact).max() <= 1e-4
    assert warm.n_hvp < cold.n_hvp


def test_warm_start_missing_the_top_direction_still_finds_it() -> None:
    """Start in the span of eigenvectors 2–4: that space is invariant, λ1 lies outside it."""
    stds = torch.arange(1, 11, dtype=torch.float64)
    model, x, loss_fn = _linear_problem(10, 0.0, stds, 500)
    values, vectors = torch.linalg.eigh(x.T @ x / 500)
    pairs = top_eigenvalues(
        loss_fn, list(model.parameters()), k=3, tol=1e-8, warm_start=vectors[:, -4:-1].T
    )
    expected = values.flip(0)[:3]
    assert ((pairs.eigenvalues - expected).abs() / expected).max() <= 1e-6


def test_trace_estimates_are_within_their_stated_error(references) -> None:
    model, x, y, loss_of_output = _problem("mlp")
    hessian, _ = references["mlp"]
    exact = hessian.trace().item()
    operator = HessianOperator(_closure(model, x, y, loss_of_output), list(model.parameters()))
    plain = hutchinson(operator, 200, seed=1)
    plus = hutch_plus_plus(operator, 200, seed=1)
    assert plain.n_hvp == plus.n_hvp == 200
    assert abs(plain.trace - exact) <= 4 * plain.stderr
    assert abs(plus.trace - exact) <= 4 * plus.stderr
    # Hutchinson's stated error agrees with its exact standard deviation.
    theory = math.sqrt(2 * ((hessian**2).sum() - (hessian.diagonal() ** 2).sum()).item() / 200)
    assert 0.7 * theory <= plain.stderr <= 1.4 * theory


def test_trace_error_bars_cover_the_truth_at_the_nominal_rate(references) -> None:
    model, x, y, loss_of_output = _problem("mlp")
    hessian, _ = references["mlp"]
    exact = hessian.trace().item()
    operator = HessianOperator(_closure(model, x, y, loss_of_output), list(model.parameters()))
    for estimator in (hutchinson, hutch_plus_plus):
        covered = [
            abs(e.trace - exact) <= 2 * e.stderr
            for e in (estimator(operator, 30, seed=s) for s in range(40))
        ]
        assert np.mean(covered) >= 0.8, estimator.__name__  # nominal 95 %


def test_spectral_density_integrates_to_one_where_the_eigenvalues_are(references) -> None:
    model, x, y, loss_of_output = _problem("mlp")
    hessian, exact = references["mlp"]
    operator = HessianOperator(_closure(model, x, y, loss_of_output), list(model.parameters()))
    density = spectral_density(operator, runs=8, steps=40, seed=0)
    assert density.n_hvp == 8 * 40
    assert np.trapezoid(density.density, density.grid) == pytest.approx(1.0, abs=1e-6)
    np.testing.assert_allclose(density.weights.sum(1), 1.0, atol=1e-10)
    # Its mass sits where the dense eigenvalues are: compared at the same broadening, the
    # distribution functions differ by little (Kolmogorov distance) and so do the densities (L1).
    exact = exact.numpy()
    reference = broadened_density(
        exact[None], np.full((1, len(exact)), 1 / len(exact)), density.grid, density.sigma
    )
    spacing = density.grid[1] - density.grid[0]
    kolmogorov = np.abs(np.cumsum(reference - density.density) * spacing).max()
    assert kolmogorov <= 0.03
    assert np.trapezoid(np.abs(reference - density.density), density.grid) <= 0.15
    # The extreme nodes sit on the extreme eigenvalues (Lanczos finds them first).
    assert density.nodes.max() == pytest.approx(exact.max(), rel=1e-6)
    assert density.nodes.min() == pytest.approx(exact.min(), rel=1e-3)
    # First moment: ∫ λ ρ(λ) dλ = tr H / n.
    mean = np.trapezoid(density.grid * density.density, density.grid)
    assert mean == pytest.approx(hessian.trace().item() / len(exact), abs=0.05 * exact.max())


def test_pyhessian_backend_agrees_and_leaves_the_model_as_found() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))
    model = model.to(torch.float64).train()
    x, y = torch.randn(64, 8, dtype=torch.float64), torch.randn(64, 3, dtype=torch.float64)
    F.mse_loss(model(x), y).backward()
    params = list(model.parameters())
    grads = [p.grad.clone() for p in params]
    buffers = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    closure = _closure(model, x, y, F.mse_loss)

    ours = top_eigenvalues(closure, params, k=3, tol=1e-8, module=model)
    with mock.patch("torch.autograd.grad", wraps=torch.autograd.grad) as grad_calls:
        theirs = top_eigenvalues(
            closure, params, k=3, tol=1e-10, backend="pyhessian", max_hvp=3000, module=model
        )
    assert ((theirs.eigenvalues - ours.eigenvalues).abs() / ours.eigenvalues).max() <= 1e-4
    assert theirs.n_hvp == grad_calls.call_count  # PyHessian calls autograd.grad per product
    assert theirs.residuals is None and theirs.converged is None

    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))
    assert all(torch.equal(b, saved) for b, saved in zip(model.buffers(), buffers))
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.get_default_dtype() == torch.float32


def test_non_finite_loss_raises_floating_point_error() -> None:
    model, x, y, loss_of_output = _problem("mlp")
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    with pytest.raises(FloatingPointError):
        top_eigenvalues(_closure(model, x, y, loss_of_output), list(model.parameters()))


def test_bad_arguments_get_one_clear_error() -> None:
    model, x, y, loss_of_output = _problem("mlp")
    closure = _closure(model, x, y, loss_of_output)
    params = list(model.parameters())
    with pytest.raises(ValueError, match="backend"):
        top_eigenvalues(closure, params, backend="arpack")
    with pytest.raises(ValueError, match="k must be"):
        top_eigenvalues(closure, params, k=0)
    with pytest.raises(ValueError, match="float32 or all float64"):
        top_eigenvalues(closure, [p.detach().half().requires_grad_() for p in params])
