"""GradientPlane under FSDP1 and FSDP2 on two forked gloo processes: g0, the plane, the (a, b, r)
rows and the end-of-fit views equal the DDP run's over the same global batches, and
``dynamics plane`` draws two sharded run files."""

from __future__ import annotations

import multiprocessing

import h5py
import numpy as np
import pytest
import pytorch_lightning as pl
import torch

from dynamics import open_run
from dynamics.callbacks import DynamicsRecorder, GradientPlane, ParameterDisplacement
from dynamics.experiments import TeacherStudentData, TeacherStudentModule
from dynamics.store import names
from tests import sharded
from tests.conftest import run_dynamics

ARCH = dict(width=8, expansion=2, depth=3)
#: The partner's data seed: another first batch, so its g0 and ours span a plane.
PARTNER_SEED = 3


def _fit(name: str, path, probes, data_seed: int = 2, steps: int = 4, callbacks=()) -> None:
    torch.manual_seed(0)
    module = sharded.module_for(name, TeacherStudentModule)(**ARCH)
    data = TeacherStudentData(**ARCH, batch_size=8, data_seed=data_seed)
    recorder = DynamicsRecorder(path, probes)
    sharded.fit(name, module, data, [recorder, *callbacks], max_steps=steps, limit_val_batches=0)


class HeldVectors(pl.Callback):
    """At the end of fit, on every rank: the sizes of the plane vectors the probe holds."""

    def __init__(self, probe: GradientPlane, results) -> None:
        self.probe, self.results = probe, results

    def on_train_end(self, trainer, pl_module) -> None:
        local = self.probe._local
        self.results[trainer.global_rank] = {
            "local": (local.theta0.numel(), local.u.numel(), local.v.numel()),
            "full": self.probe._g0 is not None and self.probe.plane is not None,
        }


def _plane_probe(partner) -> GradientPlane:
    return GradientPlane(partner=partner, at_end=True, grid=5, checkpoints=3)


def _problems(run) -> list[str]:
    """The probes' disabling and error events (none expected)."""
    return [
        f"{e.probe}: {e.message}"
        for e in run.events()
        if e.kind in (names.EVENT_DISABLED, names.EVENT_ERROR)
    ]


@pytest.fixture(scope="module")
def partner(tmp_path_factory):
    """A DDP run of the same θ0 on other data: the partner whose g0 spans the plane with ours."""
    path = tmp_path_factory.mktemp("partner") / "partner.h5"
    _fit("ddp", path, [GradientPlane()], data_seed=PARTNER_SEED, steps=1)
    return path


@pytest.fixture(scope="module")
def reference(partner, tmp_path_factory):
    path = tmp_path_factory.mktemp("ddp") / "ddp.h5"
    _fit("ddp", path, [_plane_probe(partner)])
    return open_run(path)


@pytest.mark.parametrize("name", ["fsdp1", "fsdp2"])
def test_plane_rows_and_vectors_equal_ddp(name, partner, reference, tmp_path):
    path = tmp_path / f"{name}.h5"
    probe, held = _plane_probe(partner), multiprocessing.Manager().dict()
    _fit(name, path, [probe], callbacks=[HeldVectors(probe, held)])
    run = open_run(path)
    # each rank holds its part of θ0, u and v; the whole g0 and plane only rank 0, which writes
    assert held[0]["local"][0] + held[1]["local"][0] == run.layout.size > held[1]["local"][0]
    assert [held[r]["local"] == (held[r]["local"][0],) * 3 for r in (0, 1)] == [True, True]
    assert [held[r]["full"] for r in (0, 1)] == [True, False]
    assert _problems(run) == [] and _problems(reference) == []
    assert run.attrs[names.ATTR_THETA0_SHA256] == reference.attrs[names.ATTR_THETA0_SHA256]
    got, want = run.series(names.PLANE), reference.series(names.PLANE)
    np.testing.assert_array_equal(got.step, np.arange(4))
    for column in (names.PLANE_A, names.PLANE_B, names.PLANE_R):
        np.testing.assert_allclose(got[column], want[column], rtol=1e-5, atol=1e-9)
    # the rows can fail: the run moves in the plane and out of it
    assert np.abs(want[names.PLANE_A][1:]).min() > 1e-4 and want[names.PLANE_R][-1] > 1e-3
    vectors = [names.G0, names.PLANE_U, names.PLANE_V, names.PLANE_END_STEPS]
    vectors += [
        names.plane_end(view, field)
        for view in names.PLANE_END_VIEWS
        for field in ("alphas", "betas", "losses", "trajectory")
    ]
    vectors += [names.plane_end(names.PLANE_END_VIEWS[1], field) for field in ("u", "v")]
    for vector in vectors:
        theirs = reference.vector(vector)
        assert theirs is not None and np.isfinite(theirs[~np.isnan(theirs)]).all(), vector
        np.testing.assert_allclose(run.vector(vector), theirs, rtol=1e-6, atol=1e-9, err_msg=vector)
    partner_g0 = open_run(partner).vector(names.G0)
    assert not np.allclose(run.vector(names.G0), partner_g0, rtol=1e-2)  # a real plane


def test_plane_command_draws_two_sharded_runs(tmp_path):
    first, second = tmp_path / "a.h5", tmp_path / "b.h5"
    _fit("fsdp1", first, [GradientPlane(), ParameterDisplacement()], data_seed=PARTNER_SEED)
    _fit("fsdp1", second, [GradientPlane(partner=first), ParameterDisplacement()])
    for path in (first, second):
        assert _problems(open_run(path)) == []
    out = tmp_path / "p.html"
    result = run_dynamics("plane", first, second, "-o", out, "--grid", "5", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert out.stat().st_size > 100_000
    with h5py.File(tmp_path / "p.plane.h5") as views:
        losses = views["view1"]["losses"][:]
        assert losses.shape == (5, 5) and np.isfinite(losses).all()
