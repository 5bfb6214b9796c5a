"""What a HessianSpectrum row over a probe set of N batches costs, relative to one batch.

Workload: the default teacher–student config's student (width 64, expansion 4, depth 4; 133k
parameters), batches of ``--batch`` examples (128, the config's) drawn from its teacher, N in
``--sizes`` (32 batches of 128 are the 4096 points a PyHessian maintainer advises). For each N
and each way of holding the graphs (``keep_graphs`` True: N graphs alive; False: one rebuilt
per batch per product), in one process:

- the time of a row (``HessianSpectrum(k=5).measure``, cold Lanczos, tol 1e-4, with the
  per-batch spread), its products ``n_hvp`` and the time per product;
- the memory of the gradient graphs alive at once: the bytes of the distinct tensors autograd
  saves for the backward while the operator is built (kept) or while one batch's graph is
  rebuilt (recomputed), counted by ``torch.autograd.graph.saved_tensors_hooks``.

Prints each, and its ratio to N=1 with kept graphs (the probe's cost on one batch).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_hessian_probe_set.py [--sizes 1 2 4 8 32]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from types import SimpleNamespace

import torch

from dynamics.callbacks import HessianSpectrum
from dynamics.experiments.teacher_student.module import TeacherStudentModule


def batches(count: int, size: int, teacher: torch.nn.Module) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(1)
    made = []
    for _ in range(count):
        x = torch.randn(size, 64, generator=generator)
        with torch.no_grad():
            made.append((x, teacher(x)))
    return made


def saved_bytes(build) -> int:
    """Bytes of the distinct tensors saved for backward while ``build()`` runs (and live)."""
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        kept = build()
    del kept
    return sum(seen.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 32])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    module = TeacherStudentModule(width=64, expansion=4, depth=4, seed=0)
    teacher = TeacherStudentModule(width=64, expansion=4, depth=4, seed=1)
    data = batches(max(args.sizes), args.batch, teacher)
    params = list(module.parameters())
    print(f"{sum(p.numel() for p in params)} parameters, batches of {args.batch}")
    print("N  graphs     row s  n_hvp  s/product  graph MiB  row/1  product/1  memory/1")
    base: tuple[float, float, int] | None = None
    for n in args.sizes:
        for keep in (True, False):
            kind = {"batch": data[0]} if n == 1 else {"batches": data[:n], "keep_graphs": keep}
            if n == 1 and not keep:
                continue  # one batch has one graph either way
            probe = HessianSpectrum(k=5, tol=1e-4, warm_start=False, **kind)
            probe.setup(SimpleNamespace(strategy=None), module, None)
            seconds, rows = [], []
            for _ in range(args.repeats):
                began = time.perf_counter()
                rows.append(probe.measure(module, 0))
                seconds.append(time.perf_counter() - began)
            row_s = statistics.median(seconds)
            n_hvp = int(rows[0]["n_hvp"]) + (n > 1)  # the spread's N batch products: one more
            per_product = row_s / n_hvp
            graphs = n if keep else 1  # alive at once
            memory = saved_bytes(functools.partial(_graph_of, module, data[:graphs]))
            if base is None:
                base = (row_s, per_product, memory)
            print(
                f"{n:<2} {'kept' if keep else 'rebuilt':8} {row_s:7.3f}  {n_hvp:5d}  "
                f"{per_product:9.4f}  {memory / 2**20:9.1f}  {row_s / base[0]:5.1f}  "
                f"{per_product / base[1]:9.1f}  {memory / base[2]:8.1f}"
            )


def _graph_of(module: torch.nn.Module, data: list) -> list[tuple[torch.Tensor, ...]]:
    """The gradient graphs (``create_graph=True``) of ``data``'s batch losses, held at once."""
    params = list(module.parameters())
    return [
        torch.autograd.grad(module.dynamics_loss(batch), params, create_graph=True)
        for batch in data
    ]


if __name__ == "__main__":
    main()
