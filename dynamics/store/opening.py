"""Opening a run file for reading within a bounded time, whatever its bytes.

HDF5's live (SWMR) reads retry a metadata read whose checksum fails, by default 100 times with
a doubling sleep: on a damaged or cut file that is a wait of hours. A file is refused first
when it is too short to be a run or lacks HDF5's signature, and every live open allows few
attempts (a live run's reader retries whole reads itself; see :mod:`dynamics.store.reader`).
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import h5py

from dynamics.store.schema import RunFileError

#: HDF5's format signature, at the start of the file or after a user block of 512·2^k bytes.
SIGNATURE = b"\x89HDF\r\n\x1a\n"
#: No run file is shorter: its superblock, root attributes, status and events groups alone
#: take several KiB. A file of fewer bytes was cut (or is being written for the first time).
MIN_RUN_BYTES = 1024
#: Metadata read attempts of a live open: HDF5 sleeps 1 ns, 2 ns, ... between them, so these
#: wait about a millisecond in all, where its default (100) waits hours on a damaged file.
SWMR_READ_ATTEMPTS = 20


def check_head(path: Path) -> None:
    """Refuse a file too short to be a run file, or without HDF5's signature, before HDF5
    reads it.

    Raises:
        RunFileError: in one line, saying which.
    """
    size = path.stat().st_size
    if size < MIN_RUN_BYTES:
        raise RunFileError(
            f"{path}: not a readable run file: {size} bytes, too short for one (truncated?)"
        )
    with path.open("rb") as file:
        for offset in _signature_offsets(size):
            file.seek(offset)
            if file.read(len(SIGNATURE)) == SIGNATURE:
                return
    raise RunFileError(f"{path}: not a readable run file: no HDF5 signature")


def open_live(path: Path) -> h5py.File:
    """``path`` opened for SWMR reading, HDF5's metadata read attempts bounded.

    Raises:
        OSError: HDF5 cannot open it.
    """
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_EARLIEST, h5py.h5f.LIBVER_LATEST)
    library = _hdf5_library()
    if library is not None:
        library.H5Pset_metadata_read_attempts(ctypes.c_int64(fapl.id), SWMR_READ_ATTEMPTS)
    flags = h5py.h5f.ACC_RDONLY | h5py.h5f.ACC_SWMR_READ
    return h5py.File(h5py.h5f.open(os.fsencode(path), flags, fapl=fapl))


def _signature_offsets(size: int) -> list[int]:
    offsets, offset = [0], 512
    while offset + len(SIGNATURE) <= size:
        offsets.append(offset)
        offset *= 2
    return offsets


@functools.cache
def _hdf5_library() -> ctypes.CDLL | None:
    """The HDF5 library h5py itself uses (h5py wraps no call that sets the read attempts), or
    None when it cannot be found for sure; then HDF5's default attempts stand."""
    for candidate in _loaded_hdf5_paths():
        try:
            library = ctypes.CDLL(candidate)  # already loaded: the same instance as h5py's
            setter = library.H5Pset_metadata_read_attempts
        except (OSError, AttributeError):
            continue
        setter.argtypes, setter.restype = (ctypes.c_int64, ctypes.c_uint), ctypes.c_int
        probe = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
        # A property list h5py made is valid in this library only if it is h5py's own copy.
        library.H5Iis_valid.argtypes, library.H5Iis_valid.restype = (ctypes.c_int64,), ctypes.c_int
        if library.H5Iis_valid(ctypes.c_int64(probe.id)) > 0 and setter(probe.id, 1) >= 0:
            return library
    return None


def _loaded_hdf5_paths() -> list[str]:
    """Paths of the HDF5 libraries mapped into this process (Linux), else those beside h5py."""
    try:
        with open("/proc/self/maps") as maps:
            mapped = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        package = Path(h5py.__file__).parent
        folders = (package, package.with_name("h5py.libs"), package / ".dylibs")
        mapped = {str(p) for folder in folders if folder.is_dir() for p in folder.iterdir()}
    names = [Path(p).name for p in mapped]
    return sorted(
        p
        for p, name in zip(mapped, names)
        if name.startswith(("libhdf5", "hdf5")) and "_hl" not in name
    )
