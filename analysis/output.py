"""Writing outputs: checked before any work, written beside the target and renamed into place.

Every file a command writes (pages, plane grids, summaries) goes through here, so every output
obeys the same rules: never through a symbolic link, never onto a device, FIFO or socket, never
onto one of the command's inputs, and never onto a file of another kind (a page or a plane grid
never replaces a run file). The new content is written to a temporary file in the target's folder
(``.NAME.XXXXXXXX``) while this process owns the path (``NAME.lock``, :class:`RunLock`), then
renamed over it: a kill at any instant leaves the old file or the new one, and the next write of
the same path removes the temporary files a killed writer left.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from dynamics.errors import DynamicsError, ParameterError
from dynamics.store import RunFileError, RunLock
from dynamics.store.lock import LockHeld

#: The ``schema`` root attribute of a plane grid (``dynamics plane``'s companion HDF5 file).
PLANE_GRID_SCHEMA = "dynamics-plane-grid"
#: What a page (HTML or JSON) is, for :func:`check_existing_output`.
PAGE = "page"
#: HDF5's format signature, at the start of every file h5py creates.
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
#: The most bytes a ``schema`` attribute is read with: a crafted file's huge one is not a grid.
_MAX_SCHEMA_BYTES = 256
#: How long a page write waits for another process writing the same path (a page takes
#: milliseconds to write; a plane holds its page while it evaluates, and is refused).
_CLAIM_WAIT_S = 5.0

#: Output paths this process owns, with how many claims hold each (claims nest: a plane owns its
#: page for its whole evaluation, and writing the page claims it again).
_claims: dict[Path, list] = {}


def check_output(
    out_path: str | os.PathLike,
    overwrite: bool,
    inputs: Iterable[str | os.PathLike] = (),
    kind: str = PAGE,
) -> Path:
    """Check that ``out_path`` may be written with an output of ``kind``; returns it as a Path.

    Raises:
        DynamicsError: its folder is missing or not writable, or
            :func:`check_existing_output` refuses what is at the path.
    """
    out = Path(out_path)
    folder = out.parent
    if not folder.is_dir():
        raise DynamicsError(f"folder {folder} does not exist")
    check_existing_output(out, overwrite, inputs, kind)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise DynamicsError(f"cannot write to folder {folder}")
    return out


def check_existing_output(
    out: Path, overwrite: bool, inputs: Iterable[str | os.PathLike] = (), kind: str | None = PAGE
) -> None:
    """Refuse what is at ``out`` if an output of ``kind`` may not replace it; absent is fine.

    The one check of every command's output paths (pages, plane grids, run files).

    Args:
        out: the output path.
        overwrite: an existing regular file may be replaced.
        inputs: the command's input files; none of them may be ``out``.
        kind: :data:`PAGE` (a page never replaces an HDF5 file), :data:`PLANE_GRID_SCHEMA`
            (a grid replaces only a plane grid), or None (a run file: its writer checks the
            content).

    Raises:
        DynamicsError: ``out`` is a symbolic link (whatever it points to), a folder, a device,
            FIFO or socket, one of ``inputs``, a file of another kind, or exists and
            ``overwrite`` is false.
    """
    try:
        mode = os.lstat(out).st_mode
    except FileNotFoundError:
        return
    except OSError as error:
        raise DynamicsError(f"cannot write {out}: {error.strerror}") from None
    if stat.S_ISLNK(mode):
        raise DynamicsError(
            f"{out} is a symbolic link; outputs are never written through a link: "
            "remove it or choose another output"
        )
    if stat.S_ISDIR(mode):
        raise DynamicsError(f"{out} is a folder, not a file")
    if not stat.S_ISREG(mode):
        raise DynamicsError(
            f"{out} is not a regular file (a device, FIFO or socket); choose another output"
        )
    if any(_same_file(out, p) for p in inputs):
        raise DynamicsError(f"{out} is one of the input files; choose another output")
    if kind is not None:
        _check_kind(out, kind)
    if not overwrite:
        flag = ParameterError("overwrite", "to replace it")  # the CLI spells it --overwrite
        raise DynamicsError(f"{out} exists; pass {flag}").quoting(flag)


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename.

    Raises:
        DynamicsError: another process is writing ``path``, or the folder refuses the write
            (the message says why, in one line); ``path`` is left as it was.
    """
    with replacing(path) as temporary:
        temporary.write_text(text, encoding="utf-8")


