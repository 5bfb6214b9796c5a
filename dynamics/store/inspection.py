"""What a run file may declare, checked on open before any of its data is read.

A run file is untrusted data. HDF5 lets a file pull in other files (external links, external
storage, virtual datasets: a FIFO among them hangs a read), declare datasets far larger than
the bytes it holds (unwritten chunks read as fill values: a 1 MB file can declare 64 GiB), make
one chunk of gigabytes that a read of a few values must decompress whole, and hold attributes
of any size. A run file needs none of these, so :func:`inspect_file` refuses them in one line,
walking the file's links once without following any:

- links: hard links only (the writer makes no other kind);
- datasets: stored in the file (no external storage, not virtual), chunks of at most
  :data:`MAX_CHUNK_BYTES` (or one row, for rows larger than that), and declaring no more bytes
  than the file holds for them, but for :data:`MAX_UNWRITTEN_BYTES` in all: the rows a killed
  writer can leave declared before their data reached the disk, and claiming no more storage
  than the file has (plus that margin, for a file a full disk cut short). A vector never
  written is not allocated at all; readers treat it as unwritten without reading it
  (:func:`allocated`), so it alone is exempt: any other dataset (a series, its step index, an
  event field) is read whatever its storage, and counts whole;
- series: rows of at most :data:`MAX_ROW_ENTRIES` entries, or θ0's when it is larger;
- attributes: scalars (the writer stores structured ones as JSON text), short text ones of at
  most :data:`MAX_TEXT_ATTR_BYTES`, the others of at most :data:`MAX_ATTR_BYTES`.

So everything a reader may read takes at most the file's size plus :data:`MAX_UNWRITTEN_BYTES`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from dynamics.store import names
from dynamics.store.schema import SERIES, VECTORS, RunFileError

#: Bytes of one chunk: the writer's chunks are at most 1 MiB (or one row of a larger series).
MAX_CHUNK_BYTES = 4 << 20
#: Bytes a file may declare beyond those it stores, over all its datasets: what a writer killed
#: between HDF5's metadata and raw-data writes leaves (a block of rows per group, at most).
MAX_UNWRITTEN_BYTES = 256 << 20
#: Entries of one row of a series, unless θ0 on disk shows a model of more parameters (a
#: snapshot row holds every parameter): a row's entries are named, drawn and tabled one by one.
MAX_ROW_ENTRIES = 1 << 24
#: Links (groups, datasets) a file may hold: far more than any run's series and vectors.
MAX_LINKS = 100_000
#: Attributes that are a name or a hash, not a structure.
TEXT_ATTRS = frozenset(
    {
        "schema",
        names.ATTR_RUN_NAME,
        names.ATTR_THETA0_SHA256,
        names.ATTR_FROZEN_SHA256,
        names.ATTR_PRECISION,
        names.ATTR_LOOP,
        names.ATTR_ENCODING,
    }
)
MAX_TEXT_ATTR_BYTES = 4096
#: Structured attributes (the config, the layout, the probes' settings) as JSON text.
MAX_ATTR_BYTES = 16 << 20


def inspect_file(file: h5py.File, path: Path) -> None:
    """Refuse a file that reaches outside itself or declares more than it holds.

    Raises:
        RunFileError: one line naming the object and what is wrong.
    """
    paths: list[str] = []

    def collect(name: bytes) -> Any:
        paths.append(name.decode(errors="replace"))
        return True if len(paths) > MAX_LINKS else None  # anything but None stops the walk

    file.id.links.visit(collect)  # H5Lvisit: every link once, descending hard links only
    if len(paths) > MAX_LINKS:
        raise RunFileError(f"{path}: holds more than {MAX_LINKS} objects, not a run file")
    _check_attrs(file, "/", path)
    row_limit = max(MAX_ROW_ENTRIES, _stored_parameters(file))
    unwritten = stored = 0
    for name in paths:
        link = file.get(name, getlink=True)  # the link itself, not what it names
        if isinstance(link, h5py.ExternalLink):
            raise RunFileError(
                f"{path}: /{name} links to another file ({link.filename}); a run file holds "
                "its own data"
            )
        if not isinstance(link, h5py.HardLink):
            raise RunFileError(f"{path}: /{name} is a soft link; a run file holds only its own")
        item = file[name]
        _check_attrs(item, name, path)
        if isinstance(item, h5py.Dataset):
            if name.startswith(f"{SERIES}/") and item.ndim > 1:
                entries = int(np.prod(item.shape[1:], dtype=np.float64))
                if entries > row_limit:
                    raise RunFileError(
                        f"{path}: /{name} has rows of {entries} entries, more than the run has "
                        f"parameters or a row may hold ({row_limit})"
                    )
            unwritten += _unwritten_bytes(item, name, path)
            stored += item.id.get_storage_size()
    if stored > path.stat().st_size + MAX_UNWRITTEN_BYTES:
        raise RunFileError(
            f"{path}: its datasets claim {stored / 2**20:.0f} MiB of storage in a file of "
            f"{path.stat().st_size / 2**20:.0f} MiB: damaged or crafted"
        )
    if unwritten > MAX_UNWRITTEN_BYTES:
        raise RunFileError(
            f"{path}: declares {unwritten / 2**20:.0f} MiB more than it stores, beyond what a "
            f"killed writer leaves ({MAX_UNWRITTEN_BYTES >> 20} MiB): damaged or crafted"
        )


class Inspected:
    """Which file at a path a poller last inspected whole, so that its next polls inspect only
    what grows.

    A live run polled every second (``dynamics watch``) is the same file at each poll, grown by
    its writer: rows appended to its series and events. Inspecting it whole at every poll is
    most of a poll's cost, so a file is inspected whole once per identity (the open file's
    device and inode, its run id and the set of its links: an overwrite, a resume or a new
    object changes it) and afterwards only the datasets a poll reads are checked again, for
    what growth can change (how many bytes they declare beyond what they store).

    Example::

        inspected = Inspected()
        with h5py.File(path, "r") as file:
            inspected.check(file, path, ["series/loss", "events"])
    """

    def __init__(self) -> None:
        self.identity: tuple | None = None

    def check(self, file: h5py.File, path: Path, growing: Iterable[str]) -> None:
        """Inspect ``file`` whole if it is not the file inspected last, else the datasets of
        the groups ``growing``.

        Raises:
            RunFileError: as :func:`inspect_file`, in one line.
        """
        identity = _identity(file, path)
        if identity != self.identity:
            inspect_file(file, path)
            self.identity = identity
            return
        unwritten = 0
        for group in growing:
            for name, item in file[group].items():
                if isinstance(item, h5py.Dataset):
                    unwritten += _unwritten_bytes(item, f"{group}/{name}", path)
        if unwritten > MAX_UNWRITTEN_BYTES:
            raise RunFileError(
                f"{path}: declares {unwritten / 2**20:.0f} MiB more than it stores, beyond what "
                f"a killed writer leaves ({MAX_UNWRITTEN_BYTES >> 20} MiB): damaged or crafted"
            )


def _identity(file: h5py.File, path: Path) -> tuple:
    """The open file's device and inode, its run id and its links (a millisecond's work)."""
    _check_attr(file, names.ATTR_RUN_ID, "/", path)  # its size known before its value is read
    links: list[bytes] = []
    file.id.links.visit(lambda name: links.append(name) if len(links) <= MAX_LINKS else True)
    opened = os.fstat(file.id.get_vfd_handle())
    return opened.st_dev, opened.st_ino, str(file.attrs.get(names.ATTR_RUN_ID)), tuple(links)


def _stored_parameters(file: h5py.File) -> int:
    """The entries of θ0 when its bytes are in the file (0 otherwise): the model's size, known
    from data rather than from the attribute that declares the layout."""
    theta0 = file.get(f"{VECTORS}/{names.THETA0}")
    if isinstance(theta0, h5py.Dataset) and theta0.ndim == 1 and allocated(theta0):
        return theta0.shape[0]
    return 0


def allocated(dataset: h5py.Dataset) -> bool:
    """Whether a dataset's storage exists: a vector declared but never written has none, and
    reads as its fill value without any byte of the file."""
    return dataset.id.get_storage_size() > 0


def _unwritten_bytes(dataset: h5py.Dataset, name: str, path: Path) -> int:
    """The bytes ``dataset`` declares beyond those it stores, after checking where and how it
    is stored."""
    plist = dataset.id.get_create_plist()
    if plist.get_layout() == h5py.h5d.VIRTUAL:
        raise RunFileError(f"{path}: /{name} is a virtual dataset of other files' data")
    if plist.get_external_count():
        raise RunFileError(f"{path}: /{name} keeps its data in another file (external storage)")
    shape, itemsize = dataset.shape, dataset.dtype.itemsize
    if shape is None:  # an empty dataspace: nothing to read
        return 0
    if dataset.chunks is not None:
        chunk = int(np.prod(dataset.chunks, dtype=np.float64)) * itemsize
        row = int(np.prod(shape[1:], dtype=np.float64)) * itemsize
        if chunk > max(MAX_CHUNK_BYTES, row):
            raise RunFileError(
                f"{path}: /{name} has chunks of {chunk / 2**20:.0f} MiB (at most "
                f"{MAX_CHUNK_BYTES >> 20} MiB or one row): damaged or crafted"
            )
    stored = dataset.id.get_storage_size()
    if dataset.chunks is None and not stored and name.startswith(f"{VECTORS}/"):
        return 0  # a vector never written: never read (see allocated); other datasets are read
    declared = int(np.prod(shape, dtype=np.float64)) * itemsize
    return max(0, declared - stored)


def _check_attrs(item: h5py.HLObject, where: str, path: Path) -> None:
    for key in item.attrs:  # names only: no value is read before its size is known
        _check_attr(item, key, where, path)


def _check_attr(item: h5py.HLObject, key: str, where: str, path: Path) -> None:
    """Refuse an attribute of more than one value, or of more bytes than its kind may hold
    (nothing to check for an attribute the object lacks)."""
    if key not in item.attrs:
        return
    attribute = item.attrs.get_id(key)
    limit = MAX_TEXT_ATTR_BYTES if key in TEXT_ATTRS else MAX_ATTR_BYTES
    shape = attribute.shape
    if shape is None:
        return  # an empty dataspace holds nothing
    if int(np.prod(shape, dtype=np.float64)) > 1:
        raise RunFileError(f"{path}: {where} attribute {key!r} has shape {shape}, not one value")
    if h5py.check_vlen_dtype(attribute.dtype) is None and not _is_vlen_string(attribute):
        size = attribute.dtype.itemsize
    else:  # variable-length: its bytes are in the file's heap, one value only
        value = item.attrs[key]
        size = len(value) if isinstance(value, (bytes, str)) else limit + 1
    if size > limit:
        raise RunFileError(
            f"{path}: {where} attribute {key!r} holds {size} bytes (at most {limit}): "
            "damaged or crafted"
        )


def _is_vlen_string(attribute: Any) -> bool:
    info = h5py.check_string_dtype(attribute.dtype)
    return info is not None and info.length is None
