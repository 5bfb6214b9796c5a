r"""Watching overhead: a recorded training run with and without ``dynamics watch`` polled.

The workload is the default teacher–student config's unshifted student under Lightning with the
recorder's usual probes (training loss, hidden-state norms and activation bias, displacement,
every step), flushing its file every ``--flush-s`` seconds (0.5 by default, not the 5 s of
``dynamics run``, so that each poll finds new rows). Fits alternate, in one process, among: no
watcher; a real ``dynamics watch RUN.h5 --port 0`` subprocess polled every second by a client
that does what the page does (GET /api/figures, then POST /api/update with the ``since`` it
keeps current from the rows it receives, again after each reply plus the period); and the same
polled every 0.1 s (a stress row, ten times the page's rate). The client is a subprocess too,
as a browser would be. The run file appears at the first batch, so each fit is timed from the
end of its first step, once the watcher is up and its client has drawn the figures, to the
fit's end (the last flush and the file's close included).

Printed: per variant the median (min–max) over the repeats of the wall-time and training
process CPU-time ratios, watched / unwatched fit of the same repeat; the median training time;
the client's latency per update (median and max ms), its polls, rows received and the last
step it saw; the watcher's CPU time per poll; and whether every fit's final parameters and
every recorded series equal those of the first unwatched fit (the watcher must not change
training). Torch runs one thread; by default the training process is pinned to one core and
the watcher and its client to the other; ``--same-core`` pins all three to one core, which is
what a one-core machine (or a busy one) sees. Wall times on a shared machine are noisy: quote
the medians with ``uptime`` beside them; the CPU-time ratio is less sensitive to other
processes.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_watch_overhead.py [--repeats 5]
        [--steps 1000] [--flush-s 0.5] [--same-core]

The figures of docs/benchmarks.md come from exactly that command with its defaults, and again
with ``--same-core``, with ``uptime`` run before and after each.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch

from dynamics.callbacks import (
    DynamicsRecorder,
    HiddenStateNorms,
    ParameterDisplacement,
    TrainingLoss,
)
from dynamics.experiments.config_files import load_config
from dynamics.experiments.runner import quiet_lightning
from dynamics.experiments.teacher_student.data import TeacherStudentData
from dynamics.experiments.teacher_student.module import TeacherStudentModule
from dynamics.store import SeriesSpec, names, open_run
from dynamics.store.writer import RunWriter

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "teacher_student.yaml"
#: The watched variants: poll period in seconds (None: no watcher).
VARIANTS = {"no watcher": None, "watcher polled every 1 s": 1.0, "polled every 0.1 s": 0.1}
#: Seconds a watcher or its client may take to come up.
START_TIMEOUT_S = 60


# --- the client: what the page's script (analysis/live/watch.js) does, in Python ---


def poll(url: str, every_s: float, stop: threading.Event) -> dict[str, Any]:
    """Poll a watcher as its page does until ``stop`` is set; what the polls cost and brought.

    Example::

        stats = poll("http://127.0.0.1:8765/", 1.0, threading.Event())
    """
    key, since, events, redraw = None, {}, {}, True
    latencies, figures, rows, last_step = [], 0, 0, None
    while not stop.is_set():
        if redraw:  # drawFigures(): every figure, and `since` from what they drew
            redraw = False
            drawn = _fetch(url + "api/figures")
            figures += 1
            key, since = drawn["key"], drawn["since"]
            for label in since:
                since[label]["events"] = events.get(label, 0)
            if figures == 1:
                print("ready", flush=True)  # the fit's clock starts now
        start = time.perf_counter()
        update = _fetch(url + f"api/update?key={key}", since)
        latencies.append(1000 * (time.perf_counter() - start))
        redraw = update["key"] != key
        for label, groups in update["rows"].items():
            for group, new in groups.items():
                rows += len(new["step"])
                last_step = max(last_step or 0, new["step"][-1])
                if redraw:
                    continue  # drawn anew with these rows in them
                if group not in since.get(label, {}).get("groups", {}):
                    redraw = True  # the group's first rows: its figure is drawn anew
                    continue
                since[label]["groups"][group] = new["step"][-1]
        for run in update["runs"]:  # showEvents()
            if "events_seen" in run:
                events[run["label"]] = run["events_seen"]
                if run["label"] in since:
                    since[run["label"]]["events"] = run["events_seen"]
        stop.wait(every_s)  # the page's setTimeout after each poll
    return {"latency_ms": latencies, "figures": figures, "rows": rows, "last_step": last_step}


def _fetch(url: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=30) as reply:
        answer = json.loads(reply.read())
    if "error" in answer:
        raise RuntimeError(answer["error"])
    return answer


def client_main() -> None:
    """The client process: for each ``{"url", "every_s"}`` line on stdin, polls that watcher
    until the next line, then prints what the polls cost and brought as one JSON line."""
    for line in sys.stdin:
        asked, stop = json.loads(line), threading.Event()
        stats: dict[str, Any] = {}
        polling = threading.Thread(target=_polls, args=(asked, stop, stats), daemon=True)
        polling.start()
        sys.stdin.readline()  # the fit ended
        stop.set()
        polling.join()
        print(json.dumps(stats), flush=True)


def _polls(asked: dict[str, Any], stop: threading.Event, stats: dict[str, Any]) -> None:
    try:
        stats.update(poll(asked["url"], asked["every_s"], stop))
    except Exception as error:  # the benchmark stops with it: no figure without the polls
        print(f"failed: {error!r}", flush=True)


# --- the watcher and its client, beside a fit ---


class Client:
    """The client subprocess, started once (it imports what this script imports, seconds a
    start) and told which watcher to poll for each fit."""

    def __init__(self, cpus: set[int]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--client"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        os.sched_setaffinity(self.process.pid, cpus)

    def start(self, url: str, every_s: float) -> None:
        """Poll the watcher at ``url`` from now on; returns once the figures are drawn."""
        self.process.stdin.write(json.dumps({"url": url, "every_s": every_s}) + "\n")
        self.process.stdin.flush()
        _line(self.process, "ready")

    def stop(self) -> dict[str, Any]:
        """Stop polling: the polls' latencies (ms), figures fetched, rows, last step seen."""
        self.process.stdin.write("stop\n")
        self.process.stdin.flush()
        return json.loads(_line(self.process, "{"))

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=START_TIMEOUT_S)


