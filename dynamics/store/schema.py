"""The run-file schema: names, version and the checks every reader and writer agree on.

Layout of a run file (HDF5, one per run)::

    /                       attrs: schema, schema_version, config, versions, layout,
                                   theta0_sha256, module (JSON strings where structured)
    /series/<group>/step    int64 (n,), the optimizer step of each row, strictly increasing
    /series/<group>/<name>  (n, *shape) one row per recorded step; attr ``columns`` when the
                            last axis is named (layers, parameter tensors)
    /vectors/<name>         vectors written once: θ0, θ_T, initial gradients, probe batches

Every series group has its own ``step`` dataset because probes record on their own schedules.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dynamics.errors import DynamicsError

SCHEMA = "dynamics-run"
SCHEMA_VERSION = 1
SERIES = "series"
VECTORS = "vectors"
STEP = "step"
#: h5dump and other HDF5 1.10 tools must read every object we create.
LIBVER = ("v110", "v110")
#: Row fill for ``step``: a row whose extent reached the file before its data (a crash between
#: HDF5's metadata and raw-data writes) reads as -1 and is dropped by the reader.
UNWRITTEN_STEP = -1


@dataclass(frozen=True)
class SeriesSpec:
    """Shape (per row) and dtype of one series; ``columns`` names the last axis."""

    shape: tuple[int, ...] = ()
    dtype: str = "float32"
    columns: tuple[str, ...] | None = None


class RunFileError(DynamicsError):
    """A file that cannot be used as a run file; the message is one line for the user."""


def encode_attr(value: Any) -> Any:
    """Structured attributes are stored as JSON text so any HDF5 tool can show them."""
    return value if isinstance(value, (str, int, float)) else json.dumps(value, sort_keys=True)


def decode_attr(value: Any) -> Any:
    if isinstance(value, bytes):
        value = value.decode()
    if isinstance(value, str) and value[:1] in "[{":
        return json.loads(value)
    return value.item() if hasattr(value, "item") else value
