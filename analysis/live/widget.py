"""The notebook form of ``dynamics watch``: a widget that follows a run, or a folder of runs,
while they train.

:func:`watch` returns a :class:`Watch`, shown as the last expression of a cell: a status line
(each run's state, last step and events) above one plotly ``FigureWidget`` per recorded group.
The figures are the live page's (:class:`~dynamics.analysis.live.feed.Feed`), drawn once and then
extended in place with the rows each poll brings, by the rules of the page's script
(``watch.js``): a trace's ``meta`` names the run, series and column it draws; the figures are
drawn anew when a run joins or its file is replaced (the feed's key changes), when a group's
first rows arrive, and when a trace outgrows twice the display budget (the feed decimates it
again).

It needs ``ipywidgets`` and ``anywidget`` (plotly's ``FigureWidget`` is an anywidget), the
``notebook`` extra.
"""

from __future__ import annotations

import base64
import contextlib
import html
import importlib
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from dynamics.analysis.figures.lines import DISPLAY_BUDGET
from dynamics.analysis.live.feed import Feed
from dynamics.errors import DynamicsError

__all__ = ["Watch", "watch"]

_INSTALL = "pip install 'dynamics-for-pytorch[notebook]'"
#: States after which a run's file no longer changes.
ENDED = ("finished", "crashed", "killed")
#: Events listed under the status line at most (the newest); the rest are counted.
EVENTS_SHOWN = 10


def watch(path: str | Path, every_s: float = 1.0) -> Watch:
    """A notebook widget of the runs at ``path`` (a run file, or a folder whose new runs join)
    that updates while they train.

    A background thread polls every ``every_s`` seconds. It ends by itself once every run has
    finished, crashed or been killed (after one last poll, so the figures hold every row the
    runs flushed), or when :meth:`Watch.stop` is called; the status line then says it no
    longer follows. After that :meth:`Watch.refresh` still polls (once, at once): a run that
    joins a folder whose runs had all ended is drawn by a refresh, or by a new ``watch``.

    Args:
        path: a run file, or a folder of run files (it may still be empty: runs are awaited).
        every_s: seconds between polls.

    Returns:
        The widget; display it (the last expression of a cell) to see it.

    Raises:
        DynamicsError: ``ipywidgets`` or ``anywidget`` is not installed, or ``path`` is missing
            or not a readable run file.

    Example::

        import dynamics
        live = dynamics.watch("runs/demo/shifted.h5")
        live  # the last expression of the cell: its figures grow as the run trains
    """
    return Watch(Path(path), every_s)


class Watch:
    """The widget :func:`watch` returns: :attr:`widget` (an ``ipywidgets.VBox``) holds the
    status line and :attr:`figures`, one ``FigureWidget`` per group.

    Example::

        live = Watch(Path("runs/demo"), every_s=2.0)
        live.refresh()  # poll now
        live.figures["loss"].data[0].x  # the steps drawn of the first run's training loss
        live.stop()

    Raises:
        DynamicsError: as :func:`watch`.
    """

    def __init__(self, target: Path, every_s: float = 1.0) -> None:
        widgets, self._figure_widget = _widgets()
        self.feed = Feed(target)
        self.every_s = every_s
        self.status = widgets.HTML()
        self.figures: dict[str, Any] = {}
        self.widget = widgets.VBox([self.status])
        self._lock = threading.Lock()  # the thread and a caller's refresh() take turns
        self._stopped = threading.Event()
        self._key: str | None = None
        self._since: dict[str, dict[str, Any]] = {}
        self._redraw = True
        self._runs: list[dict[str, Any]] = []
        self._events: dict[str, list[dict[str, Any]]] = {}  # label -> the events received
        self._events_seen: dict[str, int] = {}  # label -> events the feed has sent or left out
        self.refresh()
        self._thread = threading.Thread(target=self._follow, name="dynamics.watch", daemon=True)
        self._thread.start()

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    @property
    def following(self) -> bool:
        """Whether the background thread still polls."""
        return self._thread.is_alive()

    @property
    def ended(self) -> bool:
        """Whether every run has finished, crashed or been killed (none yet: not ended)."""
        return bool(self._runs) and all(run.get("state") in ENDED for run in self._runs)

    def stop(self) -> None:
        """End the background thread (the widget keeps what it shows); :meth:`refresh` still
        polls."""
        self._stopped.set()
        self._thread.join()

    def refresh(self) -> None:
        """Poll once: extend the figures with the rows that arrived, show the runs' status.

        A poll that fails for a moment (a file being replaced) says why in the status line;
        the figures are drawn anew at the next one.
        """
        with self._lock:
            try:
                self._poll()
                note = f"updated {time.strftime('%H:%M:%S')}"
            except (DynamicsError, OSError) as error:
                self._redraw = True
                note = f"cannot update: {error}"
            if self._stopped.is_set() or self.ended:
                note += " · not following (every run has ended, or stop() was called)"
            self.status.value = _status_html(self._runs, self._events, note)

    # --- polling ---

    def _follow(self) -> None:
        while not self.ended and not self._stopped.wait(self.every_s):
            self.refresh()
        if not self._stopped.is_set():
            self._stopped.set()
            self.refresh()  # the last rows and status, said to be the last

    def _poll(self) -> None:
        if self._redraw:
            self._draw()
        update = self.feed.update(self._since, self._key)
        if update["key"] != self._key or not self._extend(update["rows"]):
            # Drawn anew with every row now; the runs and events are those since that drawing.
            self._draw()
            update = self.feed.update(self._since, self._key)
            self._redraw = update["key"] != self._key or not self._extend(update["rows"])
        self._runs = update["runs"]
        for run in self._runs:
            if "events_seen" in run:
                self._events.setdefault(run["label"], []).extend(run["events"])
                self._events_seen[run["label"]] = run["events_seen"]
                seen = self._since.setdefault(run["label"], {"groups": {}, "events": 0})
                seen["events"] = run["events_seen"]

    def _draw(self) -> None:
        """Every figure drawn anew from the feed; a group's widget is kept (redrawn in place)."""
        self._redraw = False
        drawn = self.feed.figures()
        if drawn["key"] != self._key:  # other runs, or a file replaced: their events anew
            self._events, self._events_seen = {}, {}
            self._key = drawn["key"]
        self._since = drawn["since"]
        for label, seen in self._since.items():
            seen["events"] = self._events_seen.get(label, 0)
        figures = {}
        for entry in drawn["figures"]:
            figure = _plain(entry["figure"])
            widget = self.figures.get(entry["group"])
            if widget is None:
                widget = self._figure_widget(figure)
            else:
                with widget.batch_update():
                    widget.data = ()
                    widget.add_traces(figure.get("data", []))
                    widget.layout = figure.get("layout", {})
            figures[entry["group"]] = widget
        self.figures = figures
        self.widget.children = [self.status, *figures.values()]

    def _extend(self, rows: dict[str, dict[str, Any]]) -> bool:
        """Extend the traces with ``rows`` ({label: {group: rows}}); False when the figures
        must be drawn anew (a group's first rows, or a trace past twice the display budget)."""
        extended = True
        with contextlib.ExitStack() as batches:
            for widget in self.figures.values():
                batches.enter_context(widget.batch_update())
            for label, groups in rows.items():
                for group, block in groups.items():
                    drawn = self._since.get(label, {}).get("groups", {})
                    if group not in self.figures or group not in drawn:
                        extended = False
                        continue
                    if not _extend_traces(self.figures[group], label, block):
                        extended = False
                    drawn[group] = block["step"][-1]
        return extended


