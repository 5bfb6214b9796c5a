"""The loss that probes making extra passes (HessianSpectrum, GradientPlane) differentiate."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.apply_func import move_data_to_device

from dynamics import world
from dynamics.callbacks.fit import Fit
from dynamics.callbacks.probe import ProbeUnavailable, detached_copy, parameter_shards
from dynamics.errors import ParameterError
from dynamics.params.batch_tree import flatten_batch, unflatten_batch
from dynamics.params.vectors import module_device
from dynamics.passes.isolation import Mode, checked_mode
from dynamics.passes.loss_rule import LIGHTNING_RULE, LossRule, LossUnavailable
from dynamics.sharding import ParameterShards, unsharded_copy


class ProbeLoss:
    """The module's loss by the fit's loss rule, on a fixed probe batch, in a chosen mode.

    At setup it refuses, with :class:`~dynamics.callbacks.ProbeUnavailable`, a module the fit's
    loss rule (:mod:`dynamics.passes.loss_rule`) gives no loss for, such as a manually optimized
    module without ``dynamics_loss``: decided before any extra pass, so no training step that
    steps an optimizer is ever called.

    Args:
        probe: the owning probe's class name, for messages.
        mode: the :data:`~dynamics.passes.isolation.Mode` extra passes run the module in.
        batch: the probe batch; default: a copy of the fit's first training batch.
        batches: a probe set instead of one batch: a sequence of at least two batches, copied
            (exclusive with ``batch``); it is checkpointed and restored as the batch is.

    Attributes:
        batch: the probe batch, on the module's device after setup (with ``batches``: the list
            of them).
        set_size: how many batches the probe set holds; None for one probe batch.
        rule: the fit's loss rule (:class:`~dynamics.passes.loss_rule.LossRule`), a callable
            ``rule(module, batch)``; the Lightning rule before setup.
        source: where the loss rule takes the loss from; ``None`` before setup.
        shards: which entries of the trainable parameters this rank holds; ``None`` before
            setup.
    """

    def __init__(
        self, probe: str, mode: Mode, batch: Any = None, batches: Sequence[Any] | None = None
    ) -> None:
        self.probe = probe
        self.mode = checked_mode(mode)
        self.set_size: int | None = None
        if batches is not None:
            if batch is not None:
                raise ParameterError("batches", "exclusive with batch=: give one or the other")
            if isinstance(batches, torch.Tensor | dict) or len(batches) < 2:
                raise ParameterError(
                    "batches", "must be a list of at least two batches (one batch: batch=)"
                )
            self.set_size = len(batches)
            batch = list(batches)
        self.batch = None if batch is None else detached_copy(batch)
        self.rule: LossRule = LIGHTNING_RULE
        self.source: str | None = None
        self.shards: ParameterShards | None = None
        self._frozen: ParameterShards | None = None
        # A checkpoint's batch that could not be stored: the resumed fit cannot measure the same
        # loss, so it measures nothing (the type, for the message).
        self._unrestorable: str | None = None
        # How many ranks' batches the checkpoint kept (None: one, or an older checkpoint).
        self._saved_ranks: int | None = None
        # Whether a checkpoint gave the batch, and how many batches its probe set held (None:
        # one probe batch).
        self._restored = False
        self._saved_set_size: int | None = None

    def setup(self, fit: Fit, pl_module: pl.LightningModule, batch: Any) -> None:
        """Check the loss rule, keep the probe batch, and learn how parameters are sharded
        (every rank at once).

        Raises:
            ProbeUnavailable: if the loss rule gives no loss for ``pl_module``.
        """
        self.shards = parameter_shards(fit, pl_module)
        self._frozen = parameter_shards(fit, pl_module, "frozen")
        if self.set_size is not None and world.world_size() > 1:
            # Every product is averaged over the ranks, batch by batch for the spread: each rank
            # must hold as many batches, or the collectives would not match (all ranks decide).
            count = torch.tensor([self.set_size], device=world.collective_device())
            sizes = [int(size) for size in world.all_gather(count)]
            if len(set(sizes)) > 1:
                raise ProbeUnavailable(
                    f"{self.probe}: the ranks' probe sets hold {sizes} batches; give every rank "
                    "as many"
                )
        if self._unrestorable is not None:
            raise ProbeUnavailable(
                f"{self.probe}: the checkpoint could not keep its probe batch (a "
                f"{self._unrestorable}), so a resumed fit cannot measure the same loss; give a "
                "batch of dicts, lists and tuples of tensors"
            )
        if self._saved_ranks not in (None, world.world_size()):
            raise ProbeUnavailable(
                f"{self.probe}: the checkpoint kept the probe batches of {self._saved_ranks} "
                f"ranks and this fit has {world.world_size()}, so a resumed fit cannot measure "
                f"the same loss; resume on {self._saved_ranks} ranks"
            )
        if self._restored and self._saved_set_size != self.set_size:
            raise ProbeUnavailable(
                f"{self.probe}: the checkpoint kept a probe set of {self._saved_set_size or 1} "
                f"batch(es) and this probe is given {self.set_size or 1}, so a resumed fit "
                "cannot measure the same loss; resume with the same batches="
            )
        # A probe tried outside a fit (a stand-in without a rule) takes the Lightning rule.
        self.rule = getattr(fit, "loss_rule", LIGHTNING_RULE)
        try:
            self.rule.check(pl_module)
            self.source = self.rule.source(pl_module)
        except LossUnavailable as error:
            raise ProbeUnavailable(f"{self.probe}: {error}") from None
        if self.batch is None:  # neither given nor restored from a checkpoint
            self.batch = detached_copy(batch)
        self.batch = move_data_to_device(self.batch, module_device(pl_module))

    @contextlib.contextmanager
    def whole(self, pl_module: pl.LightningModule) -> Iterator[torch.nn.Module]:
        """The module extra passes run on: ``pl_module`` itself or, under sharding, a plain
        copy holding every parameter whole on every rank (all ranks must enter; peak memory:
        one more copy of the parameters while it lives). See :mod:`dynamics.sharding.replica`.

        Example::

            with self._loss.whole(pl_module) as module:
                loss = self._loss.rule(module, self._loss.batch)
        """
        assert self.shards is not None, "ProbeLoss.whole before setup"
        with unsharded_copy(pl_module, self.shards, self._frozen) as module:
            yield module

    @property
    def batches(self) -> list[Any]:
        """The probe set's batches; the probe batch alone when there is no set."""
        return [self.batch] if self.set_size is None else list(self.batch)

    def settings(self) -> dict[str, Any]:
        """The mode and the loss's source (and the probe set's size), as stored in the run
        file."""
        size = {} if self.set_size is None else {"batches": self.set_size}
        return {"mode": self.mode, "loss": self.source, **size}

    def state_dict(self) -> dict[str, Any]:
        """The probe batch, so a resumed run keeps measuring the same loss: its tree as JSON
        text and its leaves, since a checkpoint loaded with ``weights_only`` (Lightning's
        default) holds only tensors and plain values. Under several ranks every rank's batch,
        gathered into rank zero's state (the one Lightning keeps); every rank must call."""
        if self.batch is None:
            return {}
        tree, leaves = flatten_batch(move_data_to_device(self.batch, "cpu"))
        try:
            unflatten_batch(tree, leaves)
        except ValueError:  # a custom batch class: no plain form to store
            return {"batch_unrestorable": next(_unsupported(tree))}
        state = {"batch_tree": json.dumps(tree), "batch_leaves": leaves}
        if self.set_size is not None:
            state["batch_set_size"] = self.set_size
        if world.world_size() == 1:
            return state
        # Each rank measures on its own batch and Lightning keeps rank zero's states only:
        # every rank's batch goes into rank zero's state (every rank saves together).
        states = world.gather_objects_to_zero(state)
        return {} if states is None else {**state, "batch_by_rank": states}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        by_rank = state.get("batch_by_rank")
        if by_rank is not None:
            self._saved_ranks = len(by_rank)
            if len(by_rank) == world.world_size():
                state = by_rank[world.rank()]
        if "batch_tree" in state:
            self.batch = unflatten_batch(json.loads(state["batch_tree"]), state["batch_leaves"])
            self._restored = True
            self._saved_set_size = state.get("batch_set_size")
        self._unrestorable = state.get("batch_unrestorable")


