"""Training throughput of the default teacher–student student: bare loop vs ``Trainer.fit``.

Six ways of training the ``unshifted`` student of ``configs/teacher_student.yaml`` (width 64,
depth 4, Adam, batch 128, held-out loss every ``eval_every`` steps), each for ``--steps``
steps from the same θ0 on the same batches, in alternating rounds in one process (the order
flips every round); prints steps per CPU second of the process (``--wall``: per wall-clock
second) as the median over rounds with min and max, and each ratio as the median (min–max) of
its per-round ratios:

- ``data``: drawing the training batches alone (Gaussian inputs through the teacher);
- ``bare``: a plain PyTorch loop over the same module, data stream and optimizer, with the
  held-out loss every ``eval_every`` steps;
- ``fit before``: ``Trainer.fit`` as ``dynamics run`` configured it before the fast path
  (Lightning's default progress bar, ``RichProgressBar`` where rich is installed, as in the
  dev environment, else ``TQDMProgressBar``, redrawn every step; the module logging its
  training loss every step);
- ``fit now``: ``Trainer.fit`` as ``dynamics run`` configures it now
  (:func:`dynamics.experiments.runner.trainer_for`: a bar redrawn every 1 % of the run that
  shows the returned loss, so the module logs none);
- ``run before`` / ``run now``: the same two Trainers with the recorder and the config's
  probes (every-step norms, displacement and plane coordinates, the top-5 Hessian every 100
  steps), i.e. what ``dynamics run`` trains per variant.

Bars draw into /dev/null (the cost of computing and formatting them stays; a terminal adds
its own). The fast path changes nothing recorded: tests/test_training_speed.py compares the
run files of both paths bit for bit.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_training_loop.py \
        [--steps 500 --rounds 5 --wall]

Measured with ``--rounds 7`` (500 steps, CPU time) on this project's shared 2-core machine
under heavy load from other processes (load average 5-7), 2026-12-01; medians of the per-round
ratios, with their range:

- bare loop / ``Trainer.fit`` before: 1.46x (1.19-1.63); bare / fit now: 1.10x (0.99-1.42);
  fit now / fit before: 1.22x (1.07-1.40);
- with the recorder (what ``dynamics run`` trains): now / before 1.11x (0.88-1.49); the
  recorder's probes make a step 1.89x (1.07-2.19) as costly as ``fit now``, so at this size
  they, not Lightning, bound ``dynamics run``;
- drawing the batches alone runs at 1728 batches/s against 271 bare steps/s: about a sixth of a
  bare step.

What changed: Lightning's default bar redrew (Rich) and read the logged metrics on every step,
and the student's ``self.log`` of its training loss went through Lightning's result collection
on every step (cProfile of 600 steps: the log 15 % of ``Trainer.fit``'s time). ``dynamics
run`` now shows the returned loss on a bar redrawn every 1 % of the run, and the student logs
only for a logger or Lightning's own bar. Not changed: the run is already one endless epoch
(the training data are a stream); deterministic mode was within noise in a side measurement
on the CPU; validation every 100 steps is one forward of the 2048 held-out rows, as in the
bare loop; and drawing the data in blocks was left out: the teacher's forward over a block of
batches equals the batches' own forwards only where the BLAS kernel happens not to depend on
the row count, which no one guarantees, and it would save a fraction of that sixth.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytorch_lightning as pl
import torch

from dynamics.callbacks import DynamicsRecorder
from dynamics.experiments.config_files import load_config
from dynamics.experiments.runner import quiet_lightning, trainer_for

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "teacher_student.yaml"
VARIANT = "unshifted"


def before(config, callbacks: list[pl.Callback]) -> pl.Trainer:
    """The Trainer ``dynamics run`` built before the fast path, progress bar on."""
    return pl.Trainer(
        max_steps=config.steps,
        val_check_interval=config.eval_every,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=True,
        deterministic=True,
    )


def bare(experiment, config, folder: Path, clock: Callable[[], float]) -> float:
    built = experiment.build(config, VARIANT)
    module, optimizer = built.module, built.module.configure_optimizers()
    batches = iter(built.data.train_dataloader())
    heldout = next(iter(built.data.val_dataloader()))
    start = clock()
    for step in range(1, config.steps + 1):
        loss = module.dynamics_loss(next(batches))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % config.eval_every == 0:
            with torch.no_grad():
                module.dynamics_loss(heldout)
    return config.steps / (clock() - start)


def data(experiment, config, folder: Path, clock: Callable[[], float]) -> float:
    batches = iter(experiment.build(config, VARIANT).data.train_dataloader())
    start = clock()
    for _ in range(config.steps):
        next(batches)
    return config.steps / (clock() - start)


def fitted(make: Callable, recorded: bool) -> Callable:
    def measure(experiment, config, folder: Path, clock: Callable[[], float]) -> float:
        built = experiment.build(config, VARIANT)
        callbacks = []
        if recorded:
            recording = experiment.recordings(config, {VARIANT: built})[VARIANT]
            path = folder / f"{time.perf_counter_ns()}.h5"
            callbacks = [DynamicsRecorder(path, probes=recording.probes, overwrite=True)]
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            with contextlib.redirect_stderr(sink):
                trainer = make(config, callbacks)
                start = clock()
                trainer.fit(built.module, built.data)
        return config.steps / (clock() - start)

    return measure


CASES = {
    "data": data,
    "bare": bare,
    "fit before": fitted(before, recorded=False),
    "fit now": fitted(lambda c, cb: trainer_for(c, cb, progress=True), recorded=False),
    "run before": fitted(before, recorded=True),
    "run now": fitted(lambda c, cb: trainer_for(c, cb, progress=True), recorded=True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--wall", action="store_true", help="wall time instead of CPU time")
    args = parser.parse_args()
    # CPU seconds of this process (all its threads) by default: on a shared machine, wall time
    # swings with whatever else runs.
    clock = time.perf_counter if args.wall else time.process_time
    experiment, config = load_config(CONFIG, steps=args.steps)
    torch.set_num_threads(config.threads)
    quiet_lightning()
    rates: dict[str, list[float]] = {name: [] for name in CASES}
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(args.rounds):
            order = list(CASES) if round_ % 2 == 0 else list(reversed(CASES))
            for name in order:
                rates[name].append(CASES[name](experiment, config, Path(folder), clock))
    bar = type(before(config, []).progress_bar_callback).__name__
    unit = "wall" if args.wall else "CPU"
    print(f"{args.steps} steps of the {VARIANT} student, {args.rounds} rounds, steps per {unit} s")
    print(f"(fit before: Lightning's default bar, here {bar}):")
    for name, values in rates.items():
        print(
            f"  {name:11s} median {statistics.median(values):6.1f}"
            f"  min {min(values):6.1f}  max {max(values):6.1f}"
        )
    for a, b in [
        ("bare", "fit before"),
        ("bare", "fit now"),
        ("fit now", "fit before"),
        ("run now", "run before"),
        ("fit now", "run now"),
    ]:
        ratios = [x / y for x, y in zip(rates[a], rates[b])]
        print(
            f"  {a} / {b}: {statistics.median(ratios):.2f}x"
            f"  (rounds {min(ratios):.2f}-{max(ratios):.2f})"
        )


if __name__ == "__main__":
    main()
