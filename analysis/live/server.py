"""The local web server of ``dynamics watch``: one page, and the two JSON endpoints it polls.

``GET /`` is the page (plotly.js embedded: it works offline), ``GET /api/figures`` every figure
of the runs now (drawn once, and again when a run joins or is replaced), ``POST
/api/update?key=K`` the rows after the steps the page has, its body; a page holding the figures
of another key than ``K`` gets no rows (:class:`~dynamics.analysis.live.feed.Feed`). The server
binds to the loopback interface unless asked otherwise, and there answers only requests whose
``Host`` header names it, so a web page elsewhere cannot read the runs through a DNS name it
points at this machine (DNS rebinding).
"""

from __future__ import annotations

import json
import sys
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from plotly.utils import PlotlyJSONEncoder

from dynamics.analysis.live.feed import Feed
from dynamics.analysis.live.watch_page import watch_page
from dynamics.errors import DynamicsError

__all__ = ["LOOPBACK", "WatchServer"]

#: The addresses of this machine alone: binding elsewhere is the user's explicit choice.
LOOPBACK = ("127.0.0.1", "localhost", "::1")
#: The largest request body read (an update's ``since``: a few bytes per run and group).
_MAX_BODY = 1 << 20


class WatchServer(ThreadingHTTPServer):
    """The server of one watched path, bound on creation; :meth:`serve_forever` serves it.

    Example::

        server = WatchServer(Path("runs/demo"), "127.0.0.1", 0)  # 0: any free port
        print(server.url)
        server.serve_forever()

    Raises:
        DynamicsError: the path is no run file or folder (:class:`Feed`), or the port cannot
            be bound (in use, or not allowed).
    """

    daemon_threads = True  # a page left open never keeps the command from stopping
    allow_reuse_address = True

    def __init__(self, target: Path, host: str, port: int, every_s: float = 1.0) -> None:
        self.feed = Feed(target)
        self.page = watch_page(str(target), every_s).encode()
        self.address_family = _family(host)
        try:
            super().__init__((host, port), _Handler)
        except OSError as error:
            why = "in use" if error.errno == 98 else error.strerror or str(error)
            raise DynamicsError(
                f"cannot listen on {host}:{port}: {why} (another --port, or --port 0 for any "
                "free one)"
            ) from None
        bound = self.server_address[1]
        self.url = f"http://{_url_host(host)}:{bound}/"
        self.loopback = host in LOOPBACK
        self.hosts = {f"{name}:{bound}" for name in ("127.0.0.1", "localhost", "[::1]")}

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One line for a request that failed (a page gone mid-reply is no failure)."""
        error = sys.exc_info()[1]
        if isinstance(error, (BrokenPipeError, ConnectionResetError)):
            return
        print(f"dynamics watch: a request failed: {error!r}", file=sys.stderr)


class _Handler(BaseHTTPRequestHandler):
    server: WatchServer

    def do_GET(self) -> None:
        if not self._host_allowed():
            return
        if self.path in ("/", "/index.html"):
            self._reply(self.server.page, "text/html; charset=utf-8")
        elif self.path == "/api/figures":
            self._json(self.server.feed.figures)
        elif self.path == "/favicon.ico":
            # A browser asks for it; a 404 would show as an error in the page's console.
            self.send_response(HTTPStatus.NO_CONTENT)
            self.end_headers()
        else:
            self.send_error(HTTPStatus.NOT_FOUND)

    def do_POST(self) -> None:
        if not self._host_allowed():
            return
        url = urlsplit(self.path)
        if url.path != "/api/update":
            self.send_error(HTTPStatus.NOT_FOUND)
            return
        key = parse_qs(url.query).get("key", [None])[0]
        length = int(self.headers.get("Content-Length") or 0)
        try:
            if not 0 <= length <= _MAX_BODY:
                raise ValueError(f"a body of {length} bytes")
            since = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(since, dict):
                raise ValueError("since is not an object")
        except ValueError as error:
            self.send_error(HTTPStatus.BAD_REQUEST, str(error)[:200])
            return
        self._json(lambda: self.server.feed.update(since, key))

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a poll a second would bury the terminal; failures have their own line

    def _host_allowed(self) -> bool:
        if not self.server.loopback or self.headers.get("Host") in self.server.hosts:
            return True
        self.send_error(HTTPStatus.FORBIDDEN, "the watcher answers only at 127.0.0.1/localhost")
        return False

    def _json(self, make: Any) -> None:
        try:
            body = json.dumps(make(), cls=PlotlyJSONEncoder)
        except DynamicsError as error:  # the watched path went away, or a run file broke
            body = json.dumps({"error": str(error)})
        self._reply(body.encode(), "application/json")

    def _reply(self, body: bytes, kind: str) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)


def _family(host: str) -> int:
    import socket

    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _url_host(host: str) -> str:
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host
