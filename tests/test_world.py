"""dynamics.world: the collectives probes use, on two forked gloo processes and in one."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dynamics import world


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        counts = torch.tensor([rank + 1, 10], dtype=torch.int64)
        sums = torch.tensor([[0.5 * rank, 1.0]], dtype=torch.float32)
        summed = world.all_reduce([counts, sums])
        (largest,) = world.all_reduce([torch.tensor([float(rank), -float(rank)])], "max")
        gathered = world.gather_to_zero(torch.tensor([rank, 2 * rank]))
        results[rank] = {
            "rank": world.rank(),
            "size": world.world_size(),
            "summed": [t.tolist() for t in summed],
            "dtypes": [str(t.dtype) for t in summed],
            "inputs_kept": counts.tolist() == [rank + 1, 10],
            "max": largest.tolist(),
            "gathered": None if gathered is None else [t.tolist() for t in gathered],
            "average": world.average(torch.tensor([float(rank)])).tolist(),
        }
    finally:
        dist.destroy_process_group()


def test_collectives_on_two_processes():
    results = mp.Manager().dict()
    mp.start_processes(_rank_main, args=(_free_port(), results), nprocs=2, start_method="fork")
    for rank in range(2):
        got = results[rank]
        assert (got["rank"], got["size"]) == (rank, 2)
        assert got["summed"] == [[3, 20], [[0.5, 2.0]]]
        assert got["dtypes"] == ["torch.int64", "torch.float32"] and got["inputs_kept"]
        assert got["max"] == [1.0, 0.0]
        assert got["average"] == [0.5]
    assert results[0]["gathered"] == [[0, 0], [1, 2]] and results[1]["gathered"] is None


def test_one_process_is_the_identity():
    assert not world.is_distributed() and (world.rank(), world.world_size()) == (0, 1)
    t = torch.tensor([1.0, 2.0])
    assert world.all_reduce([t])[0] is t
    assert world.gather_to_zero(t)[0].tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match="op must be one of sum, max"):
        world.all_reduce([t], "mean")
    with pytest.raises(ValueError, match="reduce must be 'global' or 'rank0'"):
        world.checked_reduce("all")


def test_only_world_talks_to_torch_distributed():
    """Probes and tools reach collectives through dynamics.world (and dynamics.sharding on top
    of it), so that another strategy or training loop changes one module."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    offenders = []
    for folder in ("dynamics", "callbacks", "analysis"):
        for path in (root / folder).rglob("*.py"):
            if path == root / "dynamics" / "world.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                    names = [f"{node.value.id}.{node.attr}"]
                if any(n.split(".")[:2] == ["torch", "distributed"] for n in names):
                    offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not offenders, offenders
