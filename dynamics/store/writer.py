"""Writing run files: declared up front, appended in blocks, readable while they grow.

The writer creates every dataset before SWMR writing starts (HDF5 before 2.0 refuses to create
objects afterwards, and a live reader would not see them), buffers rows in memory and appends
them in blocks, flushing at a bounded interval so a killed process loses at most that interval.
Each flush also updates the run status in place (last flushed step, wall time), and closing
records how the run ended.

What a file on disk says is true whatever stops the writer:

- One live writer per path (:class:`~dynamics.store.lock.RunLock`), and a new file is laid out
  under a temporary name, opened there for SWMR writing, and only then renamed over the old one,
  so the path holds the old file or the new one, each readable, at every instant: an overwrite
  or a resume never destroys a file before its replacement is made and open (a reader holding
  the old file keeps reading it).
- Each file gets a run id when it is created (kept by resumes); with θ0's hash it is the file's
  :class:`RunIdentity`, which a checkpoint keeps so that resuming proves the file is its own.
- A row counts once its step is written, and steps are written only after their values are on
  disk (HDF5 writes cached chunks in its own order, so writing values first is not enough): a
  flush cut short, by a kill or a full disk, leaves rows without steps, which readers skip.
- A file that cannot be written (a full disk, a lost mount) stops the recording, not the
  training: one warning, an event in the file if it still takes one, and HDF5 detached from the
  file so it never retries the failed writes (a retried flush of a full disk ends in a crash).
  A file that cannot even be created is refused in one line, leaving nothing behind.
- A process that exits with the file open (a DDP worker whose fit raised: Lightning calls the
  callbacks' ``on_exception`` in the launching process, not in the worker) closes it as crashed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import socket
import stat
import sys
import time
import uuid
import warnings
from collections.abc import Collection, Iterator, Mapping
from multiprocessing.util import Finalize
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from dynamics.errors import ParameterError
from dynamics.store import names
from dynamics.store.lock import LOCK_EXIT_PRIORITY, RunLock
from dynamics.store.reader import open_run, series_key
from dynamics.store.schema import (
    BFLOAT16,
    LIBVER,
    SCHEMA,
    SCHEMA_VERSION,
    SERIES,
    STEP,
    TEXT_BYTES,
    UNWRITTEN_STEP,
    VECTORS,
    RunFileError,
    encode_attr,
)

#: Target bytes per HDF5 chunk: large enough for few chunk-index entries, small enough that a
#: block append of a snapshot series does not rewrite megabytes.
_CHUNK_BYTES = 1 << 20

#: Suffixes of the names a run file is laid out under before it is renamed into place.
_CREATING, _RESUMING = ".creating", ".resuming"


@dataclasses.dataclass(frozen=True)
class RunIdentity:
    """What tells one run file from another: the id written when it was created and θ0's hash.

    A checkpoint keeps the identity of the file its fit wrote, so that a resume can refuse a
    file replaced by another run and follow the run to another path. Files from before run ids
    have none, and are told apart by θ0's hash alone (runs sharing θ0 then look alike).
    """

    run_id: str | None
    theta0_sha256: str | None

    @classmethod
    def of(cls, attrs: Mapping[str, Any]) -> RunIdentity:
        """The identity recorded in a run file's root attributes."""
        return cls(attrs.get(names.ATTR_RUN_ID), attrs.get(names.ATTR_THETA0_SHA256))

    def to_dict(self) -> dict[str, str | None]:
        """Plain values, as a checkpoint stores them."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> RunIdentity:
        return cls(state.get("run_id"), state.get("theta0_sha256"))

    def describe(self) -> str:
        """``run <id>``, or ``θ0 <hash>`` for a file from before run ids, shortened."""
        if self.run_id is not None:
            return f"run {str(self.run_id)[:12]}"
        return f"the run of θ0 {str(self.theta0_sha256)[:12]}" if self.theta0_sha256 else "no id"

    def mismatch(self, found: RunIdentity) -> str | None:
        """Why ``found`` (a file's identity) is not this one (a checkpoint's); None if it is.

        The run id decides when the checkpoint's file had one; else θ0's hash does.
        """
        if self.run_id is not None:
            if found.run_id == self.run_id:
                return None
        elif self.theta0_sha256 is None or found.theta0_sha256 == self.theta0_sha256:
            return None
        theta0 = "same θ0" if found.theta0_sha256 == self.theta0_sha256 else "another θ0"
        return f"it holds {found.describe()} ({theta0}), not {self.describe()} of the checkpoint"


def _new_run_id() -> str:
    return uuid.uuid4().hex


def _reached(point: str) -> None:
    """Mark a named point of laying out, reopening and renaming a run file; does nothing.

    A hook for tests only (tests/test_kill_windows.py): a test replaces this function in a
    writer process to kill it at ``point`` and checks that the path still holds a readable run.
    """


class RunWriter:
    """Appends rows to a run file whose series and vectors were declared when it was created.

    Use :meth:`create` for a new run and :meth:`resume` to continue one from a checkpoint.

    Args:
        file: an open ``h5py.File`` already laid out and in SWMR mode (internal; use the
            constructors).
        path: the run file's path (the file may have been laid out under another name).
        lock: this writer's lock on ``path``, released when it closes.
        block_rows: buffered rows of a group that trigger writing that group.
        block_bytes: buffered bytes of a group that trigger writing it, so large rows such as
            parameter snapshots never pile up in memory (counted from the group's first row:
            a group's rows keep their shapes).
        flush_interval_s: the time after which the next :meth:`append` flushes everything
            (the recorder also asks at every batch boundary and phase change, see
            :meth:`interval_elapsed`).

    Writing a group's block and flushing the file are separate: blocks of values are written
    when they fill, the file is flushed (made durable for readers, every group written, then
    the steps of the rows written) once per interval. Flushing after every block would cost a
    metadata write of every dataset each time.
    """

    def __init__(
        self,
        file: h5py.File,
        path: Path,
        lock: RunLock,
        block_rows: int = 256,
        block_bytes: int = 16 << 20,
        flush_interval_s: float = 5.0,
    ):
        self._file = file
        self._path = path
        self._identity = RunIdentity.of({k: v for k, v in file.attrs.items()})
        self._lock = lock
        self.block_rows = block_rows
        self.block_bytes = block_bytes
        self.flush_interval_s = flush_interval_s
        self._pending: dict[str, list[tuple[int, Mapping[str, Any]]]] = {}
        self._block_limits: dict[str, int] = {}  # rows of a group that make a block
        # Rows whose values are written but whose steps wait for those values to be on disk:
        # (step dataset, first row, steps).
        self._unindexed: list[tuple[h5py.Dataset, int, list[int]]] = []
        # Dataset handles once: looking them up through h5py per block costs more than writing.
        # Keyed by the names probes declared (rows are), not by the datasets' safe names.
        self._groups = {
            name: (group[STEP], {series_key(n, d): d for n, d in group.items() if n != STEP})
            for name, group in file.get(SERIES, {}).items()
        }
        # Rows written per group, steps included or not: the next row's index.
        self._rows = {name: steps.shape[0] for name, (steps, _) in self._groups.items()}
        events = file[names.EVENTS]
        self._events = (events[STEP], {n: d for n, d in events.items() if n != STEP})
        self._event_rows = events[STEP].shape[0]
        self._status = dict(file[names.STATUS].items())
        self._wall_before = float(self._status[names.STATUS_WALL_TIME][()])
        self._written_step = int(self._status[names.STATUS_LAST_STEP][()])
        self._opened = self._last_flush = time.monotonic()
        self._stopped = False  # the file could not be written; every later call does nothing
        self._at_exit = Finalize(self, self._close_at_exit, exitpriority=LOCK_EXIT_PRIORITY + 1)
        self._pid = os.getpid()

    @property
    def path(self) -> Path:
        return self._path

    @property
    def identity(self) -> RunIdentity:
        """The run file's identity, for a checkpoint to keep."""
        return self._identity

    @property
    def rows(self) -> dict[str, int]:
        """Rows written so far per series group (after :meth:`flush`, every row appended)."""
        return dict(self._rows)

    @property
    def stopped(self) -> bool:
        """Whether recording stopped because the file could not be written."""
        return self._stopped

    @classmethod
    def create(
        cls,
        path: str | os.PathLike,
        series: Mapping[str, Mapping[str, Any]],
        vectors: Mapping[str, Any],
        attrs: Mapping[str, Any],
        overwrite: bool = False,
        lock: RunLock | None = None,
        **kwargs: Any,
    ) -> RunWriter:
        """Create a run file holding the declared series groups and vectors.

        The file is laid out under a temporary name beside ``path``, opened there for SWMR
        writing and renamed to ``path`` only then, so an existing file is replaced only by a
        complete new one that readers can open. It gets a new run id (:class:`RunIdentity`).

        Args:
            path: the run file to create.
            series: ``{group: {name: SeriesSpec}}`` (see ``dynamics.callbacks.probe``).
            vectors: ``{name: SeriesSpec}`` of vectors written once.
            attrs: root attributes (config, versions, layout, ...); JSON-encoded when structured.
            overwrite: replace an existing file; without it an existing file is refused.
            lock: the path's lock when the caller took it earlier (the recorder does, at fit
                start); else it is taken here. The writer releases it when it closes.
            **kwargs: ``block_rows``, ``block_bytes`` and ``flush_interval_s``.

        Raises:
            RunFileError: if ``path`` exists and ``overwrite`` is false, its folder is missing,
                another live writer holds it, or the file cannot be written (a full disk).
        """
        path = Path(path)
        cls.check_path(path, overwrite)
        lock = lock or RunLock.acquire(path)
        staging = path.with_name(path.name + _CREATING)
        try:
            # Laid out in memory and written in one piece: a disk that refuses it fails one
            # plain write, where HDF5 would fail at the close of each object it made.
            staging.write_bytes(_image(series, vectors, attrs))
            _reached("staged")
            file = _open_in_place(staging, path)
        except BaseException as error:
            staging.unlink(missing_ok=True)
            lock.release()
            if isinstance(error, OSError):
                raise RunFileError(f"cannot create {path}: {_reason(error)}") from error
            raise
        return cls(file, path, lock, **kwargs)

    @staticmethod
    def check_path(path: str | os.PathLike, overwrite: bool = False) -> None:
        """Refuse, before anything is written, a path :meth:`create` would refuse.

        Raises:
            RunFileError: if ``path`` exists and ``overwrite`` is false, or its folder is missing.
        """
        path = Path(path)
        if path.is_dir():
            raise RunFileError(f"{path} is a directory; give the run file's path")
        if path.exists() and not overwrite:
            flag = ParameterError("overwrite", "to replace it")  # the CLI spells it --overwrite
            raise RunFileError(f"{path} exists; pass {flag}").quoting(flag)
        if not path.parent.is_dir():
            raise RunFileError(f"folder {path.parent} does not exist")

    @classmethod
    def resume(
        cls,
        path: str | os.PathLike,
        through_steps: Mapping[str, int],
        lock: RunLock | None = None,
        **kwargs: Any,
    ) -> RunWriter:
        """Continue a run file from a checkpoint.

        Args:
            path: the run file the checkpointed fit was writing.
            through_steps: ``{group: last step written before the checkpoint}``; later rows
                (and every row of a group not named) are dropped, so the resumed series equal
                those of an uninterrupted run.
            lock: the path's lock when the caller took it earlier; else it is taken here.
            **kwargs: ``block_rows``, ``block_bytes`` and ``flush_interval_s``.

        Events are kept through ``through_steps[names.EVENTS]`` likewise. The file is rewritten
        through a SWMR read, which also recovers a file whose writer was killed (HDF5 refuses to
        reopen those for writing), under a temporary name that is opened for SWMR writing
        before it replaces ``path``; its status continues (start time, wall time so far), and
        its run id with it (a file from before run ids gets one).

        Raises:
            RunFileError: the file is refused by :meth:`check_resumable` (it is left untouched),
                another live writer holds it, or it cannot be rewritten.
        """
        path = Path(path)
        lock = lock or RunLock.acquire(path)
        try:
            cls.check_resumable(path, through_steps)
            return cls(cls._copy_through(path, through_steps), path, lock, **kwargs)
        except BaseException:
            lock.release()
            raise

    @staticmethod
    def check_resumable(
        path: str | os.PathLike,
        through_steps: Mapping[str, int],
        identity: RunIdentity | None = None,
        rows: Mapping[str, int] | None = None,
    ) -> str | None:
        """Refuse, reading only, a file that :meth:`resume` would continue wrongly.

        The file must be a whole run file (a file shorter than its HDF5 superblock records
        reads zeros for its lost end, which would come back as rows, and SWMR reads of it retry
        for minutes), the checkpoint's own (its ``identity``, when the checkpoint kept one) and
        hold every row the checkpoint counts as written: each group of ``through_steps`` has a
        row at its step, and ``rows[group]`` rows through it (else it is another run's file,
        or one that lost rows).

        Returns:
            What could not be proven, in one line for a warning (a file from before run ids,
            known by θ0's hash only; a checkpoint that kept no identity), or None.

        Raises:
            RunFileError: one line saying why; the file is not touched.
        """
        path = Path(path)
        if not path.is_file():
            raise RunFileError(f"cannot resume: run file {path} is missing")
        mode = path.stat().st_mode
        if not mode & 0o222:
            # A resume rewrites the file under a new name (mode 0644): the permission its owner
            # set to protect the run would silently go, even for root, who writes anything.
            raise RunFileError(
                f"cannot resume {path}: it is read-only (mode {stat.S_IMODE(mode):o}), and a "
                "resume rewrites it; make it writable (chmod u+w) to continue it"
            )
        _check_whole(path)
        try:
            run = open_run(path)
            found = RunIdentity.of(run.attrs)
            if identity is not None and (mismatch := identity.mismatch(found)) is not None:
                raise RunFileError(
                    f"{path} is not the file this checkpoint's fit wrote: {mismatch} "
                    "(replaced by another run after the checkpoint?)"
                )
            _check_rows(path, through_steps, rows)
        except RunFileError as error:
            raise RunFileError(f"cannot resume: {error}") from error
        if identity is None:
            return (
                f"the checkpoint keeps no run identity (saved by an older dynamics): {path} is "
                "taken as its run file on its rows alone"
            )
        if identity.run_id is None:
            return (
                f"{path} has no run id (written by an older dynamics): it is taken as the "
                "checkpoint's run file on θ0's hash and its rows (runs sharing θ0 look alike); "
                "the resumed file gets a run id"
            )
        return None

    @staticmethod
    def check_layout(
        path: str | os.PathLike,
        series: Mapping[str, Mapping[str, Any]],
        vectors: Mapping[str, Any],
        undeclared: Collection[str] | None = None,
    ) -> None:
        """Refuse a file to resume that does not hold every declared series and vector as
        declared (same names, row shapes and dtypes), or holds series groups not declared.

        A resumed fit appends the rows its probes declare: a group the file lacks would end
        the fit at the next flush (nothing can be created in a file under SWMR), rows of
        another shape or series would mix two measurements in one series, and a group left
        undeclared would end at the checkpoint as if its probe had stopped there.

        Args:
            undeclared: groups the file may hold that are not declared (those of a probe
                disabled before the checkpoint); None: any.

        Raises:
            RunFileError: one line naming each group, series or vector that differs.
        """
        path = Path(path)
        differences = []
        try:
            with h5py.File(path, "r", swmr=True) as file:
                stored = file.get(SERIES, {})
                differences += [
                    f"series group {group!r} (in the file, not declared)"
                    for group in stored
                    if group not in series and undeclared is not None and group not in undeclared
                ]
                for group, specs in series.items():
                    if group not in stored:
                        differences.append(f"series group {group!r} (not in the file)")
                        continue
                    found = {n: d for n, d in stored[group].items() if n != STEP}
                    differences += _differences(f"{group}/", specs, found, rows=True)
                differences += _differences("vector ", vectors, dict(file.get(VECTORS, {})))
        except OSError as error:
            raise RunFileError(f"cannot resume {path}: {_reason(error)}") from error
        if differences:
            raise RunFileError(
                f"cannot resume {path}: this fit's probes declare what the file does not hold "
                f"so: {'; '.join(differences)}; resume with the probes (and settings) of the fit "
                "that wrote it, or record the new ones to a new file"
            )

    @staticmethod
    def _copy_through(path: Path, through_steps: Mapping[str, int]) -> h5py.File:
        staging = path.with_name(path.name + _RESUMING)
        try:
            _copy_file_through(path, staging, through_steps)
            _reached("copied")
            return _open_in_place(staging, path)
        except BaseException as error:
            staging.unlink(missing_ok=True)
            if isinstance(error, (OSError, KeyError)):
                raise RunFileError(f"cannot resume {path}: {_reason(error)}") from error
            raise

    def append(self, group: str, step: int, values: Mapping[str, Any]) -> None:
        """Buffer one row of ``group`` (every series of the group, as tensors or arrays)."""
        if self._stopped:
            return
        rows = self._pending.setdefault(group, [])
        rows.append((step, values))
        limit = self._block_limits.get(group)
        if limit is None:
            # A group's rows keep their shapes and dtypes, so the first row's bytes say how many
            # rows fill block_bytes; counting every row's bytes would cost more than the append.
            row_bytes = sum(getattr(v, "nbytes", 8) for v in values.values())
            limit = self._block_limits[group] = max(
                1, min(self.block_rows, -(-self.block_bytes // max(row_bytes, 1)))
            )
        if self.interval_elapsed():
            self.flush()
        elif len(rows) >= limit:
            with self._writing():
                self._write(group)

    def append_event(self, step: int, probe: str, kind: str, message: str) -> None:
        """Write one event row at once (events are rare; the next flush makes it durable)."""
        if not self._stopped:
            with self._writing():
                self._write_event(step, probe, kind, message)

    def write_vector(self, name: str, value: Any) -> None:
        """Fill a declared vector (θ0, θ_T, ...) and flush it to disk at once."""
        if self._stopped:
            return
        value = _to_numpy(value)
        with self._writing():
            self._file[VECTORS][name][...] = value
        self.flush()

    def flush(self) -> None:
        """Write every buffered row and make it durable for readers, with the status."""
        if self._stopped:
            return
        with self._writing():
            for group in list(self._pending):
                self._write(group)
            if self._unindexed:
                self._file.flush()  # the values, before any step names them
                self._index()
            now = time.monotonic()
            self._status[names.STATUS_LAST_STEP][()] = self._written_step
            self._status[names.STATUS_WALL_TIME][()] = self._wall_before + now - self._opened
            self._status[names.STATUS_UPDATED][()] = time.time()
            self._file.flush()
            self._last_flush = now

    def interval_elapsed(self) -> bool:
        """Whether ``flush_interval_s`` has passed since the last flush."""
        return time.monotonic() - self._last_flush >= self.flush_interval_s

    def close(self, state: str = names.FINISHED, exception: str = "") -> None:
        """Write everything, record how the run ended, close the file and release the path.

        Args:
            state: ``names.FINISHED`` or ``names.CRASHED``.
            exception: for a crash, ``"Type: message"`` of the exception that ended it.
        """
        self._at_exit.cancel()
        if not self._stopped and self._file.id.valid:
            self.flush()
        if not self._stopped and self._file.id.valid:  # the flush may have stopped it
            with self._writing():
                self._set_text(names.STATUS_STATE, state)
                self._set_text(names.STATUS_EXCEPTION, exception)
                self._file.flush()
                self._file.close()
        self._lock.release()

    def _close_at_exit(self) -> None:
        # The process is exiting with the file open: its fit ended without closing it.
        if os.getpid() != self._pid:
            return
        exception = _exception_in_flight() or "the process exited during the fit"
        # A DDP launcher terminates the other workers as soon as one fails: SIGTERM waits
        # until the file is closed.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            self.close(names.CRASHED, exception)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def _write(self, group: str) -> None:
        rows = self._pending.pop(group, [])
        if rows:
            steps, datasets = self._groups[group]
            start = self._rows[group]
            blocks = {
                name: _block(dataset, [v[name] for _, v in rows])
                for name, dataset in datasets.items()
            }
            for name, dataset in datasets.items():
                dataset.resize(start + len(rows), axis=0)
                dataset[start:] = blocks[name]
            self._rows[group] = start + len(rows)
            self._unindexed.append((steps, start, [step for step, _ in rows]))

    def _write_event(self, step: int, probe: str, kind: str, message: str) -> None:
        steps, fields = self._events
        row = self._event_rows
        for name, text in (
            (names.EVENT_PROBE, probe),
            (names.EVENT_KIND, kind),
            (names.EVENT_MESSAGE, message),
        ):
            fields[name].resize((row + 1,))
            fields[name][row] = _text(text, fields[name].dtype)
        self._event_rows = row + 1
        self._unindexed.append((steps, row, [step]))

    def _index(self) -> None:
        """Write the steps of rows whose values are on disk: the rows now count."""
        for steps, start, values in self._unindexed:
            steps.resize((start + len(values),))
            steps[start:] = values
            if steps is not self._events[0]:
                self._written_step = max(self._written_step, values[-1])
        self._unindexed = []

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Stop recording, not the training, when the file cannot be written."""
        try:
            yield
        except (OSError, RuntimeError) as error:  # what h5py raises for a failed write
            self._stop(error)

    def _stop(self, error: BaseException) -> None:
        self._stopped = True
        reason = _reason(error)
        # The first step whose row is lost (rows are written in step order).
        lost = [s for _, _, steps in self._unindexed for s in steps]
        lost += [s for rows in self._pending.values() for s, _ in rows]
        step = min(lost, default=max(self._written_step, 0))
        warnings.warn(
            f"recording stopped at step {step}: cannot write {self._path} ({reason}). "
            "Training goes on; the file keeps the rows flushed before.",
            RuntimeWarning,
            stacklevel=2,
        )
        self._pending, self._unindexed = {}, []  # never index rows whose values may be lost
        try:  # the disk may take a last event and the status after all
            self._write_event(step, names.EVENT_WRITER, names.EVENT_ERROR, reason)
            self._file.flush()
            self._index()
            self._set_text(names.STATUS_STATE, names.CRASHED)
            self._set_text(names.STATUS_EXCEPTION, f"recording stopped: {reason}")
            self._file.flush()
            self._file.close()
        except (OSError, RuntimeError):
            _detach(self._file)

    def _set_text(self, field: str, text: str) -> None:
        self._status[field][()] = _text(text, self._status[field].dtype)


def _copy_file_through(path: Path, staging: Path, through_steps: Mapping[str, int]) -> None:
    """Write to ``staging`` the run file at ``path`` with its rows through ``through_steps``."""
    with h5py.File(path, "r", swmr=True) as old, h5py.File(staging, "w", libver=LIBVER) as new:
        for key, value in old.attrs.items():
            new.attrs[key] = value
        if names.ATTR_RUN_ID not in new.attrs:  # a file from before run ids
            new.attrs[names.ATTR_RUN_ID] = _new_run_id()
        last_step = UNWRITTEN_STEP
        for group_name, group in old.get(SERIES, {}).items():
            steps = _copy_rows(
                group,
                new.require_group(SERIES).create_group(group_name),
                through_steps.get(group_name, UNWRITTEN_STEP),
            )
            if len(steps):
                last_step = max(last_step, int(steps[-1]))
        if names.EVENTS in old:
            events = new.create_group(names.EVENTS)
            _copy_rows(old[names.EVENTS], events, through_steps.get(names.EVENTS, -1))
        else:  # a file from before events were recorded
            _create_events(new)
        if VECTORS in old:
            old.copy(old[VECTORS], new)
        status = old.get(names.STATUS, {})
        _create_status(
            new,
            started_at=_scalar(status, names.STATUS_STARTED, time.time()),
            wall_time_s=_scalar(status, names.STATUS_WALL_TIME, 0.0),
            last_step=last_step,
        )


def _check_rows(
    path: Path, through_steps: Mapping[str, int], rows: Mapping[str, int] | None
) -> None:
    """Refuse a file lacking the row of a group at its step of ``through_steps``, or holding
    other than ``rows[group]`` rows through it. Reads the steps only: a snapshot group's
    values can be gigabytes."""
    try:
        with h5py.File(path, "r", swmr=True) as file:
            stored = file.get(SERIES, {})
            for group, step in through_steps.items():
                if group == names.EVENTS or step == UNWRITTEN_STEP:
                    continue
                steps = stored[group][STEP][:] if group in stored else np.array([], np.int64)
                valid = steps[steps != UNWRITTEN_STEP]
                kept = _rows_through(stored[group], step) if len(valid) else 0
                if not kept or steps[kept - 1] != step:
                    last = f"rows through step {valid[-1]}" if len(valid) else "no row"
                    raise RunFileError(
                        f"{path} holds {last} of {group!r}, but the checkpoint counts its rows "
                        f"through step {step} as written: not the file this checkpoint's fit "
                        "wrote, or one that lost rows"
                    )
                if rows is not None and group in rows and kept != rows[group]:
                    raise RunFileError(
                        f"{path} holds {kept} rows of {group!r} through step {step}, but the "
                        f"checkpoint counted {rows[group]}: not the file this checkpoint's fit "
                        "wrote, or one whose rows changed"
                    )
    except OSError as error:
        raise RunFileError(f"{path}: {_reason(error)}") from error


def _differences(
    prefix: str, specs: Mapping[str, Any], found: Mapping[str, Any], rows: bool = False
) -> list[str]:
    """How declared datasets (``specs``) differ from a file's (``found``), one phrase each.

    For declared series (``rows``) every dataset of the group must be declared too; the file
    may hold vectors nothing declares now (written once, never appended to).
    """
    differences = [f"{prefix}{name} (not in the file)" for name in specs if name not in found]
    if rows:
        differences += [f"{prefix}{name} (not declared)" for name in found if name not in specs]
    for name in specs.keys() & found.keys():
        spec, dataset = specs[name], found[name]
        shape = dataset.shape[1:] if rows else dataset.shape
        if shape != tuple(spec.shape) or dataset.dtype != np.dtype(_stored(spec.dtype)):
            differences.append(
                f"{prefix}{name} (declared {tuple(spec.shape)} {spec.dtype}, "
                f"the file's {shape} {dataset.dtype})"
            )
    return sorted(differences)


def _open_in_place(staging: Path, path: Path) -> h5py.File:
    """Open the laid-out file ``staging`` for SWMR writing, then rename it to ``path``.

    A file opened for writing is marked so in its superblock, and HDF5 then refuses every open
    but a SWMR read, which needs the SWMR mark too: a writer killed between the two leaves a
    file nothing opens. Both happen under the staging name, so ``path`` holds the old file or
    the new one, each readable, at every instant. Leftovers of an earlier create or resume of
    ``path`` that was killed go once the new file is in place.
    """
    file = h5py.File(staging, "r+", libver=LIBVER)
    try:
        _reached("opened")
        file.swmr_mode = True
        _reached("swmr")
        os.replace(staging, path)  # the open file follows its new name
    except BaseException:
        file.close()
        raise
    _reached("renamed")
    for suffix in (_CREATING, _RESUMING):
        path.with_name(path.name + suffix).unlink(missing_ok=True)
    return file


_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def _check_whole(path: Path) -> None:
    """Refuse a file that is not HDF5 or is shorter than its superblock's end-of-file address.

    Run files have a version 2 or 3 superblock at byte 0: signature, version, sizes of offsets
    and lengths, flags, then the base, extension and end-of-file addresses. HDF5 makes this
    check itself, except in the SWMR reads that resuming needs.
    """
    with path.open("rb") as file:
        head = file.read(64)
    if head[:8] != _HDF5_SIGNATURE:
        raise RunFileError(f"cannot resume: {path} is not an HDF5 file")
    if len(head) > 12 and head[8] in (2, 3):
        width = head[9]
        base, _, end = (
            int.from_bytes(head[12 + i * width : 12 + (i + 1) * width], "little") for i in range(3)
        )
        size = path.stat().st_size
        if base + end > size:
            raise RunFileError(
                f"cannot resume: {path} is truncated ({size} bytes of the {base + end} its "
                "HDF5 superblock records)"
            )


def _detach(file: h5py.File) -> None:
    """Close a file HDF5 can no longer write, leaving on disk what is there.

    HDF5 retries the failed writes at every flush and at close, and a process whose library
    holds unwritable dirty data crashes at exit. Pointing the file's descriptor at /dev/null
    lets it close; the file on disk stays as a killed writer leaves it.
    """
    null = os.open(os.devnull, os.O_RDWR)
    try:
        os.dup2(null, file.id.get_vfd_handle())
    finally:
        os.close(null)
    with contextlib.suppress(OSError, RuntimeError):
        file.close()


def _reason(error: BaseException) -> str:
    # HDF5's messages carry the system's reason inside a long report; that reason is the news.
    found = re.search(r"error message = '([^']*)'", str(error))
    if found:
        return found.group(1)
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return f"{type(error).__name__}: {str(error).splitlines()[0]}"


def _exception_in_flight() -> str:
    """``"Type: message"`` of the exception ending the process, if one is.

    A DDP worker that raised exits by ``sys.exit`` from the ``except`` clause that caught the
    fit's exception, so the ``SystemExit`` in flight carries it as its context.
    """
    error = sys.exc_info()[1]
    while isinstance(error, SystemExit) and error.__context__ is not None:
        error = error.__context__
    if error is None or isinstance(error, SystemExit):
        return ""
    return f"{type(error).__name__}: {error}"


def _image(
    series: Mapping[str, Mapping[str, Any]],
    vectors: Mapping[str, Any],
    attrs: Mapping[str, Any],
) -> bytes:
    """A new run file's bytes: every object laid out, no row written."""
    with h5py.File("run.h5", "w", driver="core", backing_store=False, libver=LIBVER) as file:
        _lay_out(file, series, vectors, attrs)
        file.flush()
        return file.id.get_file_image()


def _lay_out(
    file: h5py.File,
    series: Mapping[str, Mapping[str, Any]],
    vectors: Mapping[str, Any],
    attrs: Mapping[str, Any],
) -> None:
    file.attrs["schema"] = SCHEMA
    file.attrs["schema_version"] = SCHEMA_VERSION
    for key, value in attrs.items():
        file.attrs[key] = encode_attr(value)
    file.attrs[names.ATTR_RUN_ID] = _new_run_id()  # a new file is a new run, whatever attrs say
    for group, specs in series.items():
        _create_group(file.require_group(SERIES).create_group(group), specs)
    for name, spec in vectors.items():
        file.require_group(VECTORS).create_dataset(
            name, shape=spec.shape, dtype=spec.dtype, fillvalue=_unfilled(spec.dtype)
        )
    _create_events(file)
    _create_status(file, started_at=time.time(), wall_time_s=0.0, last_step=UNWRITTEN_STEP)


def _create_group(group: h5py.Group, specs: Mapping[str, Any]) -> None:
    group.create_dataset(
        STEP, shape=(0,), maxshape=(None,), dtype="int64", chunks=(4096,), fillvalue=UNWRITTEN_STEP
    )
    for name, spec in specs.items():
        row_bytes = np.dtype(_stored(spec.dtype)).itemsize * max(1, int(np.prod(spec.shape)))
        chunk_rows = max(1, min(1024, _CHUNK_BYTES // row_bytes))
        dataset = group.create_dataset(
            names.series_name(name),
            shape=(0, *spec.shape),
            maxshape=(None, *spec.shape),
            dtype=_stored(spec.dtype),
            chunks=(chunk_rows, *spec.shape),
            fillvalue=_unfilled(spec.dtype),
        )
        dataset.attrs[names.ATTR_NAME] = name
        if spec.dtype == BFLOAT16:
            dataset.attrs[names.ATTR_ENCODING] = BFLOAT16
        if spec.columns is not None:
            dataset.attrs[names.ATTR_COLUMNS] = encode_attr(list(spec.columns))
        if spec.view is not None:
            dataset.attrs[names.ATTR_VIEW] = encode_attr(spec.view.to_dict())


def _create_events(file: h5py.File) -> None:
    group = file.create_group(names.EVENTS)
    group.create_dataset(
        STEP, shape=(0,), maxshape=(None,), dtype="int64", chunks=(256,), fillvalue=UNWRITTEN_STEP
    )
    for name in (names.EVENT_PROBE, names.EVENT_KIND, names.EVENT_MESSAGE):
        group.create_dataset(
            name, shape=(0,), maxshape=(None,), dtype=_text_dtype(name), chunks=(256,)
        )


def _create_status(file: h5py.File, started_at: float, wall_time_s: float, last_step: int) -> None:
    group = file.create_group(names.STATUS)
    for name, value in (
        (names.STATUS_LAST_STEP, np.int64(last_step)),
        (names.STATUS_WALL_TIME, np.float64(wall_time_s)),
        (names.STATUS_STARTED, np.float64(started_at)),
        (names.STATUS_UPDATED, np.float64(started_at)),
        (names.STATUS_PID, np.int64(os.getpid())),
    ):
        group.create_dataset(name, data=value)
    for name, text in (
        (names.STATUS_STATE, names.RUNNING),
        (names.STATUS_EXCEPTION, ""),
        (names.STATUS_HOST, socket.gethostname()),
    ):
        group.create_dataset(name, data=_text(text, _text_dtype(name)))


def _text_dtype(field: str) -> np.dtype:
    return h5py.string_dtype("utf-8", TEXT_BYTES[field])


def _text(text: str, dtype: np.dtype) -> np.ndarray:
    # Cut to the field's bytes without splitting a character; the dtype carries the UTF-8 tag
    # HDF5 needs to convert it.
    encoded = text.encode()[: dtype.itemsize].decode(errors="ignore").encode()
    return np.array(encoded, dtype=dtype)


def _scalar(group: Any, name: str, default: float) -> float:
    return float(group[name][()]) if name in group else default


def _copy_rows(source: h5py.Group, target: h5py.Group, through_step: int) -> np.ndarray:
    """Copy a group's rows up to ``through_step`` into ``target``; the steps kept."""
    keep = _rows_through(source, through_step)
    for name, dataset in source.items():
        copy = target.create_dataset(
            name,
            data=dataset[:keep],
            maxshape=(None, *dataset.shape[1:]),
            chunks=dataset.chunks,
            fillvalue=dataset.fillvalue,
        )
        copy.attrs.update(dataset.attrs)
    return source[STEP][:keep]


def _stored(dtype: str) -> str:
    return "uint16" if dtype == BFLOAT16 else dtype


def _unfilled(dtype: str) -> float | int:
    # NaN marks "never written" where the dtype can hold it.
    if dtype == BFLOAT16:
        return _BFLOAT16_NAN
    return np.nan if np.dtype(dtype).kind in "fc" else 0


_BFLOAT16_NAN = 0x7FC0


def _bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """The bfloat16 nearest each value (ties to even, as torch rounds), as its uint16 bits."""
    values = np.asarray(values, dtype=np.float32)
    bits = values.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    # Rounding could carry a NaN's payload into the exponent; every NaN stays the quiet NaN.
    return np.where(np.isnan(values), _BFLOAT16_NAN, rounded).astype(np.uint16)


def _block(dataset: h5py.Dataset, values: list[Any]) -> np.ndarray:
    """Rows stacked as ``dataset`` stores them."""
    block = _stack(values)
    if dataset.dtype == np.uint16 and dataset.attrs.get(names.ATTR_ENCODING) == BFLOAT16:
        block = _bfloat16_bits(block)
    return block


def _rows_through(group: h5py.Group, through_step: int) -> int:
    steps = group[STEP][:]
    valid = (steps != UNWRITTEN_STEP) & (steps <= through_step)
    return int(np.argmin(valid)) if not valid.all() else len(steps)


def _stack(values: list[Any]) -> np.ndarray:
    if len(values) == 1:  # a lone large row (a snapshot): a view of it, no copy on the host
        return _to_numpy(values[0])[None]
    torch = _torch()
    if torch is not None and all(isinstance(v, torch.Tensor) for v in values):
        # One device-to-host copy per block rather than per row; _to_numpy detaches the block
        # (a detach per row would cost more than the stack).
        return _to_numpy(torch.stack(values))
    return np.stack([_to_numpy(v) for v in values])


def _to_numpy(value: Any) -> np.ndarray:
    torch = _torch()
    if torch is not None and isinstance(value, torch.Tensor):
        if value.dtype == torch.bfloat16:  # NumPy has no bfloat16; float32 holds every value
            value = value.float()
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _torch() -> Any:
    # Rows can only be tensors once torch is loaded; offline tools (info, report) never load it,
    # which keeps them quick to start.
    return sys.modules.get("torch")
