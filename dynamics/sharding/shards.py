"""Which entries of each parameter this rank holds, and the few operations on them probes need.

Under FSDP a rank holds a piece of each parameter: FSDP1 (Lightning's ``FSDPStrategy``, whose
default ``use_orig_params=True`` keeps the original parameters as 1-D views of the rank's shard)
and FSDP2 (``fully_shard``: a ``DTensor`` sharded on dim 0). Either way the pieces of one
parameter, taken in rank order, are its flattened entries end to end, each entry held by one
rank. :class:`ParameterShards` records that partition once, at fit start, for the parameters in
their unsharded layout, so that a probe can

- take this rank's part of θ, of its gradient and of any stored flat vector (:meth:`local`,
  :meth:`local_grad`, :meth:`part`), sums over which :func:`dynamics.world.all_reduce` turns
  into global norms and inner products, exactly;
- gather full vectors or parameters to rank zero, or to every rank, a bucket of tensors at a
  time (:meth:`gather`, :meth:`full_tensors`), so that no rank ever holds a whole padded copy;
- hash θ as the unsharded run does (:meth:`hash`), bit for bit.

Without sharding (one device, DDP) every rank holds every entry and all of this is the identity:
no collective, no copy beyond what the unsharded code made.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn

from dynamics import world
from dynamics.errors import DynamicsError
from dynamics.params.layout import ParameterLayout
from dynamics.params.naming import module_class, named_parameters
from dynamics.params.vectors import storable

#: Which parameters a :class:`ParameterShards` describes: the trainable ones in
#: ``named_parameters`` order (θ's layout), or the frozen ones by name (the frozen hash's order).
Selection = Literal["trainable", "frozen"]

#: Where gathered tensors arrive: on rank zero alone, or on every rank.
Destination = Literal["zero", "all"]

#: Entries gathered per collective: 64 MiB of float32, whatever the model's size.
BUCKET_ENTRIES = 1 << 24


class UnsupportedSharding(DynamicsError):
    """Parameters laid out across ranks in a way the toolkit cannot describe (the message says
    which parameter, how, and what to use instead)."""


@dataclass(frozen=True)
class ParameterShards:
    """The unsharded layout of a module's parameters and which entries of each this rank holds.

    Built by :meth:`of` on every rank at once (one small collective under sharding).

    Example::

        shards = ParameterShards.of(pl_module)          # every rank, at fit start
        local = shards.local(pl_module) - theta0_part  # this rank's part of θ - θ0
        (sq,) = world.all_reduce([local.square().sum()]) if shards.sharded else [...]
        norm = sq.sqrt()                                # ‖θ - θ0‖ over every rank's entries

    Args:
        layout: the parameters' unsharded names and shapes.
        lengths: ``lengths[r][i]``: entries of parameter ``i`` held by rank ``r``; under no
            sharding a single row of every parameter's size.
        rank: this process's rank.
    """

    layout: ParameterLayout
    lengths: tuple[tuple[int, ...], ...]
    rank: int = 0

    @classmethod
    def of(
        cls, module: nn.Module, select: Selection = "trainable", wrapper: nn.Module | None = None
    ) -> ParameterShards:
        """The shards of ``module``'s ``select`` parameters; every rank must call it together.

        Args:
            module: the module (a LightningModule, whose parameters FSDP1 replaced by views).
            select: which parameters.
            wrapper: what the strategy wrapped ``module`` in (Lightning's
                ``trainer.strategy.model``): FSDP1 keeps the unsharded shapes there.

        Raises:
            UnsupportedSharding: a parameter is sharded other than on dim 0 over all ranks,
                or some parameters are sharded and others replicated.
        """
        reshard(module)
        named = _selected(module, select)
        fsdp1 = _fsdp1_shapes([module, *([wrapper] if wrapper is not None else [])])
        shapes = [_full_shape(name, p, fsdp1) for name, p in named]
        held = [_local_entries(p).numel() for _, p in named]
        layout = ParameterLayout(tuple(n for n, _ in named), tuple(shapes))
        if not world.is_distributed():
            return cls(layout, (tuple(held),))
        table = world.all_gather(
            torch.tensor(held, dtype=torch.int64, device=world.collective_device())
        )
        lengths = tuple(tuple(int(v) for v in row.tolist()) for row in table)
        whole = [all(row[i] == n for row in lengths) for i, n in enumerate(layout.numels)]
        if all(whole):  # DDP, FSDP1's NO_SHARD: every rank holds everything
            return cls(layout, (tuple(layout.numels),), world.rank())
        for i, (name, numel) in enumerate(zip(layout.names, layout.numels)):
            pieces = [row[i] for row in lengths]
            if whole[i]:
                raise UnsupportedSharding(
                    f"parameter {name!r} is whole on every rank while others are sharded; "
                    "shard every parameter (apply fully_shard to the root module too, or do "
                    "not ignore modules in FSDP) so that each entry is held by one rank"
                )
            if sum(pieces) != numel:
                raise UnsupportedSharding(
                    f"parameter {name!r} has {numel} entries but the ranks hold {pieces}; "
                    "only sharding on dim 0 across every rank (FSDP, fully_shard) is supported"
                )
        return cls(layout, lengths, world.rank())

    @property
    def sharded(self) -> bool:
        """Whether the entries are spread over several ranks (then sums need an all-reduce)."""
        return len(self.lengths) > 1

    @property
    def here(self) -> tuple[int, ...]:
        """Entries of each parameter this rank holds."""
        return self.lengths[self.rank] if self.sharded else self.lengths[0]

    @property
    def starts(self) -> tuple[int, ...]:
        """Where this rank's piece of each parameter begins in the flattened parameter."""
        return tuple(
            sum(row[i] for row in self.lengths[: self.rank]) for i in range(len(self.here))
        )

    @property
    def local_size(self) -> int:
        """Length of this rank's part of a flat vector."""
        return sum(self.here)

    def pieces(self, module: nn.Module) -> list[torch.Tensor]:
        """This rank's entries of each parameter, flat and detached (views, not copies); every
        rank must call it together (FSDP2 may have to put its shards back, see :func:`reshard`)."""
        if self.sharded:
            reshard(module)
        params = dict(_selected(module, self._select(module)))
        return [_local_entries(params[name]).detach() for name in self.layout.names]

    def local(self, module: nn.Module) -> torch.Tensor:
        """This rank's part of the flat parameter vector θ (a copy; half precision as float32).

        Example::

            theta0_part = shards.local(pl_module)
        """
        return storable(torch.cat(self.pieces(module)))

    def local_grad(self, module: nn.Module) -> torch.Tensor | None:
        """This rank's part of the flat gradient ``.grad`` (a copy), or None when no parameter
        has one. A parameter without ``.grad`` counts as zeros."""
        params = dict(_selected(module, self._select(module)))
        grads = [params[name].grad for name in self.layout.names]
        if all(g is None for g in grads):
            return None
        parts = [
            _local_entries(g).detach() if g is not None else torch.zeros(n, device=_device(params))
            for g, n in zip(grads, self.here)
        ]
        return storable(torch.cat(parts))

    def part(self, vector: torch.Tensor | np.ndarray) -> torch.Tensor:
        """This rank's part of a full flat ``vector`` in the layout (a copy; a tensor).

        Example::

            g0_part = shards.part(run.vector("g0"))
        """
        vector = torch.as_tensor(
            np.asarray(vector) if not isinstance(vector, torch.Tensor) else vector
        )
        if not self.sharded:
            return vector.clone()
        offsets = np.cumsum((0, *self.layout.numels))
        return torch.cat(
            [
                vector[offset + start : offset + start + n]
                for offset, start, n in zip(offsets, self.starts, self.here)
            ]
        )

    def sum(self, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each of this rank's partial sums added over the ranks that hold parts (one
        collective under sharding; the values themselves otherwise).

        Example::

            dot, sq = shards.sum([(a * b).sum(), a.square().sum()])
        """
        return world.all_reduce(values) if self.sharded else list(values)

    def gather(
        self, local: torch.Tensor, to: Literal["zero", "all"] = "zero"
    ) -> torch.Tensor | None:
        """The full flat vector of which ``local`` is this rank's part: on rank zero (None
        elsewhere) or on every rank. Gathered a bucket of parameters at a time.

        Example::

            theta = shards.gather(shards.local(pl_module))  # the whole θ on rank zero
        """
        if not self.sharded:
            return local
        pieces = torch.split(local, self.here)
        tensors = [t.reshape(-1) for t in self._gathered(pieces, to)]
        return torch.cat(tensors) if tensors else None

    def full_tensors(
        self, module: nn.Module, to: Destination = "zero"
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, whole parameter)`` in layout order, on rank zero (nothing is yielded
        elsewhere, but every rank must run the loop) or on every rank; a bucket at a time.

        Example::

            for name, tensor in shards.full_tensors(pl_module):
                hasher.update(...)
        """
        pieces = self.pieces(module)
        if not self.sharded:
            yield from zip(
                self.layout.names, (p.view(s) for p, s in zip(pieces, self.layout.shapes))
            )
            return
        yield from zip(self.layout.names, self._gathered(pieces, to))

    def hash(self, module: nn.Module) -> str | None:
        """:func:`dynamics.params.vectors.vector_hash` of the full θ (on rank zero; None
        elsewhere; every rank must call it), computed a bucket of parameters at a time.

        Example::

            shards.hash(pl_module) == run.theta0_sha256  # on rank zero
        """
        hasher = hashlib.sha256()
        for _, tensor in self.full_tensors(module):
            array = tensor.detach().float().cpu().numpy()
            hasher.update(np.ascontiguousarray(array, dtype="<f4").tobytes())
        return hasher.hexdigest() if world.rank() == 0 or not self.sharded else None

    @torch.no_grad()
    def load(self, module: nn.Module, local: torch.Tensor) -> None:
        """Copy this rank's part ``local`` of a flat vector into the module's own entries.

        Example::

            shards.load(pl_module, theta0_part)  # back to θ0 on every rank
        """
        for piece, chunk in zip(self.pieces(module), torch.split(local, self.here)):
            piece.copy_(chunk)

    def _select(self, module: nn.Module) -> Selection:
        trainable = [n for n, p in named_parameters(module) if p.requires_grad]
        return "trainable" if list(self.layout.names) == trainable else "frozen"

    def _gathered(
        self, pieces: list[torch.Tensor] | tuple[torch.Tensor, ...], to: str
    ) -> Iterator[torch.Tensor]:
        """Each parameter whole, from every rank's pieces, a bucket at a time."""
        for bucket in _buckets(self.layout.numels):
            # One buffer per bucket: mixed dtypes travel as their common type, exactly, and
            # come back in their own.
            mine = [pieces[i].reshape(-1) for i in bucket]
            sent = [sum(row[i] for i in bucket) for row in self.lengths]
            flat = torch.cat(mine) if mine else pieces[0].new_empty(0)
            padded = torch.zeros(max(sent), dtype=flat.dtype, device=flat.device)
            padded[: flat.numel()] = flat
            parts = world.all_gather(padded) if to == "all" else world.gather_to_zero(padded)
            if parts is None:
                continue
            by_rank = [
                torch.split(part[:size], [row[i] for i in bucket])
                for part, size, row in zip(parts, sent, self.lengths)
            ]
            for j, i in enumerate(bucket):
                whole = torch.cat([rank_pieces[j] for rank_pieces in by_rank])
                yield whole.to(pieces[i].dtype).view(self.layout.shapes[i])


