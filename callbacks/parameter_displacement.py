"""Parameter displacement from θ0, update sizes, and snapshots for offline re-projection."""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dynamics.callbacks.fit import Fit
from dynamics.callbacks.probe import (
    Probe,
    Rows,
    SeriesSpec,
    expected_steps,
    parameter_shards,
)
from dynamics.params.layout import BufferLayout, ParameterLayout
from dynamics.params.vectors import flatten
from dynamics.sharding import ParameterShards
from dynamics.store import names
from dynamics.store.views import standard_view

if TYPE_CHECKING:
    import pytorch_lightning as pl

#: How snapshots can be stored: full precision, or half the bytes at a coarser precision.
SNAPSHOT_DTYPES = ("float32", "float16", "bfloat16")

#: The default snapshot budget (``snapshot_budget_mb=None``): this many MiB, raised to hold
#: ``AUTO_MIN_SNAPSHOTS`` snapshots of a larger model, never above ``AUTO_MAX_MB``. A 50k-
#: parameter model keeps ~20 snapshots in 4 MiB where a fixed 64 MiB made 50 MB files that a
#: plane path drawn through 20 points does not need.
AUTO_BUDGET_MB = 4.0
AUTO_MIN_SNAPSHOTS = 8
AUTO_MAX_MB = 64.0


