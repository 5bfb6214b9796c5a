"""Top-k eigenspace overlap: the closed forms, the probe's series, stored vectors within their
budget, and the cross-run overlap that ``dynamics compare`` draws."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from dynamics import open_run
from dynamics.analysis.measures.eigenspace_overlap import eigenspace_overlap
from dynamics.callbacks import DynamicsRecorder, TrainingLoss
from dynamics.callbacks.hessian_spectrum import HessianSpectrum
from dynamics.geometry.subspace_overlap import subspace_overlap, update_share
from dynamics.store import names
from tests.conftest import run_dynamics


def _plane_rotation(n: int, i: int, j: int, angle: float) -> torch.Tensor:
    rotation = torch.eye(n, dtype=torch.float64)
    c, s = math.cos(angle), math.sin(angle)
    rotation[i, i], rotation[i, j], rotation[j, i], rotation[j, j] = c, -s, s, c
    return rotation


def test_overlap_is_one_for_a_subspace_in_any_basis_and_cos_squared_for_a_rotated_one() -> None:
    generator = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(30, 3, generator=generator, dtype=torch.float64)).Q.T
    mixed = torch.linalg.qr(torch.randn(3, 3, generator=generator, dtype=torch.float64)).Q
    assert subspace_overlap(basis, mixed @ basis) == pytest.approx(1.0, abs=1e-12)
    assert subspace_overlap(basis.numpy(), (mixed @ basis).numpy()) == pytest.approx(1.0)
    # One of two basis vectors turned by φ out of the span: (cos²φ + 1) / 2.
    e = torch.eye(4, dtype=torch.float64)
    for angle in (0.0, 0.3, 1.0, math.pi / 2):
        turned = (_plane_rotation(4, 0, 2, angle) @ e[:, :2]).T
        expected = (math.cos(angle) ** 2 + 1) / 2
        assert subspace_overlap(e[:2], turned) == pytest.approx(expected, abs=1e-12)
    with pytest.raises(ValueError, match="one shape"):
        subspace_overlap(e[:2], e[:3])


def test_update_share_is_the_squared_share_inside_the_span() -> None:
    e = torch.eye(4, dtype=torch.float64)
    update = torch.tensor([3.0, 0.0, 4.0, 0.0], dtype=torch.float64)
    assert update_share(update, e[:2]) == pytest.approx(9 / 25)
    assert math.isnan(update_share(torch.zeros(4, dtype=torch.float64), e[:2]))


class Quadratic(pl.LightningModule):
    """``½ θᵀ A θ`` with ``A = Q diag(4, 3, 1, 0.5) Qᵀ``, ``Q`` a rotation by ``angle`` in the
    plane of the first and third coordinates: the Hessian is ``A`` exactly, and its top-2
    eigenspace is span(Q e1, e2)."""

    def __init__(self) -> None:
        super().__init__()
        self.theta = nn.Parameter(torch.tensor([1.0, -2.0, 0.5, 1.0], dtype=torch.float64))
        self.angle = 0.0

    def dynamics_loss(self, batch) -> torch.Tensor:
        rotation = _plane_rotation(4, 0, 2, self.angle)
        hessian = rotation @ torch.diag(torch.tensor([4.0, 3.0, 1.0, 0.5]).double()) @ rotation.T
        return 0.5 * self.theta @ hessian @ self.theta


def test_probe_overlap_is_one_for_a_fixed_hessian_and_cos_squared_when_it_rotates() -> None:
    module = Quadratic()
    probe = HessianSpectrum(k=2, tol=1e-10, eigenspace_overlap=True)
    probe.setup(SimpleNamespace(strategy=None), module, torch.zeros(1))
    first = probe.measure(module, 0)
    assert math.isnan(first["overlap_previous"]) and math.isnan(first["update_share"])
    before = module.theta.detach().clone()
    with torch.no_grad():
        module.theta.add_(torch.tensor([3.0, 0.0, 4.0, 0.0], dtype=torch.float64))
    fixed = probe.measure(module, 1)  # the same Hessian: the same eigenspace
    assert fixed["overlap_previous"] == pytest.approx(1.0, abs=1e-10)
    # The update (3, 0, 4, 0) against the eigenspace span(e1, e2) at the earlier record.
    assert fixed["update_share"] == pytest.approx(9 / 25, abs=1e-10)
    module.angle = 0.7
    rotated = probe.measure(module, 2)
    assert rotated["overlap_previous"] == pytest.approx((math.cos(0.7) ** 2 + 1) / 2, abs=1e-8)
    assert math.isnan(rotated["update_share"])  # θ did not move
    assert (module.theta.detach() - before).abs().max() == pytest.approx(4.0)


class Wide(pl.LightningModule):
    """A linear regression with one output, trained by SGD: its Hessian on the probe batch is
    constant, ``2 XᵀX / N`` in the weights, with distinct eigenvalues (several outputs would
    repeat each one, and a top-k cutting through a repeated eigenvalue is no one subspace)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Linear(20, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(64, 20, generator=generator)
        y = torch.randn(64, 1, generator=generator)
        return torch.utils.data.DataLoader(list(zip(x, y)), batch_size=16)


def _recorded_fit(path, seed: int, budget_mb: float, steps: int) -> HessianSpectrum:
    probe = HessianSpectrum(
        k=3, every_n_steps=2, vector_budget_mb=budget_mb, eigenspace_overlap=True
    )
    pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[DynamicsRecorder(path, probes=[TrainingLoss(), probe])],
    ).fit(Wide(seed))
    return probe


