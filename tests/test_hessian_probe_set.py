"""HessianSpectrum over a probe set of N batches: the operator is the Hessian of the mean loss
over the set (against dense Hessians), the spread of λ1 over the batches is each batch's
Rayleigh quotient, and the probe is harmless, checkpointed and resumed."""

from __future__ import annotations

from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dynamics import open_run
from dynamics.callbacks import DynamicsRecorder, HessianSpectrum, HessianTrace, check_probe
from dynamics.callbacks.probe import ProbeUnavailable
from dynamics.curvature.mean_operator import MeanHessianOperator
from dynamics.errors import ParameterError
from dynamics.experiments import TeacherStudentModule
from dynamics.params.vectors import flatten
from tests import tiny_gpt2


class TinyRegressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _tiny() -> tuple[TinyRegressor, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    module = TinyRegressor().double()
    generator = torch.Generator().manual_seed(1)
    batches = [
        (
            torch.randn(8, 3, generator=generator, dtype=torch.float64) * (1 + i),
            torch.randn(8, 2, generator=generator, dtype=torch.float64),
        )
        for i in range(3)
    ]
    return module, batches


def _dense(module: nn.Module, batches: list) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The dense Hessian of the mean loss over ``batches`` and of each batch's loss
    (torch.func.hessian of the functional loss of the flat parameters)."""
    names = [n for n, _ in module.named_parameters()]
    shapes = [p.shape for p in module.parameters()]
    theta = flatten(module.parameters()).double()

    def loss_of(flat: torch.Tensor, batch) -> torch.Tensor:
        pieces = torch.split(flat, [s.numel() for s in shapes])
        tensors = {n: piece.view(s) for n, piece, s in zip(names, pieces, shapes)}
        x, y = batch
        return F.mse_loss(torch.func.functional_call(module, tensors, (x,)), y)

    each = [torch.func.hessian(lambda t, b=b: loss_of(t, b))(theta) for b in batches]
    mean = torch.func.hessian(lambda t: sum(loss_of(t, b) for b in batches) / len(batches))(theta)
    return mean, each


def _operator_matrix(operator) -> torch.Tensor:
    eye = torch.eye(operator.size, dtype=operator.dtype)
    return torch.stack([operator.matvec(e) for e in eye], 1)


@pytest.mark.parametrize("keep_graphs", [True, False])
def test_the_set_operator_is_the_dense_hessian_of_the_mean_loss(keep_graphs) -> None:
    module, batches = _tiny()
    params = list(module.parameters())
    fns = [lambda b=b: F.mse_loss(module(b[0]), b[1]) for b in batches]
    operator = MeanHessianOperator(fns, params, keep_graphs=keep_graphs)
    matrix = _operator_matrix(operator)
    mean, each = _dense(module, batches)
    torch.testing.assert_close(matrix, mean, rtol=0, atol=1e-10)
    # Each batch's own Hessian is far from the set's: the test cannot pass with one batch.
    assert all((matrix - single).abs().max() > 1e-2 for single in each)
    for i, single in enumerate(each):
        columns = [operator.batch_matvec(i, e) for e in torch.eye(operator.size).double()]
        torch.testing.assert_close(torch.stack(columns, 1), single, rtol=0, atol=1e-10)
    with torch.no_grad():
        losses = [float(fn()) for fn in fns]
    assert operator.losses == pytest.approx(losses, abs=1e-14)
    assert operator.loss == pytest.approx(np.mean(losses), abs=1e-14)
    grads = [flatten(torch.autograd.grad(fn(), params)) for fn in fns]
    torch.testing.assert_close(operator.gradient, torch.stack(grads).mean(0), rtol=0, atol=1e-14)
    assert operator.n_hvp == operator.size and operator.n_batch_hvp == 3 * operator.size
    assert all(p.grad is None for p in params)


def _measured(module, batches, **kwargs) -> dict:
    probe = HessianSpectrum(k=2, tol=1e-10, max_hvp=2000, batches=batches, **kwargs)
    probe.setup(SimpleNamespace(strategy=None), module, None)
    return probe.measure(module, 0)


def test_the_recorded_spectrum_and_spread_are_those_of_the_dense_mean_hessian() -> None:
    module, batches = _tiny()
    mean, each = _dense(module, batches)
    values, vectors = torch.linalg.eigh(mean)
    row = _measured(module, batches)
    # Rows store eigenvalues as float32: equal to the dense float64 ones up to that rounding.
    np.testing.assert_allclose(row["eigenvalues"], values.flip(0)[:2].numpy(), rtol=1e-7)
    v1 = vectors[:, -1]
    by_hand = np.array([float(v1 @ h @ v1) for h in each])
    np.testing.assert_allclose(row["batch_rayleigh"], by_hand, rtol=0, atol=1e-7)
    assert row["batch_rayleigh_std"] == pytest.approx(np.std(by_hand, ddof=1), abs=1e-7)
    assert by_hand.mean() == pytest.approx(float(values[-1]), abs=1e-10)  # the spread's mean
    assert row["batch_rayleigh_std"] > 1e-2  # the batches differ: the spread is not zero
    # The rebuilt graphs give the same row.
    rebuilt = _measured(module, batches, keep_graphs=False)
    np.testing.assert_allclose(rebuilt["eigenvalues"], row["eigenvalues"], rtol=1e-7)


def test_bad_sets_are_refused_in_one_line() -> None:
    _, batches = _tiny()
    with pytest.raises(ParameterError, match="batches must be a list of at least two"):
        HessianSpectrum(batches=batches[:1])
    with pytest.raises(ParameterError, match="exclusive with batch="):
        HessianSpectrum(batch=batches[0], batches=batches)
    with pytest.raises(ParameterError, match="keep_graphs False needs mode='eval'"):
        HessianSpectrum(batches=batches, keep_graphs=False, mode="train")


def test_check_probe_contract_holds_for_a_probe_set() -> None:
    module, batches = _tiny()
    check_probe(
        HessianSpectrum(k=2, batches=batches, measurements=[HessianTrace(hvp=6)]),
        module,
        batches[0],
    )


def _teacher_student_fit(quiet_trainer, path=None, probes=(), steps=4, ckpt=None, checkpoints=None):
    from pytorch_lightning.callbacks import ModelCheckpoint

    pl.seed_everything(0, verbose=False)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x.flip(-1)), batch_size=32)  # an epoch a step: resumable
    module = TeacherStudentModule(width=8, expansion=2, depth=2, seed=0)
    callbacks = [] if path is None else [DynamicsRecorder(path, list(probes), flush_interval_s=1e9)]
    if checkpoints is not None:
        callbacks.append(ModelCheckpoint(checkpoints, every_n_train_steps=2, save_top_k=-1))
    trainer = quiet_trainer(
        max_steps=steps, enable_checkpointing=checkpoints is not None, callbacks=callbacks
    )
    trainer.fit(module, loader, ckpt_path=ckpt)
    return flatten(module.parameters())


def _set_of(count: int = 3) -> list:
    generator = torch.Generator().manual_seed(5)
    return [
        (lambda x: (x, x.flip(-1)))(torch.randn(8, 8, generator=generator)) for _ in range(count)
    ]


def test_training_is_bit_identical_and_the_run_file_holds_finite_rows(
    tmp_path, quiet_trainer
) -> None:
    probe = HessianSpectrum(k=2, every_n_steps=2, batches=_set_of(), measurements=[HessianTrace(6)])
    recorded = _teacher_student_fit(quiet_trainer, tmp_path / "run.h5", [probe])
    assert torch.equal(recorded, _teacher_student_fit(quiet_trainer))
    (stored,) = open_run(tmp_path / "run.h5").attrs["probes"]
    assert stored["settings"]["batches"] == 3 and stored["settings"]["keep_graphs"] is True
    with h5py.File(tmp_path / "run.h5", "r") as file:
        group = file["series/hessian"]
        assert list(group["step"][:]) == [0, 2]
        assert group["batch_rayleigh"].shape == (2, 3)
        for name in ("eigenvalues", "batch_rayleigh", "batch_rayleigh_std", "trace"):
            assert np.isfinite(group[name][:]).all()
        np.testing.assert_allclose(
            group["batch_rayleigh"][:].mean(1), group["eigenvalues"][:, 0], rtol=1e-3
        )


def test_a_resumed_fit_records_the_rows_of_an_uninterrupted_one(tmp_path, quiet_trainer) -> None:
    def probe():
        return HessianSpectrum(k=2, every_n_steps=1, batches=_set_of())

    _teacher_student_fit(quiet_trainer, tmp_path / "full.h5", [probe()])
    _teacher_student_fit(
        quiet_trainer, tmp_path / "part.h5", [probe()], steps=2, checkpoints=tmp_path / "ckpt"
    )
    (ckpt,) = (tmp_path / "ckpt").glob("*step=2*.ckpt")
    # The resumed probe is given other batches: the checkpoint's set is the one measured.
    resumed = HessianSpectrum(k=2, every_n_steps=1, batches=_set_of(4)[1:])
    _teacher_student_fit(quiet_trainer, tmp_path / "part.h5", [resumed], ckpt=str(ckpt))
    with h5py.File(tmp_path / "full.h5", "r") as full, h5py.File(tmp_path / "part.h5", "r") as part:
        for name in ("step", "eigenvalues", "batch_rayleigh", "loss"):
            np.testing.assert_array_equal(
                part[f"series/hessian/{name}"][:], full[f"series/hessian/{name}"][:]
            )


def test_a_checkpoint_of_another_set_size_is_refused_at_setup() -> None:
    module, batches = _tiny()
    saved = HessianSpectrum(batches=batches)
    saved.setup(SimpleNamespace(strategy=None), module, None)
    other = HessianSpectrum(batches=batches[:2])
    other.load_state_dict(saved.state_dict())
    with pytest.raises(ProbeUnavailable, match="probe set of 3 batch"):
        other.setup(SimpleNamespace(strategy=None), module, None)


def test_an_sdpa_transformer_records_finite_rows() -> None:
    net = tiny_gpt2.LightningGPT2()
    batches = [tiny_gpt2.collate(tiny_gpt2.examples(4, seed=s)) for s in range(2)]
    probe = HessianSpectrum(k=1, tol=1e-3, max_hvp=30, batches=batches)
    probe.setup(SimpleNamespace(strategy=None), net, None)
    row = probe.measure(net, 0)
    assert all(np.isfinite(v).all() for name, v in row.items() if name != "error_bounds")
    assert row["batch_rayleigh"].shape == (2,)
    assert row["batch_rayleigh_std"] > 0


def _ddp_rank(rank: int, init_method: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    try:
        module, batches = _tiny()
        mine = [batches[rank], batches[rank + 1]]  # each rank its own set of two
        torch.save(_measured(module, mine), out.format(rank))
        uneven = HessianSpectrum(batches=batches[: 2 + rank])  # 2 batches on rank 0, 3 on 1
        with pytest.raises(ProbeUnavailable, match=r"probe sets hold \[2, 3\] batches"):
            uneven.setup(SimpleNamespace(strategy=None), module, None)
    finally:
        dist.destroy_process_group()


def test_under_ddp_the_set_is_per_rank_and_products_are_averaged(tmp_path) -> None:
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
    module, batches = _tiny()
    # Rank 0 holds batches 0 and 1, rank 1 holds 1 and 2: the mean of the four losses.
    mean, each = _dense(module, [batches[0], batches[1], batches[1], batches[2]])
    values, vectors = torch.linalg.eigh(mean)
    np.testing.assert_allclose(rows[0]["eigenvalues"], values.flip(0)[:2].numpy(), rtol=1e-7)
    # The i-th quotient is along the i-th batches of both ranks: (H_0 + H_1)/2, (H_1 + H_2)/2.
    v1 = vectors[:, -1]
    by_hand = [float(v1 @ (each[0] + each[1]) @ v1) / 2, float(v1 @ (each[2] + each[3]) @ v1) / 2]
    np.testing.assert_allclose(rows[0]["batch_rayleigh"], by_hand, rtol=0, atol=1e-7)
