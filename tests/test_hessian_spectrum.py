"""The HessianSpectrum probe: what it records, that it records it right, and that it is harmless."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dynamics import open_run
from dynamics.callbacks import DynamicsRecorder
from dynamics.callbacks.hessian_spectrum import HessianSpectrum
from dynamics.curvature import top_eigenvalues
from dynamics.experiments.teacher_student.module import TeacherStudentModule
from dynamics.params.vectors import flatten


class TinyRegressor(pl.LightningModule):
    """A few dozen parameters, loss from ``training_step`` only (no ``dynamics_loss``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss


def _tiny(seed: int = 0) -> tuple[TinyRegressor, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(seed)
    module = TinyRegressor().double()
    batch = (torch.randn(32, 4, dtype=torch.float64), torch.randn(32, 2, dtype=torch.float64))
    return module, batch


def _teacher_student() -> tuple[TeacherStudentModule, tuple[torch.Tensor, torch.Tensor]]:
    module = TeacherStudentModule(width=16, expansion=2, depth=2, seed=0)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 16, generator=generator)
    return module, (x, torch.randn(64, 16, generator=generator))


def _ready(probe: HessianSpectrum, module: pl.LightningModule, batch=None) -> HessianSpectrum:
    probe.setup(SimpleNamespace(strategy=None), module, batch)
    return probe


def _dense(module: nn.Module, loss_of_flat_params) -> torch.Tensor:
    theta = flatten(module.parameters())
    return torch.autograd.functional.hessian(loss_of_flat_params, theta, vectorize=True)


def _tiny_loss_of_flat(module: TinyRegressor, batches):
    names = [n for n, _ in module.named_parameters()]
    shapes = [p.shape for p in module.parameters()]
    numels = [p.numel() for p in module.parameters()]

    def loss(theta: torch.Tensor) -> torch.Tensor:
        tensors = dict(zip(names, (c.view(s) for c, s in zip(theta.split(numels), shapes))))
        losses = [
            F.mse_loss(torch.func.functional_call(module, tensors, (x,), strict=False), y)
            for x, y in batches
        ]
        return torch.stack(losses).mean()

    return loss


def test_rows_match_dense_references_for_eigenvalues_share_trace_and_density() -> None:
    module, batch = _tiny()
    probe = _ready(
        HessianSpectrum(
            k=3, tol=1e-8, batch=batch, gradient_share=True, trace_hvp=60, density_runs=2
        ),
        module,
    )
    row = probe.measure(module, step=0)
    loss = _tiny_loss_of_flat(module, [batch])
    hessian = _dense(module, loss)
    values, vectors = torch.linalg.eigh(hessian)
    exact = values.flip(0)[:3]
    np.testing.assert_allclose(row["eigenvalues"], exact.numpy(), rtol=1e-4)
    assert row["converged"] == 1 and row["residuals"].max() <= 1e-6 * exact[0].item()
    theta = flatten(module.parameters()).requires_grad_()
    (gradient,) = torch.autograd.grad(loss(theta), theta)
    share = (vectors[:, -3:].T @ gradient).square().sum() / gradient.square().sum()
    assert row["gradient_share"] == pytest.approx(share.item(), rel=1e-4)
    assert abs(row["trace"] - hessian.trace().item()) <= 4 * row["trace_stderr"]
    np.testing.assert_allclose(row["density_weights"].sum(1), 1.0, rtol=1e-5)
    assert row["loss"] == pytest.approx(loss(flatten(module.parameters())).item())
    assert row["n_hvp"] > 60 + 2 * 40
    assert all(p.grad is None for p in module.parameters())


def test_series_declared_match_the_rows() -> None:
    module, batch = _tiny()
    probe = _ready(
        HessianSpectrum(k=2, batch=batch, gradient_share=True, trace_hvp=9, density_runs=2),
        module,
    )
    specs = probe.series()["hessian"]
    row = probe.measure(module, 0)
    assert set(row) == set(specs)
    for name, spec in specs.items():
        assert np.shape(row[name]) == spec.shape, name
    assert probe.vectors()["hessian_float_bits"].shape == (1,)
    np.testing.assert_array_equal(probe.initial_vectors()["hessian_float_bits"], [64])
    assert probe.settings() == {
        "mode": "eval",
        "loss": "training_step",
        "solver": "lanczos",
        "tol": probe.tol,
        "cold_every": 0,
    }


def test_declarations_before_setup_are_well_defined() -> None:
    probe = HessianSpectrum(k=2, trace_hvp=9)
    assert set(probe.series()["hessian"]) >= {"eigenvalues", "trace"}
    assert set(probe.vectors()) == {"hessian_float_bits"}
    assert probe.initial_vectors() == {}  # the precision is the module's, known at setup
    assert probe.settings() == {
        "mode": "eval",
        "loss": None,
        "solver": "lanczos",
        "tol": 1e-4,
        "cold_every": 0,
    }


def test_probe_agrees_with_top_eigenvalues_on_the_module_loss() -> None:
    module, batch = _teacher_student()
    probe = _ready(HessianSpectrum(k=3, tol=1e-6, warm_start=False), module, batch)
    row = probe.measure(module, 0)  # on the batch given at setup (the first training batch)
    params = list(module.parameters())
    reference = top_eigenvalues(lambda: module.dynamics_loss(batch), params, k=3, tol=1e-6)
    np.testing.assert_allclose(row["eigenvalues"], reference.eigenvalues.numpy(), rtol=1e-4)
    assert row["n_hvp"] == reference.n_hvp  # same operator, same seed, same iteration


def test_float32_regardless_of_autocast_and_of_bf16_weights() -> None:
    module, batch = _teacher_student()
    probe = _ready(HessianSpectrum(k=3, tol=1e-6, batch=batch, warm_start=False), module)
    plain = probe.measure(module, 0)["eigenvalues"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = probe.measure(module, 0)["eigenvalues"]
    np.testing.assert_allclose(autocast, plain, rtol=1e-5)

    # "bf16-true" training keeps weights and inputs in bf16.
    half = copy.deepcopy(module).to(torch.bfloat16)
    half_batch = tuple(t.to(torch.bfloat16) for t in batch)
    half_probe = _ready(HessianSpectrum(k=3, tol=1e-6, batch=half_batch, warm_start=False), half)
    assert half_probe.initial_vectors()["hessian_float_bits"][0] == 32
    rounded = copy.deepcopy(half).float()
    rounded_batch = tuple(t.float() for t in half_batch)
    rounded_probe = _ready(HessianSpectrum(k=3, tol=1e-6, batch=rounded_batch), rounded)
    expected = rounded_probe.measure(rounded, 0)["eigenvalues"]
    np.testing.assert_allclose(half_probe.measure(half, 0)["eigenvalues"], expected, rtol=1e-5)
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())


def test_warm_start_from_the_previous_row_saves_products() -> None:
    module, batch = _teacher_student()
    warm = _ready(HessianSpectrum(k=5, batch=batch), module)
    cold = _ready(HessianSpectrum(k=5, batch=batch, warm_start=False), module)
    warm.measure(module, 0)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
    for _ in range(3):  # a few training steps between two recorded rows
        optimizer.zero_grad()
        module.dynamics_loss(batch).backward()
        optimizer.step()
    warm_row, cold_row = warm.measure(module, 3), cold.measure(module, 3)
    np.testing.assert_allclose(warm_row["eigenvalues"], cold_row["eigenvalues"], rtol=3e-4)
    assert warm_row["n_hvp"] < cold_row["n_hvp"]


def test_a_non_finite_loss_raises_rather_than_record_nan() -> None:
    module, batch = _tiny()
    probe = _ready(HessianSpectrum(k=2, batch=batch), module)
    with torch.no_grad():
        module.net[0].weight[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="loss is nan"):
        probe.measure(module, 7)


class SqrtLoss(pl.LightningModule):
    """A finite loss, Σ√w at w = 0, whose gradient and Hessian are infinite."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3))

    def dynamics_loss(self, batch) -> torch.Tensor:
        return self.w.sqrt().sum()


def test_non_finite_products_raise_rather_than_record_nan() -> None:
    module = SqrtLoss()
    probe = _ready(HessianSpectrum(k=1), module, batch=torch.zeros(1))
    with pytest.raises(FloatingPointError, match="not finite"):
        probe.measure(module, 3)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_measuring_leaves_a_train_mode_module_untouched(small_cnn, mode) -> None:
    module = small_cnn().train()
    module.features[1].eval()  # a frozen BatchNorm, as fine-tuning code leaves it
    flags = [m.training for m in module.modules()]
    batch = next(iter(module.train_dataloader()))
    F.cross_entropy(module(batch[0]), batch[1]).backward()
    grads = [p.grad.clone() for p in module.parameters()]
    buffers = [b.clone() for b in module.buffers()]
    rng = torch.get_rng_state()
    probe = _ready(HessianSpectrum(k=2, batch=batch, mode=mode), module)
    assert np.isfinite(probe.measure(module, 0)["eigenvalues"]).all()
    assert all(torch.equal(p.grad, g) for p, g in zip(module.parameters(), grads))
    assert all(torch.equal(b, saved) for b, saved in zip(module.buffers(), buffers))
    assert torch.equal(torch.get_rng_state(), rng)
    assert [m.training for m in module.modules()] == flags


class DropoutRegressor(TinyRegressor):
    """TinyRegressor with dropout and batch normalisation between its layers."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Dropout(0.3), nn.Linear(6, 2)
        )
        with torch.no_grad():  # running statistics unlike the batch's, so the modes differ
            self.net[1].running_mean.uniform_(-0.5, 0.5)
            self.net[1].running_var.uniform_(0.5, 2.0)


