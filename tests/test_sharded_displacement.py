"""ParameterDisplacement and TrajectoryGeometry under FSDP1 and FSDP2 on two forked gloo
processes record what the same fit records under DDP: every row, θ0, θT, the same snapshots,
and a file an unsharded module loads offline."""

from __future__ import annotations

import math
import multiprocessing

import numpy as np
import pytest
import pytorch_lightning as pl
import torch

from dynamics import open_run
from dynamics.callbacks import DynamicsRecorder, ParameterDisplacement, TrajectoryGeometry
from dynamics.experiments import TeacherStudentData, TeacherStudentModule
from dynamics.model.loading import load_into
from dynamics.params.layout import ParameterLayout
from tests import sharded

ARCH = dict(width=8, expansion=2, depth=3)
STEPS = 8


def budget_mb() -> float:
    """A budget of 3.5 whole snapshots: 3 kept, every 4 steps of 8 (a budget counted on a
    rank's half of θ would keep 7, every 2 steps)."""
    size = ParameterLayout.of(TeacherStudentModule(**ARCH)).size
    return 3.5 * 4 * size / 2**20


class States(pl.Callback):
    """Rank zero's checkpoint states of the probes at the end of the fit, taken on every rank
    together as Lightning takes them (a state may gather the ranks' parts)."""

    def __init__(self, name: str, probes: list, results) -> None:
        self.name, self.probes, self.results = name, probes, results

    def on_train_end(self, trainer, pl_module) -> None:
        states = {p.name: p.state_dict() for p in self.probes}
        if trainer.is_global_zero:
            self.results[self.name] = states


@pytest.fixture(scope="module")
def states() -> dict:
    return multiprocessing.Manager().dict()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, states) -> dict:
    """The run file of the same fit under each strategy."""
    folder = tmp_path_factory.mktemp("sharded_displacement")
    paths = {}
    for name in sharded.STRATEGIES:
        paths[name] = folder / f"{name}.h5"
        torch.manual_seed(0)
        module = sharded.module_for(name, TeacherStudentModule)(**ARCH)
        probes = [
            ParameterDisplacement(snapshot_budget_mb=budget_mb()),
            TrajectoryGeometry(per_tensor=True),
        ]
        recorder = DynamicsRecorder(paths[name], probes)
        data = TeacherStudentData(**ARCH, batch_size=8)
        callbacks = [recorder, States(name, probes, states)]
        sharded.fit(name, module, data, callbacks, max_steps=STEPS, limit_val_batches=0)
    return {name: open_run(path) for name, path in paths.items()}


@pytest.mark.parametrize("name", ["fsdp1", "fsdp2"])
def test_rows_equal_the_unsharded_runs(runs, name):
    ddp, run = runs["ddp"], runs[name]
    assert run.events() == [] and ddp.events() == []  # no probe stepped aside or failed
    for group in ("displacement", "trajectory"):
        expected, got = ddp.series(group), run.series(group)
        np.testing.assert_array_equal(got.step, np.arange(STEPS))
        np.testing.assert_array_equal(got.step, expected.step)
        assert got.values.keys() == expected.values.keys()
        for series, values in expected.values.items():
            # Not an accident: the path grows, the model moves, updates turn.
            assert np.isfinite(values[1:]).all() and np.ptp(values[1:]) > 0, series
            np.testing.assert_allclose(
                got[series], values, rtol=1e-5, atol=1e-7, equal_nan=True, err_msg=series
            )
    cosine = ddp.series("trajectory")["update_cosine"]
    assert math.isnan(cosine[0]) and np.isfinite(cosine[1:]).all()


@pytest.mark.parametrize("name", ["fsdp1", "fsdp2"])
def test_vectors_and_snapshots_equal_the_unsharded_runs(runs, name):
    ddp, run = runs["ddp"], runs[name]
    assert run.layout == ddp.layout
    for vector in ("theta0", "theta_final", "theta_final_step"):
        np.testing.assert_allclose(run.vector(vector), ddp.vector(vector), rtol=1e-6, atol=0)
    assert not np.allclose(ddp.vector("theta0"), ddp.vector("theta_final"))
    expected, got = ddp.series("snapshots"), run.series("snapshots")
    np.testing.assert_array_equal(expected.step, [0, 4])  # the budget's plan on the whole θ
    np.testing.assert_array_equal(got.step, expected.step)
    np.testing.assert_allclose(got["theta"], expected["theta"], rtol=1e-6, atol=0)
    np.testing.assert_array_equal(got["theta"][0], run.vector("theta0"))
    settings = {p["name"]: p["settings"] for p in run.attrs["probes"]}["displacement"]
    assert settings["snapshots"]["bytes_each"] == 4 * ddp.layout.size


@pytest.mark.parametrize("name", ["fsdp1", "fsdp2"])
def test_a_sharded_run_rebuilds_offline_as_the_unsharded_one(runs, name):
    for step in (0, 4, None):  # θ0, a snapshot, θT
        models = []
        for source in ("ddp", name):
            model = TeacherStudentModule(**ARCH)
            assert load_into(runs[source], model, step).step == (STEPS if step is None else step)
            models.append(dict(model.named_parameters()))
        expected, got = models
        assert got.keys() == expected.keys()
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=1e-6, atol=0)


def test_each_step_costs_each_probe_one_all_reduce(tmp_path, monkeypatch):
    """Under FSDP2 every rank sums every norm and cosine of a step in one all-reduce per probe
    (ParameterShards.sum goes through dynamics.world.all_reduce)."""
    import multiprocessing

    from dynamics import world

    calls = multiprocessing.Manager().dict()
    reduce = world.all_reduce

    def counted(tensors, op="sum"):
        calls[world.rank()] = calls.get(world.rank(), 0) + 1
        return reduce(tensors, op)

    monkeypatch.setattr(world, "all_reduce", counted)  # the forked ranks inherit it
    torch.manual_seed(0)
    module = sharded.module_for("fsdp2", TeacherStudentModule)(**ARCH)
    probes = [ParameterDisplacement(snapshot_budget_mb=0), TrajectoryGeometry(per_tensor=True)]
    recorder = DynamicsRecorder(tmp_path / "run.h5", probes)
    data = TeacherStudentData(**ARCH, batch_size=8)
    sharded.fit("fsdp2", module, data, [recorder], max_steps=3, limit_val_batches=0)
    assert dict(calls) == {0: 2 * 3, 1: 2 * 3}
    assert len(open_run(tmp_path / "run.h5").series("trajectory")) == 3


@pytest.mark.parametrize("name", ["fsdp1", "fsdp2"])
def test_rank_zeros_checkpoint_state_holds_the_whole_theta0_and_path(runs, states, name):
    """What Lightning saves of a sharded fit: rank zero's states. The displacement's holds the
    whole θ0, the path's the whole θ0 and last update and the sums so far, as DDP's do."""
    torch.testing.assert_close(
        states[name]["displacement"]["theta0"], states["ddp"]["displacement"]["theta0"]
    )
    expected, got = states["ddp"]["trajectory"], states[name]["trajectory"]
    assert got.keys() == expected.keys() >= {"theta0", "previous", "path", "tensor_path"}
    for key in ("theta0", "previous"):
        assert [t.shape for t in got[key]] == [t.shape for t in expected[key]]
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-8)
    for key in ("path", "previous_squares", "tensor_path"):
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=0)
