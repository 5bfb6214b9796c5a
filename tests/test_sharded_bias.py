"""LossChangeSplit, BiasComponent and BiasAudit under FSDP1 and FSDP2 (two forked gloo
processes): their rows and the recorded audit equal a DDP run's over the same batches."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
import torch

from dynamics.analysis.measures.bias_audit import recorded_audit
from dynamics.callbacks import BiasAudit, BiasComponent, DynamicsRecorder, LossChangeSplit
from dynamics.experiments import TeacherStudentData, TeacherStudentModule
from dynamics.store import names, open_run
from tests import sharded

ARCH = dict(width=8, expansion=2, depth=3, activation="gelu")
STEPS = 4


def _probes():
    return [
        LossChangeSplit(groups="kind", every_n_steps=1),
        BiasComponent(layers=["student.blocks.*.act", "student.blocks.*.up"], every_n_steps=2),
        BiasAudit(draws=2),
    ]


def _record(name: str, path) -> object:
    torch.manual_seed(0)
    module = sharded.module_for(name, TeacherStudentModule)(**ARCH)
    data = TeacherStudentData(**ARCH, batch_size=8)
    recorder = DynamicsRecorder(path, _probes())
    sharded.fit(name, module, data, [recorder], max_steps=STEPS, limit_val_batches=0)
    return open_run(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, object]:
    folder = tmp_path_factory.mktemp("sharded_bias")
    return {name: _record(name, folder / f"{name}.h5") for name in sharded.STRATEGIES}


def _assert_rows_equal(got, reference) -> None:
    assert list(got.values) == list(reference.values)
    np.testing.assert_array_equal(got.step, reference.step)
    for key in reference.values:
        np.testing.assert_allclose(got[key], reference[key], rtol=1e-5, atol=1e-12, err_msg=key)


@pytest.mark.parametrize("name", ["fsdp1", "fsdp2"])
def test_loss_change_split_rows_equal_the_unsharded_runs(runs, name):
    run, ddp = runs[name], runs["ddp"]
    assert [e for e in run.events() if e.probe in (names.LOSS_CHANGE, "bias_component")] == []
    reference = ddp.series(names.LOSS_CHANGE)
    assert len(reference.step) == STEPS and reference["converged"].all()
    _assert_rows_equal(run.series(names.LOSS_CHANGE), reference)
    assert run.columns(names.LOSS_CHANGE, "terms") == ddp.columns(names.LOSS_CHANGE, "terms")


@pytest.mark.parametrize("name", ["fsdp1", "fsdp2"])
def test_bias_component_rows_equal_the_unsharded_runs(runs, name):
    run, ddp = runs[name], runs["ddp"]
    reference = ddp.series(names.BIAS_COMPONENT)
    assert len(reference.step) == STEPS // 2
    _assert_rows_equal(run.series(names.BIAS_COMPONENT), reference)
    assert run.columns(names.BIAS_COMPONENT, "bias_share") == ddp.columns(
        names.BIAS_COMPONENT, "bias_share"
    )


@pytest.mark.parametrize("name", ["fsdp1", "fsdp2"])
def test_bias_audit_equals_the_unsharded_runs(runs, name):
    run, ddp = runs[name], runs["ddp"]
    assert [e for e in run.events() if e.probe == "bias_audit"] == []
    got, reference = recorded_audit(run), recorded_audit(ddp)
    assert reference.layers and reference.activations
    assert got == reference


class FailingSplit(LossChangeSplit):
    """Fails on rank zero (the one that measures) at its second record."""

    def measure(self, *args, **kwargs):
        if self._sum_delta and not hasattr(self, "_failed"):
            self._failed = True
            raise FloatingPointError("the loss is nan at t = 1 on the step")
        return super().measure(*args, **kwargs)


def test_a_split_failing_on_rank_zero_stops_every_rank_and_training_goes_on(tmp_path):
    """Only rank zero measures; were the other rank left gathering for a probe rank zero has
    given up, the fit would hang at the next due step."""
    torch.manual_seed(0)
    module = sharded.module_for("fsdp1", TeacherStudentModule)(**ARCH)
    final = tmp_path / "final.pt"
    recorder = DynamicsRecorder(tmp_path / "x.h5", [FailingSplit(every_n_steps=1)])
    data = TeacherStudentData(**ARCH, batch_size=8)
    callbacks = [recorder, sharded.FinalParameters(final)]
    # A collective left waiting fails the fit in a minute rather than hang the test.
    strategy = sharded.CPUFSDPStrategy(timeout=timedelta(seconds=60))
    sharded.fit(
        "fsdp1", module, data, callbacks, max_steps=STEPS, limit_val_batches=0, strategy=strategy
    )
    run = open_run(tmp_path / "x.h5")
    (event,) = [e for e in run.events() if e.probe == names.LOSS_CHANGE]
    assert (event.step, event.kind) == (1, names.EVENT_ERROR)
    assert "FloatingPointError" in event.message
    np.testing.assert_array_equal(run.series(names.LOSS_CHANGE).step, [0])
    assert final.exists()  # every rank trained to the end
