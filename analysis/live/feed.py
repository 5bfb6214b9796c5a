"""What a live page shows of the runs at a path: their figures once, then only the rows that
arrive, their status and their events.

A :class:`Feed` follows one run file, or every run file of a folder (new ones join as they
start). Each poll opens each file once, only while it reads it (:meth:`dynamics.store.Run.update`),
so a writer is never slowed or blocked and an overwrite never held up. A file that cannot be
read for a moment (being created, being replaced) keeps its place with the reason; a file
replaced by another run (an overwrite) changes the feed's :attr:`Feed.key`, which tells a page
to draw its figures anew.

The figures are the report's (:func:`~dynamics.analysis.figures.compared_view_figure` over the
stored views, every drawn series of every group); each trace carries in its ``meta`` the run,
series and column it draws, which is how a page extends it with the rows of an update.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dynamics.analysis.figures.series import compared_view_figure
from dynamics.analysis.measures.run_series import drawn_groups, group_title, series_views
from dynamics.errors import DynamicsError
from dynamics.store import Run, RunFileError, open_run, other_output

__all__ = ["Feed"]

#: Events sent per run and update at most; the page says how many it was not sent.
EVENTS_PER_UPDATE = 50


@dataclass
class _Followed:
    """One run file as the feed last read it."""

    path: Path
    run: Run | None = None  # None until the file could be opened once
    problem: str | None = None  # why the last read failed, or None
    # The file's (device, inode) when last opened: a resume keeps the run id but rewrites the
    # file under a new name (rows after its checkpoint dropped), as an overwrite of a file from
    # before run ids does; either renames another file over the path.
    file_id: tuple[int, int] | None = None


class Feed:
    """The runs at ``target`` (a run file, or a folder of them), as a live page polls them.

    Example::

        feed = Feed(Path("runs/demo"))
        drawn = feed.figures()  # {"key", "figures": [{"group", "title", "figure"}], "since"}
        update = feed.update(drawn["since"])  # {"key", "runs", "rows"}: rows after `since`

    Raises:
        DynamicsError: ``target`` is missing, or a file that is not a readable run file (a
            folder may be empty: its runs are awaited).
    """

    def __init__(self, target: Path) -> None:
        self.target = Path(target)
        if not self.target.exists():
            raise DynamicsError(f"{self.target}: no such file or directory")
        self.folder = self.target.is_dir()
        self._lock = threading.Lock()  # a threaded server polls from several requests at once
        self._followed: dict[Path, _Followed] = {}
        self._kinds: dict[Path, tuple[tuple[int, ...] | None, bool]] = {}
        if not self.folder:
            run = open_run(self.target)
            self._followed[self.target] = _Followed(self.target, run, file_id=_file_id(run.path))

    def figures(self) -> dict[str, Any]:
        """Every figure of the runs now, with the last step each drew of each group.

        Returns:
            ``{"key", "figures": [{"group", "title", "figure"}], "since": {label: {"groups":
            {group: last step drawn}, "events": 0}}}``; a figure is plotly's JSON of it.
        """
        with self._lock:
            self._check_folder()
            self._discover()
            runs = {}
            for followed in self._followed.values():
                self._reopen(followed)
                if followed.run is not None:
                    runs[followed.path] = followed.run
            labels = self._labels()
            figures = []
            since: dict[str, dict] = {labels[p]: {"groups": {}, "events": 0} for p in runs}
            for group in drawn_groups(runs.values()):
                drawn = {labels[p]: series_views(run, group) for p, run in runs.items()}
                drawn = {label: views for label, views in drawn.items() if views}
                if not drawn:
                    continue
                for label, views in drawn.items():
                    since[label]["groups"][group] = int(views[0].step[-1])
                figure = compared_view_figure(drawn, title=group_title(group))
                figures.append(
                    {"group": group, "title": group_title(group), "figure": figure.to_plotly_json()}
                )
            return {"key": self._key(), "figures": figures, "since": since}

    def update(self, since: dict[str, dict[str, Any]], key: str | None = None) -> dict[str, Any]:
        """The rows of every run's drawn groups after the steps ``since`` gives, with the runs'
        status and the events after those the page has.

        Args:
            since: ``{label: {"groups": {group: last step the page has}, "events": how many
                events it has}}``, as :meth:`figures` starts it; a group not named is sent
                whole (its first rows: the page draws its figures anew).
            key: the key of the page's figures; when it is not the feed's, no rows are read
                (the page draws its figures anew first, and its ``since`` may be another
                file's).

        Returns:
            ``{"key", "runs": [run state], "rows": {label: {group: {"step": [...],
            "series": {name: [[values of a row, flattened], ...]}}}}}``, non-finite values
            as null.
        """
        with self._lock:
            self._check_folder()
            self._discover()
            labels = self._labels()
            rows, updates = {}, {}
            stale = key is not None and key != self._key()
            for path, followed in self._followed.items():
                label = labels[path]
                groups, events_seen = _asked(since.get(label))
                update = self._read_update(followed, groups)
                if stale and update is not None:
                    update = dataclasses.replace(update, rows={})
                if update is None:
                    continue
                updates[path] = (update, events_seen)
                rows[label] = {
                    group: {
                        "step": series.step.tolist(),
                        "series": {n: _rows_json(v) for n, v in series.values.items()},
                    }
                    for group, series in update.rows.items()
                    if len(series)
                }
            return {"key": self._key(), "runs": self._states(labels, updates), "rows": rows}

    # --- following files ---

    def _check_folder(self) -> None:
        """A watched folder deleted says so (a lone file deleted is its run's problem)."""
        if self.folder and not self.target.is_dir():
            raise DynamicsError(f"{self.target}: no such file or directory")

    def _discover(self) -> None:
        """Follow the run files now in the folder; files gone from it are dropped."""
        if not self.folder:
            return
        # `dynamics run --seeds` writes OUT/<variant>/seed<k>.h5: the runs one folder down are
        # the folder's too.
        found = [*self.target.glob("*.h5"), *self.target.glob("*/*.h5")]
        present = [p for p in sorted(found) if p.is_file() and not self._other_output(p)]
        for path in present:
            self._followed.setdefault(path, _Followed(path))
        for path in [p for p in self._followed if p not in present]:
            del self._followed[path]

    def _other_output(self, path: Path) -> bool:
        """Whether ``path`` is a plane grid or other output beside the runs, by its stat."""
        signature = _signature(path)
        if signature is None or self._kinds.get(path, (None,))[0] != signature:
            self._kinds[path] = (signature, other_output(path))
        return self._kinds[path][1]

    def _reopen(self, followed: _Followed) -> None:
        """Open the file anew (its rows read fresh); a failure keeps the last run with why."""
        try:
            followed.run = open_run(followed.path)
            followed.file_id = _file_id(followed.path)
            followed.problem = None
        except RunFileError as error:
            followed.problem = str(error)

    def _read_update(self, followed: _Followed, since: dict[str, int]) -> Any:
        if followed.run is None:
            self._reopen(followed)  # a file that could not be read yet (being created)
            if followed.run is None:
                return None
        run = followed.run
        asked = {g: since.get(g) for g in run.groups if run.views(g)}
        try:
            update = run.update(asked)
        except RunFileError as error:
            followed.problem = str(error)  # being replaced, or replaced by no run
            return None
        if update.run_id != run.run_id or _file_id(followed.path) != followed.file_id:
            self._reopen(followed)  # another file at the path: an overwrite, or a resume
            # The key changed: the page draws the new file's figures; its status shows now.
            return dataclasses.replace(update, events=[], rows={})
        followed.problem = None
        return update

    def _labels(self) -> dict[Path, str]:
        """The label of each run in legends and panel titles: its file's name in a folder
        (unique there), "" for a lone file (its figures need no legend of runs)."""
        if not self.folder:
            return {path: "" for path in self._followed}
        return {
            path: path.relative_to(self.target).with_suffix("").as_posix()
            for path in self._followed
        }

    def _key(self) -> str:
        """What a page's figures depend on: which runs, by path and id. A page whose figures
        were drawn under another key draws them anew (a run joined, or was overwritten)."""
        runs = [
            (str(p), f.run.run_id, f.file_id) for p, f in sorted(self._followed.items()) if f.run
        ]
        return hashlib.sha256(json.dumps(runs).encode()).hexdigest()[:16]

    def _states(self, labels: dict[Path, str], updates: dict[Path, Any]) -> list[dict[str, Any]]:
        states = []
        for path, followed in self._followed.items():
            state: dict[str, Any] = {
                "label": labels[path],
                "path": str(path),
                "name": followed.run.name if followed.run is not None else path.stem,
                "problem": followed.problem,
            }
            if path in updates:
                update, events_seen = updates[path]
                state.update(_finite(update.status.to_dict()))
                new = update.events[events_seen:]
                state["events_seen"] = len(update.events)
                state["events"] = [dataclasses.asdict(e) for e in new[-EVENTS_PER_UPDATE:]]
                state["events_left_out"] = max(0, len(new) - EVENTS_PER_UPDATE)
            states.append(state)
        return states


def _file_id(path: Path) -> tuple[int, int] | None:
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_dev, status.st_ino


def _signature(path: Path) -> tuple[int, ...] | None:
    """What tells a file changed: its device, inode, size and modification time."""
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns


def _asked(seen: Any) -> tuple[dict[str, int], int]:
    """``(groups' last steps, events seen)`` of what a page says it has; anything malformed
    (a page of another version) counts as having nothing."""
    if not isinstance(seen, dict):
        return {}, 0
    groups = seen.get("groups")
    groups = {
        g: step
        for g, step in (groups.items() if isinstance(groups, dict) else ())
        if isinstance(step, int) and not isinstance(step, bool)
    }
    events = seen.get("events")
    return groups, events if isinstance(events, int) and events >= 0 else 0


def _rows_json(values: np.ndarray) -> list[list[float | None]]:
    flat = np.asarray(values, dtype=float).reshape(len(values), -1)
    return [[v if math.isfinite(v) else None for v in row] for row in flat.tolist()]


def _finite(values: dict[str, Any]) -> dict[str, Any]:
    return {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in values.items()
    }
