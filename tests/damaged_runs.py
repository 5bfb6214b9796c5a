"""A corpus of damaged run files, made from one real run by mutating it with h5py.

Each mutation takes the path of a copy of the real run and damages it in place (or replaces it
with something that is not a run file at all). :data:`MUTATIONS` names them; the tests run every
one through every command and the public API that read run files.

:data:`UNTRUSTED` holds the files crafted to make a reader do what a run file never asks for:
read other files (external links and storage, virtual datasets, FIFOs among their targets),
follow soft links, allocate gigabytes (huge declared shapes, chunks and attributes), wait
forever (files cut to a few hundred bytes) or import a module (a named tuple's stored path).
A reader that fails on one of them hangs or exhausts memory, so the tests read them only in
child processes under a time and memory limit. Each comes with what its refusal says (None:
the file is read, and must be read within the limits).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np

Mutation = Callable[[Path], None]


def _edit(path: Path, change: Callable[[h5py.File], None]) -> None:
    with h5py.File(path, "r+") as file:
        change(file)


def _replace(path: Path, name: str, data: object, **attrs: object) -> Mutation:
    """Replace the dataset ``name`` of the file by ``data`` (keeping none of its attributes
    unless given)."""

    def change(file: h5py.File) -> None:
        del file[name]
        file[name] = data
        file[name].attrs.update(attrs)

    _edit(path, change)


def _set_attr(name: str, value: object, dataset: str = "/") -> Mutation:
    return lambda path: _edit(path, lambda f: f[dataset].attrs.__setitem__(name, value))


def _del(name: str) -> Mutation:
    return lambda path: _edit(path, lambda f: f.__delitem__(name))


def _del_attr(name: str, dataset: str = "/") -> Mutation:
    return lambda path: _edit(path, lambda f: f[dataset].attrs.__delitem__(name))


def _vector(name: str, make: Callable[[np.ndarray], object]) -> Mutation:
    """Replace a stored dataset by ``make(its values)``."""

    def mutate(path: Path) -> None:
        with h5py.File(path, "r") as file:
            values = file[name][()]
        _replace(path, name, make(values))

    return mutate


def _series(name: str, make: Callable[[np.ndarray], object]) -> Mutation:
    """Replace a series dataset, keeping its attributes."""

    def mutate(path: Path) -> None:
        with h5py.File(path, "r") as file:
            values = file[name][()]
            attrs = dict(file[name].attrs)
        _replace(path, name, make(values), **attrs)

    return mutate


def _truncate(fraction: float) -> Mutation:
    def mutate(path: Path) -> None:
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * fraction)])

    return mutate


def _bytes(data: bytes) -> Mutation:
    return lambda path: path.write_bytes(data)


def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _directory_of_runs(path: Path) -> None:
    original = path.read_bytes()
    path.unlink()
    path.mkdir()
    (path / "inside.h5").write_bytes(original)


def _other_hdf5(path: Path) -> None:
    path.unlink()
    with h5py.File(path, "w") as file:
        file["x"] = np.arange(3)


def _layout(change: Callable[[dict], object]) -> Mutation:
    def mutate(path: Path) -> None:
        with h5py.File(path, "r+") as file:
            layout = json.loads(file.attrs["layout"])
            file.attrs["layout"] = json.dumps(change(layout))

    return mutate


def _without(key: str) -> Callable[[dict], dict]:
    return lambda d: {k: v for k, v in d.items() if k != key}


def _running_status(path: Path) -> None:
    """A file whose writer was killed before θT: status running, θT unfilled (NaN)."""

    def change(file: h5py.File) -> None:
        file["status/state"][()] = b"running"
        file["status/pid"][()] = 2**22 + 1  # no such process
        file["vectors/theta_final"][...] = np.nan
        file["vectors/theta_final_step"][...] = np.nan

    _edit(path, change)


def _running_on_this_host(pid: int) -> Callable[[h5py.File], None]:
    """Status running, written by the process ``pid`` of this machine (so readers ask it)."""

    def change(file: h5py.File) -> None:
        file["status/state"][()] = b"running"
        file["status/host"][()] = socket.gethostname().encode()
        file["status/pid"][()] = pid

    return change


NAN, INF = np.nan, np.inf
S = "series/"
V = "vectors/"

#: ``{name: mutation}``; names say what is wrong with the file.
MUTATIONS: dict[str, Mutation] = {
    # not a run file at all
    "empty": _bytes(b""),
    "random_bytes": _bytes(np.random.default_rng(0).bytes(4096)),
    "text_file": _bytes(b"step,loss\n0,1.0\n"),
    "directory": _directory,
    "directory_of_runs": _directory_of_runs,
    "other_hdf5": _other_hdf5,
    **{f"truncated_{int(f * 100)}": _truncate(f) for f in (0.02, 0.3, 0.6, 0.9, 0.99)},
    # root attributes
    "schema_deleted": _del_attr("schema"),
    "schema_wrong": _set_attr("schema", "other"),
    "schema_version_string": _set_attr("schema_version", "1"),
    "schema_version_negative": _set_attr("schema_version", -1),
    "schema_version_zero": _set_attr("schema_version", 0),
    "schema_version_newer": _set_attr("schema_version", 99),
    "schema_version_float": _set_attr("schema_version", 1.5),
    "schema_version_deleted": _del_attr("schema_version"),
    "config_list": _set_attr("config", "[1, 2]"),
    "config_not_json": _set_attr("config", "{not json"),
    "config_number": _set_attr("config", 3),
    "layout_not_json": _set_attr("layout", "{oops"),
    "layout_list": _set_attr("layout", "[1]"),
    "layout_without_shapes": _layout(_without("shapes")),
    "layout_without_names": _layout(_without("names")),
    "layout_shapes_not_lists": _layout(lambda d: {**d, "shapes": [3] * len(d["shapes"])}),
    "layout_negative_shape": _layout(lambda d: {**d, "shapes": [[-1]] * len(d["shapes"])}),
    "layout_short": _layout(lambda d: {**d, "shapes": d["shapes"][:-1]}),
    "buffers_not_json": _set_attr("buffers", "{x"),
    "probes_not_json": _set_attr("probes", "[x"),
    "probes_dict": _set_attr("probes", '{"a": 1}'),
    "probes_strings": _set_attr("probes", '["a", "b"]'),
    "module_list": _set_attr("module", "[1]"),
    "submodules_entry_not_a_pair": _set_attr("submodules", '{"student": {"a": 1}}'),
    "submodules_entry_of_numbers": _set_attr("submodules", '{"student": [1, 2]}'),
    "theta0_sha_number": _set_attr("theta0_sha256", 3),
    # series structure
    "series_not_group": lambda p: _replace(p, "series", np.arange(3)),
    "group_is_dataset": lambda p: _replace(p, S + "loss", np.arange(3)),
    "step_deleted": _del(S + "loss/step"),
    "step_2d": _series(S + "loss/step", lambda v: np.stack([v, v], axis=1)),
    "step_scalar": _series(S + "loss/step", lambda v: v[0]),
    "step_strings": _series(S + "loss/step", lambda v: v.astype(str).astype("S")),
    "step_float_nan": _series(S + "loss/step", lambda v: np.where(v > 2, np.nan, v)),
    "step_decreasing": _series(S + "loss/step", lambda v: v[::-1].copy()),
    "step_is_group": lambda p: _edit(
        p, lambda f: (f.__delitem__(S + "loss/step"), f.create_group(S + "loss/step"))
    ),
    "series_scalar": _series(S + "loss/train", lambda v: v[0]),
    "series_strings": _series(S + "loss/train", lambda v: v.astype(str).astype("S")),
    "series_complex": _series(S + "loss/train", lambda v: v.astype(np.complex64)),
    "series_short": _series(S + "loss/train", lambda v: v[:2]),
    "series_named_step_group": lambda p: _edit(p, lambda f: f.create_group(S + "loss/sub")),
    "norm_1d": _series(S + "hidden_norms/norm", lambda v: v[:, 0]),
    "norm_nan": _series(S + "hidden_norms/norm", lambda v: np.full_like(v, np.nan)),
    "norm_inf": _series(S + "hidden_norms/norm", lambda v: np.full_like(v, np.inf)),
    "norm_3d": _series(S + "hidden_norms/norm", lambda v: v[:, :, None]),
    "columns_not_json": _set_attr("columns", "[oops", S + "hidden_norms/norm"),
    "columns_wrong_length": _set_attr("columns", '["a"]', S + "hidden_norms/norm"),
    "columns_number": _set_attr("columns", 7, S + "hidden_norms/norm"),
    "view_not_json": _set_attr("view", "{oops", S + "loss/train"),
    "view_bad_kind": _set_attr("view", '{"kind": "pie", "title": "x"}', S + "loss/train"),
    "view_list": _set_attr("view", "[1]", S + "loss/train"),
    "encoding_unknown": _set_attr("encoding", "float8", S + "loss/train"),
    "snapshots_nan": _series(S + "snapshots/theta", lambda v: np.full_like(v, np.nan)),
    "snapshots_short_rows": _series(S + "snapshots/theta", lambda v: v[:, :-1]),
    "snapshots_1d": _series(S + "snapshots/theta", lambda v: v[:, 0]),
    "plane_complex": _series(S + "plane/a", lambda v: v.astype(np.complex128)),
    # vectors
    "vectors_not_group": lambda p: _replace(p, "vectors", np.arange(3)),
    "theta0_deleted": _del(V + "theta0"),
    "theta0_zero": _vector(V + "theta0", np.zeros_like),
    "theta0_inf": _vector(V + "theta0", lambda v: np.full_like(v, np.inf)),
    "theta0_nan": _vector(V + "theta0", lambda v: np.full_like(v, np.nan)),
    "theta0_some_nan": _vector(V + "theta0", lambda v: np.where(np.arange(len(v)) % 2, np.nan, v)),
    "theta0_short": _vector(V + "theta0", lambda v: v[:-3]),
    "theta0_2d": _vector(V + "theta0", lambda v: v[None, :]),
    "theta0_scalar": _vector(V + "theta0", lambda v: v[0]),
    "theta0_strings": _vector(V + "theta0", lambda v: v.astype(str).astype("S")),
    "theta0_complex": _vector(V + "theta0", lambda v: v.astype(np.complex64)),
    "g0_zero": _vector(V + "g0", np.zeros_like),
    "g0_inf": _vector(V + "g0", lambda v: np.full_like(v, np.inf)),
    "g0_short": _vector(V + "g0", lambda v: v[:-3]),
    "g0_nan": _vector(V + "g0", lambda v: np.full_like(v, np.nan)),
    "theta_final_nan": _vector(V + "theta_final", lambda v: np.full_like(v, np.nan)),
    "theta_final_short": _vector(V + "theta_final", lambda v: v[:-1]),
    "theta_final_step_nan": _vector(V + "theta_final_step", lambda v: np.array([np.nan])),
    "theta_final_step_2": _vector(V + "theta_final_step", lambda v: np.array([1, 2])),
    "theta_final_step_inf": _vector(V + "theta_final_step", lambda v: np.array([np.inf])),
    "theta_final_step_negative": _vector(V + "theta_final_step", lambda v: np.array([-3.0])),
    "probe_batch_wrong_shape": _vector(V + "probe_batch.0", lambda v: v[:, :-1]),
    "probe_batch_deleted": _del(V + "probe_batch.0"),
    "plane_u_short": _vector(V + "plane_u", lambda v: v[:-1]),
    "killed_before_theta_final": _running_status,
    # events and status
    "events_step_deleted": _del("events/step"),
    "events_step_2d": _vector("events/step", lambda v: np.zeros((len(v), 2), dtype=np.int64)),
    "status_state_deleted": _del("status/state"),
    "status_pid_string": _vector("status/pid", lambda v: b"abc"),
    "status_last_step_float": _vector("status/last_step", lambda v: np.float64(np.nan)),
    "status_wall_time_string": _vector("status/wall_time_s", lambda v: b"soon"),
    "status_pid_huge": lambda p: _edit(p, _running_on_this_host(2**62)),
    "status_pid_zero": lambda p: _edit(p, _running_on_this_host(0)),
}


def _beside(path: Path, suffix: str) -> Path:
    return path.with_name(f"{path.stem}.{suffix}")


def _fifo(path: Path) -> Path:
    """A FIFO beside the run: opening it for reading blocks until a writer comes, never."""
    fifo = _beside(path, "fifo")
    os.mkfifo(fifo)
    return fifo


def _text_target(path: Path) -> Path:
    target = _beside(path, "passwd")
    target.write_text("root:x:0:0:root:/root:/bin/bash\n" * 4)
    return target


def _external_link(target: Callable[[Path], Path]) -> Mutation:
    def mutate(path: Path) -> None:
        where = target(path)
        _edit(path, lambda f: f.__setitem__(S + "loss/other", h5py.ExternalLink(where, "/x")))

    return mutate


def _run_copy(path: Path) -> Path:
    copy = _beside(path, "copy.h5")
    shutil.copyfile(path, copy)
    return copy


def _external_storage(target: Callable[[Path], Path]) -> Mutation:
    """``series/loss/train`` stored in another file, as HDF5's external storage allows."""

    def mutate(path: Path) -> None:
        where = target(path)

        def change(file: h5py.File) -> None:
            attrs = dict(file[S + "loss/train"].attrs)
            rows = file[S + "loss/train"].shape[0]
            del file[S + "loss/train"]
            file.create_dataset(
                S + "loss/train", shape=(rows,), dtype="float32", external=[(where, 0, rows * 4)]
            )
            file[S + "loss/train"].attrs.update(attrs)

        _edit(path, change)

    return mutate


