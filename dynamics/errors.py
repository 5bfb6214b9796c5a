"""The error the command line turns into one line on stderr and exit code 2."""


class DynamicsError(ValueError):
    """Bad input from the user (a file, a config, an argument); the message is one line."""
