"""The one solver table: top_eigenvalues and HessianSpectrum pick solvers by the same names,
tracking is reachable from top_eigenvalues, the old spellings still work, and a newcomer's
solver (one function, one table entry) is reachable from both."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from dynamics.callbacks import HessianSpectrum
from dynamics.curvature import SOLVERS, Eigenpairs, HessianProblem, Solver, top_eigenvalues
from dynamics.errors import ParameterError
from dynamics.params.vectors import flatten


def _problem():
    """A float64 MLP with a batch: (model, loss closure, params, dense Hessian eigenvalues)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    x, y = torch.randn(40, 5, dtype=torch.float64), torch.randn(40, 2, dtype=torch.float64)
    params = list(model.parameters())
    shapes = [p.shape for p in params]

    def loss_of_flat(theta: torch.Tensor) -> torch.Tensor:
        chunks = torch.split(theta, [s.numel() for s in shapes])
        w1, b1, w2, b2 = (c.view(s) for c, s in zip(chunks, shapes))
        return F.mse_loss(torch.tanh(x @ w1.T + b1) @ w2.T + b2, y)

    dense = torch.autograd.functional.hessian(loss_of_flat, flatten(params).detach())
    return model, (lambda: F.mse_loss(model(x), y)), params, torch.linalg.eigvalsh(dense).flip(0)


def test_tracking_from_top_eigenvalues_matches_dense_and_refines_cheaper() -> None:
    _, loss, params, exact = _problem()
    cold = top_eigenvalues(loss, params, k=3, tol=1e-8, solver="tracking")
    assert len(cold.eigenvalues) == 3 + SOLVERS["tracking"].guards  # the guards come along
    torch.testing.assert_close(cold.top(3).eigenvalues, exact[:3], rtol=1e-6, atol=0)
    with torch.no_grad():  # a small step: the eigenvectors move a little
        for p in params:
            p.add_(1e-4 * torch.randn_like(p))
    tracked = top_eigenvalues(
        loss, params, k=3, tol=1e-6, solver="tracking", previous=cold.eigenvectors
    )
    again = top_eigenvalues(loss, params, k=3, tol=1e-8)  # a cold Lanczos, the reference
    assert not tracked.restarted and tracked.converged
    torch.testing.assert_close(tracked.top(3).eigenvalues, again.eigenvalues, rtol=1e-6, atol=0)
    assert tracked.n_hvp < again.n_hvp


def test_the_old_spellings_still_work_with_a_warning_and_give_the_same_pairs() -> None:
    _, loss, params, _ = _problem()
    new = top_eigenvalues(loss, params, k=2, tol=1e-8, solver="power", max_hvp=3000)
    with pytest.warns(DeprecationWarning, match="backend"):
        old = top_eigenvalues(loss, params, k=2, tol=1e-8, backend="power", max_hvp=3000)
    torch.testing.assert_close(old.eigenvalues, new.eigenvalues, rtol=0, atol=0)
    start = new.eigenvectors
    with pytest.warns(DeprecationWarning, match="warm_start"):
        warm_old = top_eigenvalues(loss, params, k=2, tol=1e-8, warm_start=start)
    warm_new = top_eigenvalues(loss, params, k=2, tol=1e-8, previous=start)
    torch.testing.assert_close(warm_old.eigenvalues, warm_new.eigenvalues, rtol=0, atol=0)
    with pytest.raises(ParameterError, match="old name of solver"):
        top_eigenvalues(loss, params, solver="power", backend="power")


def test_arguments_a_solver_does_not_take_are_refused_by_name() -> None:
    _, loss, params, _ = _problem()
    with pytest.raises(ParameterError, match="^solver must be one of 'lanczos'"):
        top_eigenvalues(loss, params, solver="arpack")
    with pytest.raises(ParameterError, match="^previous is not used by solver 'power'"):
        top_eigenvalues(loss, params, solver="power", previous=torch.ones(1, 50))
    with pytest.raises(ParameterError, match="^basis_size is not used by solver 'pyhessian'"):
        top_eigenvalues(loss, params, solver="pyhessian", basis_size=10)
    with pytest.raises(ParameterError, match="^solver 'pyhessian' reports no residuals"):
        HessianSpectrum(solver="pyhessian")


def _dense_solve(problem, k, tol, *, max_hvp, previous, basis_size, seed) -> Eigenpairs:
    """A newcomer's solver: the dense Hessian from ``size`` products, then eigh."""
    operator = problem.operator
    identity = torch.eye(operator.size, dtype=operator.dtype)
    hessian = torch.stack([operator.matvec(e) for e in identity])
    values, vectors = torch.linalg.eigh((hessian + hessian.T) / 2)
    top = values.argsort(descending=True)[:k]
    pairs = vectors[:, top].T
    residuals = torch.linalg.vector_norm(pairs @ hessian - values[top, None] * pairs, dim=1)
    return Eigenpairs(values[top], pairs, residuals, operator.size, True)


def test_a_solver_added_as_one_table_entry_is_reachable_from_both(monkeypatch) -> None:
    entry = Solver(_dense_solve, "dense eigh, for tiny models", uses_previous=False)
    monkeypatch.setitem(SOLVERS, "dense", entry)
    model, loss, params, exact = _problem()
    pairs = top_eigenvalues(loss, params, k=3, solver="dense")
    torch.testing.assert_close(pairs.eigenvalues, exact[:3], rtol=1e-10, atol=0)
    x = torch.randn(40, 5, dtype=torch.float64)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def training_step(self, batch, _):
            return F.mse_loss(self.net(batch[0]), batch[1])

    module = Module()
    batch = (x, torch.randn(40, 2, dtype=torch.float64))
    probe = HessianSpectrum(k=3, tol=1e-10, batch=batch, solver="dense")
    probe.setup(SimpleNamespace(strategy=None), module, None)
    row = probe.measure(module, 0)
    reference = top_eigenvalues(
        lambda: F.mse_loss(model(batch[0]), batch[1]), params, k=3, tol=1e-10
    )
    np.testing.assert_allclose(row["eigenvalues"], reference.eigenvalues.float(), rtol=1e-6)
    assert row["n_hvp"] == sum(p.numel() for p in params)
    assert probe.settings()["solver"] == "dense"
    assert isinstance(HessianProblem(loss, params).operator.size, int)


def test_the_probe_takes_the_table_names_that_report_residuals() -> None:
    model, _, params, _ = _problem()
    torch.manual_seed(1)
    batch = (torch.randn(40, 5, dtype=torch.float64), torch.randn(40, 2, dtype=torch.float64))

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def training_step(self, batch, _):
            return F.mse_loss(self.net(batch[0]), batch[1])

    module = Module()
    loss = lambda: F.mse_loss(model(batch[0]), batch[1])  # noqa: E731
    reference = top_eigenvalues(loss, params, k=2, tol=1e-10, max_hvp=3000)
    for name in ("lanczos", "tracking", "power"):
        probe = HessianSpectrum(k=2, tol=1e-10, max_hvp=3000, batch=batch, solver=name)
        probe.setup(SimpleNamespace(strategy=None), module, None)
        row = probe.measure(module, 0)
        np.testing.assert_allclose(
            row["eigenvalues"], reference.eigenvalues.float(), rtol=1e-5, err_msg=name
        )
        assert row["converged"] == 1 and probe.settings()["solver"] == name
