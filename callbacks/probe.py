"""The contract between the recorder and its probes.

A probe has one job: turn the module's state into rows. It never touches the file: it declares
its series up front (HDF5 before 2.0 cannot create datasets once SWMR writing has begun) and
hands rows to the recorder, which owns the file, the schedule and the flushing.

Writing one: subclass :class:`Probe`, give it a unique ``name``, create every attribute in
``__init__`` (calling ``super().__init__``), and override only the hooks the measurement needs.
The recorder calls them in this order: ``validate`` (fit start), ``setup`` (first batch),
``series``/``vectors``/``settings``/``initial_vectors``, then per due step ``on_step_start``,
``on_micro_batch_end`` (each micro-batch; ``on_before_optimizer_step`` before the last one's,
where the loop has that point) and ``on_step_end`` (returns the step's rows, shaped
as declared), ``on_validation_end``, ``final_vectors`` and ``teardown``. Hooks leave ``.grad``,
the RNG, buffers, train/eval flags and parameters as they found them (extra passes run inside
:func:`dynamics.passes.isolation.side_effect_free`). A hook that cannot measure raises
:class:`ProbeUnavailable`; any exception disables the probe for the rest of the run (it is not
retried) with an event in the run file, and training goes on. :meth:`Probe.note` records a
warning and goes on. :func:`dynamics.callbacks.check_probe` tests a probe against all of this.

Probes depend on no training loop: each hook receives the fit
(:class:`~dynamics.callbacks.fit.Fit`: the step, the rank, the optimizers, the logged metrics, the
loss rule) and the module being trained, whichever loop runs it: Lightning (either namespace),
the Hugging Face Trainer, accelerate or a plain loop.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from dynamics.sharding import ParameterShards
from dynamics.sharding.shards import Selection, UnsupportedSharding
from dynamics.store import SeriesSpec

if TYPE_CHECKING:
    import pytorch_lightning as pl

    from dynamics.callbacks.fit import Fit

#: Rows a probe returns at a step: ``{group: {series: value}}``. Each group has its own step
#: index in the run file, so a probe may fill some of its groups at a step and not others.
Rows = dict[str, dict[str, torch.Tensor | np.ndarray | float]]


class ProbeUnavailable(ValueError):
    """A probe cannot measure correctly on this model or run (the message says why).

    Raised from any probe hook; the recorder records the reason in the run file, warns once,
    disables the probe and lets training go on: a missing number, never a wrong one.

    Example::

        def setup(self, fit, module, batch):
            if not hasattr(module, "head"):
                raise ProbeUnavailable("HeadNorms: the module has no head")
    """


class Probe:
    """Base class: override what the measurement needs; every hook is optional.

    Example::

        class WeightNorm(Probe):
            name = "weight_norm"

            def series(self):
                return {"weight_norm": {"norm": SeriesSpec(view=View("scalar", "‖θ‖", "norm"))}}

            def on_step_end(self, fit, module, batch, outputs, step):
                norm = torch.linalg.vector_norm(flatten(module.parameters())).detach()
                return {"weight_norm": {"norm": norm}}

    Args:
        every_n_steps: record at optimizer steps that are multiples of this.
    """

    #: The probe's identity, unique per recorder: it names the probe in the run file's events
    #: and probe settings and in checkpoint state. Its groups are whatever :meth:`series`
    #: declares (often one group of this name; ``HiddenStateNorms``, named ``hidden``, writes
    #: ``hidden_norms`` and ``activation_bias``).
    name: str = "probe"

    def __init__(self, every_n_steps: int = 1) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self._notes: list[tuple[int, str]] = []

    def validate(self, fit: Fit, module: nn.Module) -> None:
        """Called at fit start, before the sanity check: raise :class:`ProbeUnavailable` now
        for what can be known before the first batch (strategy, module, configuration)."""

    def setup(self, fit: Fit, module: nn.Module, batch: Any) -> None:
        """Called at the first training batch of a fit, before its forward and before
        :meth:`series`: register hooks, read θ0, keep a probe batch (``batch`` is that first
        training batch, already on the module's device)."""

    def series(self) -> dict[str, dict[str, SeriesSpec]]:
        """The groups and series this probe will fill: ``{group: {series: spec}}``."""
        return {}

    def vectors(self) -> dict[str, SeriesSpec]:
        """Vectors written once (at start or end), declared so their datasets exist up front."""
        return {}

    def initial_vectors(self) -> dict[str, np.ndarray]:
        """Values of declared vectors known at setup (θ0, a probe batch); called after it."""
        return {}

    def settings(self) -> dict[str, Any]:
        """What this probe measured and how, as JSON-compatible values, stored in the run file
        beside its class and schedule (e.g. which modules it hooked); called after setup."""
        return {}

    def is_due(self, step: int) -> bool:
        return step % self.every_n_steps == 0

    def on_step_start(self, fit: Fit, module: nn.Module, batch: Any, step: int) -> None:
        """Before the forward of a due step: arm hooks, copy what must be compared later."""

    def on_micro_batch_end(
        self,
        fit: Fit,
        module: nn.Module,
        batch: Any,
        outputs: Any,
        step: int,
    ) -> None:
        """After each micro-batch of a due step (every one under gradient accumulation, the
        last just before :meth:`on_step_end`): ``outputs`` is what the loop's training step
        returned for it (Lightning's ``on_train_batch_end`` outputs; the loss elsewhere)."""

    def on_before_optimizer_step(self, fit: Fit, module: nn.Module, step: int) -> None:
        """Before the optimizer step of a due step, after its last micro-batch's backward and
        AMP unscaling, before gradient clipping (Lightning's ``on_before_optimizer_step``): so
        before that micro-batch's :meth:`on_micro_batch_end`. Only loops with such a point call
        it (``fit.calls_before_optimizer_step``): the Hugging Face Trainer clips before its
        first callback, and a plain loop clips inside the user's code."""

    def on_step_end(
        self,
        fit: Fit,
        module: nn.Module,
        batch: Any,
        outputs: Any,
        step: int,
    ) -> Rows:
        """After the optimizer step of a due step: the rows recorded at ``step``.

        ``step`` is the number of optimizer steps taken before this batch, so rows describe the
        parameters θ_step the batch's forward used. ``batch`` and ``outputs`` are the last
        micro-batch's.
        """
        return {}

    def on_validation_end(self, fit: Fit, module: nn.Module) -> Rows:
        """After a validation run (not the sanity check): rows recorded at the current step."""
        return {}

    def final_vectors(self, fit: Fit, module: nn.Module) -> dict[str, np.ndarray]:
        """Values of declared vectors known at fit end (e.g. θ_T)."""
        return {}

    def teardown(self) -> None:
        """Remove hooks and free buffers; called however the fit ends."""

    def state_dict(self) -> dict[str, Any]:
        """What a resumed fit needs to continue the same series: tensors and plain values only
        (dicts, lists, numbers, strings), since Lightning loads checkpoints with
        ``weights_only``. The loop's adapter keeps it in the loop's checkpoints."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, before ``setup`` on a resumed fit."""

    def note(self, step: int, message: str) -> None:
        """Record a warning in the run file (an event of kind ``"warning"``); the probe goes on.

        The recorder collects notes after each hook and warns once per distinct message, so
        keep the step out of the message.
        """
        self._notes.append((step, message))

    def pop_notes(self) -> list[tuple[int, str]]:
        """The notes since the last call, as ``(step, message)``; called by the recorder."""
        notes, self._notes = self._notes, []
        return notes


def expected_steps(fit: Fit) -> float:
    """The loop's estimate of the fit's length in ``global_step`` units (the steps rows are
    due at); not positive and finite when unknown (and for a probe tried outside a fit)."""
    return getattr(fit, "expected_steps", math.nan)


def detached_copy(batch: Any) -> Any:
    """``batch`` with every tensor a detached clone: a probe batch training cannot alter."""
    return apply_to_collection(batch, torch.Tensor, lambda t: t.detach().clone())


def parameter_shards(
    fit: Fit, module: torch.nn.Module, select: Selection = "trainable"
) -> ParameterShards:
    """Which entries of ``module``'s parameters this rank holds under the fit's sharding
    (every entry without sharding); every rank must call it together, at setup.

    Example::

        self._shards = parameter_shards(fit, module)
        theta_part = self._shards.local(module)
    """
    # A probe tried outside a fit (no fit context, or a stand-in without one) holds every entry.
    return ParameterShards.of(module, select, wrapper=getattr(fit, "wrapper", None))


def refuse_deepspeed(trainer: pl.Trainer) -> None:
    """Refuse DeepSpeed, whose sharded parameters the recorder cannot describe.

    Raises:
        UnsupportedSharding: under ``DeepSpeedStrategy`` of either Lightning namespace.
    """
    # Only a namespace already imported can have built the Trainer, so the other one is never
    # imported for the check (``lightning`` is optional and slow to import).
    deepspeed = tuple(
        sys.modules[module].DeepSpeedStrategy
        for module in ("pytorch_lightning.strategies", "lightning.pytorch.strategies")
        if module in sys.modules
    )
    if isinstance(trainer.strategy, deepspeed):
        raise UnsupportedSharding(
            "DynamicsRecorder cannot record under DeepSpeedStrategy, whose ZeRO partitions "
            "hide the parameters' layout; shard with FSDPStrategy, or ModelParallelStrategy "
            "with fully_shard"
        )
