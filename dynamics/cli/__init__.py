"""The ``dynamics`` command line.

Exit codes: 0 on success, 2 on bad input (one line on stderr, nothing a user has overwritten)
or output that cannot be written (a full disk), 130 on Ctrl-C (one line), 141 when a reader
stops early (``| head``).
Every option is checked before any file is read or created.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dynamics.cli import (
    audit,
    compare,
    configs,
    info,
    overshoot,
    plane,
    report,
    reproduce,
    run,
    spectra,
    sweep,
    watch,
)
from dynamics.cli.common import (
    BROKEN_PIPE,
    INTERRUPTED,
    USAGE_ERROR,
    Parser,
    error_line,
)
from dynamics.cli.stdout import Stdout, StdoutFailed, discard
from dynamics.errors import DynamicsError

#: One module per command, in the order ``dynamics --help`` lists them.
COMMANDS = (
    run,
    sweep,
    configs,
    reproduce,
    info,
    watch,
    plane,
    report,
    compare,
    overshoot,
    audit,
    spectra,
)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command; each parsed command's ``handler`` runs it.

    Example::

        args = build_parser().parse_args(["info", "runs/demo/shifted.h5"])
        args.handler(args)  # prints the run's summary
    """
    parser = Parser(prog="dynamics", description=__doc__.splitlines()[0].replace("``", ""))
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command (``argv``: the arguments after ``dynamics``; default ``sys.argv``)
    and return its exit code.

    Example::

        code = main(["report", "runs/demo", "-o", "report.html"])  # 0, or 2 with one line
    """
    stdout, sys.stdout = sys.stdout, Stdout(sys.stdout)
    try:  # parsing too: Ctrl-C while the parser loads is one line like any other
        args = build_parser().parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)  # the command, as reports show
        code = args.handler(args)
        sys.stdout.flush()  # a full disk fails here, not in the interpreter's exit
        return code
    except DynamicsError as error:
        print(f"dynamics: error: {error_line(error)}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print("dynamics: interrupted", file=sys.stderr)
        return INTERRUPTED
    except StdoutFailed as failed:
        discard(stdout)
        if isinstance(failed.error, BrokenPipeError):
            return BROKEN_PIPE  # the reader has what it wanted (| head): nothing to report
        print(f"dynamics: error: cannot write the output: {failed.error.strerror}", file=sys.stderr)
        return USAGE_ERROR
    finally:
        sys.stdout = stdout
