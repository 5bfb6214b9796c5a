"""Top Hessian eigenvalues: our Lanczos against PyHessian, hessian-eigenthings and power iteration.

Model: the paper's controlled teacher–student setup (``dynamics.models.ResidualMLP``, width 64,
expansion 4, depth 4, ReLU; 133k parameters), one fixed batch of 256 N(0, I) inputs, MSE against
a random teacher of the same architecture, float32. Reference: the same weights in float64, our
Lanczos at residual tolerance 1e-10, cross-checked against ARPACK (``scipy.sparse.linalg.eigsh``)
on the same float64 products.

1. Time to the top-1 and top-5 eigenvalues at 1e-4 relative accuracy. Every method gets the
   loosest setting, from its own ladder, whose result is within 1e-4 of the reference for all
   k eigenvalues from each of ``--seeds`` random starts (a lucky start vector must not decide
   the setting; found once, then timed): our Lanczos and power iteration by residual
   tolerance (ours is also timed at its default, 1e-4), PyHessian 0.1 by its ``tol`` (relative
   change between iterates; ``maxIter`` 1000), hessian-eigenthings 1.0.0a5 ``lanczos`` by its
   number of steps — both on its own ``HessianOperator`` (loss and gradient recomputed per
   product, as it ships) and on our graph-reusing operator (the algorithms alone). Timed side by
   side in one process, the order rotating and the seed cycling each repetition; medians.
2. Cost of one Hessian-vector product over one gradient, per way of computing the product.
3. Warm against cold starts along a short training trajectory (Adam lr 1e-3, fresh batches):
   the top-5 on the fixed batch, from the previous record's Ritz vectors or from a random
   vector, and the products each needed — recorded every step for 10 steps, then every 10
   steps for ``--steps`` steps.
4. The cost of leaving curvature on: the default teacher–student config (``configs/
   teacher_student.yaml``, its unshifted student, ``--fit-steps`` steps) fitted bare and with
   ``HessianSpectrum(k=5, every_n_steps=50, solver="tracking", tol=--track-tol)`` (and, with
   ``--cold-every N``, the same with a cold Lanczos every N-th record; with ``--with-lanczos``,
   the default Lanczos probe), alternating in one process, ``--pairs``
   times: the median ratio of the fits' CPU times (one thread; wall time on a shared machine
   measured the neighbours) with its range. An untimed fit first checks every
   tracking record against a cold Lanczos to 1e-6 on the same operator (the same batch and
   θ): the largest relative deviation, the products per record and the cold restarts, how
   many stored eigenvalues had no gap error bound (NaN) or missed theirs, and the CPU time of
   a tracked record's solve split into its products and the rest (the basis algebra).

Usage: ``python benchmarks/bench_hessian.py [--reps 6] [--seeds 3] [--threads 1] [--steps 100]
[--pairs 5] [--fit-steps 2000] [--track-tol 1e-2] [--cold-every N] [--with-lanczos]
[--only tracking|peers]``; the curvlinops row
needs the ``bench`` extra (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import hessian_eigenthings as eigenthings
import numpy as np
import pytorch_lightning as pl
import scipy.sparse.linalg
import torch
import torch.nn.functional as F
from torch.func import functional_call, jacrev, jvp

from dynamics.callbacks import DynamicsRecorder, HessianSpectrum
from dynamics.curvature import (
    Eigenpairs,
    HessianOperator,
    eigenvalue_error_bounds,
    lanczos,
    top_eigenvalues,
)
from dynamics.experiments.config import load_config
from dynamics.experiments.runner import quiet_lightning
from dynamics.experiments.teacher_student_experiment import TeacherStudent
from dynamics.models import ResidualMLP

try:  # the bench extra; without it the curvlinops row says so instead of a number
    import curvlinops
except ImportError:
    curvlinops = None

ACCURACY = 1e-4
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "teacher_student.yaml"


@dataclass
class Problem:
    student: ResidualMLP
    teacher: ResidualMLP
    batch: tuple[torch.Tensor, torch.Tensor]
    reference: torch.Tensor  # top eigenvalues, float64

    def loss(self) -> torch.Tensor:
        x, y = self.batch
        return F.mse_loss(self.student(x), y)

    @property
    def params(self) -> list[torch.Tensor]:
        return list(self.student.parameters())


@dataclass
class Method:
    """A way to get the top-k eigenvalues, and the ladder of settings it is calibrated on."""

    name: str
    run: Callable[[Problem, int, float, int], tuple[torch.Tensor, int]]  # k, setting, seed
    ladder: list[float]
    setting: str  # what the ladder's values are


def ours(problem: Problem, k: int, tol: float, seed: int):
    pairs = top_eigenvalues(problem.loss, problem.params, k=k, tol=tol, max_hvp=5000, seed=seed)
    return pairs.eigenvalues, pairs.n_hvp


def power(problem: Problem, k: int, tol: float, seed: int):
    pairs = top_eigenvalues(
        problem.loss, problem.params, k=k, tol=tol, solver="power", max_hvp=20_000, seed=seed
    )
    return pairs.eigenvalues, pairs.n_hvp


def pyhessian(problem: Problem, k: int, tol: float, seed: int):
    torch.manual_seed(seed)  # PyHessian draws its start vectors from the global RNG
    pairs = top_eigenvalues(
        problem.loss, problem.params, k=k, tol=tol, solver="pyhessian", max_hvp=1000 * k
    )
    return pairs.eigenvalues, pairs.n_hvp


def eigenthings_as_shipped(problem: Problem, k: int, steps: float, seed: int):
    operator = eigenthings.HessianOperator(
        problem.student, [problem.batch], eigenthings.supervised_loss(F.mse_loss)
    )
    result = eigenthings.lanczos(operator, k=k, max_iter=int(steps), which="LA", seed=seed)
    return result.eigenvalues.double().sort(descending=True).values, int(steps)


def eigenthings_on_our_operator(problem: Problem, k: int, steps: float, seed: int):
    operator = HessianOperator(problem.loss, problem.params)
    wrapped = eigenthings.LambdaOperator(operator.matvec, operator.size, dtype=operator.dtype)
    result = eigenthings.lanczos(wrapped, k=k, max_iter=int(steps), which="LA", seed=seed)
    return result.eigenvalues.double().sort(descending=True).values, operator.n_hvp


def curvlinops_eigsh(problem: Problem, k: int, tol: float, seed: int):
    """curvlinops' Hessian operator (forward and double backward per product, as it ships)
    with ARPACK through ``scipy.sparse.linalg.eigsh``; products counted at the scipy boundary."""
    x, y = problem.batch
    operator = curvlinops.HessianLinearOperator(
        problem.student,
        torch.nn.MSELoss(),
        problem.params,
        [(x, y)],
        check_deterministic=False,  # a one-off check of several products, not the solve
    ).to_scipy()
    calls = [0]

    def matvec(vector: np.ndarray) -> np.ndarray:
        calls[0] += 1
        return operator @ vector

    counted = scipy.sparse.linalg.LinearOperator(operator.shape, matvec=matvec, dtype=np.float32)
    start = np.random.default_rng(seed).standard_normal(operator.shape[0]).astype(np.float32)
    values = scipy.sparse.linalg.eigsh(counted, k=k, which="LA", tol=tol, v0=start)[0]
    return torch.from_numpy(np.sort(values)[::-1].copy()).double(), calls[0]


STEPS = [10, 12, 15, 18, 20, 25, 30, 35, 40, 45, 50]
METHODS = [
    Method("ours (Lanczos)", ours, [1e-2, 3e-3, 1e-3, 3e-4, 1e-4], "tol"),
    Method("power iteration", power, [1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5], "tol"),
    Method("PyHessian", pyhessian, [1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8], "tol"),
    Method("eigenthings", eigenthings_as_shipped, STEPS, "steps"),
    Method("eigenthings on ours", eigenthings_on_our_operator, STEPS, "steps"),
    Method("curvlinops + eigsh", curvlinops_eigsh, [1e-2, 1e-3, 1e-4, 1e-5, 1e-6], "tol"),
]


def build_problem(batch_size: int) -> Problem:
    torch.manual_seed(0)
    student = ResidualMLP(width=64, expansion=4, depth=4)
    torch.manual_seed(1)
    teacher = ResidualMLP(width=64, expansion=4, depth=4)
    x = torch.randn(batch_size, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y = teacher(x)
    exact = copy.deepcopy(student).double()
    x64, y64 = x.double(), y.double()
    operator = HessianOperator(lambda: F.mse_loss(exact(x64), y64), list(exact.parameters()))
    reference = lanczos(operator, k=5, tol=1e-10, max_hvp=3000)
    arpack = scipy.sparse.linalg.eigsh(
        scipy.sparse.linalg.LinearOperator(
            (operator.size, operator.size),
            matvec=lambda v: operator.matvec(torch.from_numpy(np.ravel(v))).numpy(),
            dtype=np.float64,
        ),
        k=5,
        which="LA",
        tol=1e-12,
    )[0]
    agreement = np.abs(np.sort(arpack)[::-1] / reference.eigenvalues.numpy() - 1).max()
    print(f"model: {sum(p.numel() for p in student.parameters())} parameters, batch {batch_size}")
    print(
        f"reference top-5 (float64): {np.array2string(reference.eigenvalues.numpy(), precision=6)}"
    )
    print(f"  converged: {reference.converged}, ARPACK agrees to {agreement:.1e} (relative)")
    return Problem(student, teacher, (x, y), reference.eigenvalues)


def relative_error(problem: Problem, values: torch.Tensor, k: int) -> float:
    exact = problem.reference[:k]
    return ((values[:k].double() - exact).abs() / exact.abs()).max().item()


def calibrate(
    problem: Problem, method: Method, k: int, seeds: int
) -> tuple[float, float, float] | None:
    """The loosest setting on the ladder within ACCURACY from every seed.

    Returns (setting, median HVPs over the seeds, worst relative error), or None.
    """
    for setting in method.ladder:
        errors, counts = [], []
        for seed in range(seeds):
            values, n_hvp = method.run(problem, k, setting, seed)
            errors.append(relative_error(problem, values, k))
            counts.append(n_hvp)
            if errors[-1] > ACCURACY:
                break
        else:
            return setting, statistics.median(counts), max(errors)
    return None


def median_times(jobs: dict[str, Callable[[int], object]], reps: int, seeds: int):
    """Median seconds per job; repetition r runs every job with seed r % seeds, in rotation."""
    times: dict[str, list[float]] = {name: [] for name in jobs}
    names = list(jobs)
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            start = time.perf_counter()
            jobs[name](rep % seeds)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def time_to_accuracy(problem: Problem, k: int, reps: int, seeds: int) -> None:
    print(f"\n== top-{k} to {ACCURACY:g} relative accuracy, {seeds} seeds, median of {reps} ==")
    rows, jobs = {}, {}
    for method in METHODS:
        if method.run is curvlinops_eigsh and curvlinops is None:
            print(f"{method.name:>22}: not measured, curvlinops-for-pytorch is not installed")
            continue
        found = calibrate(problem, method, k, seeds)
        if found is None:
            print(f"{method.name:>22}: not within {ACCURACY:g} on its ladder {method.ladder}")
            continue
        setting, n_hvp, error = found
        rows[method.name] = (f"{method.setting}={setting:g}", n_hvp, error)
        jobs[method.name] = lambda seed, m=method, s=setting: m.run(problem, k, s, seed)
    runs = [ours(problem, k, 1e-4, seed) for seed in range(seeds)]
    error = max(relative_error(problem, values, k) for values, _ in runs)
    rows["ours at default tol"] = ("tol=1e-4", statistics.median(n for _, n in runs), error)
    jobs["ours at default tol"] = lambda seed: ours(problem, k, 1e-4, seed)
    times = median_times(jobs, reps, seeds)
    base = times["ours (Lanczos)"]
    print(f"{'method':>22} {'setting':>11} {'HVPs':>6} {'max err':>9} {'time':>8} {'/ ours':>7}")
    for name, (setting, n_hvp, error) in rows.items():
        print(
            f"{name:>22} {setting:>11} {n_hvp:>6g} {error:>9.1e} "
            f"{times[name]:>7.3f}s {times[name] / base:>7.2f}"
        )


def product_costs(problem: Problem, reps: int) -> None:
    print(f"\n== one Hessian-vector product / one gradient (median of {reps}) ==")
    params = problem.params
    names = [n for n, _ in problem.student.named_parameters()]
    vectors = [torch.randn_like(p) for p in params]
    block = [torch.randn(8, *p.shape) for p in params]
    graph = torch.autograd.grad(problem.loss(), params, create_graph=True)

    def loss_of(*tensors):
        x, y = problem.batch
        return F.mse_loss(functional_call(problem.student, dict(zip(names, tensors)), (x,)), y)

    def recomputed():
        grads = torch.autograd.grad(problem.loss(), params, create_graph=True)
        return torch.autograd.grad(grads, params, vectors)

    detached = tuple(p.detach() for p in params)
    jobs = {
        "gradient": lambda: torch.autograd.grad(problem.loss(), params),
        "HVP, reused graph (ours)": lambda: torch.autograd.grad(
            graph, params, vectors, retain_graph=True
        ),
        "HVP, double backward recomputed": recomputed,
        "HVP, torch.func jvp(jacrev)": lambda: jvp(
            jacrev(loss_of, argnums=tuple(range(len(params)))), detached, tuple(vectors)
        ),
        "8 HVPs, reused graph, batched": lambda: torch.autograd.grad(
            graph, params, block, retain_graph=True, is_grads_batched=True
        ),
    }
    for job in jobs.values():
        job()  # warm-up
    times = median_times({name: lambda _, j=job: j() for name, job in jobs.items()}, reps, 1)
    gradient = times["gradient"]
    for name, seconds in times.items():
        per = seconds / 8 if name.startswith("8 ") else seconds
        label = f"{name} (per vector)" if name.startswith("8 ") else name
        print(f"{label:>42}: {per * 1e3:7.2f} ms  {per / gradient:5.2f} × gradient")


def warm_against_cold(problem: Problem, steps: int, every: int) -> None:
    print(f"\n== top-5, tol 1e-4, every {every} of {steps} Adam steps: warm vs cold start ==")
    student = copy.deepcopy(problem.student)
    optimizer = torch.optim.Adam(student.parameters(), lr=1e-3)
    stream = torch.Generator().manual_seed(3)
    x_probe, y_probe = problem.batch
    previous = None
    cold_total = warm_total = 0
    worst = 0.0
    print(f"{'step':>5} {'λ1':>9} {'λ5':>9} {'cold HVPs':>10} {'warm HVPs':>10}")
    for step in range(steps + 1):
        if step % every == 0:

            def loss() -> torch.Tensor:
                return F.mse_loss(student(x_probe), y_probe)

            params = list(student.parameters())
            cold = top_eigenvalues(loss, params, k=5, tol=1e-4)
            warm = top_eigenvalues(loss, params, k=5, tol=1e-4, previous=previous)
            previous = warm.eigenvectors
            worst = max(worst, ((warm.eigenvalues / cold.eigenvalues) - 1).abs().max().item())
            cold_total += cold.n_hvp
            warm_total += warm.n_hvp
            print(
                f"{step:>5} {cold.eigenvalues[0]:>9.4f} {cold.eigenvalues[4]:>9.4f} "
                f"{cold.n_hvp:>10} {warm.n_hvp:>10}"
            )
        x = torch.randn(problem.batch[0].shape, generator=stream)
        with torch.no_grad():
            y = problem.teacher(x)
        optimizer.zero_grad()
        F.mse_loss(student(x), y).backward()
        optimizer.step()
    print(
        f"total: cold {cold_total} HVPs, warm {warm_total} HVPs "
        f"({1 - warm_total / cold_total:.0%} saved); warm vs cold eigenvalues agree to "
        f"{worst:.1e} (relative)"
    )


class TimedProducts:
    """An operator's products, their CPU time summed (what a record's solve spends outside
    them is the solver's own algebra)."""

    def __init__(self, operator: HessianOperator) -> None:
        self.operator = operator
        self.seconds = 0.0

    size = property(lambda self: self.operator.size)
    dtype = property(lambda self: self.operator.dtype)
    device = property(lambda self: self.operator.device)

    def matvec(self, vector: torch.Tensor) -> torch.Tensor:
        start = time.process_time()
        product = self.operator.matvec(vector)
        self.seconds += time.process_time() - start
        return product


