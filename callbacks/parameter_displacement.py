"""Parameter displacement from θ0, update sizes, and snapshots for offline re-projection."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch

from dynamics.callbacks.probe import Probe, Rows, SeriesSpec
from dynamics.params import ParameterLayout, parameter_vector
from dynamics.store import View, names


class ParameterDisplacement(Probe):
    """‖θt − θ0‖ in total and per parameter tensor, the update ‖θt+1 − θt‖, and snapshots.

    Snapshots of θt are kept within ``snapshot_budget_mb``, thinned evenly over the run: the
    snapshot period is the run's estimated optimizer steps over the number of snapshots that fit,
    so the whole trajectory is covered and later analysis can project it onto any plane. θ0 and
    the final θT are stored as vectors as well.

    Args:
        every_n_steps: period of the norm series.
        snapshot_budget_mb: bytes (MiB) for snapshots; 0 stores none.
        snapshot_every_n_steps: fixed snapshot period instead of the budget's (required when the
            Trainer cannot estimate its number of steps).
    """

    name = names.DISPLACEMENT

    def __init__(
        self,
        every_n_steps: int = 1,
        snapshot_budget_mb: float = 64.0,
        snapshot_every_n_steps: int | None = None,
    ) -> None:
        super().__init__(every_n_steps)
        self.snapshot_budget_mb = snapshot_budget_mb
        self.snapshot_every_n_steps = snapshot_every_n_steps
        self._theta0: torch.Tensor | None = None
        self._before: torch.Tensor | None = None  # θ_step, copied before a due step

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        self.layout = ParameterLayout.of(pl_module)
        self._params = self.layout.parameters(pl_module)
        if self._theta0 is None:  # a resumed fit restored θ0 from the checkpoint
            self._theta0 = parameter_vector(pl_module, self.layout)
        self._theta0 = self._theta0.to(self._params[0].device)
        self.snapshot_period = self._snapshot_period(trainer)

    def series(self) -> dict[str, dict[str, SeriesSpec]]:
        tensors = self.layout.names
        groups = {
            names.DISPLACEMENT: {
                names.DISPLACEMENT_TOTAL: SeriesSpec(
                    view=View("scalar", "Distance from initialization", "‖θt − θ0‖")
                ),
                names.DISPLACEMENT_PER_TENSOR: SeriesSpec(
                    (len(tensors),),
                    columns=tensors,
                    view=View("lines", "Distance from initialization per tensor", "‖θt − θ0‖"),
                ),
                names.DISPLACEMENT_UPDATE: SeriesSpec(
                    view=View("scalar", "Update size", "‖θt+1 − θt‖", log_y=True)
                ),
            }
        }
        if self.snapshot_period:
            groups[names.SNAPSHOTS] = {names.SNAPSHOT_THETA: SeriesSpec((self.layout.size,))}
        return groups

    def vectors(self) -> dict[str, SeriesSpec]:
        return {
            names.THETA0: SeriesSpec((self.layout.size,)),
            names.THETA_FINAL: SeriesSpec((self.layout.size,)),
        }

    def initial_vectors(self) -> dict[str, np.ndarray]:
        return {names.THETA0: self._theta0.cpu().numpy()}

    def is_due(self, step: int) -> bool:
        return super().is_due(step) or self._snapshot_due(step)

    def on_step_start(self, trainer, pl_module, batch, step) -> None:
        if trainer.is_global_zero:  # only rank 0 writes, and the ranks' parameters agree
            self._before = self._flat_parameters()

    def on_step_end(self, trainer, pl_module, batch, outputs, step) -> Rows:
        if self._before is None:
            return {}
        before, self._before = self._before, None
        rows: Rows = {}
        if self._snapshot_due(step):
            rows[names.SNAPSHOTS] = {names.SNAPSHOT_THETA: before}
        if super().is_due(step):
            # Flat vectors and one foreach kernel: a handful of ops per step, not a few per
            # parameter tensor (measured 0.2 ms vs 0.6 ms for index_add_ on the default model).
            per_tensor = torch.stack(
                torch._foreach_norm((before - self._theta0).split(self.layout.numels))
            )
            rows[names.DISPLACEMENT] = {
                names.DISPLACEMENT_TOTAL: torch.linalg.vector_norm(per_tensor),
                names.DISPLACEMENT_PER_TENSOR: per_tensor,
                names.DISPLACEMENT_UPDATE: torch.linalg.vector_norm(
                    self._flat_parameters() - before
                ),
            }
        return rows

    def final_vectors(self, trainer, pl_module) -> dict[str, np.ndarray]:
        return {names.THETA_FINAL: self._flat_parameters().cpu().numpy()}

    def teardown(self) -> None:
        self._before = None

    def state_dict(self) -> dict[str, Any]:
        return {"theta0": self._theta0.cpu() if self._theta0 is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._theta0 = state.get("theta0")

    def _flat_parameters(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self._params])

    def _snapshot_due(self, step: int) -> bool:
        return bool(self.snapshot_period) and step % self.snapshot_period == 0

    def _snapshot_period(self, trainer: pl.Trainer) -> int:
        if self.snapshot_every_n_steps is not None:
            return self.snapshot_every_n_steps
        if self.snapshot_budget_mb <= 0:
            return 0
        capacity = int(self.snapshot_budget_mb * 2**20 // (4 * self.layout.size))
        if capacity < 2:
            raise ValueError(
                f"snapshot_budget_mb={self.snapshot_budget_mb} holds fewer than 2 snapshots of "
                f"{self.layout.size} parameters"
            )
        steps = trainer.estimated_stepping_batches
        if not math.isfinite(steps):
            raise ValueError(
                "ParameterDisplacement cannot spread snapshots over a run of unknown length; "
                "set snapshot_every_n_steps"
            )
        # capacity - 1 intervals between capacity snapshots, the first at step 0.
        return max(1, math.ceil(steps / (capacity - 1)))
