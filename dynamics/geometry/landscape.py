"""Loss landscapes over planes of parameter space: the heatmaps of the paper's Fig. 3.

A :class:`LossSurface` holds one module and one in-memory batch and answers "what is the loss at
this parameter vector?". :func:`evaluate_grid` asks it at every point θ0 + a·u + b·v of a
:class:`~dynamics.geometry.plane.Grid`, row chunk by row chunk, optionally split across the
ranks of a torch.distributed process group. :func:`trajectory` puts a run's checkpoints on a
plane with the loss there. Core, so that both the offline ``dynamics plane`` and a probe
evaluating at the end of fit (``GradientPlane(at_end=True)``) use the same code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from numpy.typing import ArrayLike
from torch import nn

from dynamics import world
from dynamics.geometry.nearest_buffers import NearestBuffers
from dynamics.geometry.plane import Grid, Plane, in_plane_shares, project
from dynamics.params.layout import ParameterLayout
from dynamics.params.naming import module_copy, named_parameters
from dynamics.params.vectors import parameter_vector
from dynamics.passes.isolation import Mode, checked_mode
from dynamics.passes.loss_rule import module_loss

LossFunction = Callable[[nn.Module, Any], torch.Tensor]
#: Called with ``(first_row, rows)`` as each chunk of a heatmap's rows is finished.
RowsDone = Callable[[int, np.ndarray], None]


class Progress(Protocol):
    """What a progress display needs (a ``tqdm`` bar): told how many points were evaluated."""

    def update(self, n: int) -> Any: ...


@dataclass(frozen=True)
class Trajectory:
    """A run's checkpoints on a plane, with the loss there and the loss read off the plane.

    ``loss`` and ``plane_loss`` are NaN where no model was available to evaluate them.
    """

    run: str
    step: np.ndarray
    a: np.ndarray
    b: np.ndarray
    r: np.ndarray
    loss: np.ndarray  # at the real checkpoints θt
    plane_loss: np.ndarray  # at their projections θ0 + a·u + b·v


@dataclass(frozen=True)
class PlaneView:
    """One plane, the loss heatmap of one run's model on it, and trajectories drawn over it.

    ``source`` says where the heatmap came from (a model rebuilt offline, or an evaluation made
    in the training process); ``losses`` is None until the grid is evaluated.
    """

    title: str
    plane: Plane
    grid: Grid
    run: str  # whose model the heatmap evaluates
    losses: np.ndarray | None  # (len(betas), len(alphas))
    trajectories: list[Trajectory]
    notes: dict[str, float] = field(default_factory=dict)
    source: str = "offline, by the model rebuilt from the run file, in eval mode"
    #: Coarse to fine: ``losses`` only at the points of ``refine`` (NaN elsewhere), over a
    #: coarse grid evaluated everywhere.
    coarse_grid: Grid | None = None
    coarse_losses: np.ndarray | None = None
    refine: np.ndarray | None = None
    #: Which buffers (BatchNorm statistics) the points use; empty when the model has none.
    buffers: str = ""
    #: The index of the stored state whose buffers each grid point used, (len(betas),
    #: len(alphas)); None when no stored buffers were used. The heatmap is piecewise in them.
    buffer_regions: np.ndarray | None = None


class LossSurface:
    """The loss of a module on a fixed in-memory batch, as a function of its parameter vector.

    A copy of the module (switched to eval mode in ``"eval"`` mode) whose parameters live in one
    flat buffer, so a new point is one vector write; with ``buffers`` each point takes the
    buffers of the run's stored state nearest to it, and a stochastic loss sees the same draws
    at every point. Why: docs/views.md, "How a loss landscape is evaluated".

    Example::

        surface = LossSurface(model, ParameterLayout.of(model), batch)
        surface.loss(theta0)
        heatmap = evaluate_grid(surface, plane, grid)  # (len(betas), len(alphas))

    Args:
        module: the model, e.g. rebuilt from a run file; it is not modified (unless
            ``in_place``).
        layout: the layout of the parameter vectors that will be evaluated.
        batch: the batch the loss is computed on, already on the module's device.
        loss_fn: scalar loss of ``(module, batch)``; defaults to the toolkit's loss rule
            (:func:`dynamics.passes.loss_rule.module_loss`).
        seed: seed of the random draws a stochastic loss sees.
        buffers: the buffers each point uses; None: the module's own at every point.
        mode: the :data:`~dynamics.passes.isolation.Mode` the copy is evaluated in.
        in_place: evaluate ``module`` itself, which then is modified (its parameters moved
            into the flat buffer, its mode set): for a throwaway copy the caller made already,
            such as a sharded module's whole-parameter copy, which ``deepcopy`` cannot copy
            again and which would cost one more copy of the parameters.

    Raises:
        ValueError: if the module lacks a parameter of ``layout`` or has it in another shape,
            has trainable parameters outside it, or its parameters do not share one dtype and
            one device.
    """

    def __init__(
        self,
        module: nn.Module,
        layout: ParameterLayout,
        batch: Any,
        loss_fn: LossFunction = module_loss,
        *,
        seed: int = 0,
        buffers: NearestBuffers | None = None,
        mode: Mode = "eval",
        in_place: bool = False,
    ) -> None:
        self._module = module if in_place else module_copy(module)
        if checked_mode(mode) == "eval":
            self._module.eval()
        params = layout.parameters(self._module)
        outside = sorted(
            name
            for name, p in named_parameters(self._module)
            if p.requires_grad and name not in set(layout.names)
        )
        if outside:
            raise ValueError(f"module has trainable parameter {outside[0]!r} outside the layout")
        if len({(p.dtype, p.device) for p in params}) > 1:
            raise ValueError("the layout's parameters must share one dtype and one device")
        self._flat = parameter_vector(self._module, layout)
        for p, view in zip(params, layout.split(self._flat)):
            p.data = view
        self._layout = layout
        self._batch = batch
        self._loss_fn = loss_fn
        self._seed = seed
        self._buffers = buffers
        self._buffers_of: int | None = None  # the stored state whose buffers are loaded

    @property
    def buffer_note(self) -> str:
        """Which buffers the points use, for a view to state; empty when the module has none."""
        return self._buffers.note if self._buffers is not None else ""

    def buffer_regions(self, plane: Plane, grid: Grid) -> np.ndarray | None:
        """The stored state whose buffers each point of ``grid`` is evaluated with (the rule of
        :meth:`losses_on_plane`, for every point at once), shape (len(betas), len(alphas));
        None when the points use no stored buffers."""
        states = self._buffers.plane_coordinates(plane) if self._buffers is not None else None
        if states is None:
            return None
        a_s, b_s, r2 = states
        alphas, betas = grid.alphas[None, :, None], grid.betas[:, None, None]
        distances = np.maximum(r2, 0.0) + (alphas - a_s) ** 2 + (betas - b_s) ** 2
        return distances.argmin(axis=-1)  # the first of equals, as nearest_on_plane

    @property
    def layout(self) -> ParameterLayout:
        """The layout of the parameter vectors this surface evaluates."""
        return self._layout

    @property
    def device(self) -> torch.device:
        """The device the module's parameters live on."""
        return self._flat.device

    @torch.no_grad()
    def loss(self, theta: ArrayLike) -> float:
        """The loss at one flat parameter vector (e.g. a stored checkpoint).

        Raises:
            ValueError: if ``theta`` does not match the layout's size.
        """
        vector = (
            theta.detach()
            if isinstance(theta, torch.Tensor)
            else torch.from_numpy(np.array(theta, dtype=np.float64))
        )
        if vector.ndim != 1 or vector.numel() != self._layout.size:
            raise ValueError(
                f"theta has shape {tuple(vector.shape)}, layout has {self._layout.size} entries"
            )
        self._flat.copy_(vector)
        if self._buffers is not None:
            self._use_buffers(self._buffers.nearest(vector))
        with self._fixed_draws() as reset:
            reset()
            return float(self._current_loss())

    @torch.no_grad()
    def losses_on_plane(self, plane: Plane, grid: Grid, points: Sequence[int]) -> torch.Tensor:
        """Losses at a range of grid points, flattened row-major over ``grid.shape``.

        Point k is (alphas[k % len(alphas)], betas[k // len(alphas)]); increasing indices (a
        range, or the points a grid is refined at) let ranks of a distributed evaluation, or a
        caller that stores results per chunk, take slices. The
        parameters at a point are θ0 + b·v formed in float64 and rounded to the module's dtype,
        plus a·u added in that dtype: a few units in the last place from rounding the exact
        point once.

        Returns:
            A float64 tensor on :attr:`device`, one loss per point of ``points``.
        """
        self._check_plane(plane)
        device, dtype = self.device, self._flat.dtype
        origin, v = (
            torch.tensor(x, dtype=torch.float64, device=device) for x in (plane.origin, plane.v)
        )
        u = torch.tensor(plane.u, dtype=dtype, device=device)
        row = torch.empty_like(self._flat)
        row_index = None
        losses = torch.empty(len(points), dtype=torch.float64, device=device)
        states = self._buffers.plane_coordinates(plane) if self._buffers is not None else None
        with self._fixed_draws() as reset:
            for n, k in enumerate(points):
                i, j = divmod(k, grid.alphas.size)
                # θ0 + b·v is shared by a row: it is formed in float64 once per row, then each
                # point is one add in the parameters' dtype written straight into them (a
                # float64 add-and-cast per point cost 2.7x as much, ~7% of a forward here).
                if i != row_index:
                    row.copy_(torch.add(origin, v, alpha=float(grid.betas[i])))
                    row_index = i
                torch.add(row, u, alpha=float(grid.alphas[j]), out=self._flat)
                if states is not None:
                    alpha, beta = float(grid.alphas[j]), float(grid.betas[i])
                    self._use_buffers(self._buffers.nearest_on_plane(states, alpha, beta))
                reset()
                losses[n] = self._current_loss()
        return losses

    def _use_buffers(self, index: int | None) -> None:
        if index != self._buffers_of:
            self._buffers.load(self._module, index)
            self._buffers_of = index

    def _check_plane(self, plane: Plane) -> None:
        if plane.size != self._layout.size:
            raise ValueError(
                f"plane vectors have {plane.size} entries, the layout has {self._layout.size}"
            )

    def _current_loss(self) -> torch.Tensor:
        # Left on the device, so a grid needs no host synchronization per point; callers copy
        # it out before the next point, since a loss may be a view of the parameters.
        return self._loss_fn(self._module, self._batch).detach().reshape(())

    @contextmanager
    def _fixed_draws(self) -> Iterator[Callable[[], None]]:
        cuda = [self.device] if self.device.type == "cuda" else []
        # States of fresh generators, not torch.manual_seed: that would also reseed every CUDA
        # device, outside the fork, even for a module on the CPU.
        cpu_state = torch.Generator().manual_seed(self._seed).get_state()
        cuda_states = [torch.Generator(d).manual_seed(self._seed).get_state() for d in cuda]

        def reset() -> None:
            torch.set_rng_state(cpu_state)
            for d, state in zip(cuda, cuda_states):
                torch.cuda.set_rng_state(state, d)

        with torch.random.fork_rng(devices=cuda):
            yield reset


