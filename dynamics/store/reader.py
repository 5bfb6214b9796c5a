"""Reading run files: validated on open, series read on demand, live runs included.

A run still being written, or whose writer was killed, is read in SWMR mode (HDF5 refuses a
plain open of such a file); a finished one is opened plainly, which also detects truncation.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import warnings
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import h5py
import numpy as np

from dynamics.errors import DynamicsError
from dynamics.store import frames, names
from dynamics.store.schema import (
    BFLOAT16,
    SCHEMA,
    SCHEMA_VERSION,
    SERIES,
    STEP,
    UNWRITTEN_STEP,
    VECTORS,
    RunFileError,
    View,
    decode_attr,
)
from dynamics.store.views import STANDARD_VIEWS, standard_view

if TYPE_CHECKING:
    import pandas as pd
    import xarray as xr
    from torch import nn

    from dynamics.params import BufferLayout, ParameterLayout


@dataclass(frozen=True)
class Series:
    """One group of rows sharing a step index.

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

    # --- pandas and xarray (optional: pip install 'dynamics[notebook]') ---

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

        Raises:
            DynamicsError: xarray is not installed.
        """
        return frames.series_dataset(self)


@dataclass(frozen=True)
class Event:
    """Something a probe reported during the run.

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


class _Declared(NamedTuple):
    """What a series' dataset says about it before any row is read."""

    shape: tuple[int, ...]  # of one row
    columns: tuple[str, ...] | None
    view: View | None


