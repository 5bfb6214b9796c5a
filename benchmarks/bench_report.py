"""Time and size of the HTML report and comparison as runs grow from 1k to 100k recorded steps.

Each size gets two synthetic run files written through the real :class:`RunWriter` (not timed):
every step records the training loss, the hidden-state norm and activation bias of 8 layers and
the displacement (total, 24 tensors, update); the held-out loss is recorded 100 times per run
and the top-5 Hessian eigenvalues every 50 steps. The first run's norms overshoot, the second's
rise monotonically and its loss overtakes. Timed side by side in one process, repetitions
alternating report and comparison:

- ``report``: :func:`write_report` of one run;
- ``compare``: :func:`write_comparison` of the two runs.

Goal: under 10 s and 10 MB at 100k steps, time growing no faster than linearly: the last column,
the growth of report + comparison time over the previous size, stays below the growth in steps.
The page size stays near the size of the embedded plotly.js (about 4.8 MB) because long series
are decimated for display.

Usage: ``python benchmarks/bench_report.py [--steps 1000 10000 100000] [--layers 8] [--reps 3]``
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from dynamics.analysis.pages.run_comparison import write_comparison
from dynamics.analysis.pages.run_report import write_report
from dynamics.store import RunWriter, SeriesSpec

TENSORS = 24
EIGENVALUES = 5
HESSIAN_EVERY = 50


def write_run(path: Path, steps: int, layers: int, overshoot: bool, seed: int) -> Path:
    """One synthetic run file of ``steps`` recorded steps (see the module docstring)."""
    rng = np.random.default_rng(seed)
    t = np.arange(steps)
    x = t / steps  # curves keep their shape whatever the length
    tau = 0.08 if overshoot else 0.16
    loss = np.exp(-x / tau) + (0.12 if overshoot else 0.08) + rng.normal(0, 0.005, steps)
    rise = 10 + 2 * (1 - np.exp(-x[:, None] / 0.05)) * np.linspace(1, 2, layers)
    bump = 3 * np.exp(-(((x - 0.15) / 0.05) ** 2))[:, None] if overshoot else 0.0
    norms = rise + bump + rng.normal(0, 0.02, (steps, layers))
    bias = 0.4 * np.exp(-x[:, None] / 0.3) * np.ones(layers) if overshoot else np.zeros((1, layers))
    bias = np.broadcast_to(bias, (steps, layers))
    per_tensor = np.sqrt(t)[:, None] * np.linspace(0.1, 1, TENSORS)
    hessian_steps = t[::HESSIAN_EVERY]
    scale = 1.0 if overshoot else 0.1
    eigen = scale * np.outer(1 + hessian_steps / steps, np.linspace(10, 1, EIGENVALUES))
    eval_every = max(1, steps // 100)
    heldout_steps = t[::eval_every]
    heldout = np.exp(-heldout_steps / steps / tau) + (0.13 if overshoot else 0.09)

    layer_names = tuple(f"blocks.{i}" for i in range(layers))
    specs = {
        "loss": {"train": SeriesSpec()},
        "validation": {"val_loss": SeriesSpec()},
        "hidden_norms": {"norm": SeriesSpec((layers,), columns=layer_names)},
        "activation_bias": {"mean": SeriesSpec((layers,), columns=layer_names)},
        "displacement": {
            "total": SeriesSpec(),
            "per_tensor": SeriesSpec((TENSORS,), columns=tuple(f"p{i}" for i in range(TENSORS))),
            "update": SeriesSpec(),
        },
        "hessian": {
            "eigenvalues": SeriesSpec(
                (EIGENVALUES,), columns=tuple(f"lambda_{i + 1}" for i in range(EIGENVALUES))
            )
        },
    }
    attrs = {
        "config": {"variant": path.stem, "steps": steps},
        "theta0_sha256": "0" * 64,
        "run_name": path.stem,
    }
    writer = RunWriter.create(path, specs, {}, attrs, block_rows=4096)
    total = np.linalg.norm(per_tensor, axis=1)
    update = 1 / (1 + t)
    for i in range(steps):
        writer.append("loss", i, {"train": loss[i]})
        writer.append("hidden_norms", i, {"norm": norms[i]})
        writer.append("activation_bias", i, {"mean": bias[i]})
        writer.append(
            "displacement", i, {"total": total[i], "per_tensor": per_tensor[i], "update": update[i]}
        )
    for i, step in enumerate(heldout_steps):
        writer.append("validation", int(step), {"val_loss": heldout[i]})
    for i, step in enumerate(hessian_steps):
        writer.append("hessian", int(step), {"eigenvalues": eigen[i]})
    writer.close()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    print(f"{args.layers} layers, median of {args.reps} repetitions")
    header = ("steps", "report s", "report MB", "compare s", "compare MB", "time growth")
    print("  ".join(f"{h:>14}" for h in header))
    previous = None
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        for steps in args.steps:
            runs = [
                write_run(folder / f"a{steps}.h5", steps, args.layers, True, 0),
                write_run(folder / f"b{steps}.h5", steps, args.layers, False, 1),
            ]
            times = {"report": [], "compare": []}
            sizes = {}
            for _ in range(args.reps):
                for name, build, inputs in (
                    ("report", write_report, runs[:1]),
                    ("compare", write_comparison, runs),
                ):
                    start = time.perf_counter()
                    written = build(inputs, folder / f"{name}.html", overwrite=True)
                    times[name].append(time.perf_counter() - start)
                    sizes[name] = written.size_bytes / 1e6
            report_s = statistics.median(times["report"])
            compare_s = statistics.median(times["compare"])
            growth = "—"
            if previous is not None:
                growth = f"{(report_s + compare_s) / previous[1]:.2f}x / {steps / previous[0]:g}x"
            previous = (steps, report_s + compare_s)
            row = (
                f"{steps:,}",
                f"{report_s:.2f}",
                f"{sizes['report']:.2f}",
                f"{compare_s:.2f}",
                f"{sizes['compare']:.2f}",
                growth,
            )
            print("  ".join(f"{cell:>14}" for cell in row), flush=True)


if __name__ == "__main__":
    main()
