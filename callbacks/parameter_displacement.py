"""Parameter displacement from θ0, update sizes, and snapshots for offline re-projection."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dynamics.callbacks.probe import Probe, Rows, SeriesSpec, require_unsharded
from dynamics.params import BufferLayout, ParameterLayout, parameter_vector
from dynamics.store import names
from dynamics.store.views import standard_view

if TYPE_CHECKING:
    import pytorch_lightning as pl

#: How snapshots can be stored: full precision, or half the bytes at a coarser precision.
SNAPSHOT_DTYPES = ("float32", "float16", "bfloat16")


class ParameterDisplacement(Probe):
    """‖θt − θ0‖ in total and per parameter tensor, the update ‖θt+1 − θt‖, and snapshots.

    θ0, every snapshot and θT are stored with the module's persistent buffers at that moment
    (BatchNorm running statistics and counters, see :class:`~dynamics.params.BufferLayout`),
    so a model rebuilt offline at any of them is the model training had; the snapshot budget
    counts their bytes. A snapshot's buffers are those before the step's forward, as its
    parameters are.

    Snapshots of θt are kept within ``snapshot_budget_mb``, thinned evenly over the run: the
    budget holds some number of snapshots, and the period is the run's estimated optimizer steps
    over that number, so the whole trajectory is covered and later analysis can project it onto
    any plane. θ0 and the final θT are stored as vectors whatever the budget. When the budget
    holds fewer than two snapshots (above 8.4M float32 parameters for 64 MiB), or the run's
    length is unknown, no snapshots are kept and a warning event says why and what to change:
    the recorder works on a model of any size. The plan (period, expected count, dtype, bytes)
    is stored in the run file with the probe's settings.

    ``snapshot_dtype="float16"`` or ``"bfloat16"`` halves each snapshot, at a coarser precision
    (relative rounding 2⁻¹¹ and 2⁻⁸; bfloat16 keeps float32's range, float16 overflows above
    65504 and rounds to 2⁻²⁵ absolute below 6·10⁻⁵): enough to draw a trajectory, too coarse
    for displacements smaller than that rounding of θt. The dtype is recorded in the file, and
    snapshots read back as float32.

    Args:
        every_n_steps: period of the norm series.
        snapshot_budget_mb: bytes (MiB) for snapshots; 0 stores none.
        snapshot_every_n_steps: fixed snapshot period instead of the budget's (required for
            snapshots when the Trainer cannot estimate its number of steps).
        snapshot_dtype: how snapshots are stored, one of ``SNAPSHOT_DTYPES``.
    """

    name = names.DISPLACEMENT

    def __init__(
        self,
        every_n_steps: int = 1,
        snapshot_budget_mb: float = 64.0,
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
        self.layout: ParameterLayout | None = None  # set at setup, from the module
        self.buffer_layout: BufferLayout | None = None
        self.snapshot_period = 0  # 0: no snapshots
        self._expected_steps = math.inf  # the Trainer's estimate of the run's optimizer steps
        self._params: list[torch.Tensor] = []
        self._theta0: torch.Tensor | None = None
        self._buffers0: dict[str, torch.Tensor] | None = None  # {stored dtype: flat buffers}
        # θ_step, copied before a due step into one buffer preallocated at setup, and its
        # per-tensor views; the difference from θ0 goes to a second preallocated buffer, whose
        # per-tensor norms are taken over the strided views of norm_groups.
        self._before: torch.Tensor | None = None
        self._before_views: list[torch.Tensor] = []
        self._difference: torch.Tensor | None = None
        self._difference_groups: list[tuple[slice, torch.Tensor]] = []
        self._copied = False  # whether _before holds this step's θ_step
        self._buffers_before: dict[str, torch.Tensor] = {}  # its buffers, on snapshot steps

    def validate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Norms of one rank's shards would be recorded as the model's.
        require_unsharded(trainer, "ParameterDisplacement")

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        self.layout = ParameterLayout.of(pl_module)
        self.buffer_layout = BufferLayout.of(pl_module)
        # Detached views of the parameters: the optimizer's in-place updates show through.
        self._params = [p.detach() for p in self.layout.parameters(pl_module)]
        if self._theta0 is None:  # a resumed fit restored θ0 from the checkpoint
            self._theta0 = parameter_vector(pl_module, self.layout)
            self._buffers0 = self.buffer_layout.vectors(pl_module)
        self._theta0 = self._theta0.to(self._params[0].device)
        self._before = torch.empty_like(self._theta0)
        self._difference = torch.empty_like(self._theta0)
        self._before_views = self.layout.split(self._before)
        self._difference_groups = norm_groups(self.layout.numels, self._difference)
        steps = trainer.estimated_stepping_batches
        # Lightning answers -1 (max_steps' default) for an iterable dataset of unknown length.
        self._expected_steps = steps if 0 < steps < math.inf else math.inf
        self.snapshot_period, reason = self._snapshot_plan()
        if reason:
            self.note(trainer.global_step, f"{reason}: storing θ0 and θT only")

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
                "budget_mb": self.snapshot_budget_mb,
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
            names.THETA0: self._theta0.cpu().numpy(),
            **self._buffer_arrays(names.THETA0_BUFFERS, self._buffers0),
        }

    def is_due(self, step: int) -> bool:
        return super().is_due(step) or self._snapshot_due(step)

    def on_step_start(self, trainer, pl_module, batch, step) -> None:
        if trainer.is_global_zero:  # only rank 0 writes, and the ranks' parameters agree
            # One foreach copy into the preallocated buffer's views: no concatenation, no
            # allocation per step.
            torch._foreach_copy_(self._before_views, self._params)
            self._copied = True
            if self._snapshot_due(step):
                self._buffers_before = self.buffer_layout.vectors(pl_module)

    def on_step_end(self, trainer, pl_module, batch, outputs, step) -> Rows:
        if not self._copied:
            return {}
        self._copied = False
        rows: Rows = {}
        if self._snapshot_due(step):
            buffers, self._buffers_before = self._buffers_before, {}
            rows[names.SNAPSHOTS] = {
                names.SNAPSHOT_THETA: self._before.clone(),  # the buffer is reused next step
                **{names.buffer_vector(names.SNAPSHOT_BUFFERS, d): b for d, b in buffers.items()},
            }
        if super().is_due(step):
            # θ_step − θ0 in one flat op, then one norm kernel per group of equal-sized tensors
            # (the same parameter of each block) over a strided view; then θ_step − θ_step+1 in
            # place, per tensor, and one norm of the whole buffer. On the CPU each value is the
            # same float as from flat copies of θ (the same elements reduced in the same order),
            # without concatenating the parameters twice a step.
            torch.sub(self._before, self._theta0, out=self._difference)
            per_tensor = self._difference.new_empty(len(self._params))
            for tensors, view in self._difference_groups:
                torch.linalg.vector_norm(view, dim=1, out=per_tensor[tensors])
            torch._foreach_sub_(self._before_views, self._params)
            rows[names.DISPLACEMENT] = {
                names.DISPLACEMENT_TOTAL: torch.linalg.vector_norm(per_tensor),
                names.DISPLACEMENT_PER_TENSOR: per_tensor,
                names.DISPLACEMENT_UPDATE: torch.linalg.vector_norm(self._before),
            }
        return rows

    def final_vectors(self, trainer, pl_module) -> dict[str, np.ndarray]:
        return {
            names.THETA_FINAL: self._flat_parameters().cpu().numpy(),
            names.THETA_FINAL_STEP: np.array([trainer.global_step], dtype=np.float64),
            **self._buffer_arrays(names.THETA_FINAL_BUFFERS, self.buffer_layout.vectors(pl_module)),
        }

    def teardown(self) -> None:
        self._copied = False
        self._buffers_before = {}

    def state_dict(self) -> dict[str, Any]:
        return {
            "theta0": self._theta0.cpu() if self._theta0 is not None else None,
            "buffers0": (
                {d: b.cpu() for d, b in self._buffers0.items()}
                if self._buffers0 is not None
                else None
            ),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._theta0 = state.get("theta0")
        self._buffers0 = state.get("buffers0")

    def _flat_parameters(self) -> torch.Tensor:
        return torch.cat([p.reshape(-1) for p in self._params])

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

    def _snapshot_plan(self) -> tuple[int, str]:
        """The snapshot period (0: none) and, when the plan keeps none, why."""
        if self.snapshot_every_n_steps is not None:
            return self.snapshot_every_n_steps, ""
        if self.snapshot_budget_mb <= 0:
            return 0, ""
        capacity = int(self.snapshot_budget_mb * 2**20 // self._snapshot_bytes())
        if capacity < 2:
            return 0, (
                f"snapshot_budget_mb={self.snapshot_budget_mb:g} holds fewer than 2 "
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


def norm_groups(numels: Sequence[int], flat: torch.Tensor) -> list[tuple[slice, torch.Tensor]]:
    """Strided ``(k, n)`` views of ``flat`` (the concatenation of tensors of sizes ``numels``),
    each gathering k tensors of one size at a regular spacing in ``flat`` and in the tensor order
    (the same parameter in each of k identical blocks), with the slice of tensor indices it holds.

    One norm kernel over a view's rows replaces k calls, a tensor's row holding its elements in
    the order a norm of the tensor alone reduces them.
    """
    offsets = list(itertools.accumulate(numels, initial=0))
    runs: list[list[int]] = []
    open_runs: dict[int, list[int]] = {}  # the run each size extends next
    for i, numel in enumerate(numels):
        run = open_runs.get(numel)
        if run is not None and (
            len(run) == 1
            or (i - run[-1], offsets[i] - offsets[run[-1]])
            == (run[1] - run[0], offsets[run[1]] - offsets[run[0]])
        ):
            run.append(i)
            continue
        open_runs[numel] = [i]
        runs.append(open_runs[numel])
    groups = []
    for run in runs:
        first, numel = run[0], numels[run[0]]
        index_step = run[1] - first if len(run) > 1 else 1
        spacing = offsets[run[1]] - offsets[first] if len(run) > 1 else numel
        view = flat.as_strided(
            (len(run), numel), (spacing, 1), flat.storage_offset() + offsets[first]
        )
        groups.append((slice(first, run[-1] + 1, index_step), view))
    return groups