def test_eval_mode_measures_the_deterministic_eval_hessian_and_train_mode_differs() -> None:
    torch.manual_seed(0)
    module = DropoutRegressor().double().train()
    _, batch = _tiny()
    hessian = _dense(module.eval(), _tiny_loss_of_flat(module, [batch]))
    exact = torch.linalg.eigvalsh(hessian).flip(0)[:3].numpy()
    module.train()
    rows = {
        mode: _ready(HessianSpectrum(k=3, tol=1e-8, batch=batch, mode=mode), module).measure(
            module, 0
        )
        for mode in ("eval", "train")
    }
    np.testing.assert_allclose(rows["eval"]["eigenvalues"], exact, rtol=1e-4)
    assert not np.allclose(rows["train"]["eigenvalues"], exact, rtol=1e-2)
    assert all(m.training for m in module.modules())


def test_mode_is_checked_when_the_probe_is_made() -> None:
    with pytest.raises(ValueError, match="mode must be 'eval' or 'train'"):
        HessianSpectrum(mode="inference")


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_recording_leaves_training_bit_identical_and_fills_the_run_file(
    small_cnn, tmp_path, quiet_trainer, mode
) -> None:
    def fit(recorder: DynamicsRecorder | None) -> torch.Tensor:
        pl.seed_everything(0, verbose=False)
        module = small_cnn()
        callbacks = [recorder] if recorder else []
        quiet_trainer(max_steps=6, callbacks=callbacks).fit(module)
        return flatten(module.parameters())

    probe = HessianSpectrum(k=2, every_n_steps=2, trace_hvp=6, mode=mode)
    recorded = fit(DynamicsRecorder(tmp_path / "run.h5", probes=[probe]))
    assert torch.equal(recorded, fit(None))
    (stored,) = open_run(tmp_path / "run.h5").attrs["probes"]
    assert stored["settings"] == {
        "mode": mode,
        "loss": "training_step",
        "solver": "lanczos",
        "tol": probe.tol,
        "cold_every": 0,
    }
    with h5py.File(tmp_path / "run.h5", "r") as file:
        group = file["series/hessian"]
        assert list(group["step"][:]) == [0, 2, 4]
        assert np.isfinite(group["eigenvalues"][:]).all()
        assert (group["eigenvalues"][:, 0] >= group["eigenvalues"][:, 1]).all()
        assert (group["n_hvp"][:] > 0).all()
        assert json.loads(group["eigenvalues"].attrs["columns"]) == ["lambda_1", "lambda_2"]
        assert file["vectors/hessian_float_bits"][0] == 32


