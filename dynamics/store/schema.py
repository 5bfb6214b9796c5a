"""The run-file schema: names, version and the checks every reader and writer agree on.

Layout of a run file (HDF5, one per run)::

    /                       attrs: schema, schema_version, config, versions, layout,
                                   buffers (the persistent buffers' names, shapes, dtypes),
                                   theta0_sha256, module (class path, init args, the names of
                                   init args not recorded), probes (GradientPlane's settings
                                   hold the probe batch's structure), and what the fit is —
                                   submodules, optimizers, schedulers, precision, data (files
                                   from before these lack them) (JSON strings where structured)
    /series/<group>/step    int64 (n,), the optimizer step of each row, strictly increasing
    /series/<group>/<name>  (n, *shape) one row per recorded step; attr ``columns`` when the
                            last axis is named (layers, parameter tensors), attr ``view`` when
                            the series is drawn (see :class:`View`), attr ``encoding`` when the
                            stored values need decoding (``bfloat16``: the uint16 upper halves
                            of float32 values)
    /vectors/<name>         vectors written once: θ0, θ_T (and its step), their buffers (one
                            flat vector per stored dtype: theta0_buffers.float32, ...),
                            initial gradients, probe batch leaves; snapshots hold their
                            buffers as series snapshots/buffers.<dtype>
    /events/step            int64 (n,), non-decreasing: what probes reported, one row each
    /events/{probe,kind,message}  fixed-length UTF-8 strings (kind: disabled, error, warning)
    /status/<field>         scalars updated in place: state (running, finished, crashed),
                            exception, last_step (last flushed), wall_time_s, started_at,
                            updated_at (Unix times), pid and host of the writer

Every series group has its own ``step`` dataset because probes record on their own schedules.
Events and status exist in every file, declared empty up front: under SWMR nothing can be
created, attributes included. Files from before they existed read as no events and an
``unknown`` state. The names of groups, series, vectors and attributes are in
:mod:`dynamics.store.names`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from dynamics.errors import DynamicsError
from dynamics.store import names

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
#: Bytes (UTF-8) of each fixed-length text field; longer text is cut at a character boundary.
TEXT_BYTES = {
    names.EVENT_PROBE: 64,
    names.EVENT_KIND: 16,
    names.EVENT_MESSAGE: 512,
    names.STATUS_STATE: 16,
    names.STATUS_EXCEPTION: 512,
    names.STATUS_HOST: 256,
}
#: Storage of a ``SeriesSpec`` dtype that HDF5 has no type for: its bits and the decoding attr.
BFLOAT16 = "bfloat16"


#: How a series can be drawn over steps (see :class:`View`).
VIEW_KINDS = ("scalar", "lines", "panels", "heatmap")


@dataclass(frozen=True)
class View:
    """How a series is drawn, stored with it so a report draws any probe's series unchanged.

    Example::

        view = View("lines", "Weight norm per tensor", "‖W‖", log_y=True)
        SeriesSpec((n_tensors,), columns=names, view=view)

    Attributes:
        kind: ``"scalar"`` (one value per step: one line), ``"lines"`` (one line per column,
            overlaid), ``"panels"`` (one small panel per column, e.g. per layer) or
            ``"heatmap"`` (a row is a vector: steps × entries as colour).
        title: the figure's title.
        y_label: the value axis's label (for a heatmap: the colour bar's).
        log_y: draw the values on a log scale.
        units: units of the values, shown beside the label (empty when unitless).
    """

    kind: str
    title: str
    y_label: str = ""
    log_y: bool = False
    units: str = ""

    def __post_init__(self) -> None:
        if self.kind not in VIEW_KINDS:
            raise ValueError(f"view kind must be one of {', '.join(VIEW_KINDS)}, got {self.kind!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> View:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class SeriesSpec:
    """Shape (per row) and dtype of one series; ``columns`` names the last axis, ``view`` says
    how it is drawn (None: not drawn, e.g. parameter snapshots).

    ``dtype`` is a NumPy dtype name or ``"bfloat16"`` (stored as bits, read back as float32).

    Example::

        SeriesSpec((n_layers,), columns=layer_names, view=View("panels", "Norm per layer", "‖h‖"))
        SeriesSpec(())  # one float32 value per row
    """

    shape: tuple[int, ...] = ()
    dtype: str = "float32"
    columns: tuple[str, ...] | None = None
    view: View | None = None

    def __post_init__(self) -> None:
        # Checked where a probe declares it, so a run never records rows its view cannot draw
        # (the reader refuses such a file).
        if self.view is not None and len(self.shape) != (0 if self.view.kind == "scalar" else 1):
            rows = "one number" if self.view.kind == "scalar" else "one axis"
            raise ValueError(
                f"a {self.view.kind} view draws rows of {rows}, not rows of shape {self.shape}"
            )


class RunFileError(DynamicsError):
    """A file that cannot be used as a run file; the message is one line for the user.

    Example::

        try:
            dynamics.open_run("notes.txt")
        except RunFileError as error:
            print(error)  # one line naming the file and what is wrong
    """


#: The type each root attribute decodes to, when present (structured ones are JSON text).
ATTR_TYPES: dict[str, type] = {
    names.ATTR_RUN_NAME: str,
    names.ATTR_CONFIG: dict,
    names.ATTR_VERSIONS: dict,
    names.ATTR_LAYOUT: dict,
    names.ATTR_BUFFERS: dict,
    names.ATTR_THETA0_SHA256: str,
    names.ATTR_FROZEN_SHA256: str,
    names.ATTR_MODULE: dict,
    names.ATTR_PROBES: list,
    names.ATTR_SUBMODULES: dict,
    names.ATTR_OPTIMIZERS: list,
    names.ATTR_SCHEDULERS: list,
    names.ATTR_PRECISION: str,
    names.ATTR_LOOP: str,
    names.ATTR_LOSS_RULE: dict,
    names.ATTR_DATA: dict,
    names.ATTR_MODEL_EDITS: list,
}
#: Vectors of one entry per parameter: flat, of the layout's size.
PARAMETER_VECTORS = (names.THETA0, names.THETA_FINAL, names.G0, names.PLANE_U, names.PLANE_V)


def check_attrs(attrs: dict[str, Any]) -> None:
    """Check the decoded root attributes a reader relies on.

    Raises:
        ValueError: one line saying which attribute is wrong and how.
    """
    version = attrs.get("schema_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise ValueError(f"schema_version is {version!r}, not an integer")
    if version < 1:
        raise ValueError(f"schema_version is {version}, not a version (versions start at 1)")
    for name, kind in ATTR_TYPES.items():
        # None is stored as the JSON text "null": not recorded.
        if attrs.get(name, "null") != "null" and not isinstance(attrs[name], kind):
            raise ValueError(
                f"attribute {name!r} is {_kind(attrs[name])}, not {_KINDS[kind]}: "
                f"{str(attrs[name])[:60]!r}"
            )
    for name, keys in ((names.ATTR_LAYOUT, 2), (names.ATTR_BUFFERS, 3)):
        if isinstance(attrs.get(name), dict):
            _check_layout(name, attrs[name], keys)
    submodules = attrs.get(names.ATTR_SUBMODULES)
    for name, record in submodules.items() if isinstance(submodules, dict) else ():
        # [class path, extra_repr()]: the rebuild, load_into and compare unpack each one.
        if not (isinstance(record, list) and len(record) == 2) or not all(
            isinstance(text, str) for text in record
        ):
            raise ValueError(
                f"attribute 'submodules' holds {str(record)[:60]!r} for {str(name)[:60]!r}, "
                "not [class path, settings]"
            )
    probes = attrs.get(names.ATTR_PROBES)
    for probe in probes if isinstance(probes, list) else ():
        if not isinstance(probe, dict) or not isinstance(probe.get("settings", {}), dict):
            raise ValueError(f"attribute 'probes' holds {str(probe)[:60]!r}, not a probe's record")


def layout_size(layout: dict[str, Any]) -> int:
    """The number of entries of a (checked) layout's flat vector."""
    return sum(int(np.prod(shape)) for shape in layout["shapes"])


