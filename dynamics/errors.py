"""The error the command line turns into one line on stderr and exit code 2."""


class DynamicsError(ValueError):
    """Bad input from the user (a file, a config, an argument); the message is one line."""


def one_line(error: BaseException | None) -> str:
    """``Type: first line of the message``: an exception of user code, for a one-line error."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