class Run:
    """A run file's metadata, series, vectors, events and status; see :func:`open_run`."""

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

    @property
    def config(self) -> dict[str, Any]:
        return self.attrs.get(names.ATTR_CONFIG) or {}

    @property
    def name(self) -> str:
        return self.attrs.get(names.ATTR_RUN_NAME) or self.path.stem

    @cached_property
    def layout(self) -> ParameterLayout | None:
        from dynamics.params import ParameterLayout  # torch, which offline summaries never need

        data = self.attrs.get(names.ATTR_LAYOUT)
        return ParameterLayout.from_dict(data) if data else None

    @cached_property
    def buffer_layout(self) -> BufferLayout | None:
        """The layout of the module's persistent buffers; None in files from before buffers
        were recorded."""
        from dynamics.params import BufferLayout

        data = self.attrs.get(names.ATTR_BUFFERS)
        return BufferLayout.from_dict(data) if data is not None else None

    def stored_states(self) -> list[StoredState]:
        """θ0, every parameter snapshot and θT (those stored), in step order.

        Raises:
            RunFileError: the run stores no θ0 (record with ParameterDisplacement).
        """
        theta0 = self.vector(names.THETA0)
        if theta0 is None:
            raise RunFileError(f"{self.path.name}: no θ0 stored (record ParameterDisplacement)")
        states = [StoredState(0, "theta0", theta0, self._stored_buffers(names.THETA0_BUFFERS))]
        snapshots = self.recorded(names.SNAPSHOTS)
        if snapshots is not None:
            keys = [names.buffer_vector(names.SNAPSHOT_BUFFERS, d) for d in self._buffer_dtypes()]
            recorded = self.buffer_layout is not None and all(k in snapshots.values for k in keys)
            for i, step in enumerate(snapshots.step):
                buffers = (
                    {d: snapshots[k][i] for d, k in zip(self._buffer_dtypes(), keys)}
                    if recorded
                    else None
                )
                theta = snapshots[names.SNAPSHOT_THETA][i]
                states.append(StoredState(int(step), "snapshot", theta, buffers))
        final = self.vector(names.THETA_FINAL)
        if final is not None:
            buffers = self._stored_buffers(names.THETA_FINAL_BUFFERS)
            states.append(StoredState(self._final_step(), "theta_final", final, buffers))
        return states

    def load_into(self, model: nn.Module, step: int | None = None) -> StoredState:
        """Load a stored state into ``model`` in place: its parameters and buffers.

        Args:
            model: a module of the run's parameter layout (its own instance, or
                :func:`dynamics.rebuild.rebuild_module`'s).
            step: the stored state nearest this optimizer step is loaded (θ0 counts as step
                0, θT as the run's number of steps; the earlier on a tie); None: θT, or the
                latest state stored when the run ended before storing θT.

        Returns:
            The state loaded.

        Raises:
            RunFileError: the run stores no θ0 or no parameter layout.
            DynamicsError: the model's parameters or buffers differ from the run's.

        Warns:
            UserWarning: the model has persistent buffers and the run recorded none: the model
                keeps its own (e.g. BatchNorm's initial running statistics), not the run's.
        """
        from dynamics.params import BufferLayout, load_state

        if self.layout is None:
            raise RunFileError(f"{self.path.name}: no parameter layout recorded")
        states = self.stored_states()
        state = states[-1] if step is None else min(states, key=lambda s: abs(s.step - step))
        try:
            load_state(model, state.theta, self.layout, state.buffers, self.buffer_layout)
        except ValueError as error:
            raise DynamicsError(
                f"{self.path.name}: the model differs from the run's: {error}"
            ) from None
        if state.buffers is None and BufferLayout.of(model).names:
            warnings.warn(
                f"{self.path.name}: no buffers recorded; the model keeps its own", stacklevel=2
            )
        return state

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
            return int(step[0])
        # Files from before the step was stored: one past the last recorded training step.
        last = [
            rows.step[-1]
            for rows in (self.train_loss(), self.recorded(names.SNAPSHOTS))
            if rows is not None
        ]
        return int(max(last)) + 1 if last else 0

    @property
    def theta0_sha256(self) -> str | None:
        """The recorded hash of θ0, or None when the run did not record it."""
        return self.attrs.get(names.ATTR_THETA0_SHA256)

    def shares_theta0(self, other: Run) -> bool:
        """Whether both runs recorded the same θ0 (False when either recorded no hash)."""
        return self.theta0_sha256 is not None and self.theta0_sha256 == other.theta0_sha256

    def series(self, group: str) -> Series:
        """Every row of ``group`` (read once, then cached).

        Raises:
            KeyError: the run has no such group.
            RunFileError: its data cannot be read (a damaged file).
        """
        if group not in self.groups:
            raise KeyError(
                f"{self.path.name} has no series {group!r} (has {', '.join(self.groups)})"
            )
        if group not in self._series:
            try:
                with _open(self.path) as file:
                    step, values = _read_rows(file[SERIES][group])
            except OSError as error:
                raise RunFileError(
                    f"{self.path}: cannot read series {group!r} (truncated or corrupted?)"
                ) from error
            columns = {n: d.columns for n, d in self._declared[group].items() if d.columns}
            self._series[group] = Series(step, values, columns, self.views(group), group)
        return self._series[group]

    def recorded(self, group: str) -> Series | None:
        """The rows of ``group``, or None when it was not recorded or holds no row.

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
        """The training loss (group ``loss``, series ``train``), or None when not recorded."""
        rows = self.recorded(names.LOSS)
        if rows is None or names.LOSS_TRAIN not in rows.values:
            return None
        return Metric(names.LOSS_TRAIN, rows.step, rows[names.LOSS_TRAIN])

    def validation_metrics(self) -> dict[str, Metric]:
        """Every metric logged during validation, ``{key: Metric}``; empty when none was."""
        rows = self.recorded(names.VALIDATION)
        if rows is None:
            return {}
        return {key: Metric(key, rows.step, values) for key, values in rows.values.items()}

    def heldout_loss(self) -> Metric | None:
        """The held-out loss, or None.

        It is the validation metric ``val_loss`` (what the teacher–student module logs), else
        the first whose name contains ``loss``: a module's own logging names vary.
        """
        metrics = self.validation_metrics()
        keys = [k for k in metrics if k == names.VAL_LOSS] or [k for k in metrics if "loss" in k]
        return metrics[keys[0]] if keys else None

    def vector(self, name: str) -> np.ndarray | None:
        """A stored vector, or None when it is absent or was never filled (NaN)."""
        if name not in self.vector_names:
            return None
        with _open(self.path) as file:
            value = file[VECTORS][name][...]
        unfilled = value.dtype.kind in "fc" and np.isnan(value).all()
        return None if unfilled else value

    def events(self) -> list[Event]:
        """What probes reported (disabled, failed, warned), in the order it happened.

        Read anew at each call, so a live run's latest events show.
        """
        with _open(self.path) as file:
            if names.EVENTS not in file:
                return []
            group = file[names.EVENTS]
            steps = group[STEP][:]
            fields = [
                group[name][:]
                for name in (names.EVENT_PROBE, names.EVENT_KIND, names.EVENT_MESSAGE)
            ]
        # A killed writer can leave a row's fields without its step, or a step unwritten.
        rows = min(len(steps), *map(len, fields))
        return [
            Event(int(steps[i]), *(_decoded_text(field[i]) for field in fields))
            for i in range(rows)
            if steps[i] != UNWRITTEN_STEP
        ]

    def status(self) -> RunStatus:
        """The run's state, last flushed step and wall time, read anew at each call."""
        with _open(self.path) as file:
            if names.STATUS not in file:
                return RunStatus(names.UNKNOWN)
            fields = {name: _decoded_text(d[()]) for name, d in file[names.STATUS].items()}
        state = fields[names.STATUS_STATE]
        if state == names.RUNNING and not _writer_alive(
            fields[names.STATUS_HOST], fields[names.STATUS_PID]
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

    def summary(self) -> dict[str, Any]:
        """Series lengths, step ranges, status, events and metadata, as ``dynamics info``
        prints them."""
        series = {}
        try:
            # Only each group's step index and extents are read: a snapshot group can hold
            # gigabytes that a summary never needs.
            with _open(self.path) as file:
                spans = {group: _step_span(file[SERIES][group]) for group in self.groups}
        except OSError as error:
            raise RunFileError(
                f"{self.path}: cannot read its steps (truncated or corrupted?)"
            ) from error
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
            "events": [dataclasses.asdict(event) for event in self.events()],
            "series": series,
            "vectors": {n: list(s) for n, s in self._vector_shapes.items()},
            "attrs": {
                k: v for k, v in self.attrs.items() if k not in ("schema", names.ATTR_LAYOUT)
            },
        }

    # --- xarray (optional: pip install 'dynamics[notebook]') ---

    def to_xarray(self, groups: list[str] | None = None) -> xr.DataTree:
        """The run's series as an xarray DataTree: one node per group, each the Dataset of
        :meth:`Series.to_xarray` (groups have their own ``step`` index).

        Args:
            groups: the groups to read; default every group but the parameter snapshots,
                which can hold gigabytes (name ``"snapshots"`` to read them).

        Raises:
            KeyError: a named group the run did not record.
            DynamicsError: xarray is not installed.
        """
        return frames.run_tree(self, groups)


