"""The HTML of the live page: the page kit's head (plotly.js embedded), a table of the runs'
status, their events, and the figures that ``watch.js`` draws and extends."""

from __future__ import annotations

import html
from importlib.resources import files

from dynamics.analysis.figures.lines import DISPLAY_BUDGET
from dynamics.analysis.pages.page import html_page

__all__ = ["watch_page"]

_HEADER = ("run", "status", "last step", "rows/s", "last flush", "note")


def watch_page(target: str, every_s: float) -> str:
    """The page that follows the runs at ``target``, polling every ``every_s`` seconds."""
    script = files("dynamics.analysis.live").joinpath("watch.js").read_text(encoding="utf-8")
    head = "".join(f"<th>{h}</th>" for h in _HEADER)
    body = (
        f"<div id='watch' data-every='{every_s:g}' data-budget='{DISPLAY_BUDGET}'>"
        f"<h1>dynamics watch</h1><p class='meta'>{html.escape(target)} · "
        f"<span id='watcher' class='meta'>connecting…</span></p>"
        f"<table id='runs'><thead><tr>{head}</tr></thead><tbody></tbody></table>"
        "<h2>Events</h2><p id='no-events' class='note'>None so far.</p><ul id='events'></ul>"
        "<h2>Figures</h2><p id='empty' class='note'>No rows recorded yet.</p>"
        "<div id='figures'></div></div>"
        f"<style>{_CSS}</style><script>{script}</script>"
    )
    return html_page(f"dynamics watch: {target}", body)


_CSS = """
tr.running td{background:#eef8ee} tr.crashed td,tr.killed td,tr.unreadable td{background:#ffe0e0;
font-weight:600} .warning{color:#b00} #events li.disabled,#events li.error{color:#b00}
"""
