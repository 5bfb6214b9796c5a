r"""Recording overhead: a training run with and without the recorder, side by side.

Two workloads: the default teacher–student config's unshifted student, and a small character
transformer (``dynamics.experiments.char_gpt``: 2 blocks, width 64, SDPA attention, 120k
parameters, batch 32 × 64 bytes). Each is trained with the recorder (training loss,
hidden-state norms and activation bias, displacement every step, snapshots within the budget)
and without it in alternating pairs, in one process; prints, per variant, the wall-time ratio
recorded/bare of each pair as "median (min–max) over N pairs", and the recorder's peak extra
memory as a multiple of the model's parameter bytes (what it holds at batch ends, between steps:
temporaries inside a probe's hook are not seen). ``--unit-health`` also times
HiddenStateNorms(unit_health=True) every step; ``--hessian`` the curvature probe (top-5 every 50
steps); ``--each-probe`` the recorder without probes and each of the three probes alone. Each
variant's line also gives the CPU time it adds per step, in µs, the figure a probe's fixed cost
is judged by.
Wall times on a shared machine are noisy: quote the median of many pairs with the machine's
load (``uptime``) beside it; the process's CPU-time ratio, printed beside, is far less
sensitive to other processes.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_recording.py [--steps 2000 --reps 7]
        [--workload teacher-student|char-gpt|both] [--unit-health] [--hessian] [--each-probe]

The recording figures of docs/benchmarks.md come from exactly

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_recording.py \
        --workload teacher-student --reps 7
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_recording.py \
        --workload char-gpt --steps 500 --reps 7

with ``uptime`` run before and after each for the load average quoted beside them.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch

from dynamics.callbacks import (
    DynamicsRecorder,
    HiddenStateNorms,
    ParameterDisplacement,
    TrainingLoss,
)
from dynamics.experiments.char_gpt.data import StdlibTextData
from dynamics.experiments.char_gpt.module import CharGPTModule
from dynamics.experiments.config_files import load_config
from dynamics.experiments.runner import quiet_lightning
from dynamics.experiments.teacher_student.data import TeacherStudentData
from dynamics.experiments.teacher_student.module import TeacherStudentModule

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "teacher_student.yaml"
#: Steps of the untimed fit that meters the recorder's memory.
METERED_STEPS = 300


class HeldBytes(pl.Callback):
    """Peak bytes of tensors and arrays the recorder holds beyond the model's own parameters,
    read at each batch end."""

    def __init__(self, recorder: DynamicsRecorder) -> None:
        self.recorder, self.peak = recorder, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        own = {p.data_ptr() for p in pl_module.parameters()}
        self.peak = max(self.peak, _held(self.recorder, own, set()))


def _held(obj, own: set[int], seen: set) -> int:
    if id(obj) in seen or isinstance(obj, (pl.Trainer, torch.nn.Module)):
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        # Views of one buffer (a flat vector's per-tensor views) hold its bytes once.
        storage = ("storage", obj.untyped_storage().data_ptr())
        if obj.data_ptr() in own or storage in seen:
            return 0
        seen.add(storage)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(_held(v, own, seen) for v in obj.values())
    if isinstance(obj, (list, tuple, set)):
        return sum(_held(v, own, seen) for v in obj)
    if hasattr(obj, "__dict__"):
        return sum(_held(v, own, seen) for v in vars(obj).values())
    return 0


def workloads(config) -> dict[str, tuple]:
    """``{name: (module factory, data factory)}`` of the workloads this benchmark times."""
    return {
        "teacher-student": (
            lambda: TeacherStudentModule(
                **vars(config.model), seed=config.seed, lr=config.optimizer.lr
            ),
            lambda: TeacherStudentData(**vars(config.model), batch_size=config.data.batch_size),
        ),
        "char-gpt": (CharGPTModule, StdlibTextData),
    }


def train(
    workload: tuple, steps: int, probes, folder: Path, meter_memory: bool = False
) -> tuple[tuple[float, float], int, int]:
    """Wall and CPU time of one fit, and (when metered, an untimed run) the recorder's peak
    bytes."""
    make_module, make_data = workload
    module, data = make_module(), make_data()
    callbacks: list[pl.Callback] = []
    meter = None
    if probes is not None:
        recorder = DynamicsRecorder(folder / f"run{time.monotonic_ns()}.h5", probes)
        callbacks = [recorder]
        if meter_memory:  # walking the recorder's objects every step costs time: never timed
            meter = HeldBytes(recorder)
            callbacks.append(meter)
    trainer = pl.Trainer(
        max_steps=steps,
        limit_val_batches=0,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    start, cpu = time.perf_counter(), time.process_time()
    trainer.fit(module, data)
    elapsed = time.perf_counter() - start, time.process_time() - cpu
    param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    return elapsed, (meter.peak if meter else 0), param_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="default: the config's steps")
    parser.add_argument("--reps", type=int, default=7, help="alternating pairs per variant")
    parser.add_argument("--unit-health", action="store_true", help="also time unit health")
    parser.add_argument(
        "--every-10", action="store_true", help="also time the probes every 10 steps"
    )
    parser.add_argument("--hessian", action="store_true", help="also time HessianSpectrum")
    parser.add_argument(
        "--each-probe", action="store_true", help="also time the recorder alone and each probe"
    )
    parser.add_argument(
        "--workload", choices=("teacher-student", "char-gpt", "both"), default="both"
    )
    args = parser.parse_args()
    _, config = load_config(CONFIG, steps=args.steps)
    torch.set_num_threads(config.threads)
    quiet_lightning()
    chosen = workloads(config)
    if args.workload != "both":
        chosen = {args.workload: chosen[args.workload]}
    for name, workload in chosen.items():
        print(f"== {name}", flush=True)
        measure(workload, config.steps, args.reps, args)


def measure(workload: tuple, steps: int, reps: int, options: argparse.Namespace) -> None:
    """Alternate bare and recorded fits of one workload; print ratios and memory."""

    variants = {
        "recorder (loss, hidden norms, displacement every step)": lambda: [
            TrainingLoss(),
            HiddenStateNorms(),
            ParameterDisplacement(snapshot_budget_mb=32),
        ],
    }
    if options.unit_health:
        variants["recorder with unit health (dead, saturated, non-finite) every step"] = lambda: [
            TrainingLoss(),
            HiddenStateNorms(unit_health=True),
            ParameterDisplacement(snapshot_budget_mb=32),
        ]
    if options.every_10:
        variants["recorder, the same probes every 10 steps"] = lambda: [
            TrainingLoss(10),
            HiddenStateNorms(every_n_steps=10),
            ParameterDisplacement(10, snapshot_budget_mb=32),
        ]
    if options.each_probe:  # where the recorder's overhead goes
        variants["recorder with no probe"] = list
        variants["TrainingLoss alone"] = lambda: [TrainingLoss()]
        variants["HiddenStateNorms alone"] = lambda: [HiddenStateNorms()]
        variants["ParameterDisplacement alone"] = lambda: [
            ParameterDisplacement(snapshot_budget_mb=32)
        ]
    if options.hessian:
        from dynamics.callbacks import HessianSpectrum

        variants["HessianSpectrum alone (top-5 every 50 steps)"] = lambda: [
            HessianSpectrum(k=5, every_n_steps=50)
        ]
    times: dict[str, list[float]] = {"bare": [], **{name: [] for name in variants}}
    ratios: dict[str, list[float]] = {name: [] for name in variants}
    cpu_ratios: dict[str, list[float]] = {name: [] for name in variants}
    # What the recording adds to each step, in µs of CPU time: the fixed cost a probe has to
    # fit under (a 1.05x budget on a 2.6 ms step is 130 µs for all of them).
    cpu_added_us: dict[str, list[float]] = {name: [] for name in variants}
    peaks: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as folder:
        train(workload, steps, None, Path(folder))  # warm-up: imports, allocator, first-call costs
        for name, probes in variants.items():
            # Walking the recorder's objects each step is slow: metered on a shorter fit, which
            # passes through the same states (blocks filling, snapshots pending).
            _, peaks[name], param_bytes = train(
                workload, min(steps, METERED_STEPS), probes(), Path(folder), meter_memory=True
            )
        for rep in range(reps):
            bare, _, _ = train(workload, steps, None, Path(folder))
            times["bare"].append(bare[0])
            for name, probes in variants.items():
                elapsed, _, _ = train(workload, steps, probes(), Path(folder))
                times[name].append(elapsed[0])
                ratios[name].append(elapsed[0] / bare[0])
                cpu_ratios[name].append(elapsed[1] / bare[1])
                cpu_added_us[name].append((elapsed[1] - bare[1]) / steps * 1e6)
            print(
                f"rep {rep + 1}/{reps}: bare {bare[0]:.1f} s, "
                + ", ".join(f"{times[n][-1]:.1f} s" for n in variants),
                flush=True,
            )
    print(
        f"{steps} steps, {param_bytes // 4} parameters ({param_bytes / 2**20:.2f} MiB), {reps} reps"
    )
    bare_us = statistics.median(times["bare"]) / steps * 1e6
    print(f"bare step: {bare_us:.0f} µs wall (median)")
    for name in variants:
        print(
            f"{name}: wall-time ratio median {statistics.median(ratios[name]):.3f}x "
            f"({min(ratios[name]):.3f}–{max(ratios[name]):.3f}) over {reps} pairs; "
            f"CPU-time ratio median {statistics.median(cpu_ratios[name]):.3f}x "
            f"({min(cpu_ratios[name]):.3f}–{max(cpu_ratios[name]):.3f}); "
            f"CPU time added per step median {statistics.median(cpu_added_us[name]):.0f} µs "
            f"({min(cpu_added_us[name]):.0f}–{max(cpu_added_us[name]):.0f}); "
            f"peak extra memory {peaks[name] / param_bytes:.2f}x parameter bytes"
        )


if __name__ == "__main__":
    main()
