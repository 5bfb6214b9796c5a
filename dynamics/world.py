"""Rank, world size and the few collectives probes need, in one place.

Probes measure statistics of the global batch: each rank reduces its own micro-batches to sums
and counts, and one collective adds them up. Everything that talks to ``torch.distributed`` goes
through here, so that a later strategy (sharding, another training loop) changes one module.
Outside an initialised process group of more than one process every function is the identity
of a single process: no collective, no cost.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

#: How :func:`all_reduce` combines the ranks' values.
ReduceOp = Literal["sum", "max"]

_OPS = {"sum": "SUM", "max": "MAX"}


@contextmanager
def process_group(rank: int, size: int, rendezvous: Path) -> Iterator[None]:
    """This process as rank ``rank`` of ``size`` CPU (gloo) processes meeting through the file
    ``rendezvous``, for the duration: offline tools that split work across processes.

    Example::

        with process_group(rank, 2, folder / "rendezvous"):
            part = evaluate(my_share)  # world.all_gather(...) inside
    """
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def is_distributed() -> bool:
    """Whether this process is one of several in an initialised default process group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's global rank (0 outside a process group).

    Example::

        if rank() == 0:
            print("written by rank zero")
    """
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """How many processes share the default process group (1 outside one).

    Example::

        global_batch = world_size() * local_batch
    """
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def collective_device() -> torch.device:
    """Where tensors must be for this process group's collectives: the current CUDA device
    under NCCL (which moves CUDA tensors only), else the CPU.

    Example::

        counts = torch.tensor(local_counts, device=collective_device())
    """
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(tensors: Sequence[torch.Tensor], op: ReduceOp = "sum") -> list[torch.Tensor]:
    """Each tensor combined over every rank by ``op``, in one collective.

    The tensors are packed into one float64 buffer (so integer counts and float32 sums travel
    together, exactly), reduced once, and unpacked into new tensors of their own shapes and
    dtypes; the inputs are left as they were. No host sync: on a GPU the collective is queued on
    the device like any kernel. Every rank must call it with tensors of the same shapes.
    In a single process the tensors are returned as they are.

    Example::

        total, count = all_reduce([loss_sum, n])  # one collective; a no-op on one process
    """
    if op not in _OPS:
        raise ValueError(f"op must be one of {', '.join(_OPS)}, got {op!r}")
    if not is_distributed() or not tensors:
        return list(tensors)
    buffer = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
    dist.all_reduce(buffer, op=getattr(dist.ReduceOp, _OPS[op]))
    sizes = [t.numel() for t in tensors]
    return [part.reshape(t.shape).to(t.dtype) for part, t in zip(buffer.split(sizes), tensors)]


def average(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` averaged over every rank, in place (the data-parallel mean of a gradient).

    Example::

        average(gradient)  # in place: the mean over ranks, as DDP's step applies
    """
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        tensor /= dist.get_world_size()
    return tensor


def all_gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape and dtype on each), in rank order, on every rank.

    Example::

        lengths = all_gather(torch.tensor(local_lengths))  # one row per rank
    """
    if not is_distributed():
        return [tensor.clone()]
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return parts


def gather_to_zero(tensor: torch.Tensor) -> list[torch.Tensor] | None:
    """Every rank's ``tensor`` (same shape on each), in rank order, on rank zero; None elsewhere.

    Gathered with ``all_gather``, which every backend (gloo, NCCL) implements for any shape.

    Example::

        rows = gather_to_zero(local_rows)  # a list on rank zero, None elsewhere
    """
    parts = all_gather(tensor)
    return parts if rank() == 0 else None


def gather_objects_to_zero(value: Any) -> list[Any] | None:
    """Every rank's picklable ``value``, in rank order, on rank zero; None elsewhere.

    Example::

        batches = gather_objects_to_zero(state)  # a list on rank zero, None elsewhere
    """
    if not is_distributed():
        return [value]
    parts = [None] * dist.get_world_size() if rank() == 0 else None
    dist.gather_object(value, parts, dst=0)
    return parts


def broadcast_from_zero(value: Any) -> Any:
    """Rank zero's picklable ``value`` on every rank: a decision every rank must share (stop
    or go on), so that none waits in a collective the others left.

    Example::

        problem = broadcast_from_zero(check() if rank() == 0 else None)
    """
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, device=collective_device())
    return box[0]


#: Whose batch a probe's statistics are of: every rank's (the global batch: sums and counts
#: reduced across ranks, one collective per due step) or rank zero's alone (no collective).
Reduce = Literal["global", "rank0"]


def checked_reduce(reduce: str) -> Reduce:
    """``reduce`` if it is a :data:`Reduce`.

    Raises:
        ValueError: otherwise.
    """
    if reduce not in ("global", "rank0"):
        raise ValueError(f"reduce must be 'global' or 'rank0', got {reduce!r}")
    return reduce
