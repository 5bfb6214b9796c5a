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


# --- ParameterShards and unsharded_copy on raw fully_shard modules, without Lightning ---------


class Tied(torch.nn.Module):
    """Uneven first dimensions (5 and 1 rows over two ranks), a bf16 tensor, a weight tied
    between embedding and head, and a user's forward hook."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 3)
        self.mix = torch.nn.Linear(3, 1)
        self.scale = torch.nn.Parameter(torch.randn(1, 3, dtype=torch.bfloat16))
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.seen = []
        self.mix.register_forward_hook(lambda m, i, o: self.seen.append(o.shape))

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.mix(h) * self.scale.float()
        return self.head(h).logsumexp(-1).mean()


def _raw_main(rank: int, port: int, how: str, results) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from dynamics.sharding import shards as shards_module

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = Tied()
        tokens = torch.tensor([[0, 4, 2], [1, 3, 3]])[rank : rank + 1]
        if how == "fsdp2":
            fully_shard(model.mix)
            fully_shard(model)
            shards_module.BUCKET_ENTRIES = 4  # many buckets, a parameter larger than one alone
            shards = ParameterShards.of(model)
            with unsharded_copy(model, shards) as copy:
                loss = copy(tokens)
                grads = torch.autograd.grad(loss, list(copy.parameters()))
                results[rank] = {
                    "names": shards.layout.names,
                    "shapes": shards.layout.shapes,
                    "here": shards.here,
                    "hash": shards.hash(model),
                    "whole": shards.gather(shards.local(model)),
                    "grads": [g.clone() for g in grads],
                    "copy_params": len(list(copy.parameters())),
                    "hooks_fired": len(model.seen),
                    "copy_class": type(copy).__name__,
                    "fsdp_hooks_left": sum(len(m._forward_pre_hooks) for m in copy.modules()),
                }
        elif how == "mixed":
            fully_shard(model.mix)  # the rest stays whole on every rank
            try:
                ParameterShards.of(model)
            except Exception as error:
                results[rank] = f"{type(error).__name__}: {error}"
        elif how == "tensor-parallel":
            mesh = init_device_mesh("cpu", (2,))
            weight = model.mix.weight
            model.mix.weight = torch.nn.Parameter(
                distribute_tensor(weight.detach(), mesh, [Shard(1)])
            )
            try:
                ParameterShards.of(model)
            except Exception as error:
                results[rank] = f"{type(error).__name__}: {error}"
    finally:
        dist.destroy_process_group()


def _raw(how: str) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.start_processes(_raw_main, args=(port, how, results), nprocs=2, start_method="fork")
    return dict(results)


def test_uneven_tied_and_bf16_parameters_gather_and_hash_as_unsharded():
    torch.manual_seed(0)
    model = Tied()
    layout = ParameterLayout.of(model)
    theta = parameter_vector(model, layout)
    losses = [model(torch.tensor([[0, 4, 2]])), model(torch.tensor([[1, 3, 3]]))]
    expected = [torch.autograd.grad(loss, list(model.parameters())) for loss in losses]
    results = _raw("fsdp2")
    for rank in (0, 1):
        got = results[rank]
        assert got["names"] == layout.names and got["shapes"] == layout.shapes
        assert got["copy_params"] == len(layout.names)  # the tied weight is one parameter
        assert got["copy_class"] == "Tied" and got["fsdp_hooks_left"] == 0
        assert got["hooks_fired"] == 1  # the user's hook ran in the copy, FSDP's did not
        for g, e in zip(got["grads"], expected[rank]):
            torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)
    assert results[0]["here"] != results[1]["here"]  # 3 + 2 rows, 1 + 0 rows
    torch.testing.assert_close(results[0]["whole"], theta, rtol=0, atol=0)
    assert results[0]["hash"] == vector_hash(theta)


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("mixed", "is whole on every rank while others are sharded"),
        ("tensor-parallel", "only sharding on dim 0"),
    ],
)
def test_layouts_the_toolkit_cannot_describe_are_refused_in_one_line(how, message):
    results = _raw(how)
    for rank in (0, 1):
        assert results[rank].startswith("UnsupportedSharding: ")
        assert message in results[rank] and "\n" not in results[rank]