@dataclass
class Watching:
    """A ``dynamics watch`` subprocess on a run file, polled by the client."""

    watcher: subprocess.Popen
    client: Client
    cpu_start: float

    @classmethod
    def start(cls, run: Path, every_s: float, client: Client, cpus: set[int]) -> Watching:
        watcher = subprocess.Popen(
            [sys.executable, "-m", "dynamics.cli", "watch", str(run), "--port", "0"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            os.sched_setaffinity(watcher.pid, cpus)
            url = _line(watcher, "watching ").split(" at ", 1)[1].split()[0]
            client.start(url, every_s)
        except BaseException:
            watcher.kill()
            raise
        return cls(watcher, client, _cpu_s(watcher.pid))

    def stop(self) -> dict[str, Any]:
        """Stop the client's polls and the watcher; the client's stats with the watcher's CPU
        seconds over the polls."""
        watcher_cpu = _cpu_s(self.watcher.pid) - self.cpu_start
        stats = self.client.stop() | {"watcher_cpu_s": watcher_cpu}
        self.watcher.send_signal(signal.SIGINT)  # Ctrl-C: it closes its socket and exits
        self.watcher.communicate(timeout=START_TIMEOUT_S)
        return stats


def _line(process: subprocess.Popen, starting: str) -> str:
    """The first line of the process's output that starts with ``starting``."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if line.startswith(starting):
            return line
        if line.startswith("failed: "):
            raise RuntimeError(f"the client {line.strip()}")
        if not line and process.poll() is not None:
            break
    process.kill()
    raise RuntimeError(f"{process.args[:4]} did not say {starting!r}")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class FlushTimes:
    """Seconds each of the recorder's flushes took (where a reader holding the file would make
    the writer wait: HDF5 writes its metadata there), gathered while installed."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._flush = RunWriter.flush

    def __enter__(self) -> FlushTimes:
        flush, seconds = self._flush, self.seconds

        def timed(writer: RunWriter) -> None:
            start = time.perf_counter()
            flush(writer)
            seconds.append(time.perf_counter() - start)

        RunWriter.flush = timed
        return self

    def __exit__(self, *exc: object) -> None:
        RunWriter.flush = self._flush


class Clock(pl.Callback):
    """Times a fit from the end of its first step (the run file exists from that step's batch;
    a watcher, if any, is started then and is up before the clock starts) to the fit's end."""

    def __init__(self, run: Path, every_s: float | None, client: Client, cpus: set[int]) -> None:
        self.run, self.every_s, self.client, self.cpus = run, every_s, client, cpus
        self.watching: Watching | None = None
        self.wall = self.cpu = 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx != 0:
            return
        if self.every_s is not None:
            self.watching = Watching.start(self.run, self.every_s, self.client, self.cpus)
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def on_train_end(self, trainer, pl_module) -> None:  # after the recorder's (listed first)
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu


@dataclass
class Fit:
    """One timed fit: wall and CPU seconds, what its client saw, and digests of its outcome."""

    wall: float
    cpu: float
    stats: dict[str, Any]
    parameters: str
    series: str


@dataclass
class Setup:
    """What every fit shares: the config, its length, the recorder's flush interval, where the
    runs go, the client and the cores of the watcher and the client."""

    config: Any
    steps: int
    flush_s: float
    folder: Path
    client: Client
    watch_cpus: set[int]


def train(setup: Setup, every_s: float | None, run: Path) -> Fit:
    """One recorded fit of the teacher–student student, watched every ``every_s`` seconds
    (None: not watched)."""
    config = setup.config
    module = TeacherStudentModule(**vars(config.model), seed=config.seed, lr=config.optimizer.lr)
    data = TeacherStudentData(**vars(config.model), batch_size=config.data.batch_size)
    probes = [TrainingLoss(), HiddenStateNorms(), ParameterDisplacement(snapshot_budget_mb=32)]
    recorder = DynamicsRecorder(run, probes, flush_interval_s=setup.flush_s)
    clock = Clock(run, every_s, setup.client, setup.watch_cpus)
    trainer = pl.Trainer(
        max_steps=setup.steps,
        limit_val_batches=0,
        callbacks=[recorder, clock],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    try:
        with FlushTimes() as flushes:
            trainer.fit(module, data)
    finally:
        stats = clock.watching.stop() if clock.watching is not None else {}
    stats["flush_s"] = flushes.seconds
    parameters = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        parameters.update(name.encode() + tensor.detach().cpu().numpy().tobytes())
    return Fit(clock.wall, clock.cpu, stats, parameters.hexdigest(), _series_digest(run))


def _series_digest(path: Path) -> str:
    """Digest of every recorded row (steps and values) of every group of the run."""
    run, digest = open_run(path), hashlib.sha256()
    for group in sorted(run.groups):
        series = run.series(group)
        digest.update(group.encode() + np.asarray(series.step).tobytes())
        for name in sorted(series.values):
            digest.update(name.encode() + np.ascontiguousarray(series.values[name]).tobytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds of the three variants")
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps per fit")
    parser.add_argument("--flush-s", type=float, default=0.5, help="the recorder's flush interval")
    parser.add_argument(
        "--same-core", action="store_true", help="the watcher and client share the fit's core"
    )
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)  # its process
    args = parser.parse_args()
    if args.client:
        client_main()
        return
    _, config = load_config(CONFIG, steps=args.steps)
    torch.set_num_threads(1)
    quiet_lightning()
    cores = sorted(os.sched_getaffinity(0))
    fit_cpus = {cores[0]}
    watch_cpus = fit_cpus if args.same_core or len(cores) < 2 else {cores[1]}
    os.sched_setaffinity(0, fit_cpus)
    print(
        f"torch threads 1; the fit on core {cores[0]}, the watcher and its client on core "
        f"{min(watch_cpus)}{' (the same core)' if watch_cpus == fit_cpus else ' (the other)'}; "
        f"{args.steps} steps, the recorder flushing every {args.flush_s} s; load "
        f"{os.getloadavg()[0]:.2f}",
        flush=True,
    )
    fits: dict[str, list[Fit]] = {name: [] for name in VARIANTS}
    client = Client(watch_cpus)
    with tempfile.TemporaryDirectory() as folder:
        setup = Setup(config, args.steps, args.flush_s, Path(folder), client, watch_cpus)
        warm_up = dataclasses.replace(setup, steps=min(200, args.steps))
        train(warm_up, None, setup.folder / "warm-up.h5")  # imports, first calls: untimed
        order = list(VARIANTS)
        for repeat in range(args.repeats):
            for name in order if repeat % 2 == 0 else order[::-1]:  # no variant always first
                run = setup.folder / f"run{repeat}-{order.index(name)}.h5"
                fits[name].append(train(setup, VARIANTS[name], run))
                if repeat or name != "no watcher":
                    run.unlink()  # a watcher of a folder would see every run: one at a time
            print(
                f"repeat {repeat + 1}/{args.repeats}: "
                + ", ".join(f"{name} {fits[name][-1].wall:.2f} s" for name in VARIANTS),
                flush=True,
            )
        recorded = setup.folder / f"run0-{order.index('no watcher')}.h5"
        poll_cpu = steady_poll_cpu(recorded, setup.folder / "replayed.h5")
    client.close()
    report(fits, args)
    print(
        f"steady state, in one process: a poll of a file growing by {ROWS_PER_POLL} steps a "
        f"second (every group of the fit's run) takes {1000 * statistics.median(poll_cpu):.1f} ms "
        f"of CPU (median, max {1000 * max(poll_cpu):.1f} ms over {len(poll_cpu)} polls; the "
        "answer's JSON included), what a watcher polled every second takes of a core"
    )


#: Steps a second of the fit's run (about its speed here), replayed into a file per poll.
ROWS_PER_POLL = 180


def steady_poll_cpu(recorded: Path, replayed: Path, polls: int = 30) -> list[float]:
    """The CPU seconds of each of ``polls`` feed updates (and their JSON) of a file into which
    the rows of the ``recorded`` run's per-step groups are written again, over and over with
    increasing steps, :data:`ROWS_PER_POLL` steps between polls: a watcher's cost once its
    figures are drawn, without the start of the fit's short run."""
    from plotly.utils import PlotlyJSONEncoder

    from dynamics.analysis.live.feed import Feed

    run = open_run(recorded)
    length = len(run.series(names.LOSS))
    rows = {g: run.series(g) for g in run.groups if run.views(g) and len(run.series(g)) == length}
    specs = {
        g: {
            n: SeriesSpec(v.shape[1:], columns=series.columns.get(n), view=series.views.get(n))
            for n, v in series.values.items()
        }
        for g, series in rows.items()
    }
    writer = RunWriter.create(replayed, specs, {}, {"config": {}}, flush_interval_s=1e9)

    def write(first: int) -> None:
        for step in range(first, first + ROWS_PER_POLL):
            for group, series in rows.items():
                writer.append(group, step, {n: v[step % length] for n, v in series.values.items()})
        writer.flush()

    write(0)
    feed = Feed(replayed)
    drawn = feed.figures()
    since, cpu = drawn["since"], []
    for poll in range(1, polls + 1):
        write(poll * ROWS_PER_POLL)
        began = time.process_time()
        update = feed.update(since, drawn["key"])
        json.dumps(update, cls=PlotlyJSONEncoder)
        cpu.append(time.process_time() - began)
        for label, groups in update["rows"].items():
            for group, new in groups.items():
                since[label]["groups"][group] = new["step"][-1]
    writer.close()
    return cpu


def report(fits: dict[str, list[Fit]], args: argparse.Namespace) -> None:
    """Print the ratios, the client's and the watcher's figures, and the identity check."""
    bare = fits["no watcher"]
    print(
        f"no watcher: training {statistics.median(f.wall for f in bare):.2f} s wall "
        f"({min(f.wall for f in bare):.2f}–{max(f.wall for f in bare):.2f}), "
        f"{statistics.median(f.cpu for f in bare):.2f} s CPU, median of {args.repeats}"
    )
    for name, every_s in VARIANTS.items():
        if every_s is None:
            continue
        walls = [f.wall / b.wall for f, b in zip(fits[name], bare)]
        cpus = [f.cpu / b.cpu for f, b in zip(fits[name], bare)]
        latencies = [ms for f in fits[name] for ms in f.stats["latency_ms"]]
        polls = [len(f.stats["latency_ms"]) for f in fits[name]]
        shares = [f.stats["watcher_cpu_s"] / f.wall for f in fits[name]]
        print(
            f"{name}: wall-time ratio {_spread(walls)}, CPU-time ratio {_spread(cpus)} over "
            f"{args.repeats} pairs; training {statistics.median(f.wall for f in fits[name]):.2f} "
            f"s; per update {statistics.median(latencies):.1f} ms median, "
            f"{max(latencies):.1f} ms max over {sum(polls)} polls; per fit "
            f"{statistics.median(polls):.0f} polls, "
            f"{statistics.median(f.stats['rows'] for f in fits[name]):.0f} rows received, last "
            f"step seen {min(f.stats['last_step'] or -1 for f in fits[name])} or later, "
            f"figures fetched {max(f.stats['figures'] for f in fits[name])}x at most; the "
            f"watcher's CPU time {_spread(shares, '.1%', '')} of the fit's wall time"
        )
    for name, variant in fits.items():
        flushes = [1000 * s for f in variant for s in f.stats["flush_s"]]
        print(
            f"{name}: the recorder's flushes {statistics.median(flushes):.1f} ms median, "
            f"{max(flushes):.1f} ms max, {len(flushes) / len(variant):.0f} a fit taking "
            f"{sum(flushes) / len(variant):.0f} ms in all"
        )
    first = bare[0]
    every = [f for variant in fits.values() for f in variant]
    same = [f.parameters == first.parameters and f.series == first.series for f in every]
    print(
        f"final parameters and every recorded series identical to the first unwatched fit's: "
        f"{'yes' if all(same) else 'NO'} ({sum(same)} of {len(every)} fits)"
    )


def _spread(values: list[float], form: str = ".3f", unit: str = "x") -> str:
    """``median (min–max)`` of the values."""
    low, high = min(values), max(values)
    return f"{statistics.median(values):{form}}{unit} ({low:{form}}–{high:{form}})"


if __name__ == "__main__":
    main()