def _ddp_rank(rank: int, init_method: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    try:
        module, _ = _tiny(seed=0)
        _, batch = _tiny(seed=1 + rank)  # each rank its own probe batch
        row = _ready(HessianSpectrum(k=3, tol=1e-8, batch=batch), module).measure(module, 0)
        torch.save(row, out.format(rank))
    finally:
        dist.destroy_process_group()


def test_ddp_ranks_agree_on_the_hessian_of_the_averaged_loss(tmp_path) -> None:
    # fork, as Lightning's ddp_fork does: the children need not re-import anything.
    context = torch.multiprocessing.get_context("fork")
    args = (f"file://{tmp_path / 'store'}", str(tmp_path / "row{}.pt"))
    ranks = [context.Process(target=_ddp_rank, args=(rank, *args)) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=60)
        assert process.exitcode == 0
    rows = [torch.load(tmp_path / f"row{rank}.pt", weights_only=False) for rank in range(2)]
    np.testing.assert_array_equal(rows[0]["eigenvalues"], rows[1]["eigenvalues"])

    module, _ = _tiny(seed=0)
    batches = [_tiny(seed=1 + rank)[1] for rank in range(2)]
    exact = torch.linalg.eigvalsh(_dense(module, _tiny_loss_of_flat(module, batches))).flip(0)
    np.testing.assert_allclose(rows[0]["eigenvalues"], exact[:3].numpy(), rtol=1e-4)
    single = torch.linalg.eigvalsh(_dense(module, _tiny_loss_of_flat(module, batches[:1])))
    assert not np.allclose(rows[0]["eigenvalues"], single.flip(0)[:3].numpy(), rtol=1e-2)
