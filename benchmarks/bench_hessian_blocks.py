"""Cost of a ``BlockHessian`` row against the full-spectrum row of the same ``k``.

Model: the teacher–student student (``TeacherStudentModule``, width 64, expansion 4, depth 4:
133k parameters, 12 layers as blocks: each block's norm, up and down projections), one fixed
probe batch of 256 N(0, I) inputs against random targets, float32, one thread. Rows: a bare
``HessianSpectrum(k)`` (the full spectrum: Lanczos at ``tol``), and the same probe with
``BlockHessian("layers", k=k)``, without and with a ``trace_hvp`` Hutchinson trace per block;
each measured ``--reps`` times, alternating in one process, at the same θ; medians of the
rows' CPU times (one thread: wall time on a shared machine measures the neighbours), as
ratios to the full row, with the products each row used.

Usage: ``python benchmarks/bench_hessian_blocks.py [--k 5] [--trace-hvp 20] [--reps 5]
[--threads 1] [--width 64] [--depth 4]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from dynamics.callbacks import BlockHessian, HessianSpectrum
from dynamics.experiments.teacher_student.module import TeacherStudentModule


def _probe(k: int, batch, blocks: BlockHessian | None) -> HessianSpectrum:
    return HessianSpectrum(k=k, batch=batch, measurements=[blocks] if blocks else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--trace-hvp", type=int, default=20)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    module = TeacherStudentModule(width=args.width, expansion=4, depth=args.depth, seed=0)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(256, args.width, generator=generator)
    batch = (x, torch.randn(256, args.width, generator=generator))
    rows = {
        "full spectrum": _probe(args.k, batch, None),
        "blocks": _probe(args.k, batch, BlockHessian("layers", k=args.k)),
        f"blocks + trace ({args.trace_hvp})": _probe(
            args.k, batch, BlockHessian("layers", k=args.k, trace_hvp=args.trace_hvp)
        ),
    }
    for probe in rows.values():
        probe.setup(SimpleNamespace(strategy=None), module, batch)
    blocks = rows["blocks"].measurements[0]
    parameters = sum(p.numel() for p in module.parameters())
    print(
        f"teacher–student: {parameters:,} parameters, {len(blocks.block_names)} blocks, k={args.k}"
    )
    times: dict[str, list[float]] = {name: [] for name in rows}
    products: dict[str, int] = {}
    for _ in range(args.reps):
        for name, probe in rows.items():
            start = time.process_time()
            row = probe.measure(module, 0)
            times[name].append(time.process_time() - start)
            products[name] = int(row["n_hvp"])
    full = statistics.median(times["full spectrum"])
    print(f"{'row':<24} {'CPU s':>9} {'× full':>7} {'HVPs':>6} {'HVPs × full':>11}")
    for name, spent in times.items():
        median = statistics.median(spent)
        ratio = products[name] / products["full spectrum"]
        print(f"{name:<24} {median:>9.3f} {median / full:>7.2f} {products[name]:>6} {ratio:>11.2f}")


if __name__ == "__main__":
    main()
