r"""GradientStats' cost: a teacher–student fit with and without the probe, side by side.

The default teacher–student config's student (width 64, expansion 4, depth 4) is trained bare
(no recorder), with the recorder and no probe, and with the recorder and ``GradientStats``
every step, in rotating order, in one process; once with one micro-batch per step and once with
``accumulate_grad_batches=2`` (where the noise scale is measured and the probe keeps one copy of
the gradients). Prints, per variant, the wall-time and CPU-time ratio to the bare fit of the
same round as "median (min–max) over N rounds". Wall times on a shared machine are noisy: quote
the median with the machine's load (``uptime``) beside it.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_gradient_stats.py [--steps 300 --reps 9]

The figures of docs/probes/gradient_stats.md come from exactly that command.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import pytorch_lightning as pl

from dynamics.callbacks import DynamicsRecorder, GradientStats
from dynamics.experiments.config_files import load_config
from dynamics.experiments.runner import quiet_lightning
from dynamics.experiments.teacher_student.data import TeacherStudentData
from dynamics.experiments.teacher_student.module import TeacherStudentModule

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "teacher_student.yaml"
#: What each variant records: None is the bare fit.
VARIANTS = {"bare": None, "recorder alone": [], "GradientStats": "probe"}


def train(config, steps: int, accumulate: int, probes, folder: Path) -> tuple[float, float]:
    """Wall and CPU seconds of one fit."""
    module = TeacherStudentModule(**vars(config.model), seed=config.seed, lr=config.optimizer.lr)
    data = TeacherStudentData(**vars(config.model), batch_size=config.data.batch_size)
    callbacks = []
    if probes is not None:
        probes = [GradientStats()] if probes == "probe" else probes
        callbacks = [DynamicsRecorder(folder / f"run{time.monotonic_ns()}.h5", probes)]
    trainer = pl.Trainer(
        max_steps=steps,
        accumulate_grad_batches=accumulate,
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
    return time.perf_counter() - start, time.process_time() - cpu


def _summary(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--reps", type=int, default=9, help="rounds of all variants")
    args = parser.parse_args()
    _, config = load_config(CONFIG)
    quiet_lightning()
    with tempfile.TemporaryDirectory() as folder:
        for accumulate in (1, 2):
            times: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
            train(config, 20, accumulate, None, Path(folder))  # warm-up, untimed
            for rep in range(args.reps):
                names = list(VARIANTS)
                names = names[rep % len(names) :] + names[: rep % len(names)]  # rotate order
                for name in names:
                    times[name].append(
                        train(config, args.steps, accumulate, VARIANTS[name], Path(folder))
                    )
            print(f"accumulate_grad_batches={accumulate}, {args.steps} steps, {args.reps} rounds")
            for name in list(VARIANTS)[1:]:
                wall = [t[0] / b[0] for t, b in zip(times[name], times["bare"])]
                cpu = [t[1] / b[1] for t, b in zip(times[name], times["bare"])]
                print(f"  {name:15s} / bare: wall {_summary(wall)}, cpu {_summary(cpu)}")


if __name__ == "__main__":
    main()
