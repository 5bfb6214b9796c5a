"""Curvature through F.scaled_dot_product_attention, whose fused kernels have no double backward."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import DataLoader, TensorDataset

from dynamics import open_run
from dynamics.callbacks import DynamicsRecorder, GradientPlane, HessianSpectrum
from dynamics.curvature import pyhessian_eigenpairs, top_eigenvalues
from dynamics.params.vectors import flatten, parameter_vector

VOCAB, WIDTH, HEADS, CONTEXT = 5, 8, 2, 4


class TinyGPT(pl.LightningModule):
    """One pre-norm causal attention block, no dropout: a few hundred parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(0.1 * torch.randn(CONTEXT, WIDTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position
        n, t, _ = x.shape
        q, k, v = (
            z.view(n, t, HEADS, WIDTH // HEADS).transpose(1, 2)
            for z in self.qkv(self.norm(x)).chunk(3, dim=-1)
        )
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + self.proj(attended.transpose(1, 2).reshape(n, t, WIDTH)))

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        return F.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, VOCAB, (32, CONTEXT + 1), generator=generator)
        data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
        return DataLoader(data, batch_size=8, shuffle=True, generator=generator)


@pytest.fixture(scope="module")
def problem():
    """A float64 TinyGPT, a batch, and the eigenvalues of its dense Hessian, largest first."""
    torch.manual_seed(0)
    module = TinyGPT().double()
    tokens, targets = batch = next(iter(module.train_dataloader()))
    names = [n for n, _ in module.named_parameters()]
    shapes = [p.shape for p in module.parameters()]
    numels = [p.numel() for p in module.parameters()]

    def loss_of_flat(theta: torch.Tensor) -> torch.Tensor:
        tensors = dict(zip(names, (c.view(s) for c, s in zip(theta.split(numels), shapes))))
        logits = functional_call(module, tensors, (tokens,))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    with sdpa_kernel(SDPBackend.MATH):  # the reference takes a double backward as well
        hessian = torch.autograd.functional.hessian(
            loss_of_flat, flatten(module.parameters()), vectorize=True
        )
    return module, batch, torch.linalg.eigvalsh(hessian).flip(0)


def test_probe_eigenvalues_match_the_dense_hessian(problem) -> None:
    module, batch, exact = problem
    probe = HessianSpectrum(k=3, tol=1e-8, batch=batch)
    probe.setup(SimpleNamespace(strategy=None), module, batch)
    row = probe.measure(module, 0)
    np.testing.assert_allclose(row["eigenvalues"], exact[:3].numpy(), rtol=1e-4)


def test_every_backend_of_top_eigenvalues_differentiates_attention_twice(problem) -> None:
    module, (tokens, targets), exact = problem

    def loss() -> torch.Tensor:
        return F.cross_entropy(module(tokens).flatten(0, 1), targets.flatten())

    params = list(module.parameters())
    pairs = top_eigenvalues(loss, params, k=3, tol=1e-8, module=module)
    np.testing.assert_allclose(pairs.eigenvalues.numpy(), exact[:3].numpy(), rtol=1e-4)
    largest = exact[exact.abs().argmax()].item()
    power = top_eigenvalues(loss, params, tol=1e-8, backend="power", max_hvp=2000)
    assert power.eigenvalues[0].item() == pytest.approx(largest, rel=1e-4)
    cross_check = pyhessian_eigenpairs(loss, params, tol=1e-8, max_iter=2000)
    assert cross_check.eigenvalues[0].item() == pytest.approx(largest, rel=1e-3)


def test_recording_a_transformer_completes_and_leaves_training_bit_identical(
    tmp_path, quiet_trainer
) -> None:
    def fit(callbacks) -> torch.Tensor:
        pl.seed_everything(0, verbose=False)
        module = TinyGPT()
        quiet_trainer(max_steps=4, callbacks=callbacks).fit(module)
        return parameter_vector(module)

    probes = [HessianSpectrum(k=2, every_n_steps=2), GradientPlane()]
    recorded = fit([DynamicsRecorder(tmp_path / "run.h5", probes)])
    assert torch.equal(recorded, fit([]))
    run = open_run(tmp_path / "run.h5")
    assert np.isfinite(run.series("hessian")["eigenvalues"]).all()
    assert np.isfinite(run.vector("g0")).all()
