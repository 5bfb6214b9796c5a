"""ParameterDisplacement scales its snapshot plan to the budget: any model size, any run length."""

from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pytorch_lightning import LightningModule
from pytorch_lightning.strategies import FSDPStrategy, ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from dynamics import open_run
from dynamics.callbacks import DynamicsRecorder, ParameterDisplacement
from dynamics.params.vectors import parameter_vector


class Wide(LightningModule):
    """9,003,000 float32 parameters: above what 64 MiB holds two snapshots of."""

    def __init__(self, width: int = 3000) -> None:
        super().__init__()
        self.layer = nn.Linear(width, width)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.layer(batch), batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(torch.randn(8, 3000, generator=torch.Generator().manual_seed(0)), 4)


def displacement_settings(run):
    [probe] = [p for p in run.attrs["probes"] if p["name"] == "displacement"]
    return probe["settings"]["snapshots"]


def test_the_default_recorder_records_a_9m_parameter_model(tmp_path, quiet_trainer):
    module, path = Wide(), tmp_path / "wide.h5"
    theta0 = parameter_vector(module)
    assert theta0.numel() == 9_003_000
    with pytest.warns(UserWarning, match="holds fewer than 2 float32 snapshots"):
        quiet_trainer(max_steps=2, callbacks=[DynamicsRecorder(path)]).fit(module)
    run = open_run(path)
    assert {"loss", "hidden_norms", "displacement"} <= set(run.groups)
    assert "snapshots" not in run.groups
    np.testing.assert_array_equal(run.series("displacement").step, [0, 1])
    np.testing.assert_array_equal(run.vector("theta0"), theta0.numpy())
    np.testing.assert_array_equal(run.vector("theta_final"), parameter_vector(module).numpy())
    [event] = run.events()
    assert (event.step, event.probe, event.kind) == (0, "displacement", "warning")
    assert "9,003,000 parameters (34.3 MiB each)" in event.message
    assert "storing θ0 and θT only" in event.message
    assert displacement_settings(run) == {
        "period": 0,
        "expected": None,
        "dtype": "float32",
        "bytes_each": 4 * 9_003_000,
        "budget_mb": 64.0,  # the default's ceiling: 8 snapshots would take 274 MiB
        "budget": "default",
    }


# float16 keeps an absolute 2⁻²⁴ below its normal range (6·10⁻⁵); bfloat16 has float32's range.
@pytest.mark.parametrize(
    "dtype, rtol, atol", [("float16", 2**-11, 2**-25), ("bfloat16", 2**-8, 1e-38)]
)
def test_half_precision_snapshots_fit_where_float32_ones_do_not(
    tmp_path, quiet_trainer, dtype, rtol, atol
):
    module, path = Wide(), tmp_path / "half.h5"
    theta0 = parameter_vector(module).numpy()
    probe = ParameterDisplacement(snapshot_dtype=dtype)
    quiet_trainer(max_steps=2, callbacks=[DynamicsRecorder(path, [probe])]).fit(module)
    run = open_run(path)
    assert run.events() == []
    snapshots = run.series("snapshots")
    np.testing.assert_array_equal(snapshots.step, [0, 1])
    np.testing.assert_allclose(snapshots["theta"][0], theta0, rtol=rtol, atol=atol)
    assert displacement_settings(run) == {
        "period": 1,
        "expected": 2,
        "dtype": dtype,
        "bytes_each": 2 * 9_003_000,
        "budget_mb": 64.0,  # the default's ceiling: 8 snapshots would take 274 MiB
        "budget": "default",
    }
    with h5py.File(path) as file:  # half the bytes on disk, and the precision is said there
        stored = file["series/snapshots/theta"]
        assert stored.dtype.itemsize == 2
        assert dtype in (str(stored.dtype), stored.attrs.get("encoding"))


class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.randn(3, 4, 3000, generator=torch.Generator().manual_seed(0)))


def test_a_run_of_unknown_length_keeps_no_snapshots_and_says_why(tmp_path, quiet_trainer):
    path = tmp_path / "stream.h5"
    module = Wide()
    probe = ParameterDisplacement(snapshot_budget_mb=1000)
    with pytest.warns(UserWarning, match="length is unknown"):
        quiet_trainer(max_epochs=1, callbacks=[DynamicsRecorder(path, [probe])]).fit(
            module, DataLoader(Stream(), batch_size=None)
        )
    run = open_run(path)
    assert "snapshots" not in run.groups and len(run.series("displacement")) == 3
    assert "set snapshot_every_n_steps" in run.events()[0].message


@pytest.mark.parametrize("strategy", [FSDPStrategy, ModelParallelStrategy])
def test_sharded_strategies_are_not_refused_before_training(strategy):
    """The probe measures from the parameters' shards (tests/test_sharded_displacement.py);
    DeepSpeed, which Lightning runs on GPUs only, is the recorder's to refuse."""
    trainer = SimpleNamespace(strategy=strategy.__new__(strategy))
    assert ParameterDisplacement().validate(trainer, Wide(width=2)) is None


def test_arguments_are_checked_and_nothing_is_declared_before_setup():
    with pytest.raises(ValueError, match="snapshot_dtype must be one of"):
        ParameterDisplacement(snapshot_dtype="int8")
    probe = ParameterDisplacement()
    assert probe.series() == probe.vectors() == probe.settings() == {}


def test_the_default_budget_of_a_50k_parameter_run_stays_small_and_plane_still_draws(
    tmp_path, quiet_trainer, dynamics
):
    """200 steps of a 50,112-parameter model (issue 22 item 11: such runs made 50–60 MB files):
    the default budget holds floor(4 MiB / 200,448 bytes) = 20 snapshots, period ceil(200 / 19)
    = 11, and `dynamics plane` draws the two runs from them."""
    from dynamics.callbacks import GradientPlane
    from dynamics.experiments import TeacherStudentData, TeacherStudentModule

    arch = dict(width=64, expansion=2, depth=3)
    paths = [tmp_path / "a.h5", tmp_path / "b.h5"]
    for path, shift in zip(paths, ("none", "expected")):
        module = TeacherStudentModule(**arch, shift=shift)
        assert sum(p.numel() for p in module.parameters()) == 50_112
        probes = [ParameterDisplacement(every_n_steps=10), GradientPlane()]
        recorder = DynamicsRecorder(path, probes)
        data = TeacherStudentData(**arch, batch_size=16)
        quiet_trainer(max_steps=200, callbacks=[recorder]).fit(module, data)
    run = open_run(paths[0])
    snapshots = run.series("snapshots")
    np.testing.assert_array_equal(snapshots.step, np.arange(0, 200, 11))
    assert displacement_settings(run) == {
        "period": 11,
        "expected": 19,
        "dtype": "float32",
        "bytes_each": 4 * 50_112,
        "budget_mb": 4.0,
        "budget": "default",
    }
    size = paths[0].stat().st_size
    assert size < 5 * 2**20, size  # 4 MiB of snapshots, θ0, θT, g0 and the series
    info = dynamics("info", paths[0])
    assert "snapshots 19 of θ (every 11 steps, 3.6 MiB; default budget 4 MiB)" in info.stdout
    out = tmp_path / "plane.html"
    result = dynamics("plane", *paths, "-o", out, "--grid", "5", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert out.stat().st_size > 100_000