def reshard(module: nn.Module) -> None:
    """Put FSDP2's shards back on each module ``fully_shard`` sharded (nothing to do for other
    modules); every rank must call it together.

    FSDP2 keeps the root's parameters whole after a forward without backward (the sanity
    check's, a validation run's) until the next backward; read then, each rank would hold every
    entry. Resharding frees the whole copies, values unchanged; the next forward gathers them
    again on every rank alike.
    """
    for child in module.modules():
        if module_class(child) is not type(child):  # fully_shard swapped its class
            child.reshard()


def _selected(module: nn.Module, select: Selection) -> list[tuple[str, nn.Parameter]]:
    if select == "trainable":
        return [(n, p) for n, p in named_parameters(module) if p.requires_grad]
    return sorted((n, p) for n, p in named_parameters(module) if not p.requires_grad)


def _local_entries(tensor: torch.Tensor) -> torch.Tensor:
    """The entries of ``tensor`` this rank holds, flat: a ``DTensor``'s local shard, else the
    tensor itself (FSDP1's views of the rank's shard are flat already)."""
    to_local = getattr(tensor, "to_local", None)
    return (to_local() if to_local is not None else tensor).reshape(-1)


def _full_shape(
    name: str, param: nn.Parameter, fsdp1: dict[int, tuple[int, ...]]
) -> tuple[int, ...]:
    """The unsharded shape of ``param``."""
    placements = getattr(param, "placements", None)
    if placements is not None:  # a DTensor: fully_shard (FSDP2) or tensor parallelism
        mesh = param.device_mesh
        if mesh.ndim != 1 or mesh.size() != world.world_size() or len(placements) != 1:
            raise UnsupportedSharding(
                f"parameter {name!r} is a DTensor on a {mesh.ndim}-D mesh of {mesh.size()} "
                f"ranks; only fully_shard over every rank (a 1-D mesh) is supported"
            )
        (placement,) = placements
        if not (placement.is_shard(0) or placement.is_replicate()):
            raise UnsupportedSharding(
                f"parameter {name!r} is placed {placement}; only sharding on dim 0 "
                "(fully_shard's default) is supported, not tensor parallelism"
            )
        return tuple(param.shape)
    return fsdp1.get(id(param), tuple(param.shape))


