"""One live writer per run file: an exclusive lock on ``<run file>.lock`` beside it.

HDF5's own file lock cannot tell a live writer apart: it is taken after ``"w"`` has already
truncated the file, and a SWMR writer gives it up so readers can open. The lock is an ``flock``
on a small file that names its owner; the kernel drops it when the owner's process ends, however
it ends, so a killed run never leaves a path locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import socket
import time
from multiprocessing.util import Finalize
from pathlib import Path

from dynamics.store.schema import RunFileError

#: Finalizers run at a process's exit by decreasing priority: a writer closes its file (above)
#: before its lock goes.
LOCK_EXIT_PRIORITY = 0


class LockHeld(RunFileError):
    """Another live process holds the lock (as opposed to a lock file that cannot be made)."""


class RunLock:
    """Exclusive ownership of a run file's path by this process, until :meth:`release`.

    Use :meth:`acquire`. The lock file is removed when the lock is released, when this object is
    collected, and when the process exits through Python (``multiprocessing`` children included).
    """

    def __init__(self, path: Path, fd: int):
        self.path = path
        self._release = Finalize(
            self, _unlock, args=(path, fd, os.getpid()), exitpriority=LOCK_EXIT_PRIORITY
        )

    @classmethod
    def acquire(cls, run_file: str | os.PathLike, writer: str = "run") -> RunLock:
        """Lock ``run_file`` for writing, or refuse in one line if a live writer holds it.

        Args:
            run_file: the file to own (a run file, or any output a command writes).
            writer: what the other holder is called in the refusal ("another run").

        Raises:
            LockHeld: another live process holds the lock.
            RunFileError: the lock file cannot be made or written (a full disk: it is removed
                again); the OSError is the cause.
        """
        run_file = Path(run_file)
        path = run_file.with_name(run_file.name + ".lock")
        for _ in range(3):
            try:
                # never through a link: a planted one would truncate its target
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            except OSError as error:
                raise RunFileError(f"cannot lock {run_file}: {error.strerror}") from error
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _owner(fd)
                os.close(fd)
                raise LockHeld(
                    f"{run_file} is being written by another {writer} ({owner}); "
                    "wait for it to end or choose another path"
                ) from None
            # The previous owner removes the lock file as it releases it: a lock taken on a file
            # already removed guards nothing, so take the one now at the path instead.
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    _check_lock_file(path, fd, run_file)
                    _name_owner(path, fd, run_file)
                    return cls(path, fd)
            os.close(fd)
        raise RunFileError(f"cannot lock {run_file}: its lock file {path} keeps being replaced")

    def release(self) -> None:
        """Give the path up (a second call does nothing)."""
        self._release()


#: What a lock file holds: its owner's name (:func:`_name_owner`), or nothing yet.
_OWNER_TEXT = re.compile(rb"(pid \d+ on \S*)?")


def _check_lock_file(path: Path, fd: int, run_file: Path) -> None:
    """Refuse a file at the lock's path that is not a lock file: taking the lock truncates it,
    so a hard link there (to a run file) or a file of that name (``uv.lock`` for ``-o uv``)
    would be destroyed. The file is left as it was (and unlocked).

    Raises:
        RunFileError: in one line, naming the file.
    """
    info = os.fstat(fd)
    head = os.pread(fd, 512, 0)
    if info.st_nlink == 1 and info.st_size <= 512 and _OWNER_TEXT.fullmatch(head.strip()):
        return
    os.close(fd)  # releases the flock; the file is not ours to remove
    why = "a hard link to another file" if info.st_nlink > 1 else "a file that is not a lock"
    raise RunFileError(
        f"cannot lock {run_file}: {path} is {why}, which taking the lock would truncate; "
        "remove it or choose another path"
    )


def _name_owner(path: Path, fd: int, run_file: Path) -> None:
    """Write this process's name into the lock file it holds; on a write the disk refuses (a
    full disk), give the lock up again, so no empty lock file is left behind."""
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
    except OSError as error:
        _unlock(path, fd, os.getpid())
        raise RunFileError(f"cannot lock {run_file}: {error.strerror or error}") from error


def _owner(fd: int) -> str:
    # The owner names itself just after it locks: a moment's wait reads a name, not a blank.
    for _ in range(20):
        owner = os.pread(fd, 256, 0).decode(errors="replace").strip()
        if owner:
            return owner
        time.sleep(0.01)
    return "another process"


def _unlock(path: Path, fd: int, pid: int) -> None:
    if os.getpid() != pid:
        return  # a forked child holds a copy of the descriptor, not the lock's ownership
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # before the unlock, so no one locks a file about to vanish
    os.close(fd)
