"""The recorder's core, which no training loop owns: the run file, the schedule, the probes.

:class:`Recording` is driven through a small fit context (:class:`~dynamics.callbacks.fit.Fit`)
by one adapter per loop: Lightning's ``DynamicsRecorder`` (:mod:`dynamics.callbacks.recorder`),
the Hugging Face callback and the plain-loop recorder (:mod:`dynamics.integrations`). Each
adapter calls :meth:`Recording.begin` at fit start, :meth:`~Recording.batch_start` and
:meth:`~Recording.batch_end` around every micro-batch, :meth:`~Recording.validation_end`,
:meth:`~Recording.train_end` and :meth:`~Recording.close`, and keeps
:meth:`~Recording.state_dict` in the loop's checkpoints. What ends up in the file does not
depend on the loop, except the fit's description (``loop``, the loss rule, the versions).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, get_args

import h5py
import numpy as np
import torch
from torch import nn

import dynamics
from dynamics import world
from dynamics.callbacks.fit import Fit
from dynamics.callbacks.fit_description import fit_attributes
from dynamics.callbacks.hidden_state_norms import HiddenStateNorms
from dynamics.callbacks.parameter_displacement import ParameterDisplacement
from dynamics.callbacks.probe import Probe, ProbeUnavailable, Rows, parameter_shards
from dynamics.callbacks.training_loss import TrainingLoss
from dynamics.model.record import module_record
from dynamics.params.layout import BufferLayout
from dynamics.params.naming import named_parameters
from dynamics.sharding import ParameterShards, UnsupportedSharding
from dynamics.store import RunFileError, RunLock, RunWriter, SeriesSpec, names, open_run
from dynamics.store.writer import RunIdentity

#: What the recorder does when a probe raises: disable it and go on, or end the fit.
OnProbeError = Literal["disable", "raise"]


class Recording:
    """Records what its probes measure into one HDF5 run file, without changing the training,
    under whichever loop drives it through a :class:`~dynamics.callbacks.fit.Fit`.

    What it owns, how resumes and probe errors are handled: ``docs/probes/recorder.md``.
    Under FSDP (``FSDPStrategy``, or ``ModelParallelStrategy`` with ``fully_shard``) the file
    is the one an unsharded fit of the same seed writes (layout, hashes, buffers, model); a
    sharding it cannot describe (tensor parallelism, ``use_orig_params=False``, parameters
    partly sharded) and DeepSpeed are refused at fit start, in one line, on every rank.

    Example::

        recorder = DynamicsRecorder("runs/run.h5", [TrainingLoss(), HiddenStateNorms()])
        pl.Trainer(callbacks=[recorder]).fit(module)

    Args:
        path: the run file to write.
        probes: what to record; default ``TrainingLoss``, ``HiddenStateNorms`` and
            ``ParameterDisplacement``, every step.
        overwrite: replace an existing file at ``path`` (never done silently).
        config: JSON-serializable configuration stored with the run (e.g. the experiment's).
        run_name: a display name; defaults to the file's stem.
        log_to_loggers: also send series to the Trainer's loggers (TensorBoard, CSV, ...):
            scalars as ``dynamics/<group>/<series>``, vectors with named columns (per-layer
            norms, eigenvalues) as ``dynamics/<group>/<series>/<column>``.
        flush_interval_s: how long rows may wait in memory. The file is flushed at the first
            training batch boundary after this many seconds since the last flush, and always
            before each validation loop, at each checkpoint save, at each training epoch's end
            and when the fit ends. A killed process therefore loses at most the rows of the
            last ``flush_interval_s`` plus one training step, never rows recorded before a
            validation loop it was killed in. If the file cannot be written (a full disk), the
            recording stops with one warning and training goes on.
        block_rows: rows buffered per series group before a write.
        on_probe_error: ``"disable"`` (record, warn, go on) or ``"raise"`` (record, then end
            the fit with the probe's exception).
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
        on_probe_error: OnProbeError = "disable",
    ) -> None:
        self.path = Path(path)
        self.probes = list(probes) if probes is not None else _default_probes()
        probe_names = [p.name for p in self.probes]
        if len(set(probe_names)) != len(probe_names):
            raise ValueError(f"probe names must be unique, got {probe_names}")
        if on_probe_error not in get_args(OnProbeError):
            choices = ", ".join(get_args(OnProbeError))
            raise ValueError(f"on_probe_error must be one of {choices}, got {on_probe_error!r}")
        self.overwrite = overwrite
        self.config = config or {}
        self.run_name = run_name or self.path.stem
        self.log_to_loggers = log_to_loggers
        self.flush_interval_s = flush_interval_s
        self.block_rows = block_rows
        self.on_probe_error = on_probe_error
        self._writer: RunWriter | None = None
        # The path's lock, held from fit start until the writer takes it over.
        self._lock: RunLock | None = None
        self._started = False
        self._resume_from: dict[str, int] | None = None
        self._armed: tuple[int, list[Probe]] | None = None
        self._last_step = -1  # last optimizer step whose probes ran
        self._last_rows: dict[str, int] = {}  # last step written, per series group
        self._disabled: set[str] = set()  # names of probes out of the run
        self._series: dict[str, dict[str, SeriesSpec]] = {}  # declared series, per group
        self._shapes: dict[str, dict[str, tuple[int, ...]]] = {}  # their row shapes
        self._vectors: dict[str, SeriesSpec] = {}  # declared vectors
        self._owners: dict[str, str] = {}  # the probe that declared each group and vector
        self._unwritten_events: list[tuple[int, str, str, str]] = []  # before the file exists
        self._warned: set[tuple[str, str]] = set()  # (probe, note) already shown
        self._edits: list[dict[str, Any]] = []  # what model-editing callbacks did this fit
        self._checkpoint_edits: list[dict[str, Any]] | None = None  # the resumed fit's
        # The run file a checkpoint keeps: the path the checkpoint's fit wrote, and what proves
        # a file is this run's, as the last writer left it or a checkpoint restored it (None:
        # no file yet, or a checkpoint from before they were kept).
        self._checkpoint_path: str | None = None
        self._run_identity: RunIdentity | None = None
        self._run_rows: dict[str, int] | None = None
        self._run_groups: dict[str, str] | None = None  # {series group: its probe}

    @property
    def path(self) -> Path:
        return self._path

    @path.setter
    def path(self, path: str | os.PathLike) -> None:
        self._path = Path(path)

    def begin(self, fit: Fit) -> None:
        """At fit start, before any batch (and before Lightning's sanity check), on every rank:
        refuse, in one line on every rank alike, a fit that cannot be recorded, before it costs
        anything; claim the path; let the probes validate the fit.

        Raises:
            RunFileError: the path cannot take this fit's run file.
            UnsupportedSharding: the parameters are laid out in a way the file cannot describe.
        """
        # A sharding the file cannot describe stops every rank alike, before the path is locked.
        _parameter_shards(fit)
        fresh = self._resume_from is None
        if fresh:
            self._reset()
        self._edits = fit.model_edits()
        if not fresh and self._checkpoint_edits is not None:
            before, now = map(_edit_settings, (self._checkpoint_edits, self._edits))
            if before != now:
                raise RunFileError(
                    f"{self.path}: the checkpoint's fit edited the model with {before}, this "
                    f"fit with {now}; resume with the same model-editing callbacks"
                )
        problem = self._claim_path(fit) if fit.is_global_zero else None
        problem = world.broadcast_from_zero(problem)  # every rank stops, none hangs
        if problem is not None:
            raise RunFileError(problem)
        for probe in self._active():
            self._call(fit, probe, fit.global_step, probe.validate, fit, fit.module)

    def batch_start(self, fit: Fit, batch: Any) -> None:
        """Before each micro-batch's forward: the first starts the recording (probes keep it as
        their probe batch); the first of a due step arms the probes due at it."""
        if not self._started:
            self._start(fit, batch)
        step = fit.global_step
        if self._armed is not None or step == self._last_step:
            self._flush_if_due()
            return  # a later micro-batch of a step already armed or recorded
        due = [p for p in self._active() if self._call(fit, p, step, p.is_due, step)]
        for probe in due:
            self._call(fit, probe, step, probe.on_step_start, fit, fit.module, batch, step)
        self._armed = (step, due)

    def batch_end(self, fit: Fit, batch: Any, outputs: Any) -> None:
        """After each micro-batch (``outputs``: what its training step returned); once the
        optimizer has stepped (``fit.global_step`` advanced), the step's rows are recorded."""
        if self._armed is None:
            return
        step, due = self._armed
        module = fit.module
        for probe in self._active(due):
            self._call(
                fit, probe, step, probe.on_micro_batch_end, fit, module, batch, outputs, step
            )
        if fit.global_step == step:
            return  # gradient accumulation: the optimizer has not stepped yet
        self._armed = None
        self._last_step = step
        for probe in self._active(due):
            self._collect(fit, probe, step, probe.on_step_end, fit, module, batch, outputs, step)
        self._flush_if_due()

    def before_optimizer_step(self, fit: Fit) -> None:
        """After a due step's last backward and AMP unscaling, before gradient clipping and the
        optimizer step (adapters whose loop has that point call it)."""
        if self._armed is None:
            return
        step, due = self._armed
        for probe in self._active(due):
            self._call(fit, probe, step, probe.on_before_optimizer_step, fit, fit.module, step)

    def flush(self) -> None:
        """Make the rows so far durable: before a validation loop (which can last far longer
        than the flush interval, with no row arriving to trigger a flush), at an epoch's end."""
        if self._writer is not None:
            self._writer.flush()

    def validation_end(self, fit: Fit) -> None:
        """After a validation run: the rows probes take from it, at the current step."""
        if not self._started:
            return
        for probe in self._active():
            self._collect(fit, probe, fit.global_step, probe.on_validation_end, fit, fit.module)

    def train_end(self, fit: Fit) -> None:
        """After the last optimizer step: the vectors probes know at the end (θ_T)."""
        for probe in self._active():
            self._call(
                fit,
                probe,
                fit.global_step,
                lambda p=probe: self._write_vectors(p, p.final_vectors(fit, fit.module)),
            )

    def close(self, fit: Fit, state: str, exception: str = "") -> None:
        """End the recording however the fit ended (``state``: finished, crashed or killed):
        probes torn down, the file closed with that state, the path's lock released."""
        if self._started:
            for probe in self._active():
                try:
                    probe.teardown()
                except Exception as error:  # the fit is over: record it, never raise over it
                    message = f"teardown: {type(error).__name__}: {error}"
                    self._event(fit, fit.global_step, probe, names.EVENT_ERROR, message)
        self._started = False
        self._armed = None
        self._unwritten_events = []  # a fit that ended before its file existed
        if self._writer is not None:
            self._writer.close(state, exception)
            self._keep_run_state()  # for a checkpoint saved after the fit
            self._writer = None
        self._series, self._shapes, self._vectors, self._owners = {}, {}, {}, {}
        if self._lock is not None:  # the fit ended before its file was created
            self._lock.release()
            self._lock = None

    def state_dict(self) -> dict[str, Any]:
        # Called as a checkpoint is saved: every row the checkpoint counts as written must be
        # on disk, or a crash before the next flush would leave a gap on resume.
        if self._writer is not None:
            self._writer.flush()
            self._keep_run_state()
        return {
            "path": os.path.abspath(self.path),
            # What proves, on resume, that a file is this run's and holds its rows.
            "run": self._run_identity.to_dict() if self._run_identity is not None else None,
            "rows": self._run_rows,
            "groups": self._run_groups,
            "last_step": self._last_step,
            "last_rows": dict(self._last_rows),
            "disabled": sorted(self._disabled),
            "probes": {p.name: p.state_dict() for p in self._active()},
            "model_edits": self._edits,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Rows written before the checkpoint stay; later ones are dropped and recorded again.
        # Probes disabled before it stay disabled, so their series keep no gap.
        _check_recorder_state(state_dict)
        self._last_step = state_dict["last_step"]
        self._last_rows = dict(state_dict["last_rows"])
        self._resume_from = dict(self._last_rows)
        self._disabled = set(state_dict.get("disabled", ()))
        self._checkpoint_edits = state_dict.get("model_edits")  # None: an older checkpoint
        self._checkpoint_path = state_dict.get("path")
        run = state_dict.get("run")
        self._run_identity = RunIdentity.from_dict(run) if run is not None else None
        self._run_rows = state_dict.get("rows")
        self._run_groups = state_dict.get("groups")
        for probe in self._active():
            probe.load_state_dict(state_dict["probes"].get(probe.name, {}))

    def _start(self, fit: Fit, batch: Any) -> None:
        # At the first training batch rather than at fit start: probes may keep that batch
        # (a probe batch) and must know its shape before the file's datasets are created.
        self._started = True
        step = fit.global_step
        # Every rank takes part: under sharding the hashes gather the parameters. Before the
        # probes' setup, which may run forwards of its own.
        shards, frozen = _parameter_shards(fit)
        parameters = _parameter_attrs(fit.module, shards, frozen)
        for probe in self._active():
            self._call(fit, probe, step, probe.setup, fit, fit.module, batch)
        # Every rank declares, so that every rank checks rows against the declaration.
        settings = {
            probe.name: self._call(fit, probe, step, self._declare, probe, default={})
            for probe in self._active()
        }
        notes: list[str] = []
        if self._resume_from is not None or fit.checkpoint is not None or fit.restores_late:
            # Checked again now that the probes declared their series (and, for strategies that
            # restore a checkpoint after fit start, first now); every rank stops, none hangs.
            problem = None
            if fit.is_global_zero:
                try:
                    notes = self._check_continuation(fit, declared=True)
                except RunFileError as error:
                    problem = str(error)
            problem = world.broadcast_from_zero(problem)
            if problem is not None:
                raise RunFileError(problem)
        if not fit.is_global_zero:
            return
        for note in notes:
            fit.warn(note)
            self._unwritten_events.append((step, names.EVENT_RECORDER, names.EVENT_WARNING, note))
        # A row of a parameter vector's bytes (a snapshot) is written as it arrives, so the
        # recorder holds no snapshot between steps; smaller rows of small models (under 256 KiB)
        # are gathered into blocks of that size rather than written one HDF5 call each. The
        # unsharded sizes: a rank of a sharded fit holds a part of each parameter.
        param_bytes = _parameter_bytes(fit.module, shards) + _parameter_bytes(fit.module, frozen)
        writer_options = {
            "block_rows": self.block_rows,
            "block_bytes": max(256 << 10, param_bytes),
            "flush_interval_s": self.flush_interval_s,
        }
        if self._resume_from is not None:
            through = self._resumed_through()
            self._writer = RunWriter.resume(self.path, through, self._lock, **writer_options)
            self._resume_from = None
        else:
            self._writer = RunWriter.create(
                self.path,
                self._series,
                self._vectors,
                parameters | self._attrs(fit, settings),
                self.overwrite,
                self._lock,
                **writer_options,
            )
        self._lock = None  # the writer's now, released when it closes
        for event in self._unwritten_events:
            self._writer.append_event(*event)
        self._unwritten_events = []
        for probe in self._active():
            self._call(
                fit,
                probe,
                step,
                lambda p=probe: self._write_vectors(p, p.initial_vectors()),
            )

    def _declare(self, probe: Probe) -> dict[str, Any]:
        """Take in a probe's series and vectors; its settings, checked to be JSON."""
        series, vectors = probe.series(), probe.vectors()
        settings = probe.settings()
        json.dumps(settings)
        for name in [*series, *vectors]:
            if name in self._owners and self._owners[name] != probe.name:
                # Two probes configured to write one group (HiddenStateNorms() beside
                # ActivationBias()): the later steps aside, and the message says how to fix it.
                raise ProbeUnavailable(
                    f"{name!r} is written by probe {self._owners[name]!r} already; a group has "
                    "one writer: drop one of the two, or turn that part off in the other"
                )
        self._series |= series
        self._shapes |= {
            group: {name: spec.shape for name, spec in specs.items()}
            for group, specs in series.items()
        }
        self._vectors |= vectors
        self._owners |= dict.fromkeys([*series, *vectors], probe.name)
        return settings

    def _call(
        self,
        fit: Fit,
        probe: Probe,
        step: int,
        hook: Callable[..., Any],
        *args: Any,
        default: Any = None,
    ) -> Any:
        """Call one probe hook; if it raises, the probe is out of the run and ``default``
        stands in for its result."""
        try:
            return hook(*args)
        except Exception as error:
            self._disable(fit, probe, step, error)
            return default
        finally:
            for note_step, message in probe.pop_notes():
                self._event(fit, note_step, probe, names.EVENT_WARNING, message)

    def _disable(self, fit: Fit, probe: Probe, step: int, error: Exception) -> None:
        if isinstance(error, ProbeUnavailable):
            kind, message = names.EVENT_DISABLED, str(error)
        else:
            kind, message = names.EVENT_ERROR, f"{type(error).__name__}: {error}"
        self._disabled.add(probe.name)
        self._event(fit, step, probe, kind, message)
        if self.on_probe_error == "raise":
            raise error
        # Its hooks must stop recording now, not at the end of the fit; a probe that failed may
        # fail to tear down too, and it is out of the run either way.
        with contextlib.suppress(Exception):
            probe.teardown()
        fit.warn(
            f"{type(probe).__name__} ({probe.name!r}) is disabled for the rest of the run at step "
            f"{step}: {message}. Training goes on; the event is recorded in {self.path}."
        )

    def _event(self, fit: Fit, step: int, probe: Probe, kind: str, message: str) -> None:
        if kind == names.EVENT_WARNING and (probe.name, message) not in self._warned:
            self._warned.add((probe.name, message))
            fit.warn(f"{type(probe).__name__} ({probe.name!r}) at step {step}: {message}")
        event = (step, probe.name, kind, message)
        if self._writer is not None:
            self._writer.append_event(*event)
        elif fit.is_global_zero:  # the file does not exist yet
            self._unwritten_events.append(event)

    def _collect(
        self, fit: Fit, probe: Probe, step: int, hook: Callable[..., Rows], *args: Any
    ) -> None:
        """Record the rows a hook returns; rows unlike the declared series disable the probe."""
        rows = self._call(fit, probe, step, self._checked, probe, hook, *args, default={})
        if rows:
            self._record(fit, step, rows)

    def _checked(self, probe: Probe, hook: Callable[..., Rows], *args: Any) -> Rows:
        rows = hook(*args)
        for group, values in rows.items():
            self._check(probe, group, values)
        return rows

    def _check(self, probe: Probe, group: str, values: Mapping[str, Any]) -> None:
        """Refuse a row unlike its group's declaration, in one line saying how it differs.

        Runs at every row (a probe may go wrong at any step); the declared shapes are looked up
        once per group, so the usual row costs one comparison per series.
        """
        shapes = self._shapes.get(group)
        if shapes is None or self._owners.get(group) != probe.name:
            raise ValueError(f"rows for group {group!r}, which {probe.name!r} did not declare")
        if values.keys() != shapes.keys():
            raise ValueError(
                f"rows of {group!r} hold {sorted(values)}, but {sorted(shapes)} were declared"
            )
        for name, value in values.items():
            if _shape(value) != shapes[name]:
                raise ValueError(
                    f"{group}/{name} has shape {tuple(_shape(value))}, declared {shapes[name]}"
                )

    def _write_vectors(self, probe: Probe, vectors: Mapping[str, Any]) -> None:
        for name, value in vectors.items():
            if self._owners.get(name) != probe.name:
                raise ValueError(f"vector {name!r}, which {probe.name!r} did not declare")
            if tuple(np.shape(value)) != self._vectors[name].shape:
                raise ValueError(
                    f"vector {name!r} has shape {tuple(np.shape(value))}, "
                    f"declared {self._vectors[name].shape}"
                )
            if self._writer is not None:
                self._writer.write_vector(name, value)

    def _record(self, fit: Fit, step: int, rows: Rows) -> None:
        for group, values in rows.items():
            if step <= self._last_rows.get(group, -1):
                continue  # e.g. two validation runs after one optimizer step: keep the first
            self._last_rows[group] = step
            if self._writer is not None:
                self._writer.append(group, step, values)
            if self.log_to_loggers and fit.is_global_zero:
                self._log(fit, step, group, values)

    def _log(self, fit: Fit, step: int, group: str, values: Rows) -> None:
        metrics: dict[str, float] = {}
        for name, value in values.items():
            key = f"dynamics/{group}/{name}"
            columns = self._series[group][name].columns
            ndim = np.ndim(value)  # tensors answer ndim without a copy to the host
            if ndim == 0:
                metrics[key] = float(value)
            elif ndim == 1 and columns:  # long unnamed rows (snapshots) are not metrics
                metrics |= {f"{key}/{c}": float(v) for c, v in zip(columns, value.tolist())}
        if metrics:
            fit.log_metrics(metrics, step)

    def _attrs(self, fit: Fit, settings: dict[str, Any]) -> dict[str, Any]:
        return {
            names.ATTR_RUN_NAME: self.run_name,
            names.ATTR_CONFIG: self.config,
            names.ATTR_BUFFERS: BufferLayout.of(fit.module).to_dict(),
            names.ATTR_MODULE: module_record(fit.module),
            **fit_attributes(fit),
            names.ATTR_MODEL_EDITS: self._edits,
            names.ATTR_PROBES: [
                {
                    "class": type(p).__name__,
                    "name": p.name,
                    "every_n_steps": p.every_n_steps,
                    "settings": settings.get(p.name, {}),
                }
                for p in self.probes
            ],
            names.ATTR_VERSIONS: {
                "dynamics": dynamics.__version__,
                "torch": torch.__version__,
                **fit.versions,
                "h5py": h5py.__version__,
                "numpy": np.__version__,
                "python": platform.python_version(),
            },
        }

    def _active(self, probes: Sequence[Probe] | None = None) -> Sequence[Probe]:
        probes = self.probes if probes is None else probes
        if not self._disabled:  # the usual case, several times a step: no list built
            return probes
        return [p for p in probes if p.name not in self._disabled]

    def _claim_path(self, fit: Fit) -> str | None:
        """Lock the path for this fit, checking first what the fit will do with the file
        there (create it, or continue the checkpoint's run); what stands in the way, in one
        line."""
        if self._lock is not None or self._writer is not None:
            return None  # claimed already: fit() called again on the same recorder
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)  # as ModelCheckpoint does
            # A strategy restoring the checkpoint after fit start (FSDP) has not named it to
            # the trainer yet: a new run's path is checked at the first batch then.
            late = fit.restores_late
            if fit.checkpoint is None and self._resume_from is None and not late:
                RunWriter.check_path(self.path, self.overwrite)
            self._lock = RunLock.acquire(self.path)
            # Refused now, before the fit costs anything; a strategy that restores the
            # checkpoint after fit start is checked at the first batch.
            if self._resume_from is not None or not late:
                self._check_continuation(fit, declared=False)
        except (OSError, RunFileError) as error:
            if self._lock is not None:
                self._lock.release()
                self._lock = None
            return str(error)
        return None

    def _check_continuation(self, fit: Fit, declared: bool) -> list[str]:
        """Refuse a fit from a checkpoint that would continue a file wrongly; what it does that
        a user must hear of (warnings, also recorded as events).

        A resumed fit continues the checkpoint's own run file (identity, rows, probes, and
        once ``declared``, every series); a fit from a checkpoint without recorder state may
        start a new file only where none exists, or with ``overwrite``.

        Raises:
            RunFileError: one line saying why.
        """
        if self._resume_from is None:
            if fit.checkpoint is None:  # a new run
                RunWriter.check_path(self.path, self.overwrite)
                return []
            if self.path.exists() and not self.overwrite:
                raise RunFileError(
                    f"{self.path} exists, but the checkpoint {fit.checkpoint} holds no "
                    "DynamicsRecorder state (saved by a fit without the recorder?), "
                    "so it cannot continue that run file; resume from a checkpoint of the fit "
                    "that wrote it, or pass overwrite=True to replace it by a new run whose θ0 "
                    "is the checkpoint's parameters"
                )
            RunWriter.check_path(self.path, overwrite=True)
            return [
                f"the checkpoint {fit.checkpoint} holds no DynamicsRecorder state: "
                f"{self.path} is a new run file whose θ0 is the parameters at step "
                f"{fit.global_step} the checkpoint restored, not the initialization"
            ]
        moved = self._checkpoint_path is not None and not _same_path(
            self._checkpoint_path, self.path
        )
        wrote = f" (the checkpoint's fit wrote {self._checkpoint_path})" if moved else ""
        if moved and self._run_identity is None:
            raise RunFileError(
                f"cannot resume {self.path}: the checkpoint's fit wrote "
                f"{self._checkpoint_path}, and the checkpoint (saved by an older dynamics) "
                "keeps no run identity that could prove another path holds that run; give the "
                "recorder the path its fit wrote"
            )
        try:
            note = RunWriter.check_resumable(
                self.path, self._resumed_through(), self._run_identity, self._run_rows
            )
            self._check_probes()
            if declared:
                RunWriter.check_layout(self.path, self._series, self._vectors, self._undeclared())
        except RunFileError as error:
            raise RunFileError(f"{error}{wrote}") from error
        notes = [note] if note is not None else []
        if moved:
            notes.append(
                f"{self.path} holds {self._run_identity.describe()} that the checkpoint's "
                f"fit wrote at {self._checkpoint_path}: the run continues at {self.path}"
            )
        return notes

    def _keep_run_state(self) -> None:
        """Take from the writer what a checkpoint keeps of the run file."""
        self._run_identity, self._run_rows = self._writer.identity, self._writer.rows
        self._run_groups = {group: self._owners[group] for group in self._series}

    def _undeclared(self) -> set[str] | None:
        """The file's series groups this resumed fit may leave undeclared: those of probes
        out of the run (None: any, for a checkpoint that did not keep who declared what)."""
        if self._run_groups is None:
            return None
        return {g for g, probe in self._run_groups.items() if probe in self._disabled}

    def _check_probes(self) -> None:
        """Refuse a resume whose probes are not those the run file was recorded with: rows of
        a probe the file lacks cannot be written (nothing is created under SWMR), and a probe
        left out would leave its series cut short under a record that says it ran."""
        recorded = open_run(self.path).attrs.get(names.ATTR_PROBES)
        if not isinstance(recorded, list):
            return  # a file from before probes were recorded
        before = sorted(_probe_label(p.get("class"), p.get("name")) for p in recorded)
        now = sorted(_probe_label(type(p).__name__, p.name) for p in self.probes)
        if before != now:
            added = [p for p in now if p not in before]
            missing = [p for p in before if p not in now]
            change = "; ".join(
                f"{what} {', '.join(probes)}"
                for what, probes in (("added", added), ("left out", missing))
                if probes
            )
            raise RunFileError(
                f"cannot resume {self.path}: its run was recorded with the probes "
                f"{', '.join(before)}, this fit has {', '.join(now)} ({change}); resume with "
                "the same probes, or record the new ones to a new file"
            )

    def _resumed_through(self) -> dict[str, int]:
        """The last step of each group (and of the events) the checkpoint counts as written."""
        events = max([self._last_step, *self._resume_from.values()])
        return self._resume_from | {names.EVENTS: events}

    def _flush_if_due(self) -> None:
        if self._writer is not None and self._writer.interval_elapsed():
            self._writer.flush()

    def _reset(self) -> None:
        # A fresh fit (not resumed from a checkpoint) records from scratch.
        self._last_step = -1
        self._last_rows = {}
        self._disabled = set()
        self._armed = None
        self._checkpoint_path = self._run_identity = None
        self._run_rows = self._run_groups = None


def _parameter_shards(fit: Fit) -> tuple[ParameterShards, ParameterShards]:
    """The shards of the trainable and of the frozen parameters (every rank calls).

    Raises:
        UnsupportedSharding: on every rank alike, in one line, when the parameters are laid
            out across ranks in a way the run file cannot describe.
    """
    try:
        module = fit.module
        return parameter_shards(fit, module), parameter_shards(fit, module, "frozen")
    except UnsupportedSharding as error:
        raise UnsupportedSharding(f"DynamicsRecorder cannot record this fit: {error}") from None


def _parameter_attrs(
    module: nn.Module, shards: ParameterShards, frozen: ParameterShards
) -> dict[str, Any]:
    """The layout of the trainable parameters, θ0's hash and the frozen parameters' hash, as
    the unsharded model has them (every rank calls; on ranks but zero the hashes are None)."""
    attrs = {
        names.ATTR_LAYOUT: shards.layout.to_dict(),
        names.ATTR_THETA0_SHA256: shards.hash(module),
    }
    if frozen.layout.names:
        attrs[names.ATTR_FROZEN_SHA256] = frozen.hash(module)
    return attrs


def _parameter_bytes(module: nn.Module, shards: ParameterShards) -> int:
    """Bytes of the unsharded parameters ``shards`` describes, in their own dtypes."""
    sizes = dict(zip(shards.layout.names, shards.layout.numels))
    return sum(sizes[n] * p.element_size() for n, p in named_parameters(module) if n in sizes)


def _edit_settings(edits: list[dict[str, Any]]) -> str:
    """Each edit's kind and settings, in words: what a resumed fit must repeat."""
    return (
        "; ".join(
            f"{e.get('edit')}({json.dumps(e.get('settings'), sort_keys=True)})" for e in edits
        )
        or "nothing"
    )


def _is_recorder_state(state: Any) -> bool:
    """Whether a callback state in a checkpoint is a recorder's (of any namespace, any
    version)."""
    return isinstance(state, dict) and {"path", "last_step", "last_rows", "probes"} <= state.keys()


#: What each entry of the recorder's checkpointed state holds: its types, and those of its
#: values (a dict's) or items (a list's) when it has any to check.
_STATE_FIELDS: dict[str, tuple[tuple[type, ...], type | tuple[type, ...] | None]] = {
    "path": ((str, type(None)), None),
    "run": ((dict, type(None)), (str, type(None))),
    "rows": ((dict, type(None)), int),
    "groups": ((dict, type(None)), str),
    "last_step": ((int,), None),
    "last_rows": ((dict,), int),
    "disabled": ((list, tuple), str),
    "probes": ((dict,), dict),
    "model_edits": ((list, type(None)), None),
}
#: Entries every checkpoint of a recorder holds; older ones lack the others.
_STATE_REQUIRED = ("last_step", "last_rows", "probes")


def _check_recorder_state(state: Any) -> None:
    """Refuse a checkpoint's recorder state whose entries are not of the types the recorder
    writes: a checkpoint is a file a user can edit, and a wrong type would fail deep in the
    resume (a comparison, an unpacking) as a traceback.

    Raises:
        RunFileError: in one line, naming the entry.
    """
    if not isinstance(state, Mapping):
        raise RunFileError(
            f"the checkpoint's DynamicsRecorder state is a {type(state).__name__}, not a dict: "
            "an edited or damaged checkpoint"
        )
    for key, (kinds, item_kinds) in _STATE_FIELDS.items():
        if key not in state and key not in _STATE_REQUIRED:
            continue
        value = state.get(key)
        items = value.values() if isinstance(value, dict) else value
        well_typed = isinstance(value, kinds) and not isinstance(value, bool)
        if well_typed and item_kinds is not None and value is not None:
            well_typed = all(isinstance(v, item_kinds) and not isinstance(v, bool) for v in items)
        if not well_typed:
            raise RunFileError(
                f"the checkpoint's DynamicsRecorder state holds {str(value)[:60]!r} as {key!r}, "
                "not what a recorder writes: an edited or damaged checkpoint"
            )


def _same_path(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    return Path(a).resolve() == Path(b).resolve()


def _probe_label(cls: Any, name: Any) -> str:
    return f"{cls}({name!r})"


def _shape(value: Any) -> tuple[int, ...]:
    """A row value's shape; read from tensors and arrays directly (``np.shape`` costs a
    dispatch per row; a ``torch.Size`` compares with a tuple as it is)."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.shape
    return np.shape(value)


def _default_probes() -> list[Probe]:
    return [TrainingLoss(), HiddenStateNorms(), ParameterDisplacement()]