def open_run(path: str | os.PathLike) -> Run:
    """Open and validate a run file.

    Raises:
        RunFileError: the path is missing, is not an HDF5 run file, is truncated or corrupted,
            or carries a newer schema version than this dynamics reads.
    """
    path = Path(path)
    if not path.is_file():
        raise RunFileError(f"{path}: no such file")
    try:
        with _open(path) as file:
            attrs = {k: decode_attr(v) for k, v in file.attrs.items()}
            if attrs.get("schema") != SCHEMA:
                raise RunFileError(f"{path}: not a dynamics run file (no '{SCHEMA}' schema)")
            version = attrs.get("schema_version")
            if not isinstance(version, int) or version > SCHEMA_VERSION:
                raise RunFileError(
                    f"{path}: schema version {version} is newer than this dynamics reads "
                    f"({SCHEMA_VERSION}); upgrade dynamics"
                )
            declared = {}
            for group, datasets in file[SERIES].items() if SERIES in file else ():
                # Every dataset, step included, is looked at here so corruption shows on open.
                declared[group] = {n: _declared(d) for n, d in datasets.items()}
                del declared[group][STEP]
            vectors = {n: d.shape for n, d in file[VECTORS].items()} if VECTORS in file else {}
    except RunFileError:
        raise
    except (OSError, KeyError, ValueError, TypeError) as error:
        raise RunFileError(f"{path}: not a readable run file (truncated or corrupted?)") from error
    if not any(d.view for series in declared.values() for d in series.values()):
        declared = {
            group: {n: d._replace(view=standard_view(group, n)) for n, d in series.items()}
            for group, series in declared.items()
        }
    return Run(path, attrs, declared, vectors)


def _open(path: Path) -> h5py.File:
    try:
        # A plain open checks the file against its recorded end, so truncation shows here.
        return h5py.File(path, "r")
    except OSError as error:
        if "truncated file" in str(error):
            return _open_cut_short(path, error)
        if "consistency flags" not in str(error):
            raise
    # A run still being written, or whose writer was killed: only SWMR reads open those.
    return h5py.File(path, "r", swmr=True)


def _open_cut_short(path: Path, truncated: OSError) -> h5py.File:
    """A file shorter than it records: readable if its writer never closed it, else damaged.

    A writer stopped by a full disk can leave the file's recorded end past what reached the
    disk. Its rows are counted by their steps, written only once their values were on disk, so
    what it holds is true. A file that was closed and then lost its end is damaged.
    """
    file = h5py.File(path, "r", swmr=True)
    status = file.get(names.STATUS)
    if status is None or _decoded_text(status[names.STATUS_STATE][()]) != names.RUNNING:
        file.close()
        raise truncated
    return file


def _writer_alive(host: str, pid: int) -> bool:
    if host != socket.gethostname():
        return True  # another machine's processes cannot be seen from here: trust the file
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by someone else
    return True


def _decoded_text(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value.item() if hasattr(value, "item") else value


def _values(dataset: h5py.Dataset) -> np.ndarray:
    # Half-precision series are read as float32, so no analysis computes in half precision.
    if dataset.attrs.get(names.ATTR_ENCODING) == BFLOAT16:
        # bfloat16 is the upper half of a float32: shifting the bits back up is exact.
        return (dataset[:].astype(np.uint32) << 16).view(np.float32)
    if dataset.dtype == np.float16:
        return dataset[:].astype(np.float32)
    return dataset[:]


def _declared(dataset: h5py.Dataset) -> _Declared:
    _ = dataset.dtype
    attrs = dataset.attrs
    columns = attrs.get(names.ATTR_COLUMNS)
    view = attrs.get(names.ATTR_VIEW)
    return _Declared(
        dataset.shape[1:],
        None if columns is None else tuple(decode_attr(columns)),
        None if view is None else View.from_dict(decode_attr(view)),
    )


def _read_rows(group: h5py.Group) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """``(step, {series: values})`` of the group's complete rows."""
    step = group[STEP][:]
    values = {name: _values(d) for name, d in group.items() if name != STEP}
    n = _complete_rows(step, [len(v) for v in values.values()])
    return step[:n], {k: v[:n] for k, v in values.items()}


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