@contextlib.contextmanager
def replacing(path: Path, keep_unfinished: bool = False) -> Iterator[Path]:
    """Yield a new temporary file beside ``path``, renamed over ``path`` when the block ends.

    The path is claimed (:func:`claimed`) for the block. When the block raises, the temporary
    file is removed and ``path`` is left as it was; with ``keep_unfinished``, what the block
    wrote takes ``path``'s place if nothing is there (an interrupted plane grid keeps its
    finished rows) and never replaces a file.

    Raises:
        DynamicsError: another process is writing ``path``, the target turned into a link or a
            special file meanwhile, or the folder refuses the write.
    """
    with claimed([path], wait_s=_CLAIM_WAIT_S):
        try:
            descriptor, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        except OSError as error:
            raise DynamicsError(f"cannot write {path}: {error.strerror or error}") from None
        os.close(descriptor)
        temporary = Path(name)
        try:
            try:
                yield temporary
            except BaseException:
                if keep_unfinished:
                    with contextlib.suppress(OSError):
                        _share(temporary)
                        os.link(temporary, path)  # refuses an existing path: none is replaced
                raise
            _share(temporary)
            check_existing_output(path, True, kind=None)  # a link or node made meanwhile stays
            os.replace(temporary, path)
        except OSError as error:
            raise DynamicsError(f"cannot write {path}: {error.strerror or error}") from error
        finally:
            temporary.unlink(missing_ok=True)
        _remove_leftovers(path)


@contextlib.contextmanager
def claimed(paths: Iterable[Path], wait_s: float = 0.0) -> Iterator[None]:
    """Own ``paths`` for writing in this process for the block (an exclusive lock on
    ``NAME.lock`` beside each; claims of this process nest).

    Raises:
        DynamicsError: another process still holds one after ``wait_s`` seconds.
    """
    taken: list[Path] = []
    try:
        for path in paths:
            key = Path(os.path.abspath(path))
            if key not in _claims:
                _claims[key] = [_lock(key, wait_s), 0]
            _claims[key][1] += 1
            taken.append(key)
        yield
    finally:
        for key in reversed(taken):
            _claims[key][1] -= 1
            if not _claims[key][1]:
                _claims.pop(key)[0].release()


def _lock(path: Path, wait_s: float) -> RunLock:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return RunLock.acquire(path, writer="process")
        except LockHeld as error:
            if time.monotonic() >= deadline:
                raise DynamicsError(str(error)) from None
        except RunFileError as error:  # the folder refuses the lock file: a full disk, /proc
            cause = error.__cause__
            why = cause.strerror if isinstance(cause, OSError) and cause.strerror else error
            raise DynamicsError(f"cannot write {path}: {why}") from None
        time.sleep(0.05)


def _same_file(out: Path, other: str | os.PathLike) -> bool:
    try:
        return out.samefile(other)
    except OSError:
        return False


def _check_kind(out: Path, kind: str) -> None:
    """Refuse a file at ``out`` that an output of ``kind`` may not replace."""
    try:
        with open(out, "rb") as file:
            head = file.read(len(_HDF5_SIGNATURE))
    except OSError as error:
        raise DynamicsError(f"cannot read {out}: {error.strerror}") from None
    if not head:
        return  # empty: nothing to lose
    is_hdf5 = head == _HDF5_SIGNATURE
    if kind == PAGE and is_hdf5:
        raise DynamicsError(
            f"{out} is an HDF5 file (a run file?), not a page; a page never replaces it: "
            "choose another output"
        )
    if kind == PLANE_GRID_SCHEMA and (not is_hdf5 or _hdf5_schema(out) != PLANE_GRID_SCHEMA):
        raise DynamicsError(
            f"{out} is not a plane grid (a run file?); a plane grid never replaces it: "
            "choose another output"
        )


def _hdf5_schema(path: Path) -> str | None:
    """The ``schema`` root attribute of the HDF5 file at ``path``; None when it has none or
    cannot be read. A grid written before grids named their schema (root attributes
    ``complete`` and ``remarks``, no schema) counts as a plane grid."""
    import h5py

    try:
        with h5py.File(path, "r", locking=False) as file:
            attrs = file.attrs
            if "schema" not in attrs:
                legacy = "complete" in attrs and "remarks" in attrs
                return PLANE_GRID_SCHEMA if legacy else None
            if attrs.get_id("schema").get_storage_size() > _MAX_SCHEMA_BYTES:
                return None
            schema = attrs["schema"]
    except (OSError, KeyError, ValueError, TypeError):
        return None
    return schema.decode(errors="replace") if isinstance(schema, bytes) else str(schema)


def _share(temporary: Path) -> None:
    # mkstemp creates files readable by the owner alone; an output is for sharing.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(temporary, 0o666 & ~umask)


def _remove_leftovers(path: Path) -> None:
    """Remove the temporary files of ``path`` that killed writers left (``.NAME.XXXXXXXX``).

    Safe under the claim on ``path``: every live writer of it holds the claim while its
    temporary file exists.
    """
    pattern = re.compile(rf"\.{re.escape(path.name)}\.[a-z0-9_]{{8}}")
    with contextlib.suppress(OSError):
        for entry in os.scandir(path.parent):
            if pattern.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def slug(text: str) -> str:
    """``text`` as a file-name part: runs of other characters than ``A-Za-z0-9._-`` become _."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "run"