class ParameterDisplacement(Probe):
    """‖θt − θ0‖ in total and per parameter tensor, the update ‖θt+1 − θt‖, and snapshots.

    What it records, cost, when it steps aside and pitfalls:
    ``docs/probes/parameter_displacement.md``.

    Example::

        ParameterDisplacement(snapshot_budget_mb=64, snapshot_dtype="bfloat16")

    Args:
        every_n_steps: period of the norm series.
        snapshot_budget_mb: bytes (MiB) for snapshots; 0 stores none; None (default) the
            budget above, scaled to the model.
        snapshot_every_n_steps: fixed snapshot period instead of the budget's (required for
            snapshots when the Trainer cannot estimate its number of steps).
        snapshot_dtype: how snapshots are stored, one of ``SNAPSHOT_DTYPES``.
    """

    name = names.DISPLACEMENT

    def __init__(
        self,
        every_n_steps: int = 1,
        snapshot_budget_mb: float | None = None,
        snapshot_every_n_steps: int | None = None,
        snapshot_dtype: str = "float32",
    ) -> None:
        super().__init__(every_n_steps)
        if snapshot_dtype not in SNAPSHOT_DTYPES:
            choices = ", ".join(SNAPSHOT_DTYPES)
            raise ValueError(f"snapshot_dtype must be one of {choices}, got {snapshot_dtype!r}")
        self.snapshot_budget_mb = snapshot_budget_mb
        self.snapshot_every_n_steps = snapshot_every_n_steps
        self.snapshot_dtype = snapshot_dtype
        self.layout: ParameterLayout | None = None  # set at setup, from the module (unsharded)
        self._shards: ParameterShards | None = None  # which entries of θ this rank holds
        self.buffer_layout: BufferLayout | None = None
        self.snapshot_period = 0  # 0: no snapshots
        self._expected_steps = math.inf  # the Trainer's estimate of the run's optimizer steps
        self._params: list[torch.Tensor] = []
        # θ0 and θ_step are kept in one flat order that puts tensors of equal size side by side
        # (``SizeGroups``), so that each size's norms are one kernel over a contiguous block.
        self._groups: SizeGroups | None = None
        # θ0 (this rank's part of it under sharding): in the grouped order once setup has
        # grouped it, whole and in layout order before (restored from a checkpoint).
        self._theta0: torch.Tensor | None = None
        # Under sharding, on rank zero: the whole θ0 in layout order, on the host (written at
        # start, and what a checkpoint keeps: Lightning saves rank zero's callback states).
        self._whole_theta0: torch.Tensor | None = None
        self._buffers0: dict[str, torch.Tensor] | None = None  # {stored dtype: flat buffers}
        # θ_step, copied before a due step into one buffer preallocated at setup, through its
        # per-tensor views (in the parameters' order).
        self._before: torch.Tensor | None = None
        self._before_views: list[torch.Tensor] = []
        self._copied = False  # whether _before holds this step's θ_step
        self._buffers_before: dict[str, torch.Tensor] = {}  # its buffers, on snapshot steps

    def setup(self, fit: Fit, pl_module: pl.LightningModule, batch: Any) -> None:
        shards = self._shards = parameter_shards(fit, pl_module)
        self.layout = shards.layout
        self.buffer_layout = BufferLayout.of(pl_module)
        # Detached views of the parameters (of this rank's pieces under sharding, taken anew
        # each step): the optimizer's in-place updates show through.
        self._params = (
            [] if shards.sharded else [p.detach() for p in self.layout.parameters(pl_module)]
        )
        # Every rank takes the same branch: all start fresh or all restored the same state.
        if self._theta0 is None:
            local = shards.local(pl_module)
            if shards.sharded:
                whole = shards.gather(local)  # every rank sends, rank zero keeps
                self._whole_theta0 = whole.cpu() if whole is not None else None
            self._buffers0 = self.buffer_layout.vectors(pl_module)
        elif self._groups is None:  # the whole θ0, restored from a checkpoint
            local = shards.part(self._theta0)
            if shards.sharded:
                self._whole_theta0 = self._theta0.cpu() if fit.is_global_zero else None
        else:  # a previous fit's, this rank's part
            local = self._groups.in_layout_order(self._theta0)
        # The grouped order of this rank's entries of each tensor (every entry unsharded).
        held = self.layout
        if shards.sharded:
            held = ParameterLayout(held.names, tuple((n,) for n in shards.here))
        self._groups = SizeGroups(held)
        self._theta0 = self._groups.grouped(local.to(self._pieces(pl_module)[0].device))
        self._before = torch.empty_like(self._theta0)
        self._before_views = self._groups.views(self._before)
        steps = expected_steps(fit)
        # Lightning answers -1 (max_steps' default) for an iterable dataset of unknown length.
        self._expected_steps = steps if 0 < steps < math.inf else math.inf
        # Planned on the whole θ's size, as unsharded: the same snapshots are kept.
        self.snapshot_period, reason = self._snapshot_plan()
        if reason:
            self.note(fit.global_step, f"{reason}: storing θ0 and θT only")

    def series(self) -> dict[str, dict[str, SeriesSpec]]:
        if self.layout is None:
            return {}  # the series follow the module's parameters, known at setup
        tensors = self.layout.names
        groups = {
            names.DISPLACEMENT: {
                names.DISPLACEMENT_TOTAL: SeriesSpec(
                    view=standard_view(names.DISPLACEMENT, names.DISPLACEMENT_TOTAL)
                ),
                names.DISPLACEMENT_PER_TENSOR: SeriesSpec(
                    (len(tensors),),
                    columns=tensors,
                    view=standard_view(names.DISPLACEMENT, names.DISPLACEMENT_PER_TENSOR),
                ),
                names.DISPLACEMENT_UPDATE: SeriesSpec(
                    view=standard_view(names.DISPLACEMENT, names.DISPLACEMENT_UPDATE)
                ),
            }
        }
        if self.snapshot_period:
            groups[names.SNAPSHOTS] = {
                names.SNAPSHOT_THETA: SeriesSpec((self.layout.size,), self.snapshot_dtype),
                **self._buffer_specs(names.SNAPSHOT_BUFFERS),
            }
        return groups

    def settings(self) -> dict[str, Any]:
        if self.layout is None:
            return {}
        steps = self._expected_steps
        return {
            "snapshots": {
                "period": self.snapshot_period,
                "expected": (
                    math.ceil(steps / self.snapshot_period)
                    if self.snapshot_period and math.isfinite(steps)
                    else None
                ),
                "dtype": self.snapshot_dtype,
                "bytes_each": self._snapshot_bytes(),
                "budget_mb": self._budget_mb(),
                "budget": "default" if self.snapshot_budget_mb is None else "given",
            }
        }

    def vectors(self) -> dict[str, SeriesSpec]:
        if self.layout is None:
            return {}
        return {
            names.THETA0: SeriesSpec((self.layout.size,)),
            names.THETA_FINAL: SeriesSpec((self.layout.size,)),
            names.THETA_FINAL_STEP: SeriesSpec((1,), "float64"),
            **self._buffer_specs(names.THETA0_BUFFERS),
            **self._buffer_specs(names.THETA_FINAL_BUFFERS),
        }

    def initial_vectors(self) -> dict[str, np.ndarray]:
        return {
            names.THETA0: self._theta0_in_layout_order().cpu().numpy(),
            **self._buffer_arrays(names.THETA0_BUFFERS, self._buffers0),
        }

    def is_due(self, step: int) -> bool:
        return super().is_due(step) or self._snapshot_due(step)

    def on_step_start(self, fit, pl_module, batch, step) -> None:
        # Unsharded only rank 0 works (it writes, and the ranks' parameters agree); sharded,
        # every rank holds a part and takes part in the step's collectives.
        if not (fit.is_global_zero or self._shards.sharded):
            return
        # One foreach copy into the preallocated buffer's views: no concatenation, no
        # allocation per step.
        torch._foreach_copy_(self._before_views, self._pieces(pl_module))
        self._copied = True
        if self._snapshot_due(step) and fit.is_global_zero:
            self._buffers_before = self.buffer_layout.vectors(pl_module)

    def on_step_end(self, fit, pl_module, batch, outputs, step) -> Rows:
        if not self._copied:
            return {}
        self._copied = False
        rows: Rows = {}
        if self._snapshot_due(step):
            buffers, self._buffers_before = self._buffers_before, {}
            # A copy in the layout's order (the buffer is reused next step), whole on rank 0.
            theta = self._shards.gather(self._groups.in_layout_order(self._before))
            if theta is not None:  # None on the other ranks under sharding: rank 0 writes
                rows[names.SNAPSHOTS] = {
                    names.SNAPSHOT_THETA: theta,
                    **{
                        names.buffer_vector(names.SNAPSHOT_BUFFERS, d): b
                        for d, b in buffers.items()
                    },
                }
        if super().is_due(step):
            # θ_step − θ0 in one flat op and one norm kernel per size of tensor; then
            # θ_step − θ_step+1 in place, per tensor, and one norm of the whole buffer. The
            # difference is a temporary: between steps the probe holds θ0 and θ_step only.
            per_tensor = self._groups.norms(torch.sub(self._before, self._theta0))
            torch._foreach_sub_(self._before_views, self._pieces(pl_module))
            update = torch.linalg.vector_norm(self._before)
            if self._shards.sharded:
                per_tensor, update = self._whole_norms(per_tensor, update)
            rows[names.DISPLACEMENT] = {
                names.DISPLACEMENT_TOTAL: torch.linalg.vector_norm(per_tensor),
                names.DISPLACEMENT_PER_TENSOR: per_tensor,
                names.DISPLACEMENT_UPDATE: update,
            }
        return rows

    def final_vectors(self, fit, pl_module) -> dict[str, np.ndarray]:
        if self._shards.sharded:
            theta = self._shards.gather(self._shards.local(pl_module))
            if theta is None:
                return {}  # ranks but zero: rank zero writes
        else:
            theta = flatten(self._params)
        return {
            names.THETA_FINAL: theta.cpu().numpy(),
            names.THETA_FINAL_STEP: np.array([fit.global_step], dtype=np.float64),
            **self._buffer_arrays(names.THETA_FINAL_BUFFERS, self.buffer_layout.vectors(pl_module)),
        }

    def teardown(self) -> None:
        self._copied = False
        self._buffers_before = {}

    def state_dict(self) -> dict[str, Any]:
        return {
            "theta0": theta0.cpu()
            if (theta0 := self._theta0_in_layout_order()) is not None
            else None,
            "buffers0": (
                {d: b.cpu() for d, b in self._buffers0.items()}
                if self._buffers0 is not None
                else None
            ),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._theta0, self._groups = state.get("theta0"), None  # in layout order until setup
        self._buffers0 = state.get("buffers0")

    def _theta0_in_layout_order(self) -> torch.Tensor | None:
        """The whole θ0 in layout order; None on ranks but zero under sharding."""
        if self._theta0 is None or self._groups is None:
            return self._theta0
        if self._shards.sharded:
            return self._whole_theta0
        return self._groups.in_layout_order(self._theta0)

    def _pieces(self, pl_module: pl.LightningModule) -> list[torch.Tensor]:
        """The parameters as the probe reads them: views of whole tensors, or under sharding
        of this rank's flat pieces, looked up each step (cheap, and FSDP may rebind them)."""
        return self._shards.pieces(pl_module) if self._shards.sharded else self._params

    def _whole_norms(self, per_tensor: torch.Tensor, update: torch.Tensor) -> list[torch.Tensor]:
        """The whole vectors' norms from the norms of this rank's parts: their squares summed
        over the ranks in one all-reduce."""
        parts = [per_tensor, update]
        squares = self._shards.sum([n.double().square() for n in parts])
        return [s.sqrt().to(n.dtype) for s, n in zip(squares, parts)]

    def _snapshot_due(self, step: int) -> bool:
        return bool(self.snapshot_period) and step % self.snapshot_period == 0

    def _snapshot_bytes(self) -> int:
        parameters = (4 if self.snapshot_dtype == "float32" else 2) * self.layout.size
        return parameters + self.buffer_layout.nbytes

    def _buffer_specs(self, prefix: str) -> dict[str, SeriesSpec]:
        return {
            names.buffer_vector(prefix, dtype): SeriesSpec((size,), dtype)
            for dtype, size in self.buffer_layout.sizes().items()
        }

    @staticmethod
    def _buffer_arrays(
        prefix: str, buffers: dict[str, torch.Tensor] | None
    ) -> dict[str, np.ndarray]:
        # A checkpoint from before buffers were stored restores θ0 without them.
        return {names.buffer_vector(prefix, d): b.cpu().numpy() for d, b in (buffers or {}).items()}

    def _budget_mb(self) -> float:
        """The snapshot budget in MiB: the one given, else the default scaled to the model."""
        if self.snapshot_budget_mb is not None:
            return self.snapshot_budget_mb
        least = AUTO_MIN_SNAPSHOTS * self._snapshot_bytes() / 2**20
        return min(max(AUTO_BUDGET_MB, least), AUTO_MAX_MB)

    def _snapshot_plan(self) -> tuple[int, str]:
        """The snapshot period (0: none) and, when the plan keeps none, why."""
        if self.snapshot_every_n_steps is not None:
            return self.snapshot_every_n_steps, ""
        budget_mb = self._budget_mb()
        if budget_mb <= 0:
            return 0, ""
        capacity = int(budget_mb * 2**20 // self._snapshot_bytes())
        if capacity < 2:
            given = (
                f"the default budget ({budget_mb:g} MiB)"
                if self.snapshot_budget_mb is None
                else f"snapshot_budget_mb={budget_mb:g}"
            )
            return 0, (
                f"{given} holds fewer than 2 "
                f"{self.snapshot_dtype} snapshots of {self.layout.size:,} parameters "
                f"({self._snapshot_bytes() / 2**20:.1f} MiB each); raise the budget, or store "
                "float16/bfloat16 snapshots (snapshot_dtype)"
            )
        if not math.isfinite(self._expected_steps):
            return 0, (
                "the run's length is unknown, so snapshots cannot be spread over it; "
                "set snapshot_every_n_steps"
            )
        # capacity - 1 intervals between capacity snapshots, the first at step 0.
        return max(1, math.ceil(self._expected_steps / (capacity - 1))), ""


class SizeGroups:
    """A flat order for a layout's tensors that puts tensors of equal size side by side.

    In this order each size's tensors form one contiguous ``(k, n)`` block, so one norm kernel
    over its rows gives the k tensors' norms, each the same float as a norm of that tensor alone
    (the same elements reduced in the same order). Strided views over the layout's own order
    need a kernel per regularly spaced run of a size (10 instead of 3 on a 4-block residual MLP)
    and took 1.6 times as long on the CPU. Within a size, tensors keep the layout's order.

    Args:
        layout: the parameters' layout.
    """

    def __init__(self, layout: ParameterLayout) -> None:
        numels = layout.numels
        self.order = sorted(range(len(numels)), key=numels.__getitem__)  # stable
        self.shapes = layout.shapes
        offsets = list(itertools.accumulate((numels[i] for i in self.order), initial=0))
        self.offsets = [0] * len(numels)  # each tensor's start in the grouped order
        for position, i in enumerate(self.order):
            self.offsets[i] = offsets[position]
        self.numels = numels
        # Each size's block: its first and last position + 1, its tensors' numel, and its
        # start and end in the flat vector.
        self.blocks: list[tuple[int, int, int, int, int]] = []
        for position, i in enumerate(self.order):
            numel = numels[i]
            if self.blocks and self.blocks[-1][2] == numel:
                first, _, _, start, end = self.blocks[-1]
                self.blocks[-1] = (first, position + 1, numel, start, end + numel)
            else:
                start = offsets[position]
                self.blocks.append((position, position + 1, numel, start, start + numel))
        self._block_sizes = [end - start for *_, start, end in self.blocks]
        # Where each tensor's norm lands among the grouped norms: gathers them in layout order.
        self._positions = torch.tensor(
            sorted(range(len(numels)), key=self.order.__getitem__), dtype=torch.long
        )
        # Per device and dtype: the grouped norms' buffer, its slice per block, the positions.
        self._outputs: dict[tuple, tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]] = {}

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a grouped ``flat`` vector shaped like each tensor, in the layout's order."""
        return [
            flat[o : o + n].view(shape)
            for o, n, shape in zip(self.offsets, self.numels, self.shapes)
        ]

    def grouped(self, vector: torch.Tensor) -> torch.Tensor:
        """A layout-ordered flat ``vector`` in the grouped order (a copy)."""
        pieces = torch.split(vector, self.numels)
        return torch.cat([pieces[i] for i in self.order])

    def in_layout_order(self, flat: torch.Tensor) -> torch.Tensor:
        """A grouped ``flat`` vector in the layout's order (a copy)."""
        return torch.cat([view.reshape(-1) for view in self.views(flat)])

    def norms(self, flat: torch.Tensor) -> torch.Tensor:
        """Each tensor's L2 norm of a grouped ``flat`` vector, in the layout's order (a new
        tensor)."""
        outputs = self._outputs.get((flat.device, flat.dtype))
        if outputs is None:
            grouped = flat.new_empty(len(self.order))
            outputs = self._outputs[flat.device, flat.dtype] = (
                grouped,
                [grouped[first:last] for first, last, *_ in self.blocks],
                self._positions.to(flat.device),
            )
        grouped, slices, positions = outputs
        for block, (first, last, numel, _, _), out in zip(
            torch.split(flat, self._block_sizes), self.blocks, slices
        ):
            torch.linalg.vector_norm(block.view(last - first, numel), dim=1, out=out)
        return grouped[positions]