def _virtual(target: Callable[[Path], Path]) -> Mutation:
    """``series/loss/train`` a virtual dataset of another file's dataset."""

    def mutate(path: Path) -> None:
        where = target(path)

        def change(file: h5py.File) -> None:
            rows = file[S + "loss/train"].shape[0]
            del file[S + "loss/train"]
            layout = h5py.VirtualLayout(shape=(rows,), dtype="float32")
            layout[:] = h5py.VirtualSource(str(where), S + "loss/train", shape=(rows,))
            file.create_virtual_dataset(S + "loss/train", layout, fillvalue=np.nan)

        _edit(path, change)

    return mutate


def _soft_link(name: str, target: str) -> Mutation:
    return lambda path: _edit(path, lambda f: f.__setitem__(name, h5py.SoftLink(target)))


def _declared_rows(group: str, rows: int) -> Mutation:
    """Every dataset of a series group resized to ``rows`` rows, none of them written."""

    def change(file: h5py.File) -> None:
        for dataset in file[S + group].values():
            dataset.resize(rows, axis=0)

    return lambda path: _edit(path, change)


def _unwritten_vector(name: str, shape: tuple[int, ...], chunks: bool) -> Mutation:
    """A vector declared of ``shape``, never written (chunked: no chunk; contiguous: no
    storage)."""

    def change(file: h5py.File) -> None:
        del file[name]
        file.create_dataset(
            name, shape=shape, dtype="float32", chunks=(1 << 16,) if chunks else None
        )

    return lambda path: _edit(path, change)


