"""Reading run files: validated on open, series read on demand, live runs included.

A run still being written, or whose writer was killed, is read in SWMR mode (HDF5 refuses a
plain open of such a file); a finished one is opened plainly, which also detects truncation.
Every open is bounded in time (:mod:`dynamics.store.opening`) and the file inspected before any
of its data is read (:mod:`dynamics.store.inspection`): a run file is untrusted data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import h5py
import numpy as np

from dynamics.store import frames, names
from dynamics.store.inspection import Inspected, allocated, inspect_file
from dynamics.store.opening import check_head, open_live
from dynamics.store.schema import (
    BFLOAT16,
    PARAMETER_VECTORS,
    SCHEMA,
    SCHEMA_VERSION,
    SERIES,
    STEP,
    UNWRITTEN_STEP,
    VECTORS,
    RunFileError,
    View,
    check_attrs,
    decode_attr,
    layout_size,
)
from dynamics.store.views import STANDARD_VIEWS, standard_view

if TYPE_CHECKING:
    import pandas as pd
    import xarray as xr

    from dynamics.params.layout import BufferLayout, ParameterLayout


@dataclass(frozen=True)
class Series:
    """One group of rows sharing a step index.

    Example::

        norms = dynamics.open_run("run.h5").series("hidden_norms")
        norms.step[-1], norms["norm"][-1]  # the last row, one value per layer

    Attributes:
        step: optimizer steps, strictly increasing, shape (n,).
        values: ``{name: array of shape (n, *row_shape)}``.
        columns: ``{name: names of the last axis}`` for series that name it.
        views: ``{name: how it is drawn}`` for series that are drawn (see :meth:`Run.views`).
        group: the group's name in the run file.
    """

    step: np.ndarray
    values: dict[str, np.ndarray]
    columns: dict[str, tuple[str, ...]] = field(default_factory=dict)
    views: dict[str, View] = field(default_factory=dict)
    group: str = ""

    def __len__(self) -> int:
        return len(self.step)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.values[name]

    # --- pandas and xarray (optional: pip install 'dynamics-for-pytorch[notebook]') ---

    def to_pandas(self, long: bool = False) -> pd.DataFrame:
        """The rows as a pandas DataFrame.

        Wide (default): indexed by ``step``, one column per entry of a row, under a two-level
        header ``(series, column)``: a scalar series has the column ``""``, so
        ``frame["train"]`` is a Series and ``frame["norm"]`` a table of steps × layers named
        as recorded (``<name>_<j>`` when the file names none). Rows of several axes get one
        column per entry, named by the leading indices and the last axis's name
        (``0/density_nodes_3``).

        Long (``long=True``): one row per value, columns ``step``, ``series``, ``column``,
        ``value`` (for plotly express, seaborn, groupby).

        Example::

            frame = run.series("hidden_norms").to_pandas()
            frame["norm"].tail()  # steps × layers

        Raises:
            DynamicsError: pandas is not installed.
        """
        return frames.series_frame(self, long)

    def to_xarray(self) -> xr.Dataset:
        """The rows as an xarray Dataset on the dimension ``step``.

        Each series is a variable whose further dimensions are named after what they index:
        ``layer`` (hidden-state norms, activation bias), ``eigen_index`` (Hessian eigenvalues
        and residuals), ``tensor`` (per-tensor displacement), ``density_run`` and ``node``
        (spectral density); a user's series ``<name>_column``. An axis the file names has its
        names as coordinates; a drawn series carries its label and units as ``long_name`` and
        ``units``, so ``dataset["norm"].plot.line(x="step")`` labels itself.

        Example::

            dataset = run.series("hidden_norms").to_xarray()
            dataset["norm"].sel(layer="blocks.0")

        Raises:
            DynamicsError: xarray is not installed.
        """
        return frames.series_dataset(self)


@dataclass(frozen=True)
class Event:
    """Something a probe reported during the run.

    Example::

        [event.message for event in run.events() if event.kind == "disabled"]

    Attributes:
        step: the optimizer step it happened at.
        probe: the probe's name.
        kind: ``"disabled"`` (the probe stepped aside), ``"error"`` (it raised and was disabled)
            or ``"warning"`` (a note; the probe went on).
        message: what happened, in one line.
    """

    step: int
    probe: str
    kind: str
    message: str


@dataclass(frozen=True)
class RunStatus:
    """How far a run got and how it ended.

    Example::

        status = run.status()
        status.state in ("running", "finished", "crashed", "killed")

    Attributes:
        state: ``"running"``, ``"finished"``, ``"crashed"``, ``"killed"`` (the file says
            running but its writer, on this host, is gone) or ``"unknown"`` (a file from before
            the status was recorded).
        exception: ``"Type: message"`` of the exception that crashed the run, else ``""``.
        last_step: the largest step of any row made durable; None before the first.
        wall_time_s: seconds between the file's creation and its last flush, over every
            resumed fit.
        started_at: Unix time the file was created.
        updated_at: Unix time of the last flush.
    """

    state: str
    exception: str = ""
    last_step: int | None = None
    wall_time_s: float | None = None
    started_at: float | None = None
    updated_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Metric:
    """One value per recorded step (a loss, a logged validation metric).

    Example::

        loss = run.train_loss()
        loss.name, loss.step[-1], loss.values[-1]

    Attributes:
        name: the series' name in its group (``train``, ``val_loss``, ...).
        step: optimizer steps, shape (n,).
        values: the values, shape (n,).
    """

    name: str
    step: np.ndarray
    values: np.ndarray


@dataclass(frozen=True)
class StoredState:
    """One state of the model a run stored: its parameters and, when recorded, its buffers.

    Example::

        state = run.stored_states()[-1]  # θT
        state.step, state.source, state.theta.shape

    Attributes:
        step: optimizer steps taken before it (θ0: 0; θT: the run's steps).
        source: ``"theta0"``, ``"snapshot"`` or ``"theta_final"``.
        theta: flat parameters in the run's :attr:`Run.layout`.
        buffers: ``{stored dtype: flat buffers}`` in the run's :attr:`Run.buffer_layout`, or
            None when the run recorded none (a file from before buffers were stored).
    """

    step: int
    source: str
    theta: np.ndarray
    buffers: dict[str, np.ndarray] | None


@dataclass(frozen=True)
class Update:
    """What :meth:`Run.update` read of a live run in one open.

    Attributes:
        run_id: the id of the file now at the run's path; another id than the run's own
            (:attr:`Run.run_id`) means the file was replaced (an overwrite) and must be opened
            anew.
        status: as :meth:`Run.status`.
        events: as :meth:`Run.events`.
        rows: ``{group: its rows after the step asked for}``.
    """

    run_id: str | None
    status: RunStatus
    events: list[Event]
    rows: dict[str, Series]


@dataclass(frozen=True)
class _Polled:
    """What :meth:`Run.update` read of a quiet file, and the file's signature then."""

    signature: tuple[int, ...]
    run_id: str | None
    status: dict[str, Any] | None  # the status fields, for the writer's liveness asked anew
    events: list[Event]
    last: dict[str, int | None]  # each group's last complete step (None: no row), as read
    empty: dict[str, tuple]  # each group's rows, none of them (their dtypes and shapes)

    def covers(self, signature: tuple[int, ...], since: Mapping[str, int | None]) -> bool:
        """Whether the file is the same and ``since`` already has every row read then."""
        if signature != self.signature or not set(since) <= set(self.last):
            return False
        return all(
            self.last[g] is None or (since[g] is not None and since[g] >= self.last[g])
            for g in since
        )


class _Declared(NamedTuple):
    """What a series' dataset says about it before any row is read."""

    shape: tuple[int, ...]  # of one row
    columns: tuple[str, ...] | None
    view: View | None


class Run:
    """A run file's metadata, series, vectors, events and status; see :func:`open_run`.

    Example::

        run = dynamics.open_run("runs/demo/shifted.h5")
        norms = run.series("hidden_norms")  # steps × layers, with norms.columns["norm"]
        theta0 = run.vector("theta0")
    """

    def __init__(
        self,
        path: Path,
        attrs: dict[str, Any],
        declared: dict[str, dict[str, _Declared]],
        vectors: dict,
    ):
        self.path = path
        self.attrs = attrs
        self.groups = tuple(declared)
        self.vector_names = tuple(vectors)
        self._declared = declared
        self._vector_shapes = vectors
        self._series: dict[str, Series] = {}
        self._inspected = Inspected()  # for update(): a polled file is inspected whole once
        self._polled: _Polled | None = None  # what update() read last, of a quiet file

    @property
    def config(self) -> dict[str, Any]:
        return self.attrs.get(names.ATTR_CONFIG) or {}

    @property
    def name(self) -> str:
        return self.attrs.get(names.ATTR_RUN_NAME) or self.path.stem

    @property
    def run_id(self) -> str | None:
        """The id written when the file was created (None in files from before run ids)."""
        return self.attrs.get(names.ATTR_RUN_ID)

    @property
    def model_edits(self) -> list[dict[str, Any]] | None:
        """What callbacks did to the module before θ0 (activations shifted, biases set), one
        ``{"class_path", "edit", "settings", "table"}`` per callback, ``[]`` for none; None in
        files from before it was recorded."""
        edits = self.attrs.get(names.ATTR_MODEL_EDITS)
        return None if edits is None or edits == "null" else edits

    @cached_property
    def layout(self) -> ParameterLayout | None:
        from dynamics.params.layout import (
            ParameterLayout,  # torch, which offline summaries never need
        )

        data = self.attrs.get(names.ATTR_LAYOUT)
        return ParameterLayout.from_dict(data) if data else None

    @cached_property
    def buffer_layout(self) -> BufferLayout | None:
        """The layout of the module's persistent buffers; None in files from before buffers
        were recorded."""
        from dynamics.params.layout import BufferLayout

        data = self.attrs.get(names.ATTR_BUFFERS)
        return BufferLayout.from_dict(data) if data is not None else None

    def stored_states(self, buffers: bool = True) -> list[StoredState]:
        """θ0, every parameter snapshot and θT (those stored), in step order.

        Example::

            [state.step for state in run.stored_states()]  # θ0, the snapshots, θT

        Args:
            buffers: also read each state's buffers; without them (``buffers`` None in every
                state) the buffers' layout is not read, and torch not imported: what an
                offline measure of the parameters alone (weight spectra) asks.

        Raises:
            RunFileError: the run stores no θ0 (record with ParameterDisplacement).
        """
        theta0 = self.vector(names.THETA0)
        if theta0 is None:
            raise RunFileError(f"{self.path.name}: no θ0 stored (record ParameterDisplacement)")
        stored = self._stored_buffers if buffers else lambda prefix: None
        states = [StoredState(0, "theta0", theta0, stored(names.THETA0_BUFFERS))]
        snapshots = self.recorded(names.SNAPSHOTS)
        if snapshots is not None:
            dtypes = self._buffer_dtypes() if buffers else ()
            keys = [names.buffer_vector(names.SNAPSHOT_BUFFERS, d) for d in dtypes]
            recorded = (
                buffers
                and self.buffer_layout is not None
                and all(k in snapshots.values for k in keys)
            )
            for i, step in enumerate(snapshots.step):
                buffers = {d: snapshots[k][i] for d, k in zip(dtypes, keys)} if recorded else None
                theta = snapshots[names.SNAPSHOT_THETA][i]
                # Parameters a diverged training left are data; before it diverged, damage.
                diverged = self.diverged_at is not None and step >= self.diverged_at
                if not diverged and not np.isfinite(theta).all():
                    raise RunFileError(
                        f"{self.path}: series/{names.SNAPSHOTS}/{names.SNAPSHOT_THETA} holds "
                        f"non-finite parameters at step {step}"
                    )
                states.append(StoredState(int(step), "snapshot", theta, buffers))
        final = self.vector(names.THETA_FINAL)
        if final is not None:
            final_buffers = stored(names.THETA_FINAL_BUFFERS)
            states.append(StoredState(self._final_step(), "theta_final", final, final_buffers))
        return states

    def _buffer_dtypes(self) -> tuple[str, ...]:
        return self.buffer_layout.stored_dtypes if self.buffer_layout is not None else ()

    def _stored_buffers(self, prefix: str) -> dict[str, np.ndarray] | None:
        if self.buffer_layout is None:
            return None
        vectors = {d: self.vector(names.buffer_vector(prefix, d)) for d in self._buffer_dtypes()}
        return None if any(v is None for v in vectors.values()) else vectors

    def _final_step(self) -> int:
        step = self.vector(names.THETA_FINAL_STEP)
        if step is not None:
            value = step[0]
            if not (np.isfinite(value) and value >= 0 and value == int(value)):
                raise RunFileError(
                    f"{self.path}: {VECTORS}/{names.THETA_FINAL_STEP} is {value}, not a step"
                )
            return int(value)
        # Files from before the step was stored: one past the last recorded training step.
        last = [
            rows.step[-1]
            for rows in (self.train_loss(), self.recorded(names.SNAPSHOTS))
            if rows is not None
        ]
        return int(max(last)) + 1 if last else 0

    @cached_property
    def diverged_at(self) -> int | None:
        """The step at which training diverged, or None when its measurements say it did not.

        A run diverged when its training measured it: its parameter displacement (a norm of
        θ_step − θ0) is not finite at some step, or its training loss, finite at first, is not
        finite from some step to its last row. The step is the first whose loss or stored
        parameters (displacement, snapshots) are not finite. A NaN loss alone while the
        parameters stay finite is no divergence (an AMP step skipped, a loss not returned), and
        non-finite stored parameters that no measurement explains are damage, not divergence.
        """

        def first_divergent_step(file: h5py.File) -> int | None:
            series = file[SERIES] if SERIES in file else {}
            displaced = _first_nonfinite_step(series, names.DISPLACEMENT, names.DISPLACEMENT_TOTAL)
            loss = _nonfinite_to_the_end(series, names.LOSS, names.LOSS_TRAIN)
            evidence = [step for step in (displaced, loss) if step is not None]
            if displaced is None and not (loss is not None and self._final_not_finite(file)):
                return None
            snapshot = _first_nonfinite_snapshot(series, before=min(evidence))
            return min(evidence + ([snapshot] if snapshot is not None else []))

        return _read(self.path, "its divergence", first_divergent_step)

    def _final_not_finite(self, file: h5py.File) -> bool:
        """Whether θT is stored with its step and is not finite."""
        vectors = file[VECTORS] if VECTORS in file else {}
        if names.THETA_FINAL not in vectors or names.THETA_FINAL_STEP not in vectors:
            return False
        step = vectors[names.THETA_FINAL_STEP][...]
        stored = step.dtype.kind in "fc" and not np.isnan(step).all()
        return stored and not np.isfinite(vectors[names.THETA_FINAL][...]).all()

    @property
    def theta0_sha256(self) -> str | None:
        """The recorded hash of θ0, or None when the run did not record it."""
        return self.attrs.get(names.ATTR_THETA0_SHA256)

    def shares_theta0(self, other: Run) -> bool:
        """Whether both runs recorded the same θ0 (False when either recorded no hash)."""
        return self.theta0_sha256 is not None and self.theta0_sha256 == other.theta0_sha256

    def series(self, group: str) -> Series:
        """Every row of ``group`` (read once, then cached).

        Example::

            norms = run.series("hidden_norms")
            norms.step, norms["norm"], norms.columns["norm"]

        Raises:
            KeyError: the run has no such group.
            RunFileError: its data cannot be read (a damaged file).
        """
        if group not in self.groups:
            raise KeyError(
                f"{self.path.name} has no series {group!r} (has {', '.join(self.groups)})"
            )
        if group not in self._series:
            what = f"series {group!r}"
            step, values = _read(self.path, what, lambda file: _read_rows(file[SERIES][group]))
            columns = {n: d.columns for n, d in self._declared[group].items() if d.columns}
            self._series[group] = Series(step, values, columns, self.views(group), group)
        return self._series[group]

    def recorded(self, group: str) -> Series | None:
        """The rows of ``group``, or None when it was not recorded or holds no row.

        Example::

            hessian = run.recorded("hessian")
            if hessian is not None:
                print(hessian["eigenvalues"][-1])

        Raises:
            RunFileError: the group's data cannot be read (a damaged file).
        """
        if group not in self.groups:
            return None
        rows = self.series(group)
        return rows if len(rows) else None

    def views(self, group: str) -> dict[str, View]:
        """``{series: how it is drawn}`` of the group's drawn series, read without its rows.

        A file written before series stored their views gets the standard probes' views. The
        standard series come in the order of :data:`dynamics.store.views.STANDARD_VIEWS` (HDF5
        lists a group's series by name), the others after them.

        Example::

            run.views("hessian")["eigenvalues"].kind  # "lines"
        """
        views = {n: d.view for n, d in self._declared.get(group, {}).items() if d.view}
        standard = STANDARD_VIEWS.get(group, {})
        order = [n for n in standard if n in views] + [n for n in views if n not in standard]
        return {name: views[name] for name in order}

    def columns(self, group: str, name: str) -> tuple[str, ...]:
        """Names of the last axis of a series: as recorded, else ``<name>_0``, ``<name>_1``, ...

        Raises:
            KeyError: the run has no such series.
        """
        declared = self._declared[group][name]
        if declared.columns:
            return declared.columns
        return frames.default_columns(name, declared.shape[-1] if declared.shape else 1)

    def train_loss(self) -> Metric | None:
        """The training loss (group ``loss``, series ``train``), or None when not recorded.

        Example::

            loss = run.train_loss()
            loss.step, loss.values
        """
        rows = self.recorded(names.LOSS)
        if rows is None or names.LOSS_TRAIN not in rows.values:
            return None
        return Metric(names.LOSS_TRAIN, rows.step, rows[names.LOSS_TRAIN])

    def validation_metrics(self) -> dict[str, Metric]:
        """Every metric logged during validation, ``{key: Metric}``; empty when none was.

        Example::

            {key: metric.values[-1] for key, metric in run.validation_metrics().items()}
        """
        rows = self.recorded(names.VALIDATION)
        if rows is None:
            return {}
        return {key: Metric(key, rows.step, values) for key, values in rows.values.items()}

    def heldout_loss(self) -> Metric | None:
        """The held-out loss, or None.

        It is the validation metric ``val_loss`` (what the teacher–student module logs), else
        the first whose name contains ``loss``: a module's own logging names vary.

        Example::

            heldout = run.heldout_loss()  # None when the run validated nothing
        """
        metrics = self.validation_metrics()
        keys = [k for k in metrics if k == names.VAL_LOSS] or [k for k in metrics if "loss" in k]
        return metrics[keys[0]] if keys else None

    def vector(self, name: str) -> np.ndarray | None:
        """A stored vector, or None when it is absent or was never filled (NaN).

        Example::

            theta0, theta_final = run.vector("theta0"), run.vector("theta_final")

        Raises:
            RunFileError: the vector is damaged: a parameter vector (θ0, θT, g0, the plane's
                basis) with non-finite entries, or θT unwritten though its step is stored.
        """
        if name not in self.vector_names:
            return None
        value = _read(self.path, f"vector {name!r}", lambda file: _filled_vector(file, name))
        if value is None:
            return None
        if name in PARAMETER_VECTORS and not np.isfinite(value).all():
            if name == names.THETA_FINAL and self.diverged_at is not None:
                return value  # what a diverged training left: data, not damage
            if np.isnan(value).all():  # θT with its step (else unfilled above)
                raise RunFileError(
                    f"{self.path}: vectors/{name} is unwritten (NaN) though its step is stored, "
                    "and no recorded loss or displacement shows the run diverged"
                )
            bad = int((~np.isfinite(value)).sum())
            raise RunFileError(
                f"{self.path}: vectors/{name} holds {bad} non-finite entries of {value.size}"
            )
        return value

    def events(self) -> list[Event]:
        """What probes reported (disabled, failed, warned), in the order it happened.

        Read anew at each call, so a live run's latest events show.

        Example::

            for event in run.events():
                print(event.step, event.probe, event.kind, event.message)
        """
        return _events(_read(self.path, names.EVENTS, lambda file: _event_fields(file, self.path)))

    def status(self) -> RunStatus:
        """The run's state, last flushed step and wall time, read anew at each call.

        Example::

            status = run.status()
            status.state, status.last_step, status.wall_time_s
        """
        fields = _read(self.path, names.STATUS, lambda file: _status_fields(file, self.path))
        return _status(self.path, fields)

    def update(self, since: Mapping[str, int | None]) -> Update:
        """What a live run's file holds now: its id, status and events, and each group's rows
        after the step ``since`` gives it (every row for None), read in one open.

        This is what a watcher polls (``dynamics watch``), so a poll is cheap:

        - the file is open only while it is read, so a writer is never blocked and an
          overwrite is never held up;
        - the file is inspected whole (:func:`~dynamics.store.inspection.inspect_file`) once per
          identity; afterwards only what the poll reads is checked again
          (:class:`~dynamics.store.inspection.Inspected`);
        - a file unchanged since the last update (same inode, size and modification time, that
          time at least :data:`QUIET_S` before that update read it) is not read again when
          ``since`` asks for nothing the last update did not already hold: the answer is no
          new rows, with the status read then (whether its writer still runs is asked anew).

        Example::

            update = run.update({"loss": None})
            since = {"loss": int(update.rows["loss"].step[-1])} if len(update.rows["loss"]) else {}
            run.update(since).rows["loss"]  # only the rows written after

        Raises:
            KeyError: a group the run does not hold.
            RunFileError: the file cannot be read (replaced by a file that is not a run, cut).
        """
        for group in since:
            if group not in self.groups:
                raise KeyError(f"{self.path.name} has no series {group!r}")

        signature = _quiet_signature(self.path)  # taken before the read: a later write shows
        polled = self._polled
        if polled is not None and signature is not None and polled.covers(signature, since):
            rows = {g: self._series_of(g, *polled.empty[g]) for g in since}
            return Update(polled.run_id, _status(self.path, polled.status), polled.events, rows)

        growing = [f"{SERIES}/{g}" for g in since] + [names.EVENTS]

        def read(file: h5py.File) -> tuple:
            run_id = decode_attr(file.attrs.get(names.ATTR_RUN_ID))
            status = _status_fields(file, self.path)
            events = _event_fields(file, self.path)
            rows = {g: _read_rows(file[SERIES][g], after) for g, after in since.items()}
            return run_id, status, events, rows

        def inspect(file: h5py.File) -> None:
            self._inspected.check(file, self.path, [g for g in growing if g in file])

        run_id, status, events, rows = _read(self.path, "its new rows", read, inspect)
        events = _events(events)
        series = {group: self._series_of(group, *read) for group, read in rows.items()}
        self._polled = None
        if signature is not None:
            last = {
                g: int(series[g].step[-1]) if len(series[g]) else after
                for g, after in since.items()
            }
            empty = {g: (r[0][:0], {n: v[:0] for n, v in r[1].items()}) for g, r in rows.items()}
            self._polled = _Polled(signature, run_id, status, events, last, empty)
        return Update(run_id, _status(self.path, status), events, series)

    def _series_of(self, group: str, step: np.ndarray, values: dict[str, np.ndarray]) -> Series:
        columns = {n: d.columns for n, d in self._declared[group].items() if d.columns}
        return Series(step, values, columns, self.views(group), group)

    def summary(self) -> dict[str, Any]:
        """Series lengths, step ranges, status, events and metadata, as ``dynamics info``
        prints them.

        Example::

            run.summary()["series"]["loss"]["rows"]
        """
        series = {}

        # Only each group's step index and extents are read, and each vector's first entry: a
        # snapshot group can hold gigabytes that a summary never needs.
        def steps_and_vectors(file: h5py.File) -> tuple[dict, dict]:
            spans = {group: _step_span(file[SERIES][group]) for group in self.groups}
            vectors = {
                name: list(shape)
                for name, shape in self._vector_shapes.items()
                if not _unwritten(file, name, file[VECTORS][name][:1])
            }
            final_start = (
                file[VECTORS][names.THETA_FINAL][:1] if names.THETA_FINAL in vectors else ()
            )
            return spans, vectors, final_start

        spans, vectors, final_start = _read(self.path, "its steps", steps_and_vectors)
        if not np.isfinite(final_start).all():
            self.vector(names.THETA_FINAL)  # a NaN θT is a diverged run's, or damage: refused
        for group, (rows, first, last) in spans.items():
            series[group] = {
                "rows": rows,
                "first_step": first,
                "last_step": last,
                "series": {n: list(d.shape) for n, d in self._declared[group].items()},
            }
        return {
            "path": str(self.path),
            "schema_version": self.attrs.get("schema_version"),
            "run_name": self.name,
            "status": self.status().to_dict(),
            "diverged_at": self.diverged_at,
            "events": [dataclasses.asdict(event) for event in self.events()],
            "series": series,
            "vectors": vectors,
            "attrs": {
                k: v for k, v in self.attrs.items() if k not in ("schema", names.ATTR_LAYOUT)
            },
        }

    # --- xarray (optional: pip install 'dynamics-for-pytorch[notebook]') ---

    def to_xarray(self, groups: list[str] | None = None) -> xr.DataTree:
        """The run's series as an xarray DataTree: one node per group, each the Dataset of
        :meth:`Series.to_xarray` (groups have their own ``step`` index).

        Example::

            tree = run.to_xarray()  # needs the notebook extra
            tree["hessian"]["eigenvalues"].sel(eigen_index="lambda_1")

        Args:
            groups: the groups to read; default every group but the parameter snapshots,
                which can hold gigabytes (name ``"snapshots"`` to read them).

        Raises:
            KeyError: a named group the run did not record.
            DynamicsError: xarray is not installed.
        """
        return frames.run_tree(self, groups)


def open_run(path: str | os.PathLike) -> Run:
    """Open and validate a run file: its attributes and the structure of every group and
    vector (names, shapes, dtypes), not yet their rows.

    A file still being created (modified within the last second) gets a short retry: its
    writer may be between two of HDF5's writes.

    Example::

        run = dynamics.open_run("runs/demo/shifted.h5")
        run.status().state, run.train_loss().values[-1]

    Raises:
        RunFileError: the path is missing or a directory, is not an HDF5 run file, is
            truncated or corrupted, carries a newer schema version than this dynamics reads,
            or breaks the schema (one line naming the file, the group and what is wrong).
    """
    path = Path(path)
    if path.is_dir():
        raise RunFileError(f"{path}: is a directory, not a run file")
    if not path.is_file():
        raise RunFileError(f"{path}: no such file")
    return _retrying(path, lambda: _read_run(path))


def run_files(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """The run files of ``paths``: each file as given, each directory's ``*.h5`` files by name.

    A directory's other outputs of this toolkit (``dynamics plane``'s ``X.plane.h5`` grids,
    written beside the runs) are not runs and are left out.

    Example::

        for path in run_files(["runs/demo"]):  # a folder stands for its run files
            print(path, open_run(path).status().state)

    Raises:
        RunFileError: a directory holding no ``.h5`` file.
    """
    files = []
    for path in map(Path, paths):
        if not path.is_dir():
            files.append(path)
            continue
        inside = sorted(p for p in path.glob("*.h5") if p.is_file() and not other_output(p))
        if not inside:
            raise RunFileError(f"{path}: is a directory holding no run file (*.h5)")
        files.extend(inside)
    return files


def other_output(path: Path) -> bool:
    """Whether ``path`` is an HDF5 output of this toolkit other than a run file (its root
    ``schema`` attribute names another ``dynamics-`` kind); a file that cannot be read is not
    (opening it as a run says what is wrong with it)."""
    try:
        with h5py.File(path, "r") as file:
            schema = decode_attr(file.attrs.get("schema"))
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(schema, str) and schema.startswith("dynamics-") and schema != SCHEMA


#: Seconds a file modified this recently is read again when it cannot be read yet.
LIVE_RETRY_S = 1.0
#: Seconds since its last modification after which a file's size and modification time tell
#: for sure whether it changed: a write after a read then gets a later modification time even
#: on file systems that keep it to the second or two.
QUIET_S = 2.0


def _quiet_signature(path: Path) -> tuple[int, ...] | None:
    """The file's device, inode, size and modification time, when it has been quiet for
    :data:`QUIET_S` (None when it changed more recently, or cannot be seen)."""
    try:
        status = path.stat()
    except OSError:
        return None
    if time.time() - status.st_mtime < QUIET_S:
        return None
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns


_T = TypeVar("_T")


def _retrying(path: Path, read: Callable[[], _T]) -> _T:
    """``read()``, tried again for a moment while the file is being written (modified within
    :data:`LIVE_RETRY_S`): its writer may be between two of HDF5's writes. Every read of a run
    retries so, its open and each later read alike."""
    deadline = time.monotonic() + LIVE_RETRY_S
    while True:
        try:
            return read()
        except RunFileError:
            try:
                live = time.time() - path.stat().st_mtime < LIVE_RETRY_S
            except OSError:  # gone or unreadable now: the error stands
                live = False
            if not live or time.monotonic() > deadline:
                raise
        time.sleep(0.05)


def _read(
    path: Path,
    what: str,
    read: Callable[[h5py.File], _T],
    inspect: Callable[[h5py.File], None] | None = None,
) -> _T:
    """``read(file)`` on the file open for reading, retried while it is live (``inspect``: as
    :func:`_reading`)."""

    def once() -> _T:
        with _reading(path, what, inspect) as file:
            return read(file)

    return _retrying(path, once)


def _read_run(path: Path) -> Run:
    with _reading(path, "it") as file:
        attrs = _root_attrs(file, path)
        layout = attrs.get(names.ATTR_LAYOUT)
        size = layout_size(layout) if isinstance(layout, dict) else None
        declared = {
            group: _declared_group(path, group, members, size)
            for group, members in _group(file, SERIES, path).items()
        }
        vectors = {
            name: _vector_shape(path, name, dataset, size)
            for name, dataset in _group(file, VECTORS, path).items()
        }
    _check_drawable(path, declared)  # the views it stores; older files' rows are their own
    if not any(d.view for series in declared.values() for d in series.values()):
        declared = {
            group: {n: d._replace(view=standard_view(group, n)) for n, d in series.items()}
            for group, series in declared.items()
        }
    return Run(path, attrs, declared, vectors)


@contextlib.contextmanager
def _reading(
    path: Path, what: str, inspect: Callable[[h5py.File], None] | None = None
) -> Iterator[h5py.File]:
    """The file open for reading and inspected, before any of its data is read (at every open:
    the file at the path may have been replaced since; ``inspect`` instead of
    :func:`~dynamics.store.inspection.inspect_file` for a poller that knows the file), any
    failure of HDF5 or of its layout turned into one line."""
    try:
        with _open(path) as file:
            if inspect is None:
                inspect_file(file, path)
            else:
                inspect(file)
            yield file
    except RunFileError:
        raise
    except FileNotFoundError:  # deleted (or renamed away) since the run was opened
        raise RunFileError(f"{path}: no such file (deleted since it was opened?)") from None
    except (
        OSError,
        KeyError,
        ValueError,
        TypeError,
        AttributeError,
        RuntimeError,
        MemoryError,  # a read beyond the memory limit: still one line
    ) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise RunFileError(
            f"{path}: cannot read {what}, not a readable run file (truncated or corrupted?): "
            f"{reason[:120]}"
        ) from error


def _root_attrs(file: h5py.File, path: Path) -> dict[str, Any]:
    attrs = {}
    for name, value in file.attrs.items():
        try:
            attrs[name] = decode_attr(value)
        except (ValueError, RecursionError):  # RecursionError: JSON nested beyond reason
            raise RunFileError(f"{path}: attribute {name!r} is not valid JSON") from None
    if attrs.get("schema") != SCHEMA:
        raise RunFileError(f"{path}: not a dynamics run file (no '{SCHEMA}' schema)")
    version = attrs.get("schema_version")
    if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
        raise RunFileError(
            f"{path}: schema version {version} is newer than this dynamics reads "
            f"({SCHEMA_VERSION}); upgrade dynamics"
        )
    try:
        check_attrs(attrs)
    except ValueError as error:
        raise RunFileError(f"{path}: {error}") from None
    return attrs


def _group(file: h5py.File, name: str, path: Path) -> h5py.Group | dict:
    """A top-level group of the file (empty when absent, as in files from before it)."""
    group = file.get(name)
    if group is None:
        return {}
    if not isinstance(group, h5py.Group):
        raise RunFileError(f"{path}: /{name} is a dataset, not a group")
    return group


def _checked(
    group: h5py.Group, name: str, path: Path, kinds: str, ndim: int | None = None
) -> h5py.Dataset:
    """``group[name]``, checked to be a dataset of ``ndim`` axes whose dtype is of ``kinds``
    (NumPy dtype kinds: ``iu`` integers, ``f`` floats, ``S`` text)."""
    where = f"{group.name.lstrip('/')}/{name}"
    dataset = group.get(name)
    if dataset is None:
        raise RunFileError(f"{path}: {where} is missing")
    if not isinstance(dataset, h5py.Dataset):
        raise RunFileError(f"{path}: {where} is a group, not a dataset")
    if dataset.dtype.kind not in kinds:
        raise RunFileError(f"{path}: {where} holds {dataset.dtype}, not {_KIND_WORDS[kinds]}")
    if ndim is not None and dataset.ndim != ndim:
        raise RunFileError(f"{path}: {where} has shape {dataset.shape}, not {ndim} axes")
    return dataset


_KIND_WORDS = {
    "iu": "integers",
    "f": "floats",
    "S": "text",
    "biuf": "real numbers",
    "iuf": "numbers",
}
#: The dtype kinds of the status fields.
_STATUS_KINDS = {
    names.STATUS_STATE: "S",
    names.STATUS_EXCEPTION: "S",
    names.STATUS_LAST_STEP: "iu",
    names.STATUS_WALL_TIME: "f",
    names.STATUS_STARTED: "f",
    names.STATUS_UPDATED: "f",
    names.STATUS_PID: "iu",
    names.STATUS_HOST: "S",
}


def _declared_group(path: Path, group: str, members: Any, size: int | None) -> dict[str, _Declared]:
    """What a series group declares, its structure checked: a step index of integers and
    series of one row per step, shaped as their probe records them."""
    if not isinstance(members, h5py.Group):
        raise RunFileError(f"{path}: {SERIES}/{group} is a dataset, not a group of series")
    _checked(members, STEP, path, "iu", ndim=1)
    declared = {}
    for name in members:
        if name == STEP:
            continue
        dataset = _checked(members, name, path, "biuf")
        where = f"{SERIES}/{group}/{name}"
        key = series_key(name, dataset)
        stored = names.ATTR_NAME in dataset.attrs
        if not isinstance(key, str) or (stored and names.series_name(key) != name):
            # Two datasets must never read as one series.
            raise RunFileError(f"{path}: {where} names its series {key!r}, which is not its own")
        if dataset.ndim == 0:
            raise RunFileError(f"{path}: {where} is a scalar, not one row per step")
        snapshot = (group, key) == (names.SNAPSHOTS, names.SNAPSHOT_THETA)
        if snapshot and (dataset.ndim != 2 or size not in (None, dataset.shape[1])):
            raise RunFileError(
                f"{path}: {where} has shape {dataset.shape}, not one row of the layout's "
                f"{size} parameters per step"
            )
        encoding = dataset.attrs.get(names.ATTR_ENCODING)
        if encoding is not None and (encoding != BFLOAT16 or dataset.dtype != np.uint16):
            raise RunFileError(f"{path}: {where} has the unknown encoding {encoding!r}")
        declared[key] = _declared(dataset, path, where)
    return declared


def series_key(dataset_name: str, dataset: h5py.Dataset) -> Any:
    """The name a series was declared under: its stored name (``names.ATTR_NAME``), else, in
    files from before names were stored, its dataset's name."""
    key = dataset.attrs.get(names.ATTR_NAME, dataset_name)
    return key.decode(errors="surrogateescape") if isinstance(key, bytes) else key


def _check_drawable(path: Path, declared: dict[str, dict[str, _Declared]]) -> None:
    """Each drawn series has the rows its view draws: a number (scalar) or a vector."""
    for group, series in declared.items():
        for name, d in series.items():
            axes = None if d.view is None else (0 if d.view.kind == "scalar" else 1)
            if axes is not None and len(d.shape) != axes:
                raise RunFileError(
                    f"{path}: {SERIES}/{group}/{name} has rows of shape {d.shape}, but its "
                    f"{d.view.kind} view draws rows of {'one number' if axes == 0 else 'one axis'}"
                )


def _vector_shape(path: Path, name: str, dataset: Any, size: int | None) -> tuple[int, ...]:
    where = f"{VECTORS}/{name}"
    if not isinstance(dataset, h5py.Dataset):
        raise RunFileError(f"{path}: {where} is a group, not a vector")
    if dataset.dtype.kind not in "biuf":
        raise RunFileError(f"{path}: {where} holds {dataset.dtype}, not real numbers")
    if name in PARAMETER_VECTORS and size is not None and dataset.shape != (size,):
        raise RunFileError(
            f"{path}: {where} has shape {dataset.shape}, the parameter layout ({size},)"
        )
    if name == names.THETA_FINAL_STEP and dataset.shape != (1,):
        raise RunFileError(f"{path}: {where} has shape {dataset.shape}, not (1,)")
    return dataset.shape


def _unwritten(file: h5py.File, name: str, value: np.ndarray) -> bool:
    """Whether a vector (or its leading entries ``value``) was declared but never written:
    NaN throughout. θT is written with its step, so a NaN θT whose step is stored was written:
    by a diverged training (data) or not at all (damage), which :meth:`Run.vector` tells apart.
    """
    if value.dtype.kind not in "fc" or not value.size or not np.isnan(value).all():
        return False
    if name == names.THETA_FINAL and names.THETA_FINAL_STEP in file[VECTORS]:
        step = file[VECTORS][names.THETA_FINAL_STEP][...]
        return not (step.dtype.kind in "fc" and not np.isnan(step).all())
    return True


def _first_nonfinite_step(series: Any, group: str, name: str) -> int | None:
    """The first step of the group's complete rows whose ``name`` is not finite, if any."""
    if group not in series or name not in series[group]:
        return None
    step, values = _complete_column(series[group], name)
    bad = ~np.isfinite(values)
    return int(step[np.argmax(bad)]) if bad.any() else None


def _nonfinite_to_the_end(series: Any, group: str, name: str) -> int | None:
    """The first step of the final stretch of rows whose ``name`` is not finite, when it
    follows a finite row: a measurement that went non-finite and stayed so."""
    if group not in series or name not in series[group]:
        return None
    step, values = _complete_column(series[group], name)
    finite = np.flatnonzero(np.isfinite(values))
    if not finite.size or finite[-1] == len(values) - 1:
        return None
    return int(step[finite[-1] + 1])


def _first_nonfinite_snapshot(series: Any, before: int) -> int | None:
    """The first step before ``before`` whose stored snapshot is not finite, read one row at
    a time (snapshots can hold gigabytes)."""
    if names.SNAPSHOTS not in series or names.SNAPSHOT_THETA not in series[names.SNAPSHOTS]:
        return None
    group = series[names.SNAPSHOTS]
    step = group[STEP][:]
    n = _complete_rows(step, [d.shape[0] for key, d in group.items() if key != STEP])
    theta = group[names.SNAPSHOT_THETA]
    bfloat16 = theta.attrs.get(names.ATTR_ENCODING) == BFLOAT16
    for i in np.flatnonzero(step[:n] < before):
        row = theta[i]
        # bfloat16 is stored as its bits: all exponent bits set is an infinity or a NaN.
        finite = (row & 0x7F80) != 0x7F80 if bfloat16 else np.isfinite(row)
        if not finite.all():
            return int(step[i])
    return None


def _complete_column(group: h5py.Group, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(step, values)`` of one series' complete rows, its group's other series unread."""
    step = group[STEP][:]
    n = _complete_rows(step, [d.shape[0] for key, d in group.items() if key != STEP])
    return step[:n], _values(group[name], n)


def _open(path: Path) -> h5py.File:
    check_head(path)  # before HDF5 reads a byte: a cut file would keep a live open retrying
    try:
        # A plain open checks the file against its recorded end, so truncation shows here.
        return h5py.File(path, "r")
    except OSError as error:
        if "truncated file" in str(error):
            return _open_cut_short(path, error)
        if "consistency flags" not in str(error):
            raise
    # A run still being written, or whose writer was killed: only SWMR reads open those.
    return open_live(path)


def _open_cut_short(path: Path, truncated: OSError) -> h5py.File:
    """A file shorter than it records: readable if its writer never closed it, else damaged.

    A writer stopped by a full disk can leave the file's recorded end past what reached the
    disk. Its rows are counted by their steps, written only once their values were on disk, so
    what it holds is true. A file that was closed and then lost its end is damaged.
    """
    file = open_live(path)
    status = file.get(names.STATUS)
    if status is None or _decoded_text(status[names.STATUS_STATE][()]) != names.RUNNING:
        file.close()
        raise truncated
    return file


def _writer_alive(path: Path, host: str, pid: int) -> bool:
    if host != socket.gethostname():
        return True  # another machine's processes cannot be seen from here: trust the file
    if not 0 < pid < _PID_LIMIT:  # 0 and -1 would ask about process groups, not a process
        raise RunFileError(f"{path}: status/pid is {pid}, not a process id")
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by someone else
    return True


#: Process ids are C ints (pid_t) on every system dynamics runs on.
_PID_LIMIT = 2**31


def _filled_vector(file: h5py.File, name: str) -> np.ndarray | None:
    """The vector's values, or None when it was never written: never allocated (read as its
    first entry alone, for the check of θT against its step) or NaN throughout."""
    dataset = file[VECTORS][name]
    if not allocated(dataset):
        _unwritten(file, name, dataset[:1] if dataset.ndim else dataset[()])
        return None
    value = dataset[...]
    return None if _unwritten(file, name, value) else value


def _event_fields(file: h5py.File, path: Path) -> tuple[np.ndarray, list[np.ndarray]] | None:
    if names.EVENTS not in file:
        return None
    group = file[names.EVENTS]
    steps = _checked(group, STEP, path, "iu", ndim=1)[:]
    fields = [
        _checked(group, name, path, "S", ndim=1)[:]
        for name in (names.EVENT_PROBE, names.EVENT_KIND, names.EVENT_MESSAGE)
    ]
    return steps, fields


def _status_fields(file: h5py.File, path: Path) -> dict[str, Any] | None:
    if names.STATUS not in file:
        return None
    return {
        name: _decoded_text(_checked(file[names.STATUS], name, path, kinds, 0)[()])
        for name, kinds in _STATUS_KINDS.items()
    }


def _status(path: Path, fields: dict[str, Any] | None) -> RunStatus:
    if fields is None:
        return RunStatus(names.UNKNOWN)
    state = fields[names.STATUS_STATE]
    if state == names.RUNNING and not _writer_alive(
        path, fields[names.STATUS_HOST], fields[names.STATUS_PID]
    ):
        state = names.KILLED
    last_step = fields[names.STATUS_LAST_STEP]
    return RunStatus(
        state=state,
        exception=fields[names.STATUS_EXCEPTION],
        last_step=None if last_step == UNWRITTEN_STEP else last_step,
        wall_time_s=fields[names.STATUS_WALL_TIME],
        started_at=fields[names.STATUS_STARTED],
        updated_at=fields[names.STATUS_UPDATED],
    )


def _events(read: tuple[np.ndarray, list[np.ndarray]] | None) -> list[Event]:
    if read is None:
        return []
    steps, fields = read
    # A killed writer can leave a row's fields without its step, or a step unwritten.
    rows = min(len(steps), *map(len, fields))
    return [
        Event(int(steps[i]), *(_decoded_text(field[i]) for field in fields))
        for i in range(rows)
        if steps[i] != UNWRITTEN_STEP
    ]


def _decoded_text(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value.item() if hasattr(value, "item") else value


def _values(dataset: h5py.Dataset, rows: int, first: int = 0) -> np.ndarray:
    """Rows ``first`` to ``rows``; half-precision series as float32, so no analysis computes
    in half precision."""
    if dataset.attrs.get(names.ATTR_ENCODING) == BFLOAT16:
        # bfloat16 is the upper half of a float32: shifting the bits back up is exact.
        return (dataset[first:rows].astype(np.uint32) << 16).view(np.float32)
    if dataset.dtype == np.float16:
        return dataset[first:rows].astype(np.float32)
    return dataset[first:rows]


def _declared(dataset: h5py.Dataset, path: Path, where: str) -> _Declared:
    attrs = dataset.attrs
    columns, view = attrs.get(names.ATTR_COLUMNS), attrs.get(names.ATTR_VIEW)
    try:
        columns = None if columns is None else decode_attr(columns)
        view = None if view is None else decode_attr(view)
    except (ValueError, RecursionError):
        raise RunFileError(f"{path}: {where} has an attribute that is not valid JSON") from None
    if columns is not None:
        if not isinstance(columns, list) or not all(isinstance(c, str) for c in columns):
            raise RunFileError(f"{path}: {where} has the columns {columns!r}, not a list of names")
        if dataset.ndim < 2 or len(columns) != dataset.shape[-1]:
            raise RunFileError(
                f"{path}: {where} names {len(columns)} columns, but its rows have shape "
                f"{dataset.shape[1:]}"
            )
    if view is not None:
        try:
            view = View.from_dict(view)
        except (ValueError, TypeError, AttributeError) as error:
            reason = str(error).splitlines()[0]
            raise RunFileError(f"{path}: {where} has a view that is not one: {reason}") from None
    return _Declared(dataset.shape[1:], None if columns is None else tuple(columns), view)


def _read_rows(
    group: h5py.Group, after: int | None = None
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """``(step, {series: values})`` of the group's complete rows (those after step ``after``).

    The whole step index is read even for the rows after a step: which rows are complete is a
    property of the prefix (:func:`_complete_rows`), and eight bytes a row is cheap beside the
    values, of which only the rows asked for are read.
    """
    step = group[STEP][:]
    datasets = {series_key(name, d): d for name, d in group.items() if name != STEP}
    # Only the complete rows are read: rows declared past them were never written.
    n = _complete_rows(step, [d.shape[0] for d in datasets.values()])
    first = 0 if after is None else int(np.searchsorted(step[:n], after, side="right"))
    return step[first:n], {name: _values(d, n, first) for name, d in datasets.items()}


def _step_span(group: h5py.Group) -> tuple[int, int | None, int | None]:
    """``(rows, first step, last step)`` of the group's complete rows, read from its step
    index and its datasets' extents alone (first and last are None without a row)."""
    step = group[STEP][:]
    n = _complete_rows(step, [d.shape[0] for name, d in group.items() if name != STEP])
    return (n, int(step[0]), int(step[n - 1])) if n else (0, None, None)


def _complete_rows(step: np.ndarray, lengths: list[int]) -> int:
    """How many leading rows are complete: their step and every value arrived.

    A killed writer can leave extents ahead of data: the complete rows are a strictly
    increasing prefix of written steps, no longer than any series.
    """
    n = min([len(step), *lengths])
    written = step[:n] != UNWRITTEN_STEP
    increasing = np.concatenate([[True], np.diff(step[:n]) > 0])
    return int(np.argmin(written & increasing)) if not (written & increasing).all() else n
