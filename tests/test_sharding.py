"""dynamics.sharding under FSDP1 and FSDP2 on two forked gloo processes: the layout, the hash,
norms, gathers and the whole-parameter copy equal what the unsharded module gives."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch

from dynamics.experiments import TeacherStudentData, TeacherStudentModule
from dynamics.params.layout import ParameterLayout
from dynamics.params.vectors import parameter_vector, vector_hash
from dynamics.sharding import ParameterShards, unsharded_copy
from tests import sharded

ARCH = dict(width=8, expansion=2, depth=3)


class MeasureShards(pl.Callback):
    """At the first batch, on every rank: what ParameterShards and unsharded_copy give."""

    def __init__(self, results) -> None:
        self.results = results

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx:
            return
        shards = ParameterShards.of(pl_module, wrapper=trainer.strategy.model)
        local = shards.local(pl_module)
        (square,) = shards.sum([local.double().square().sum()])
        whole = shards.gather(local)
        all_whole = shards.gather(local, to="all")
        digest = shards.hash(pl_module)
        with unsharded_copy(pl_module, shards) as copy:
            loss = copy.dynamics_loss(batch)
            grads = torch.autograd.grad(loss, list(copy.parameters()), create_graph=True)
            v = [torch.ones_like(g) for g in grads]
            hv = torch.autograd.grad(grads, list(copy.parameters()), v)
        self.results[trainer.global_rank] = {
            "layout": shards.layout,
            "sharded": shards.sharded,
            "local_size": shards.local_size,
            "square": float(square),
            "whole": None if whole is None else whole.clone(),
            "all_whole": all_whole.clone(),
            "hash": digest,
            "loss": float(loss),
            "hv": torch.cat([h.reshape(-1) for h in hv]).clone(),
            "part_roundtrip": bool(torch.equal(shards.part(all_whole), local)),
        }


def _measure(name: str, tmp_path) -> dict:
    import multiprocessing

    results = multiprocessing.Manager().dict()
    torch.manual_seed(0)
    module = sharded.module_for(name, TeacherStudentModule)(**ARCH)
    data = TeacherStudentData(**ARCH, batch_size=8)
    sharded.fit(name, module, data, [MeasureShards(results)], max_steps=1, limit_val_batches=0)
    return dict(results)


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    module = TeacherStudentModule(**ARCH)
    layout = ParameterLayout.of(module)
    return layout, parameter_vector(module, layout)


@pytest.mark.parametrize("name", ["fsdp1", "fsdp2"])
def test_shards_describe_the_unsharded_parameters(name, tmp_path, reference):
    layout, theta = reference
    results = _measure(name, tmp_path)
    ddp = _measure("ddp", tmp_path)
    assert sorted(results) == [0, 1]
    for rank in (0, 1):
        got = results[rank]
        assert got["sharded"]
        assert got["layout"] == layout  # the unsharded names and shapes, not rank 0's pieces
        assert got["local_size"] < layout.size
        assert got["square"] == pytest.approx(float(theta.double().square().sum()), rel=1e-12)
        torch.testing.assert_close(got["all_whole"], theta, rtol=0, atol=0)
        assert got["part_roundtrip"]
        # the copy computes the unsharded loss of the rank's own batch, and its HVPs
        assert got["loss"] == pytest.approx(ddp[rank]["loss"], rel=1e-6)
        torch.testing.assert_close(got["hv"], ddp[rank]["hv"], rtol=1e-5, atol=1e-6)
    assert results[0]["local_size"] + results[1]["local_size"] == layout.size
    torch.testing.assert_close(results[0]["whole"], theta, rtol=0, atol=0)
    assert results[1]["whole"] is None
    assert results[0]["hash"] == vector_hash(theta) and results[1]["hash"] is None
    assert not ddp[0]["sharded"] and ddp[0]["hash"] == vector_hash(theta)
