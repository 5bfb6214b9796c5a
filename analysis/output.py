"""Writing HTML outputs: checked before any work, replaced atomically, never clobbered."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from dynamics.errors import DynamicsError


def check_output(
    out_path: str | os.PathLike, overwrite: bool, inputs: Iterable[str | os.PathLike] = ()
) -> Path:
    """Check that ``out_path`` may be written; returns it as a Path.

    Raises:
        DynamicsError: its folder is missing or not writable, it is a folder, it exists and
            ``overwrite`` is false, or it is one of ``inputs`` (a run file or a batch file would
            be destroyed).
    """
    out = Path(out_path)
    folder = out.parent
    if not folder.is_dir():
        raise DynamicsError(f"folder {folder} does not exist")
    if out.is_dir():
        raise DynamicsError(f"{out} is a folder, not a file")
    if out.exists():
        if any(Path(p).exists() and out.samefile(p) for p in inputs):
            raise DynamicsError(f"{out} is one of the input files; choose another output")
        if not overwrite:
            raise DynamicsError(f"{out} exists; pass --overwrite to replace it")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise DynamicsError(f"cannot write to folder {folder}")
    return out


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename.

    Raises:
        DynamicsError: the folder refuses the write (the message says why, in one line); the
            temporary file is removed and ``path`` is left as it was.
    """
    temporary = None
    try:
        with tempfile.NamedTemporaryFile(
            "w", encoding="utf-8", dir=path.parent, prefix=f".{path.name}.", delete=False
        ) as file:
            temporary = Path(file.name)
            file.write(text)
        # mkstemp creates files readable by the owner alone; a report is for sharing.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)
        os.replace(temporary, path)
    except BaseException as error:
        if temporary is not None:
            temporary.unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise DynamicsError(f"cannot write {path}: {error.strerror or error}") from error
        raise
