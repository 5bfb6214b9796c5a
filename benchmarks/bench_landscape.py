"""Throughput of the loss-grid evaluator against the bare-forward limit and a reference loop.

Model: the paper's controlled teacher–student setup (``dynamics.models.ResidualMLP``, width 64,
expansion 4, depth 4, ReLU), a batch of 512 N(0, I) inputs, MSE against a random teacher; a
41×41 grid on a random filter-normalized plane. Timed side by side in one process, the order
of the methods rotating every repetition, each repetition one grid row (41 points):

- ``evaluator``: :meth:`LossSurface.losses_on_plane`, what :func:`evaluate_grid` runs;
- ``forward``: the bare-forward limit, one forward of the same batch at the same parameters
  per point, no parameter change and no loss;
- ``state-dict loop``: the loss-landscape reference code's ``set_states`` (Li et al. 2018): per
  point a deep-copied state dict, per-tensor ``add_`` of the direction, ``load_state_dict``,
  loss ``.item()``;
- ``vmap``: ``torch.func.functional_call`` + ``vmap`` over ``--vmap-points`` points per call,
  the batched alternative; kept out of the library while it measures slower than ``evaluator``.

Usage: ``python benchmarks/bench_landscape.py [--reps 15] [--threads 1] [--vmap-points 16]``
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, vmap

from dynamics.geometry.landscape import LossSurface, evaluate_grid
from dynamics.geometry.plane import Grid, Plane, random_filter_normalized_plane
from dynamics.models import ResidualMLP
from dynamics.params.layout import ParameterLayout
from dynamics.params.vectors import parameter_vector

GRID_SIDE = 41


def mse(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(module(x), y)


def state_dict_loop(
    model: nn.Module,
    base: dict[str, torch.Tensor],
    plane: Plane,
    layout: ParameterLayout,
    batch,
    points: list,
) -> list[float]:
    """Li et al.'s ``set_states`` + evaluation, one point at a time from the state ``base``."""
    directions = [
        layout.split(torch.from_numpy(np.array(d, dtype=np.float32))) for d in (plane.u, plane.v)
    ]
    losses = []
    for a, b in points:
        states = copy.deepcopy(base)
        for name, d0, d1 in zip(layout.names, *directions):
            states[name].add_(d0 * a + d1 * b)
        model.load_state_dict(states)
        with torch.no_grad():
            losses.append(mse(model, batch).item())
    return losses


def vmapped_losses(
    model: nn.Module, plane: Plane, layout: ParameterLayout, batch, points: list, chunk: int
) -> list[float]:
    """Losses of ``chunk`` points per call, parameters stacked along a vmapped axis."""
    origin, u, v = (torch.from_numpy(np.array(x)) for x in (plane.origin, plane.u, plane.v))

    def loss_of(params: dict[str, torch.Tensor]) -> torch.Tensor:
        return mse(lambda x: functional_call(model, params, (x,)), batch)

    losses = []
    with torch.no_grad():
        for start in range(0, len(points), chunk):
            ab = torch.tensor(points[start : start + chunk], dtype=torch.float64)
            flat = (origin + ab[:, :1] * u + ab[:, 1:] * v).float()
            params = {
                name: part.reshape(len(ab), *shape)
                for name, part, shape in zip(
                    layout.names, torch.split(flat, layout.numels, dim=1), layout.shapes
                )
            }
            losses.extend(vmap(loss_of)(params).tolist())
    return losses


def points_per_second(method: Callable[[int], list], row: int) -> float:
    start = time.perf_counter()
    method(row)
    return GRID_SIDE / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15, help="repetitions (grid rows) per method")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--vmap-points", type=int, default=16, help="points per vmapped call")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    student, teacher = ResidualMLP(), ResidualMLP()
    x = torch.randn(512, 64)
    with torch.no_grad():
        batch = (x, teacher(x))
    layout = ParameterLayout.of(student)
    plane = random_filter_normalized_plane(parameter_vector(student), layout, seed=0)
    grid = Grid(np.linspace(-1, 1, GRID_SIDE), np.linspace(-1, 1, GRID_SIDE))
    surface = LossSurface(student, layout, batch, mse)
    reference = copy.deepcopy(student)
    base = copy.deepcopy(student.state_dict())
    forward_model = copy.deepcopy(student).eval()

    def row_points(row: int) -> list[tuple[float, float]]:
        return [(float(a), float(grid.betas[row])) for a in grid.alphas]

    methods = {
        "evaluator": lambda row: surface.losses_on_plane(
            plane, grid, range(row * GRID_SIDE, (row + 1) * GRID_SIDE)
        ).tolist(),
        "forward": lambda row: [forward_model(x) for _ in range(GRID_SIDE)],
        "state-dict loop": lambda row: state_dict_loop(
            reference, base, plane, layout, batch, row_points(row)
        ),
        "vmap": lambda row: vmapped_losses(
            student, plane, layout, batch, row_points(row), args.vmap_points
        ),
    }
    names = list(methods)
    with torch.no_grad():
        for method in methods.values():  # warm-up
            method(0)
        row = GRID_SIDE // 3
        evaluator, loop, vmapped = (
            methods[n](row) for n in ("evaluator", "state-dict loop", "vmap")
        )
        rates: dict[str, list[float]] = {name: [] for name in names}
        for rep in range(args.reps):
            row = (rep * 7) % GRID_SIDE
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                rates[name].append(points_per_second(methods[name], row))

    print(
        f"{layout.size} parameters, batch 512, {GRID_SIDE}x{GRID_SIDE} grid, "
        f"{args.threads} thread(s), {args.reps} reps of {GRID_SIDE} points"
    )
    print(
        f"  {'':16s} {'points/s: median':>16s} {'best':>7s}   ratio to forward: paired, best/best"
    )
    best_forward = max(rates["forward"])
    for name in names:
        # Each repetition is paired with the forward timed next to it, which cancels slow drift
        # of a shared machine; best over best estimates the uncontended costs, as timeit does.
        ratios = [r / f for r, f in zip(rates[name], rates["forward"])]
        print(
            f"  {name:16s} {statistics.median(rates[name]):16.1f} {max(rates[name]):7.1f}"
            f"   {statistics.median(ratios):5.2f} [{min(ratios):.2f}-{max(ratios):.2f}],"
            f" {max(rates[name]) / best_forward:.2f}"
        )
    speedup = [e / s for e, s in zip(rates["evaluator"], rates["state-dict loop"])]
    print(
        f"  evaluator / state-dict loop, paired: {statistics.median(speedup):.2f}x"
        f" [{min(speedup):.2f}-{max(speedup):.2f}]"
    )
    for name, other in (("state-dict loop", loop), ("vmap", vmapped)):
        worst = np.max(np.abs(np.subtract(evaluator, other)) / np.abs(other))
        print(f"  largest relative difference, evaluator vs {name}: {worst:.1e}")

    start = time.perf_counter()
    evaluate_grid(surface, plane, grid)
    elapsed = time.perf_counter() - start
    rate = grid.size / elapsed
    print(f"  full {GRID_SIDE}x{GRID_SIDE} evaluate_grid: {elapsed:.1f} s, {rate:.1f} points/s")


if __name__ == "__main__":
    main()
