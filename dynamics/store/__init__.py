"""The run-file store: one HDF5 file per run (schema, writer, reader)."""

from dynamics.store import names
from dynamics.store.lock import RunLock
from dynamics.store.reader import (
    Event,
    Metric,
    Run,
    RunStatus,
    Series,
    StoredState,
    Update,
    open_run,
    other_output,
    run_files,
)
from dynamics.store.schema import SCHEMA, SCHEMA_VERSION, RunFileError, SeriesSpec, View
from dynamics.store.writer import RunWriter

__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "Event",
    "Metric",
    "Run",
    "RunFileError",
    "RunLock",
    "RunStatus",
    "RunWriter",
    "Series",
    "SeriesSpec",
    "StoredState",
    "Update",
    "View",
    "names",
    "open_run",
    "other_output",
    "run_files",
]