def test_stored_vectors_stay_within_budget_and_compare_draws_their_overlap(tmp_path) -> None:
    each = 4 * 3 * 21  # k eigenvectors of the 21 parameters, float32
    budget_mb = 5.5 * each / 2**20  # room for 5 records of 20
    probes = [_recorded_fit(tmp_path / f"{s}.h5", s, budget_mb, 40) for s in (0, 1)]
    runs = [open_run(tmp_path / f"{s}.h5") for s in (0, 1)]
    for probe, run in zip(probes, runs):
        stored = run.recorded(names.HESSIAN_VECTORS)
        assert stored.step[0] == 0 and len(stored) * each <= budget_mb * 2**20
        assert len(stored) >= 4  # thinned evenly, not cut off
        assert np.all(np.diff(stored.step) == probe.vector_period)
        vectors = stored[names.HESSIAN_VECTORS_RITZ]
        gram = vectors @ vectors.transpose(0, 2, 1)
        np.testing.assert_allclose(gram, np.broadcast_to(np.eye(3), gram.shape), atol=1e-5)
    # Each run against itself: 1; the two runs against each other: the direct computation.
    steps, same = eigenspace_overlap(runs[0], runs[0])
    np.testing.assert_allclose(same, 1.0, atol=1e-5)
    steps, overlap = eigenspace_overlap(runs[0], runs[1])
    a, b = (run.recorded(names.HESSIAN_VECTORS) for run in runs)
    for step, value in zip(steps, overlap):
        va = a[names.HESSIAN_VECTORS_RITZ][list(a.step).index(step)].astype(np.float64)
        vb = b[names.HESSIAN_VECTORS_RITZ][list(b.step).index(step)].astype(np.float64)
        assert value == pytest.approx(np.square(va @ vb.T).sum() / 3, rel=1e-6)
    page = tmp_path / "compare.html"
    result = run_dynamics("compare", *(run.path for run in runs), "-o", page)
    assert result.returncode == 0, result.stderr
    assert "Hessian eigenspaces at matching steps" in page.read_text()
    # The report draws the overlap of consecutive records and the update's share.
    hessian = runs[0].series(names.HESSIAN)
    overlap, share = hessian[names.HESSIAN_OVERLAP], hessian[names.HESSIAN_UPDATE_SHARE]
    assert np.isnan(overlap[0])
    np.testing.assert_allclose(overlap[1:], 1.0, atol=1e-4)  # a constant Hessian
    assert np.all((share[1:] >= 0) & (share[1:] <= 1 + 1e-6))
    report = tmp_path / "report.html"
    result = run_dynamics("report", runs[0].path, "-o", report)
    assert result.returncode == 0, result.stderr
    text = report.read_text()
    assert "Top-k eigenspace overlap with the previous record" in text
    assert "in that record's top-k eigenspace" in text


def test_a_budget_too_small_for_two_records_stores_none_and_says_why() -> None:
    module = Quadratic()
    probe = HessianSpectrum(k=2, vector_budget_mb=1e-6)
    trainer = SimpleNamespace(strategy=None, estimated_stepping_batches=100, global_step=0)
    probe.setup(trainer, module, torch.zeros(1))
    assert probe.vector_period == 0 and names.HESSIAN_VECTORS not in probe.series()
    ((_, message),) = probe.pop_notes()
    assert "holds fewer than 2 records" in message