def _contiguous_unwritten(name: str, shape: tuple[int, ...], dtype: str) -> Mutation:
    """A dataset other than a vector (a series, an event field) declared of ``shape`` and never
    written: contiguous, so no storage at all, but read whole by its readers."""

    def change(file: h5py.File) -> None:
        if name in file:
            del file[name]
        file.create_dataset(name, shape=shape, dtype=dtype)

    return lambda path: _edit(path, change)


def _wide_empty_series(name: str, width: int) -> Mutation:
    """A series of no rows whose rows would hold ``width`` entries (nothing to store, but
    each entry is named and drawn)."""

    def change(file: h5py.File) -> None:
        file.create_dataset(
            S + name, shape=(0, width), maxshape=(None, width), dtype="float32", chunks=(1, width)
        )

    return lambda path: _edit(path, change)


def _huge_gzip_chunk(path: Path) -> None:
    """``series/loss/train``: its values in one gzip chunk of 256 MiB (about 250 KiB stored),
    written as compressed bytes so that making it costs no memory."""
    import zlib

    entries = 1 << 26
    compressor, zeros = zlib.compressobj(), bytes(1 << 24)
    data = b"".join(compressor.compress(zeros) for _ in range(entries * 4 // len(zeros)))
    data += compressor.flush()

    def change(file: h5py.File) -> None:
        attrs = dict(file[S + "loss/train"].attrs)
        rows = file[S + "loss/train"].shape[0]
        del file[S + "loss/train"]
        dataset = file.create_dataset(
            S + "loss/train",
            shape=(rows,),
            maxshape=(None,),
            dtype="float32",
            chunks=(entries,),
            compression="gzip",
        )
        dataset.id.write_direct_chunk((0,), data)
        dataset.attrs.update(attrs)

    _edit(path, change)


def _cut_at(size: int) -> Mutation:
    def mutate(path: Path) -> None:
        path.write_bytes(path.read_bytes()[:size])

    return mutate


#: The module a crafted named tuple names: planted in the working directory of the reader.
PLANTED_MODULE = "planted_batch_types"


def _named_tuple_batch(type_path: str, fields: tuple[str, str] = ("x", "y")) -> Mutation:
    """The probe batch's structure rewritten as a named tuple of the class ``type_path``."""

    def change(file: h5py.File) -> None:
        probes = json.loads(file.attrs["probes"])
        for probe in probes:
            settings = probe.get("settings") or {}
            if "probe_batch_structure" in settings:
                leaves = [{"tensor": 0}, {"tensor": 1}]
                settings["probe_batch_structure"] = {
                    "namedtuple": type_path,
                    "fields": list(fields),
                    "items": leaves,
                }
        file.attrs["probes"] = json.dumps(probes)

    return lambda path: _edit(path, change)


GiB = 1 << 30

#: ``{name: (mutation, what its refusal says, or None when the file is read)}``.
UNTRUSTED: dict[str, tuple[Mutation, str | None]] = {
    "external_link_to_run": (_external_link(_run_copy), "links to another file"),
    "external_link_to_fifo": (_external_link(_fifo), "links to another file"),
    "external_storage_text": (_external_storage(_text_target), "external storage"),
    "external_storage_fifo": (_external_storage(_fifo), "external storage"),
    "virtual_dataset_of_run": (_virtual(_run_copy), "virtual dataset"),
    "virtual_dataset_of_fifo": (_virtual(_fifo), "virtual dataset"),
    "soft_link_inside": (_soft_link(S + "loss/alias", "/" + S + "loss/train"), "soft link"),
    "soft_link_dangling": (_soft_link(S + "loss/alias", "/nowhere"), "soft link"),
    "soft_link_cycle": (_soft_link(S + "loss/loop", "/series"), "soft link"),
    "declared_rows_huge": (_declared_rows("loss", 1 << 31), "more than it stores"),
    "declared_rows_snapshots": (_declared_rows("snapshots", 1 << 22), "more than it stores"),
    "vector_chunked_unwritten": (
        _unwritten_vector(V + "probe_batch.0", (16 * GiB,), chunks=True),
        "more than it stores",
    ),
    # Never written, never allocated: read as unwritten without reading (or refused by shape).
    "vector_contiguous_unwritten": (
        _unwritten_vector(V + "hessian_float_bits", (16 * GiB,), chunks=False),
        None,
    ),
    # Only a vector is exempt from the count: the readers read these whole.
    "event_field_contiguous_unwritten": (
        _contiguous_unwritten("events/message", (1 << 26,), "S512"),
        "more than it stores",
    ),
    "step_index_contiguous_unwritten": (
        _contiguous_unwritten(S + "loss/step", (1 << 31,), "int64"),
        "more than it stores",
    ),
    "series_contiguous_unwritten": (
        _contiguous_unwritten(S + "loss/ghost", (30, 1 << 24), "float64"),
        "more than it stores",
    ),
    "chunk_gzip_256mib": (_huge_gzip_chunk, "has chunks of"),
    "row_of_2_28_columns": (_wide_empty_series("hidden_norms/wide", 1 << 28), "has rows of"),
    "run_name_20mb": (_set_attr("run_name", "x" * 20_000_000), "attribute 'run_name' holds"),
    "config_20mb": (
        _set_attr("config", json.dumps({"k": "x" * 20_000_000})),
        "attribute 'config' holds",
    ),
    "attribute_array": (
        _set_attr("columns", np.array(["a"] * 100_000, dtype="S1"), S + "hidden_norms/norm"),
        "not one value",
    ),
    "truncated_100_bytes": (_cut_at(100), "too short"),
    "truncated_512_bytes": (_cut_at(512), "too short"),
    "truncated_2000_bytes": (_cut_at(2000), "not a readable run file"),
    "named_tuple_planted_module": (_named_tuple_batch(f"{PLANTED_MODULE}.Batch"), None),
    "named_tuple_stdlib_module": (_named_tuple_batch("this.Batch"), None),
    # Not a named tuple anyone could define: refused where the batch is rebuilt (plane).
    "named_tuple_bad_fields": (_named_tuple_batch("os.system", ("__class__", "y")), None),
}


def make_damaged(source: Path, name: str, folder: Path) -> Path:
    """A copy of ``source`` in ``folder`` damaged by the mutation ``name``, dated an hour ago:
    a file at rest, which readers do not wait for as they wait for a file being written."""
    path = folder / f"{name}.h5"
    shutil.copyfile(source, path)
    MUTATIONS[name](path) if name in MUTATIONS else UNTRUSTED[name][0](path)
    an_hour_ago = time.time() - 3600
    os.utime(path, (an_hour_ago, an_hour_ago))
    return path