def _fsdp1_shapes(modules: list[nn.Module]) -> dict[int, tuple[int, ...]]:
    """``{id(parameter): unsharded shape}`` of the parameters FSDP1 flattened into shards.

    FSDP1 keeps no public record of the original shapes once it has flattened them; its flat
    parameters do (``_params`` beside ``_shapes``, since torch 2.0). A module FSDP1 did not
    shard has none, and every parameter keeps its own shape.
    """
    shapes: dict[int, tuple[int, ...]] = {}
    wrappers = {id(m): m for module in modules for m in module.modules()}.values()
    for child in (m for m in wrappers if type(m).__name__ == "FullyShardedDataParallel"):
        handle = getattr(child, "_handle", None)
        flat = getattr(handle, "flat_param", None)
        if flat is None:
            continue
        params = getattr(flat, "_params", None)
        if params is None:
            raise UnsupportedSharding(
                "FSDP runs with use_orig_params=False, which hides the parameters behind flat "
                "ones; pass use_orig_params=True (Lightning's FSDPStrategy default)"
            )
        shapes |= {id(p): tuple(s) for p, s in zip(params, flat._shapes)}
    return shapes


def _buckets(numels: tuple[int, ...]) -> Iterator[list[int]]:
    """Consecutive parameter indices in groups of at most :data:`BUCKET_ENTRIES` entries (a
    larger parameter alone)."""
    bucket: list[int] = []
    entries = 0
    for i, n in enumerate(numels):
        if bucket and entries + n > BUCKET_ENTRIES:
            yield bucket
            bucket, entries = [], 0
        bucket.append(i)
        entries += n
    if bucket:
        yield bucket


def _device(params: dict[str, nn.Parameter]) -> torch.device:
    return next(iter(params.values())).device
