"""HessianSpectrum and its measurements under FSDP1 and FSDP2 on two forked gloo processes.

The reference is the DDP run over the same batches (each rank its own probe batch, every product
averaged over the ranks), itself checked here against the dense Hessian of the averaged loss at
θ0. Every row (eigenvalues, residuals, trace, gradient share, density, overlap) and every stored
eigenvector must equal it; the peak memory's inputs (a whole copy of θ and k whole vectors on
every rank) are counted on each rank.
"""

from __future__ import annotations

import contextlib
import multiprocessing

import h5py
import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch.func import functional_call

from dynamics import open_run, world
from dynamics.callbacks import DynamicsRecorder
from dynamics.callbacks.hessian_density import HessianDensity
from dynamics.callbacks.hessian_eigenspace_overlap import EigenspaceOverlap
from dynamics.callbacks.hessian_gradient_share import GradientShare
from dynamics.callbacks.hessian_spectrum import HessianSpectrum
from dynamics.callbacks.hessian_trace import HessianTrace
from dynamics.callbacks.hessian_vectors import EigenvectorSnapshots
from dynamics.callbacks.probe_loss import ProbeLoss
from dynamics.experiments import TeacherStudentData, TeacherStudentModule
from dynamics.params.vectors import flatten
from tests import sharded

ARCH = dict(width=8, expansion=2, depth=3)
K = 3
#: Residual tolerance of the solver: eigenvalues good to ~tol²·λ, eigenvectors to ~tol·λ/gap.
TOL = 1e-6


def _probe() -> HessianSpectrum:
    measurements = [
        HessianTrace(hvp=12),
        GradientShare(),
        HessianDensity(runs=2, steps=8),
        EigenspaceOverlap(),
        EigenvectorSnapshots(budget_mb=1),
    ]
    return HessianSpectrum(k=K, every_n_steps=2, tol=TOL, measurements=measurements)


class FirstBatches(pl.Callback):
    """Each rank's first training batch (its probe batch), by rank."""

    def __init__(self, results) -> None:
        self.results = results

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            self.results[trainer.global_rank] = [t.clone() for t in batch]