def evaluate_grid(
    surface: LossSurface,
    plane: Plane,
    grid: Grid,
    *,
    progress: Progress | None = None,
    distributed: bool = False,
    on_rows: RowsDone | None = None,
    where: np.ndarray | None = None,
) -> np.ndarray:
    """The loss at every point θ0 + a·u + b·v of a grid, evaluated a chunk of rows at a time.

    Example::

        heatmap = evaluate_grid(LossSurface(model, layout, batch), plane, grid)

    Args:
        surface: the loss as a function of parameters.
        plane: the plane (origin θ0, basis u, v).
        grid: the coordinates; ``alphas`` along u, ``betas`` along v.
        progress: told of each finished chunk's points (pass it on rank 0 only).
        distributed: split each chunk's points across the ranks of the already-initialized
            default torch.distributed process group, each rank a contiguous slice, gathered with
            ``all_gather``; every rank returns the full heatmap. The result equals a
            one-process evaluation as long as every rank computes a point the same way (same
            device kind, dtype and thread-count-independent kernels).
        on_rows: called with ``(first_row, rows)`` as each chunk is finished (e.g. to write it
            out, so an interrupted grid keeps its finished rows).
        where: evaluate only where this boolean array of ``grid.shape`` is true.

    Returns:
        A float64 array of shape ``grid.shape`` = ``(len(betas), len(alphas))``:
        ``heatmap[i, j]`` is the loss at a = alphas[j], b = betas[i] (NaN outside ``where``).

    Raises:
        ValueError: if the plane does not match the surface's layout, or ``distributed`` is
            set without an initialized process group of several processes.
    """
    surface._check_plane(plane)
    if distributed and not world.is_distributed():
        raise ValueError(
            "distributed=True needs an initialized torch.distributed process group of several "
            "processes"
        )
    rank, ranks = (world.rank(), world.world_size()) if distributed else (0, 1)
    columns = grid.alphas.size
    rows_per_chunk = -(-ranks // columns)  # one row, unless the ranks outnumber its points
    wanted = np.ones(grid.size, dtype=bool) if where is None else np.ravel(where)
    heatmap = np.full(grid.shape, np.nan)
    for first in range(0, grid.betas.size, rows_per_chunk):
        last = min(first + rows_per_chunk, grid.betas.size)
        chunk = np.flatnonzero(wanted[first * columns : last * columns]) + first * columns
        if not len(chunk):  # the same on every rank: no rank waits in a collective
            continue
        per_rank = -(-len(chunk) // ranks)
        share = chunk[rank * per_rank : (rank + 1) * per_rank].tolist()
        losses = surface.losses_on_plane(plane, grid, share)
        if ranks > 1:
            losses = _all_gathered(losses, per_rank)
        heatmap.flat[chunk] = losses[: len(chunk)].cpu().numpy()
        if progress is not None:
            progress.update(len(chunk))
        if on_rows is not None:
            on_rows(first, heatmap[first:last])
    return heatmap


def trajectory(
    run: str,
    plane: Plane,
    steps: np.ndarray,
    thetas: np.ndarray,
    surface: LossSurface | None,
    progress: Progress | None = None,
) -> Trajectory:
    """Checkpoints θt on a plane: coordinates, the loss at θt and at its projection.

    Without a ``surface`` (no model to evaluate) the losses are NaN.

    Example::

        path = trajectory("shifted", plane, steps, thetas, surface)
        path.a, path.b, path.loss
    """
    a, b, r = project(plane, thetas)
    if surface is None:
        nan = np.full(a.shape, np.nan)
        return Trajectory(run, np.asarray(steps), a, b, r, nan, nan.copy())

    def loss(theta: np.ndarray) -> float:
        value = surface.loss(theta)
        if progress is not None:
            progress.update(1)
        return value

    return Trajectory(
        run=run,
        step=np.asarray(steps),
        a=a,
        b=b,
        r=r,
        loss=np.array([loss(theta) for theta in thetas]),
        plane_loss=np.array([loss(plane.point(x, y)) for x, y in zip(a, b)]),
    )


def in_plane_share(trajectory: Trajectory) -> float:
    """The share (a² + b²)/‖θT − θ0‖² of a trajectory's last point inside its plane."""
    return float(in_plane_shares(trajectory.a[-1], trajectory.b[-1], trajectory.r[-1]))


def _all_gathered(local: torch.Tensor, per_rank: int) -> torch.Tensor:
    # One collective of equal-sized, NaN-padded slices, where the backend moves tensors.
    padded = torch.full(
        (per_rank,), float("nan"), dtype=torch.float64, device=world.collective_device()
    )
    padded[: local.numel()] = local
    return torch.cat(world.all_gather(padded))
