"""Standard output whose write errors are told apart from every other OSError."""

from __future__ import annotations

import os
from typing import Any, TextIO


class StdoutFailed(Exception):
    """Standard output could not be written; ``error`` says why."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class Stdout:
    """Wraps a stream so that a failed write raises :class:`StdoutFailed`: a full disk or a
    reader gone away (``| head``) is told apart from an OSError of the command's own work."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as error:
            raise StdoutFailed(error) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as error:
            raise StdoutFailed(error) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def discard(stream: TextIO) -> None:
    """Point ``stream``'s descriptor at /dev/null: Python flushes what it still holds at exit,
    and that flush must not fail again with a traceback."""
    try:
        descriptor = stream.fileno()
    except (OSError, ValueError):  # not a real file (a test's captured output)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, descriptor)
    os.close(devnull)