class FrozenNorms(TeacherStudentModule):
    """The teacher-student student with its LayerNorms frozen (the Hessian is of the rest)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        for name, p in self.named_parameters():
            p.requires_grad_("norm" not in name)


def _module(name: str, module_class=TeacherStudentModule) -> pl.LightningModule:
    torch.manual_seed(0)
    return sharded.module_for(name, module_class)(**ARCH)


def _fit(name: str, folder, callbacks=(), module_class=TeacherStudentModule) -> dict:
    """The Hessian groups and the events of a 5-step fit under ``name`` (rows at steps 0, 2,
    4), and its final parameters."""
    data = TeacherStudentData(**ARCH, batch_size=8)
    path = folder / f"{name}.h5"
    recorder = DynamicsRecorder(path, probes=[_probe()])
    final = sharded.FinalParameters(folder / "final.pt")
    options = dict(max_steps=5, limit_val_batches=0)
    module = _module(name, module_class)
    sharded.fit(name, module, data, [recorder, final, *callbacks], **options)
    with h5py.File(path, "r") as file:
        rows = {
            f"{group}/{series}": file[f"series/{group}/{series}"][:]
            for group in ("hessian", "hessian_vectors")
            for series in file[f"series/{group}"]
        }
    rows["events"] = open_run(path).events()
    rows["final"] = torch.load(folder / "final.pt")
    return rows


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    batches = multiprocessing.Manager().dict()
    rows = _fit("ddp", tmp_path_factory.mktemp("ddp"), [FirstBatches(batches)])
    rows["batches"] = [batches[rank] for rank in (0, 1)]
    return rows


def _dense_at_theta0(batches) -> tuple[torch.Tensor, torch.Tensor]:
    """The Hessian and gradient of the rank-averaged probe loss at θ0, dense."""
    module = _module("ddp")
    names = [n for n, _ in module.named_parameters()]
    shapes = [p.shape for p in module.parameters()]
    numels = [p.numel() for p in module.parameters()]

    def loss(theta: torch.Tensor) -> torch.Tensor:
        tensors = dict(zip(names, (c.view(s) for c, s in zip(theta.split(numels), shapes))))
        losses = [functional_call(module, tensors, (b,), {}, strict=True) for b in batches]
        return torch.stack(losses).mean()

    module.forward = module.dynamics_loss  # functional_call calls forward: the loss of a batch
    theta = flatten(module.parameters()).detach().double()
    module.double()
    batches = [tuple(t.double() for t in b) for b in batches]
    hessian = torch.autograd.functional.hessian(loss, theta, vectorize=True)
    gradient = torch.autograd.functional.jacobian(loss, theta)
    return hessian, gradient


def test_the_ddp_reference_is_the_dense_hessian_of_the_averaged_loss(ddp):
    assert ddp["events"] == []
    hessian, gradient = _dense_at_theta0(ddp["batches"])
    values, vectors = torch.linalg.eigh(hessian)
    top, basis = values.flip(0)[:K].numpy(), vectors.flip(1)[:, :K].T.numpy()
    first = ddp["hessian/eigenvalues"][0]
    np.testing.assert_allclose(first, top, rtol=1e-5)
    stored = ddp["hessian_vectors/vectors"][0]  # (k, n), the unsharded layout
    assert stored.shape == (K, hessian.shape[0])
    np.testing.assert_allclose(np.abs((stored * basis).sum(1)), 1.0, atol=1e-5)
    share = (basis @ gradient.numpy()) ** 2 / (gradient.numpy() ** 2).sum()
    assert ddp["hessian/gradient_share"][0] == pytest.approx(share.sum(), rel=1e-5)
    trace, stderr = ddp["hessian/trace"][0], ddp["hessian/trace_stderr"][0]
    assert abs(trace - hessian.trace().item()) <= 4 * stderr


@contextlib.contextmanager
def _counted(bytes_held):
    """``ProbeLoss.whole`` and ``HessianSpectrum.measure`` counting, on each rank, the bytes of
    the whole copy's parameters, of the rank's own parameters and of the vectors kept."""
    whole, measure = ProbeLoss.whole, HessianSpectrum.measure

    @contextlib.contextmanager
    def counting_whole(self, pl_module):
        with whole(self, pl_module) as module:
            size = sum(p.numel() * p.element_size() for p in module.parameters())
            own = self.shards.local_size * 4
            bytes_held[f"copy{world.rank()}"] = (size, own)
            yield module

    def counting_measure(self, pl_module, step):
        row = measure(self, pl_module, step)
        overlap = next(m for m in self.measurements if isinstance(m, EigenspaceOverlap))
        kept = self._ritz.numel() * self._ritz.element_size()
        kept += overlap._theta.numel() * overlap._theta.element_size()
        bytes_held[f"kept{world.rank()}"] = kept
        return row

    ProbeLoss.whole, HessianSpectrum.measure = counting_whole, counting_measure
    try:
        yield
    finally:
        ProbeLoss.whole, HessianSpectrum.measure = whole, measure


@pytest.mark.parametrize("name", ["fsdp1", "fsdp2"])
def test_rows_and_eigenvectors_equal_the_ddp_runs(name, tmp_path, ddp):
    bytes_held = multiprocessing.Manager().dict()
    with _counted(bytes_held):
        got = _fit(name, tmp_path)
    assert got["events"] == []  # measured, not stepped aside
    series = {key for key in ddp if "/" in key}
    assert {key for key in got if "/" in key} == series
    for key in series:
        expected, actual = ddp[key], got[key]
        if key.endswith("/vectors"):  # each eigenvector up to its sign
            actual = actual * np.sign((actual * expected).sum(-1, keepdims=True))
            np.testing.assert_allclose(actual, expected, atol=1e-5, err_msg=key)
        else:
            rtol = 1e-4 if key == "hessian/eigenvalues" else 1e-5
            np.testing.assert_allclose(actual, expected, rtol=rtol, atol=1e-7, err_msg=key)
    plain = tmp_path / "plain.pt"
    data = TeacherStudentData(**ARCH, batch_size=8)
    final = sharded.FinalParameters(plain)
    sharded.fit(name, _module(name), data, [final], max_steps=5, limit_val_batches=0)
    for n, p in torch.load(plain).items():  # training unchanged by the measurements
        assert torch.equal(got["final"][n], p), n
    # Peak memory's inputs: every rank held θ whole (n float32) beside its own half, and keeps
    # k whole eigenvectors and θ (for the overlap) between rows.
    n = ddp["hessian_vectors/vectors"].shape[-1]
    for rank in (0, 1):
        copy, own = bytes_held[f"copy{rank}"]
        assert copy == 4 * n and own < copy
        assert bytes_held[f"kept{rank}"] == 4 * (K + 1) * n


@pytest.mark.parametrize("name", ["fsdp1", "fsdp2"])
def test_frozen_parameters_are_held_fixed_as_unsharded(name, tmp_path):
    got = _fit(name, tmp_path / "sharded", module_class=FrozenNorms)
    ddp = _fit("ddp", tmp_path / "ddp", module_class=FrozenNorms)
    assert got["events"] == [] and ddp["events"] == []
    trainable = sum(p.numel() for p in _module("ddp", FrozenNorms).parameters() if p.requires_grad)
    assert ddp["hessian_vectors/vectors"].shape == (3, K, trainable)
    np.testing.assert_allclose(got["hessian/eigenvalues"], ddp["hessian/eigenvalues"], rtol=1e-4)
    vectors, expected = got["hessian_vectors/vectors"], ddp["hessian_vectors/vectors"]
    vectors = vectors * np.sign((vectors * expected).sum(-1, keepdims=True))
    np.testing.assert_allclose(vectors, expected, atol=1e-5)