def _unsupported(tree: Any) -> Any:
    """The type paths of the objects in a batch tree that cannot be rebuilt."""
    if isinstance(tree, dict):
        if "unsupported" in tree:
            yield tree["unsupported"]
        for value in tree.values():
            yield from _unsupported(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from _unsupported(value)


def upcast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in ``dtype`` if it is floating point (batches and buffers of an extra pass
    follow the parameters' precision; integer labels and counters stay as they are)."""
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def frozen_parameters(
    module: torch.nn.Module, dtype: torch.dtype, varied: Iterable[str]
) -> dict[str, torch.Tensor]:
    """``module``'s parameters outside ``varied`` (those with ``requires_grad=False``), detached
    and :func:`upcast` to ``dtype``: a pass that substitutes the varied ones in ``dtype`` holds
    these fixed, and left in their own dtype they would meet ``dtype`` in one op and fail."""
    varied = set(varied)
    return {n: upcast(p.detach(), dtype) for n, p in module.named_parameters() if n not in varied}


def uncompiled() -> contextlib.AbstractContextManager[None]:
    """Run what ``torch.compile`` compiled as the original modules and functions, eagerly.

    For extra passes a compiled graph cannot take: AOT autograd supports no double backward
    (HVPs), and dynamo cannot trace the hooks and module copies an audit adds. The compiled
    module stays the one training steps; only the pass inside runs uncompiled, on the same
    parameters (``torch.compiler.set_stance("force_eager")``; before torch 2.6, which lacks it,
    nothing changes and such a probe steps aside with the error).
    """
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance else contextlib.nullcontext()
