"""Headless Chromium driven over the DevTools protocol on a pipe, for the browser tests.

Chromium is started with ``--remote-debugging-pipe``, so a test needs no driver, no browser
download and no network port. :class:`DevTools` records every event of the pages it opens:
JavaScript exceptions, console errors, log errors and every request a page makes.

Locally a test module that uses it skips when no Chromium is installed (:data:`NEEDS_CHROMIUM`);
under CI (``CI`` set) importing this module fails instead, because .ci/run installs Debian's
``chromium``.
"""

import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest

CHROMIUM = next(
    filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None
)
if CHROMIUM is None and os.environ.get("CI"):
    pytest.fail("CI must install Debian's chromium for the browser test", pytrace=False)
#: The mark of a test module that needs Chromium: ``pytestmark = NEEDS_CHROMIUM``.
NEEDS_CHROMIUM = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium found (apt-get install chromium; CI installs it)"
)

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-pipe",
)


class DevTools:
    """A headless Chromium and one DevTools connection to it over fds 3 and 4."""

    def __init__(self, profile: Path) -> None:
        commands_read, self._commands = os.pipe()
        self._replies, replies_write = os.pipe()

        def on_fds_3_and_4() -> None:
            os.dup2(commands_read, 3)
            os.dup2(replies_write, 4)

        self.process = subprocess.Popen(
            [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
            pass_fds=(3, 4, commands_read, replies_write),
            preexec_fn=on_fds_3_and_4,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(commands_read)
        os.close(replies_write)
        self._buffer = b""
        self._id = 0
        self.events: list[dict] = []

    def call(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self._id += 1
        message = {"id": self._id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._receive(time.monotonic() + 60)
            if reply.get("id") == self._id:
                assert "error" not in reply, reply["error"]
                return reply["result"]
            self.events.append(reply)

    def open(self, url: str) -> str:
        """A new tab at ``url``, loaded; returns its session."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})
        session = session["sessionId"]
        for domain in ("Runtime", "Log", "Network", "Page"):
            self.call(f"{domain}.enable", session=session)
        self.call("Page.navigate", {"url": url}, session=session)
        deadline = time.monotonic() + 60
        while not self._seen("Page.loadEventFired", session):
            self.events.append(self._receive(deadline))
        return session

    def evaluate(self, expression: str, session: str):
        result = self.call(
            "Runtime.evaluate", {"expression": expression, "returnByValue": True}, session
        )
        return result["result"].get("value")

    def errors(self, session: str) -> list[str]:
        found = []
        for event in self._of(session):
            params = event["params"]
            if event["method"] == "Runtime.exceptionThrown":
                details = params["exceptionDetails"]
                found.append(details.get("exception", {}).get("description") or details["text"])
            elif event["method"] == "Runtime.consoleAPICalled" and params["type"] in (
                "error",
                "assert",
            ):
                found.append(" ".join(str(a.get("value")) for a in params["args"]))
            elif event["method"] == "Log.entryAdded" and params["entry"]["level"] == "error":
                found.append(params["entry"]["text"])
        return found

    def requests(self, session: str) -> list[str]:
        return [
            e["params"]["request"]["url"]
            for e in self._of(session)
            if e["method"] == "Network.requestWillBeSent"
        ]

    def close(self) -> None:
        try:
            self.call("Browser.close")
            self.process.wait(timeout=20)
        finally:
            if self.process.poll() is None:
                self.process.kill()
            os.close(self._commands)
            os.close(self._replies)

    def _of(self, session: str) -> list[dict]:
        return [e for e in self.events if e.get("sessionId") == session and "method" in e]

    def _seen(self, method: str, session: str) -> bool:
        return any(e["method"] == method for e in self._of(session))

    def _receive(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            remaining = deadline - time.monotonic()
            ready, _, _ = select.select([self._replies], [], [], max(0.0, remaining))
            if not ready:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._replies, 1 << 16)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)