def _check_layout(name: str, layout: dict[str, Any], keys: int) -> None:
    """A parameter layout (names, shapes) or buffer layout (names, shapes, dtypes)."""
    fields = ("names", "shapes", "dtypes")[:keys]
    lists = [layout.get(field) for field in fields]
    missing = [f for f, value in zip(fields, lists) if not isinstance(value, list)]
    if missing:
        raise ValueError(f"attribute {name!r} has no list of {missing[0]}")
    if len({len(value) for value in lists}) != 1:
        raise ValueError(f"attribute {name!r} has {' and '.join(fields)} of different lengths")
    for shape in layout["shapes"]:
        valid = isinstance(shape, list) and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
        )
        if not valid:
            raise ValueError(f"attribute {name!r} has the shape {shape!r}, not a list of sizes")


_KINDS = {str: "text", dict: "a JSON object", list: "a JSON list"}


def _kind(value: Any) -> str:
    return _KINDS.get(type(value), type(value).__name__)


def encode_attr(value: Any) -> Any:
    """Structured attributes are stored as JSON text so any HDF5 tool can show them."""
    return value if isinstance(value, (str, int, float)) else json.dumps(value, sort_keys=True)


def decode_attr(value: Any) -> Any:
    if isinstance(value, bytes):
        value = value.decode()
    if isinstance(value, str) and value[:1] in "[{":
        return json.loads(value)
    return value.item() if hasattr(value, "item") else value
