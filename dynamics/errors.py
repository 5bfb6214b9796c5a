"""The errors the command line turns into one line on stderr and exit code 2."""

from __future__ import annotations

from typing import Self


class DynamicsError(ValueError):
    """Bad input from the user (a file, a config, an argument); the message is one line.

    A message that advises a parameter (``...; pass model path/to/file.py:Net``) quotes a
    :class:`ParameterError` and keeps it in :attr:`quoted` (see :meth:`quoting`), so a front
    end spells that parameter its own way there too.
    """

    #: The parameter errors this message quotes, which a front end respells.
    quoted: tuple[ParameterError, ...] = ()

    def quoting(self, *parameters: ParameterError) -> Self:
        """This error, noting that its message quotes ``parameters``.

        Example::

            model = ParameterError("model", "path/to/file.py:Net")
            raise DynamicsError(f"a.h5: cannot import Net; pass {model}").quoting(model)
            # the command line prints: a.h5: cannot import Net; pass --model path/to/file.py:Net
        """
        self.quoted = parameters
        return self


class ParameterError(DynamicsError):
    """A bad value of one named parameter of a library call.

    The message names the parameter as the library spells it (``grid_side``); a front end that
    spells it otherwise (the command line's ``--grid``) renders it with :meth:`naming`, so the
    library never names a flag and each check lives once.

    Example::

        raise ParameterError("grid_side", "must be at least 2, got 1")
        # str(): "grid_side must be at least 2, got 1"
    """

    def __init__(self, parameter: str, problem: str) -> None:
        self.parameter = parameter
        self.problem = problem
        super().__init__(f"{parameter} {problem}")

    def __reduce__(self) -> tuple:
        # Exceptions pickle as cls(*args), and args holds the one message: a worker process's
        # error (or an error quoting this one) would not unpickle.
        return type(self), (self.parameter, self.problem), self.__dict__

    def naming(self, spelling: str) -> str:
        """The message with the parameter spelled ``spelling`` (e.g. ``--grid``)."""
        return f"{spelling} {self.problem}"


def one_line(error: BaseException | None) -> str:
    """``Type: first line of the message``: an exception of user code, for a one-line error."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
