"""The one Lightning callback a user adds: Lightning's hooks, handed to the recorder's core.

Lightning ships under two namespaces whose ``Callback`` classes differ, and Trainer and
LightningCLI accept only their own namespace's callbacks. The hooks therefore live in
:class:`RecorderBase`, which imports neither; each namespace gets a thin subclass that is also
its ``Callback``: :class:`DynamicsRecorder` here for ``pytorch_lightning``, and
``dynamics.callbacks.lightning.DynamicsRecorder`` for ``lightning.pytorch``. What is recorded,
and how, is :class:`~dynamics.callbacks.recording.Recording`'s, shared with the other loops.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback

from dynamics.callbacks.fit import LightningFit
from dynamics.callbacks.probe import Probe, refuse_deepspeed
from dynamics.callbacks.recording import (
    OnProbeError,
    Recording,
    _is_recorder_state,
    _same_path,
)
from dynamics.store import RunFileError, names

__all__ = ["DynamicsRecorder", "OnProbeError", "RecorderBase"]


class RecorderBase(Recording):
    """Lightning's hooks for :class:`~dynamics.callbacks.recording.Recording` (either
    namespace); its arguments and what it records are there.

    Example::

        recorder = DynamicsRecorder("runs/run.h5", [TrainingLoss(), HiddenStateNorms()])
        pl.Trainer(callbacks=[recorder]).fit(module)
    """

    #: The Lightning package of the subclass's namespace; its version is stored with the run.
    _lightning: ModuleType

    # Per-step hooks the recorder does not use. Lightning calls a callback's hook only when it
    # is callable, each call inside a profiler context: the base class's no-ops cost ~3 µs
    # each, four times a step.
    on_before_backward = on_after_backward = None
    on_before_zero_grad = None

    _fit: LightningFit | None = None

    @property
    def state_key(self) -> str:
        # Lightning reads it at every hook call (to name the hook in its profiler): built once.
        return self._state_key

    @Recording.path.setter
    def path(self, path: Any) -> None:
        Recording.path.fset(self, path)
        self._state_key = self._generate_state_key(path=str(self.path))

    def _fit_of(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> LightningFit:
        """The fit context of this Trainer and module, built once per fit."""
        fit = self._fit
        if fit is None or fit.trainer is not trainer or fit.module is not pl_module:
            fit = self._fit = LightningFit(trainer, pl_module, self._lightning)
        return fit

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":  # before the strategy sets DeepSpeed up
            refuse_deepspeed(trainer)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Before the sanity check, so that a run that cannot be recorded costs nothing.
        self.begin(self._fit_of(trainer, pl_module))

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.batch_start(self._fit_of(trainer, pl_module), batch)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self.batch_end(self._fit_of(trainer, pl_module), batch, outputs)

    @property
    def on_before_optimizer_step(self) -> Callable[..., None] | None:
        """Lightning's hook after AMP unscaling and before gradient clipping; None (not called)
        unless a probe uses it."""
        if not any(
            getattr(type(p), "on_before_optimizer_step", None) is not Probe.on_before_optimizer_step
            for p in self.probes
        ):
            return None
        return self._before_optimizer_step

    def _before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        self.before_optimizer_step(self._fit_of(trainer, pl_module))

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.flush()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.flush()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.validation_end(self._fit_of(trainer, pl_module))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.train_end(self._fit_of(trainer, pl_module))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.close(self._fit_of(trainer, pl_module), names.FINISHED)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        state = f"{type(exception).__name__}: {exception}"
        self.close(self._fit_of(trainer, pl_module), names.CRASHED, state)

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Lightning finds a callback's state under its state_key, which holds the path as given:
        # a relative path, a moved folder or a copy would leave the state unread, and the fit
        # would start a new file from the checkpoint's parameters. Such a state is taken here;
        # at fit start the file's identity decides whether this path continues the run.
        states = checkpoint.get("callbacks") or {}
        if self.state_key in states:
            return  # Lightning loads it next
        others = {c.state_key for c in trainer.callbacks if c is not self}
        candidates = [s for k, s in states.items() if k not in others and _is_recorder_state(s)]
        same_path = [s for s in candidates if _same_path(s["path"], self.path)]
        if len(same_path) == 1 or len(candidates) == 1:
            self.load_state_dict(copy.deepcopy((same_path or candidates)[0]))
        elif candidates:
            paths = ", ".join(str(s["path"]) for s in candidates)
            raise RunFileError(
                f"cannot resume {self.path}: the checkpoint holds the states of "
                f"{len(candidates)} recorders ({paths}) and none of them is for this path; "
                "give each recorder the path its run file has"
            )


class DynamicsRecorder(RecorderBase, Callback):
    """The recorder for ``pytorch_lightning``; what it records and its arguments are in
    :class:`~dynamics.callbacks.recording.Recording`. For ``lightning.pytorch`` use
    ``dynamics.callbacks.lightning.DynamicsRecorder``."""

    _lightning = pl
