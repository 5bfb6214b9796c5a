r"""GPU check: every probe on CUDA under fp32 and bf16-mixed, host syncs per step, overhead ratios.

One script, under 10 minutes on one GPU. On the character transformer
(``dynamics.experiments.char_gpt``; by default width 384, 6 blocks, 6 heads, 10.8M parameters,
batch 64 × 256 bytes) it

1. runs every probe of ``dynamics.callbacks``, in three probe sets (per-step probes; the
   activation probes ``ActivationBias`` and ``UnitHealth``, which write groups
   ``HiddenStateNorms`` also writes; periodic probes with every Hessian measurement), under each
   precision, and lists what each fit recorded and every event a probe reported;
2. counts, in those fits, the host synchronisations CUDA's sync-debug mode
   (``torch.cuda.set_sync_debug_mode("warn")``) reports from the second training step to the
   end of the fit (the first sets the probes up), split into those inside the run file's writer
   (flushes and block writes, ``dynamics/store/writer.py``) and those outside it, each outside
   one attributed to the probe on the stack (or the module hook's file, or the training loop);
   a probe that syncs on every step is printed as a FINDING, a periodic probe that syncs at
   each of its records (an eigensolver's convergence tests) as a note;
3. times fits with the recorder against bare fits in alternating pairs in one process (loss,
   hidden norms, displacement, trajectory geometry and plane coordinates every step and every
   10 steps, and ``HessianSpectrum`` top-5 every 50 steps, at most 100 products a record) and
   prints wall-time ratios recorded/bare as "median (min–max) over N pairs", with
   ``torch.cuda.synchronize`` around whole fits only, and the peak CUDA memory of the first
   pair as a ratio to the bare fit's.

Rounds of pairs stop early when the next would pass ``--budget-s``. The last lines are a
Markdown table with the GPU, torch and the exact command. Without ``--device`` the script
measures on CUDA when there is one and otherwise says so and exits 0 (``make bench`` runs every
script); ``--device cuda`` without CUDA exits 2. ``--device cpu --quick`` checks the script in
under a minute on a CPU, where the sync-debug mode does not exist and is skipped. The fits are
``bench_recording.py``'s, on a GPU and under a precision.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/gpu_check.py --device cuda [--pairs 5]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/gpu_check.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import pytorch_lightning as pl
import torch

import dynamics
from dynamics.callbacks import (
    ActivationBias,
    BiasAudit,
    BiasComponent,
    DynamicsRecorder,
    EigenspaceOverlap,
    EigenvectorSnapshots,
    GradientPlane,
    GradientShare,
    HessianDensity,
    HessianMeasurement,
    HessianSpectrum,
    HessianTrace,
    HiddenStateNorms,
    LoggedMetrics,
    LossChangeSplit,
    ParameterDisplacement,
    Probe,
    TrainingLoss,
    TrajectoryGeometry,
    UnitHealth,
)
from dynamics.experiments.char_gpt.data import StdlibTextData
from dynamics.experiments.char_gpt.module import CharGPTModule
from dynamics.experiments.runner import quiet_lightning
from dynamics.geometry.plane import random_filter_normalized_plane
from dynamics.params.layout import ParameterLayout
from dynamics.params.vectors import parameter_vector
from dynamics.store import open_run
from dynamics.store import writer as run_writer

PRECISIONS = ("32-true", "bf16-mixed")
#: What CUDA's sync-debug mode warns with.
SYNC_MESSAGE = "called a synchronizing CUDA operation"
#: Files whose frames say where a sync came from: the project's, not this script's.
PROJECT = Path(dynamics.__file__).resolve().parents[1]
CALLBACKS = Path(sys.modules[Probe.__module__].__file__).resolve().parent
WRITER_FILE = str(Path(run_writer.__file__).resolve())
THIS_FILE = str(Path(__file__).resolve())


@dataclass(frozen=True)
class Size:
    """The model, batch and fit lengths of one run of the check."""

    width: int
    depth: int
    heads: int
    context: int
    batch: int
    sync_steps: int  # measured steps of each sync fit (after its first step)
    period: int  # recording period of the periodic probes in the sync fits
    timed_steps: int
    heldout_windows: int


FULL = Size(384, 6, 6, 256, 64, sync_steps=20, period=10, timed_steps=200, heldout_windows=64)
QUICK = Size(32, 2, 2, 32, 8, sync_steps=6, period=3, timed_steps=30, heldout_windows=8)


@dataclass(frozen=True)
class Sync:
    """One synchronisation the sync-debug mode reported."""

    step: int
    phase: str  # "step" or "validation"
    cause: str  # a probe's class, "hook in <file>", "recorder" or "training loop"
    in_writer: bool
    where: str  # the innermost project line on the stack, else the line that called the op


class SyncCounter(pl.Callback):
    """Counts the syncs the sync-debug mode reports, from the fit's second training step to
    its end, by step and by cause; listed before the recorder, so that its hooks open each
    step before the recorder's and close the count before the recorder's ``on_train_end``."""

    def __init__(self, probes: list[Probe], enabled: bool) -> None:
        self.probes, self.enabled = probes, enabled
        self.step: int | None = None  # the step being measured; None outside them
        self.phase = "step"
        self.measured = 0
        self.due: Counter[str] = Counter()
        self.syncs: list[Sync] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step < 1:
            return
        if self.step is None and self.enabled:
            torch.cuda.set_sync_debug_mode("warn")
        self.step = trainer.global_step
        self.measured += 1
        self.due.update(type(p).__name__ for p in self.probes if p.is_due(self.step))

    def on_validation_start(self, trainer, pl_module) -> None:
        self.phase = "validation"

    def on_validation_end(self, trainer, pl_module) -> None:
        self.phase = "step"

    def on_train_end(self, trainer, pl_module) -> None:
        self.stop()

    def stop(self) -> None:
        if self.enabled:
            torch.cuda.set_sync_debug_mode(0)
        self.step = None

    def add(self, frame: FrameType | None) -> None:
        if self.step is not None:
            self.syncs.append(Sync(self.step, self.phase, *cause_of_sync(frame)))


def cause_of_sync(frame: FrameType | None) -> tuple[str, bool, str]:
    """(cause, inside the run file's writer, where) of a sync whose warning ``frame`` shows.

    The cause is the innermost probe on the stack (with the innermost Hessian measurement, if
    any); else the recorder; else, for a frame of ``dynamics.callbacks`` that neither called,
    the module hook in that file; else the training loop.
    """
    probe = measurement = hook = caller = project = ""
    in_writer = recorder = False
    while frame is not None:
        file = frame.f_code.co_filename
        if file != warnings.__file__ and file != THIS_FILE:
            here = f"{_short(file)}:{frame.f_lineno}"
            caller = caller or here
            project = project or (here if file.startswith(str(PROJECT)) else "")
            in_writer = in_writer or file == WRITER_FILE
            owner = frame.f_locals.get("self")  # read only: a snapshot of the frame's locals
            if isinstance(owner, Probe):
                probe = probe or type(owner).__name__
            elif isinstance(owner, HessianMeasurement):
                measurement = measurement or type(owner).__name__
            if file.startswith(str(CALLBACKS)):
                recorder = recorder or file.endswith("recorder.py")
                hook = hook or f"hook in {_short(file)}"
        frame = frame.f_back
    if probe:
        cause = f"{probe} ({measurement})" if measurement else probe
    else:
        cause = "recorder" if recorder else hook or "training loop"
    return cause, in_writer, project or caller


def _short(file: str) -> str:
    path = Path(file)
    if path.is_relative_to(PROJECT):
        return str(path.relative_to(PROJECT))
    parts = path.parts
    return (
        str(Path(*parts[parts.index("site-packages") + 1 :])) if "site-packages" in parts else file
    )


@contextlib.contextmanager
def counted_syncs(counter: SyncCounter) -> Iterator[None]:
    """Route the sync-debug mode's warnings to ``counter``, each one (not once per line);
    other warnings show as before."""
    with warnings.catch_warnings():
        warnings.filterwarnings("always", message=f".*{SYNC_MESSAGE}")
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None) -> None:
            if SYNC_MESSAGE in str(message):
                counter.add(sys._getframe(1))
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        try:
            yield
        finally:
            counter.stop()


def sync_count_works() -> bool:
    """Whether a deliberate ``.item()`` on the device is counted: if not, no count means a thing."""
    counter = SyncCounter([], enabled=True)
    torch.cuda.set_sync_debug_mode("warn")
    counter.step = 0
    with counted_syncs(counter):
        torch.ones(1, device="cuda").item()
    return len(counter.syncs) == 1


ProbeSet = Callable[[CharGPTModule], list[Probe]]


def sync_sets(size: Size) -> dict[str, ProbeSet]:
    """The probe sets whose syncs are counted: together, every probe of ``dynamics.callbacks``."""
    period = size.period
    return {
        "per-step probes": lambda module: [
            TrainingLoss(),
            HiddenStateNorms(unit_health=True),
            ParameterDisplacement(snapshot_budget_mb=256),
            TrajectoryGeometry(),
            GradientPlane(basis=_plane(module)),
            LoggedMetrics(),
        ],
        "activation probes": lambda module: [ActivationBias(), UnitHealth()],
        f"periodic probes (every {period} steps)": lambda module: [
            BiasAudit(draws=2),
            BiasComponent(["model.blocks.*.act"], every_n_steps=period, examples=2),
            LossChangeSplit(every_n_steps=period),
            HessianSpectrum(
                k=5,
                every_n_steps=period,
                max_hvp=60,  # the syncs are the same at any count: the check's time is not
                measurements=[
                    HessianTrace(hvp=20),
                    GradientShare(),
                    HessianDensity(runs=1, steps=20),
                    EigenspaceOverlap(),
                    EigenvectorSnapshots(budget_mb=512),  # two records of 10.8M parameters
                ],
            ),
        ],
    }


def timed_variants() -> dict[str, ProbeSet]:
    """The recorded fits timed against bare ones."""

    def recorder(every: int) -> ProbeSet:
        return lambda module: [
            TrainingLoss(every_n_steps=every),
            HiddenStateNorms(every_n_steps=every),
            ParameterDisplacement(every, snapshot_budget_mb=256),
            TrajectoryGeometry(every),
            GradientPlane(basis=_plane(module), every_n_steps=every),
        ]

    return {
        "loss, hidden norms, displacement, geometry, plane every step": recorder(1),
        "the same every 10 steps": recorder(10),
        # At most 100 products a record, so that a slow Lanczos cannot take the whole budget.
        "HessianSpectrum alone, top-5 every 50 steps, ≤100 products": lambda module: [
            HessianSpectrum(k=5, every_n_steps=50, max_hvp=100)
        ],
    }


def _plane(module: CharGPTModule):
    layout = ParameterLayout.of(module)
    return random_filter_normalized_plane(parameter_vector(module, layout).numpy(), layout, seed=0)


@dataclass
class Fit:
    """What one fit measured."""

    seconds: float
    peak_bytes: int
    counter: SyncCounter | None = None
    recorded: dict[str, int] = field(default_factory=dict)  # {group: rows}
    events: list[str] = field(default_factory=list)


def fit(
    size: Size,
    device: str,
    precision: str,
    steps: int,
    probes: ProbeSet | None,
    folder: Path,
    count_syncs: bool = False,
    validate: bool = False,
) -> Fit:
    """One fit of the character transformer, bare (``probes`` None) or recorded; timed with
    ``torch.cuda.synchronize`` around the whole fit only."""
    module = CharGPTModule(size.context, size.width, size.depth, size.heads)
    data = StdlibTextData(size.context, size.batch, heldout_windows=size.heldout_windows)
    made = probes(module) if probes is not None else []
    path = folder / f"run{time.monotonic_ns()}.h5"
    counter = SyncCounter(made, enabled=device == "cuda") if count_syncs else None
    callbacks: list[pl.Callback] = [counter] if counter else []
    if probes is not None:
        callbacks.append(DynamicsRecorder(path, made))
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        precision=precision,
        limit_val_batches=1 if validate else 0,
        # An endless training stream has no epochs: validation once, after the last step.
        val_check_interval=steps if validate else None,
        check_val_every_n_epoch=None if validate else 1,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with counted_syncs(counter) if counter else contextlib.nullcontext():
        start = time.perf_counter()
        trainer.fit(module, data)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    result = Fit(seconds, torch.cuda.max_memory_allocated() if cuda else 0, counter)
    if probes is not None:
        run = open_run(path)
        result.recorded = {group: len(run.series(group)) for group in run.groups}
        result.events = [f"{e.probe} {e.kind} at step {e.step}: {e.message}" for e in run.events()]
    return result


def check_syncs(
    size: Size, device: str, folder: Path, findings: list[str]
) -> tuple[list[list[str]], list[list[str]]]:
    """Every probe set (and a bare fit) under each precision: rows of the sync table and of
    the recorded-groups table; findings and notes appended to ``findings``."""
    sync_rows, probe_rows = [], []
    sets: dict[str, ProbeSet | None] = {"bare": None, **sync_sets(size)}
    for precision in PRECISIONS:
        for name, probes in sets.items():
            start = time.perf_counter()
            done = fit(
                size,
                device,
                precision,
                size.sync_steps + 1,
                probes,
                folder,
                count_syncs=True,
                validate=probes is not None,
            )
            print(f"sync fit {precision}, {name}: {time.perf_counter() - start:.1f} s", flush=True)
            sync_rows += sync_table_rows(precision, name, done.counter, findings)
            if probes is not None:
                groups = ", ".join(f"{g} {n}" for g, n in sorted(done.recorded.items()))
                probe_rows.append([precision, name, groups, "; ".join(done.events) or "none"])
                findings += [
                    f"FINDING: {precision}, {name}: {event}"
                    for event in done.events
                    if " disabled " in event or " error " in event
                ]
    return sync_rows, probe_rows


def sync_table_rows(
    precision: str, name: str, counter: SyncCounter, findings: list[str]
) -> list[list[str]]:
    """Per cause: syncs per measured step outside the writer, steps with one, in the writer."""
    steps = counter.measured
    if not counter.enabled:
        return []
    if not counter.syncs:
        return [[precision, name, "(none)", "0", f"0/{steps}", "", "0", ""]]
    rows = []
    causes = sorted({(s.phase, s.cause) for s in counter.syncs})
    for phase, cause in causes:
        mine = [s for s in counter.syncs if (s.phase, s.cause) == (phase, cause)]
        outside = [s for s in mine if not s.in_writer]
        synced = len({s.step for s in outside})
        probe = cause.split(" (")[0]
        due = counter.due.get(probe, steps)
        shown = Counter(s.where for s in outside or mine).most_common(2)
        where = ", ".join(f"{w} ×{n}" for w, n in shown)
        if phase == "step":
            cells = [cause, f"{len(outside) / steps:.2f}", f"{synced}/{steps}", f"{due}"]
        else:  # a validation loop is no training step: its syncs in all
            cells = [f"{cause} (validation)", f"{len(outside)} in all", "", ""]
        rows.append([precision, name, *cells, f"{len(mine) - len(outside)}", where])
        if phase == "step" and cause != "training loop" and outside and synced >= due:
            # Every step: the finding this check looks for. Every due step of a periodic probe
            # (an eigensolver's convergence test) is shown too, as a note.
            kind, every = (
                ("FINDING", "every step") if due == steps else ("note", f"each of its {due} steps")
            )
            findings.append(
                f"{kind}: {precision}, {name}: {cause} syncs the host on {every} outside "
                f"flushes ({len(outside) / synced:.1f} per step with a sync; {where})"
            )
    return rows


def time_overhead(
    size: Size, device: str, folder: Path, pairs: int, deadline: float
) -> tuple[list[list[str]], int]:
    """Bare and recorded fits alternating, both precisions in each round: rows of ratios."""
    variants = timed_variants()
    bare: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    ratios = {(p, v): [] for p in PRECISIONS for v in variants}
    memory: dict[tuple[str, str], float] = {}
    for precision in PRECISIONS:  # warm-up: kernels, allocator, first-call costs
        fit(size, device, precision, min(20, size.timed_steps), None, folder)
    for rep in range(pairs):
        start = time.perf_counter()
        for precision in PRECISIONS:
            base = fit(size, device, precision, size.timed_steps, None, folder)
            bare[precision].append(base.seconds)
            for name, probes in variants.items():
                done = fit(size, device, precision, size.timed_steps, probes, folder)
                ratios[precision, name].append(done.seconds / base.seconds)
                if rep == 0 and base.peak_bytes:
                    memory[precision, name] = done.peak_bytes / base.peak_bytes
        took = time.perf_counter() - start
        print(f"round {rep + 1}/{pairs}: {took:.1f} s", flush=True)
        if rep + 1 < pairs and time.perf_counter() + took > deadline:
            print(f"stopping after {rep + 1} rounds: the next would pass --budget-s", flush=True)
            break
    rows = [
        ["bare step (ms)"]
        + [f"{1000 * statistics.median(bare[p]) / size.timed_steps:.1f}" for p in PRECISIONS]
    ]
    for name in variants:
        cells = []
        for precision in PRECISIONS:
            values = ratios[precision, name]
            cell = f"{statistics.median(values):.3f}× ({min(values):.3f}–{max(values):.3f})"
            if (precision, name) in memory:
                cell += f", memory {memory[precision, name]:.2f}×"
            cells.append(cell)
        rows.append([name] + cells)
    return rows, len(bare[PRECISIONS[0]])


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="auto: CUDA when there is one, else say so and exit 0",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny model and short fits")
    parser.add_argument("--pairs", type=int, default=5, help="rounds of alternating pairs")
    parser.add_argument(
        "--budget-s", type=float, default=480, help="stop the rounds before this many seconds"
    )
    args = parser.parse_args()
    began = time.perf_counter()
    if args.device != "cpu" and not torch.cuda.is_available():
        print(
            f"gpu_check: no CUDA device (torch {torch.__version__}, "
            f"torch.cuda.is_available() is False); --device cpu --quick checks the script",
            file=sys.stderr,
        )
        sys.exit(2 if args.device == "cuda" else 0)
    device = "cpu" if args.device == "cpu" else "cuda"
    size = QUICK if args.quick else FULL
    quiet_lightning()
    findings: list[str] = []
    if device == "cuda" and not sync_count_works():
        findings.append("FINDING: a deliberate .item() was not counted: the sync counts are void")
    with tempfile.TemporaryDirectory() as folder:
        sync_rows, probe_rows = check_syncs(size, device, Path(folder), findings)
        ratio_rows, pairs = time_overhead(
            size, device, Path(folder), args.pairs, began + args.budget_s
        )
    parameters = sum(
        p.numel()
        for p in CharGPTModule(size.context, size.width, size.depth, size.heads).parameters()
    )
    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    command = " ".join(["python", *map(shlex.quote, sys.argv)])
    print()
    print(f"## GPU check: {name}")
    print(
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), Lightning {pl.__version__}, "
        f"float32 matmul precision {torch.get_float32_matmul_precision()!r}; command: `{command}`; "
        f"{time.perf_counter() - began:.0f} s in all"
    )
    print(
        f"CharGPT width {size.width}, {size.depth} blocks, {size.heads} heads, "
        f"{parameters / 1e6:.2f}M parameters; batch {size.batch} × {size.context} bytes"
    )
    print()
    if device == "cuda":
        print(f"Host syncs per step, steps 1–{size.sync_steps} of each sync fit:")
        header = ["precision", "probe set", "cause", "syncs/step outside flushes"]
        header += ["steps with one", "due steps", "in writer", "where"]
        print(table(header, sync_rows))
    else:
        print("Host syncs: not counted, the sync-debug mode is CUDA-only")
    print()
    print("What each sync fit recorded (group rows) and the events its probes reported:")
    print(table(["precision", "probe set", "groups", "events"], probe_rows))
    print()
    print(
        f"Wall-time ratio recorded/bare, {size.timed_steps} steps, median (min–max) over "
        f"{pairs} pairs"
        + (
            "; peak CUDA memory of the first pair against the bare fit's:"
            if device == "cuda"
            else ":"
        )
    )
    print(table(["variant", *PRECISIONS], ratio_rows))
    print()
    counted = "no probe syncs on every step" if device == "cuda" else "syncs not counted"
    print("\n".join(findings) or f"no findings: no probe was disabled; {counted}")


if __name__ == "__main__":
    main()