class CheckedSpectrum(HessianSpectrum):
    """The probe, each record's eigenvalues also compared with a cold Lanczos to 1e-6 on the
    same operator (its products are not the probe's: the row's ``n_hvp`` includes them, so
    this runs untimed; the probe's own count is kept here)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.deviations: list[float] = []
        self.costs: list[int] = []
        self.restarts = 0
        self.violated = 0  # eigenvalues off by more than their stored error bound
        self.unbounded = 0  # eigenvalues stored without one (NaN: no resolved gap)
        self.product_seconds: list[float] = []  # CPU time of a tracked record's products
        self.other_seconds: list[float] = []  # and of the rest of its solve (basis algebra)

    def _eigenpairs(self, operator: HessianOperator, step: int) -> Eigenpairs:
        timed = TimedProducts(operator)
        start = time.process_time()
        pairs = super()._eigenpairs(timed, step)
        if not pairs.restarted and step:  # a tracked record: its products against the rest
            self.product_seconds.append(timed.seconds)
            self.other_seconds.append(time.process_time() - start - timed.seconds)
        self.costs.append(pairs.n_hvp)
        self.restarts += pairs.restarted
        cold = lanczos(operator, self.k, 1e-6, max_hvp=5000, seed=self.seed + 1)
        found = pairs.eigenvalues[: self.k]
        error = (found - cold.eigenvalues).abs()
        self.deviations.append((error / cold.eigenvalues.abs()).max().item())
        bounds = eigenvalue_error_bounds(pairs.eigenvalues, pairs.residuals)[: self.k]
        self.unbounded += int(bounds.isnan().sum())
        # 1e-6 of slack: the cold reference's own error.
        self.violated += int((error > bounds + 1e-6 * cold.eigenvalues.abs()).sum())
        return pairs


def fit_seconds(config, steps: int, probes: list | None, folder: Path) -> float:
    """CPU seconds of one fit of the config's unshifted student (validation off).

    CPU time of this process, not wall time: on a shared machine the wall time of identical
    fits varied 2× between neighbours, while a single-threaded fit's CPU time does not count
    the time other processes held the core.
    """
    built = TeacherStudent().build(config, "unshifted")
    callbacks = (
        [] if probes is None else [DynamicsRecorder(folder / f"{time.monotonic_ns()}.h5", probes)]
    )
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
    start = time.process_time()
    trainer.fit(built.module, built.data)
    return time.process_time() - start


def tracking_cost(
    pairs: int, steps: int | None, tol: float, cold_every: int, with_lanczos: bool
) -> None:
    _, config = load_config(CONFIG, steps=steps)
    every, k = 50, 5
    print(
        f"\n== HessianSpectrum top-{k} every {every} of {config.steps} steps, default config, "
        f"tracking tol {tol:g} =="
    )
    variants = {"tracking": lambda: [HessianSpectrum(k, every, tol, solver="tracking")]}
    if cold_every:
        variants[f"tracking, cold every {cold_every}"] = lambda: [
            HessianSpectrum(k, every, tol, solver="tracking", cold_every=cold_every)
        ]
    if with_lanczos:
        variants["lanczos (default)"] = lambda: [HessianSpectrum(k, every)]
    with tempfile.TemporaryDirectory() as folder:
        checked = CheckedSpectrum(k=k, every_n_steps=every, tol=tol, solver="tracking")
        fit_seconds(config, config.steps, [checked], Path(folder))  # also the warm-up
        print(
            f"{len(checked.costs)} records checked against a cold Lanczos to 1e-6: max relative "
            f"deviation {max(checked.deviations):.1e}; products per record median "
            f"{statistics.median(checked.costs):g} (first {checked.costs[0]}, range "
            f"{min(checked.costs)}-{max(checked.costs)}), {checked.restarts} cold restart(s); "
            f"of {k * len(checked.costs)} eigenvalues, {checked.unbounded} stored without a gap "
            f"error bound (NaN) and {checked.violated} off by more than theirs"
        )
        print(
            f"a tracked record's solve, CPU time median: products "
            f"{statistics.median(checked.product_seconds) * 1e3:.1f} ms, the rest (basis "
            f"algebra) {statistics.median(checked.other_seconds) * 1e3:.1f} ms"
        )
        ratios: dict[str, list[float]] = {name: [] for name in variants}
        for pair in range(pairs):
            bare = fit_seconds(config, config.steps, None, Path(folder))
            line = f"pair {pair + 1}/{pairs}: bare {bare:.1f} CPU s"
            for name, probes in variants.items():
                seconds = fit_seconds(config, config.steps, probes(), Path(folder))
                ratios[name].append(seconds / bare)
                line += f", {name} {seconds:.1f} s"
            print(line, flush=True)
    for name, values in ratios.items():
        print(
            f"{name} / bare, CPU time: {statistics.median(values):.2f}x (median of {pairs}, range "
            f"{min(values):.2f}-{max(values):.2f})"
        )
    print("load average (1, 5, 15 min):", " ".join(f"{x:.2f}" for x in os.getloadavg()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--fit-steps", type=int, default=None, help="default: the config's")
    parser.add_argument("--track-tol", type=float, default=1e-2)
    parser.add_argument("--cold-every", type=int, default=0, help="also time this safeguard")
    parser.add_argument("--with-lanczos", action="store_true")
    parser.add_argument("--only", choices=("tracking", "peers"), default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    quiet_lightning()
    if args.only != "peers":
        tracking_cost(
            args.pairs, args.fit_steps, args.track_tol, args.cold_every, args.with_lanczos
        )
    if args.only == "tracking":
        return
    problem = build_problem(args.batch)
    for k in (1, 5):
        time_to_accuracy(problem, k, args.reps, args.seeds)
    product_costs(problem, max(30, args.reps))
    warm_against_cold(problem, steps=10, every=1)
    warm_against_cold(problem, steps=args.steps, every=10)


if __name__ == "__main__":
    main()