def _extend_traces(figure: Any, label: str, block: dict[str, Any]) -> bool:
    """Append ``block``'s rows to the traces of ``figure`` that draw ``label``'s series; False
    when one has grown past twice the display budget."""
    step = np.asarray(block["step"], dtype=float)
    within = True
    for trace in figure.data:
        meta = trace.meta
        if not isinstance(meta, dict) or meta.get("run") != label:
            continue
        if meta.get("series") not in block["series"]:
            continue
        values = np.array(block["series"][meta["series"]], dtype=float)  # null: NaN
        x = np.concatenate([_array(trace.x), step])
        if trace.type == "heatmap":
            new = values.T  # z is columns × steps
            if meta.get("log10"):
                with np.errstate(divide="ignore", invalid="ignore"):
                    new = np.where(new > 0, np.log10(new), np.nan)
            trace.z = np.concatenate([np.asarray(trace.z, dtype=float), new], axis=1)
        else:
            trace.y = np.concatenate([_array(trace.y), values[:, meta["column"]]])
        trace.x = x
        within = within and len(x) <= 2 * DISPLAY_BUDGET
    return within


def _array(values: Any) -> np.ndarray:
    return np.asarray(values if values is not None else [], dtype=float)


def _plain(value: Any) -> Any:
    """plotly's JSON with its base64 arrays (``{"dtype", "bdata", "shape"}``) decoded, so that
    a trace extended in place holds plain numbers (an int8 step array would wrap at 128)."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        if isinstance(value.get("bdata"), str) and "dtype" in value:
            flat = np.frombuffer(base64.b64decode(value["bdata"]), dtype=value["dtype"])
            shape = value.get("shape")
            if isinstance(shape, str):
                shape = [int(n) for n in shape.split(",")]
            return (flat.reshape(shape) if shape is not None else flat).astype(float)
        return {k: _plain(v) for k, v in value.items()}
    return value


def _status_html(runs: list[dict[str, Any]], events: dict[str, list[dict]], note: str) -> str:
    lines = []
    for run in runs:
        state = run.get("state") or ("unreadable" if run.get("problem") else "waiting")
        step = run.get("last_step")
        parts = [
            f"<b>{html.escape(run['name'])}</b>: {html.escape(state)}",
            f"step {step if step is not None else '—'}",
            f"{run.get('events_seen', 0)} events",
        ]
        parts += [html.escape(n) for n in (run.get("exception"), run.get("problem")) if n]
        lines.append(" · ".join(parts))
    if not runs:
        lines.append("no run yet")
    listed = [(run["name"], e) for run in runs for e in events.get(run["label"], ())]
    for name, event in listed[-EVENTS_SHOWN:]:
        lines.append(
            html.escape(
                f"{name} · step {event['step']} · {event['probe']} · {event['kind']}: "
                f"{event['message']}"
            )
        )
    if len(listed) > EVENTS_SHOWN:
        lines.append(f"{len(listed) - EVENTS_SHOWN} earlier events (dynamics info RUN.h5)")
    lines.append(f"<i>{html.escape(note)}</i>")
    return "<div class='dynamics-watch'>" + "<br>".join(lines) + "</div>"


def _widgets() -> tuple[Any, Any]:
    """``(ipywidgets, plotly's FigureWidget)``, or one line saying what to install."""
    for module in ("ipywidgets", "anywidget"):
        try:
            importlib.import_module(module)
        except ImportError:
            raise DynamicsError(f"{module} is not installed; {_INSTALL}") from None
    import plotly.graph_objects as go

    return importlib.import_module("ipywidgets"), go.FigureWidget
