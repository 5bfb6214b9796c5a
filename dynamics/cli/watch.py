"""``dynamics watch``: a local page that follows a run file, or a folder of runs, as it grows."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dynamics.cli.common import check_range

#: The port tried first; ``--port 0`` takes any free one.
DEFAULT_PORT = 8765


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``watch`` to ``commands``."""
    watch = commands.add_parser(
        "watch", help="follow a run file (or a folder of runs) live in the browser"
    )
    watch.add_argument("run", type=Path, metavar="RUN.h5|DIR", help="a run file or a folder")
    watch.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"port to serve on (default {DEFAULT_PORT}; 0: any free port)",
    )
    watch.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1: this machine only; others are warned about)",
    )
    watch.add_argument(
        "--every", type=float, default=1.0, metavar="S", help="seconds between polls (default 1)"
    )
    watch.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    """Serve the page until Ctrl-C."""
    from dynamics.analysis.live.server import LOOPBACK, WatchServer
    from dynamics.errors import DynamicsError

    if not 0 <= args.port <= 65535:
        raise DynamicsError(f"--port must be from 0 to 65535, got {args.port}")
    check_range("--every", args.every, 0.1, 3600)
    server = WatchServer(args.run, args.host, args.port, args.every)
    if args.host not in LOOPBACK:
        print(
            f"dynamics: warning: serving on {args.host}: anyone who can reach this machine can "
            "read these runs",
            file=sys.stderr,
        )
    print(f"watching {args.run} at {server.url} (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        print("stopped watching")
    finally:
        server.server_close()
    return 0
