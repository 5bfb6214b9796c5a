"""The one Lightning callback a user adds: it owns the run file and drives the probes."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback

import dynamics
from dynamics.callbacks.hidden_state_norms import HiddenStateNorms
from dynamics.callbacks.parameter_displacement import ParameterDisplacement
from dynamics.callbacks.probe import Probe, Rows
from dynamics.callbacks.training_loss import TrainingLoss
from dynamics.params import ParameterLayout, parameter_vector, vector_hash
from dynamics.store import RunWriter, names


class DynamicsRecorder(Callback):
    """Records what its probes measure into one HDF5 run file, without changing the training.

    The recorder owns the file (created at the first training batch, on global rank zero only,
    refused if it exists unless ``overwrite``), the per-probe schedules, block writes and
    bounded-interval flushes, and the checkpoint state that lets ``Trainer.fit(ckpt_path=...)``
    continue the same file: rows recorded after the checkpoint's step are dropped first, so a
    resumed run's series equal an uninterrupted run's. Probes run on every rank (some need
    collectives); only rank zero writes.

    A step's rows describe the parameters θ_step its forward used: probes are armed before the
    first micro-batch of a due step and collected after its optimizer step.

    Args:
        path: the run file to write.
        probes: what to record; default ``TrainingLoss``, ``HiddenStateNorms`` and
            ``ParameterDisplacement``, every step.
        overwrite: replace an existing file at ``path`` (never done silently).
        config: JSON-serializable configuration stored with the run (e.g. the experiment's).
        run_name: a display name; defaults to the file's stem.
        log_to_loggers: also send scalar series to the Trainer's loggers (TensorBoard, CSV).
        flush_interval_s: longest time rows wait in memory; a killed process loses at most this.
        block_rows: rows buffered per series group before a write.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        probes: Sequence[Probe] | None = None,
        overwrite: bool = False,
        config: dict[str, Any] | None = None,
        run_name: str | None = None,
        log_to_loggers: bool = False,
        flush_interval_s: float = 5.0,
        block_rows: int = 256,
    ) -> None:
        self.path = Path(path)
        self.probes = list(probes) if probes is not None else _default_probes()
        names = [p.name for p in self.probes]
        if len(set(names)) != len(names):
            raise ValueError(f"probe names must be unique, got {names}")
        self.overwrite = overwrite
        self.config = config or {}
        self.run_name = run_name or self.path.stem
        self.log_to_loggers = log_to_loggers
        self.flush_interval_s = flush_interval_s
        self.block_rows = block_rows
        self._writer: RunWriter | None = None
        self._started = False
        self._resume_from: dict[str, int] | None = None
        self._armed: tuple[int, list[Probe]] | None = None
        self._last_step = -1  # last optimizer step whose probes ran
        self._last_rows: dict[str, int] = {}  # last step written, per series group

    @property
    def state_key(self) -> str:
        return self._generate_state_key(path=str(self.path))

    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        # At the first training batch rather than at fit start: probes may keep that batch
        # (a probe batch) and must know its shape before the file's datasets are created.
        self._started = True
        for probe in self.probes:
            probe.setup(trainer, pl_module, batch)
        if not trainer.is_global_zero:
            return
        # Large rows (snapshots) are written once about two parameter vectors are buffered, so
        # the recorder's memory stays a small multiple of the model's.
        param_bytes = sum(p.numel() * p.element_size() for p in pl_module.parameters())
        writer_options = {
            "block_rows": self.block_rows,
            "block_bytes": max(1 << 20, 2 * param_bytes),
            "flush_interval_s": self.flush_interval_s,
        }
        if self._resume_from is not None:
            self._writer = RunWriter.resume(self.path, self._resume_from, **writer_options)
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)  # as ModelCheckpoint does for its dir
        series = {g: s for p in self.probes for g, s in p.series().items()}
        vectors = {n: s for p in self.probes for n, s in p.vectors().items()}
        self._writer = RunWriter.create(
            self.path, series, vectors, self._attrs(pl_module), self.overwrite, **writer_options
        )
        for probe in self.probes:
            for name, value in probe.initial_vectors().items():
                self._writer.write_vector(name, value)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._started:
            self._start(trainer, pl_module, batch)
        step = trainer.global_step
        if self._armed is not None or step == self._last_step:
            return  # a later micro-batch of a step already armed or recorded
        due = [p for p in self.probes if p.is_due(step)]
        for probe in due:
            probe.on_step_start(trainer, pl_module, batch, step)
        self._armed = (step, due)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._armed is None or trainer.global_step == self._armed[0]:
            return  # gradient accumulation: the optimizer has not stepped yet
        step, due = self._armed
        self._armed = None
        self._last_step = step
        for probe in due:
            self._record(trainer, step, probe.on_step_end(trainer, pl_module, batch, outputs, step))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        for probe in self.probes:
            self._record(trainer, trainer.global_step, probe.on_validation_end(trainer, pl_module))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for probe in self.probes:
            vectors = probe.final_vectors(trainer, pl_module)
            if self._writer is not None:
                for name, value in vectors.items():
                    self._writer.write_vector(name, value)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._close()

    def state_dict(self) -> dict[str, Any]:
        # Called as a checkpoint is saved: every row the checkpoint counts as written must be
        # on disk, or a crash before the next flush would leave a gap on resume.
        if self._writer is not None:
            self._writer.flush()
        return {
            "path": str(self.path),
            "last_step": self._last_step,
            "last_rows": dict(self._last_rows),
            "probes": {p.name: p.state_dict() for p in self.probes},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Rows written before the checkpoint stay; later ones are dropped and recorded again.
        self._last_step = state_dict["last_step"]
        self._last_rows = dict(state_dict["last_rows"])
        self._resume_from = dict(self._last_rows)
        for probe in self.probes:
            probe.load_state_dict(state_dict["probes"].get(probe.name, {}))

    def _record(self, trainer: pl.Trainer, step: int, rows: Rows) -> None:
        for group, values in rows.items():
            if step <= self._last_rows.get(group, -1):
                continue  # e.g. two validation runs after one optimizer step: keep the first
            self._last_rows[group] = step
            if self._writer is not None:
                self._writer.append(group, step, values)
            if self.log_to_loggers and trainer.loggers:
                self._log_scalars(trainer, step, group, values)

    def _log_scalars(self, trainer: pl.Trainer, step: int, group: str, values: dict) -> None:
        scalars = {
            f"dynamics/{group}/{name}": float(v)
            for name, v in values.items()
            if np.ndim(v) == 0  # tensors answer ndim without a copy to the host
        }
        if scalars and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(scalars, step=step)

    def _attrs(self, pl_module: pl.LightningModule) -> dict[str, Any]:
        layout = ParameterLayout.of(pl_module)
        hparams = dict(getattr(pl_module, "hparams", {}) or {})
        return {
            names.ATTR_RUN_NAME: self.run_name,
            names.ATTR_CONFIG: self.config,
            names.ATTR_LAYOUT: layout.to_dict(),
            names.ATTR_THETA0_SHA256: vector_hash(parameter_vector(pl_module, layout)),
            names.ATTR_MODULE: {
                "class_path": f"{type(pl_module).__module__}.{type(pl_module).__qualname__}",
                "init_args": json.loads(json.dumps(hparams, default=str)),
            },
            names.ATTR_PROBES: [
                {
                    "class": type(p).__name__,
                    "name": p.name,
                    "every_n_steps": p.every_n_steps,
                    "settings": p.settings(),
                }
                for p in self.probes
            ],
            names.ATTR_VERSIONS: {
                "dynamics": dynamics.__version__,
                "torch": torch.__version__,
                "pytorch_lightning": pl.__version__,
                "h5py": h5py.__version__,
                "numpy": np.__version__,
                "python": platform.python_version(),
            },
        }

    def _close(self) -> None:
        self._started = False
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        for probe in self.probes:
            probe.teardown()


def _default_probes() -> list[Probe]:
    return [TrainingLoss(), HiddenStateNorms(), ParameterDisplacement()]
