"""The buffers a parameter point is evaluated with: those of the run's nearest stored state.

Buffers (BatchNorm running statistics, counters) are not a function of the parameters: a run
has them only at the states it stored (θ0, snapshots, θT). The loss at any parameter point θ —
a grid point of a plane, the projection of a checkpoint — is evaluated with the buffers of the
stored state nearest to θ in parameter space (Euclidean distance, the earlier state on a tie).
A stored state is thus evaluated with its own buffers (θT with the running statistics training
ended with), and a heatmap is piecewise in its buffers, changing where another state becomes
the nearest.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from dynamics.geometry.plane import Plane
from dynamics.params.layout import BufferLayout
from dynamics.store import Run, StoredState

#: Entries of float64 differences formed at once when finding the nearest state.
_CHUNK_ENTRIES = 1 << 23


class NearestBuffers:
    """A run's stored states with buffers, and the rule that picks one for a parameter point.

    Args:
        states: the stored states whose buffers are used (each with buffers).
        layout: the run's buffer layout.
        note: what a view says about the buffers its points use.
    """

    def __init__(self, states: Sequence[StoredState], layout: BufferLayout, note: str) -> None:
        self._thetas = torch.from_numpy(np.stack([s.theta for s in states])) if states else None
        self._buffers = [s.buffers for s in states]
        self._layout = layout
        self.note = note

    @classmethod
    def of_run(cls, run: Run, module: nn.Module) -> NearestBuffers | None:
        """The rule for ``run``'s model ``module``; None when the module has no buffers.

        For a run that recorded no buffers, no state is used (the module keeps its own) and
        the note says so.
        """
        return cls.of_runs([run], module)

    @classmethod
    def of_runs(cls, runs: Sequence[Run], module: nn.Module) -> NearestBuffers | None:
        """The rule for ``module``, a model of every run of ``runs``, over all their stored
        states: a point between two runs' endpoints uses the buffers of the nearer one's
        states. None when the module has no buffers.

        When a run recorded no buffers, or the runs' buffer layouts differ, no state is used
        (the module keeps its own) and the note says so.
        """
        if not BufferLayout.of(module).names:
            return None
        who = ", ".join(run.name for run in runs)
        layout = runs[0].buffer_layout
        # A diverged run's non-finite states are nearest to nothing (NaN would win argmin).
        stored = [
            [s for s in run.stored_states() if s.buffers is not None and np.isfinite(s.theta).all()]
            for run in runs
        ]
        if layout is None or not all(stored):
            note = f"{who}: no buffers recorded; the rebuilt model's initial buffers throughout"
            return cls([], BufferLayout((), (), ()), note)
        if any(run.buffer_layout != layout for run in runs[1:]):
            note = f"{who}: different buffers; the rebuilt model's initial buffers throughout"
            return cls([], BufferLayout((), (), ()), note)
        whose = "the run's" if len(runs) == 1 else "the runs'"
        note = (
            f"{who}: each point uses the buffers ({_summary(layout)}) of {whose} stored "
            "state nearest to it in parameter space (θ0, a snapshot or θT)"
        )
        if layout.unstored:
            note += f"; not stored, kept as initialized: {', '.join(layout.unstored)}"
        return cls([s for states in stored for s in states], layout, note)

    def nearest(self, theta: torch.Tensor) -> int | None:
        """The index of the stored state nearest ``theta`` (a flat vector); None: no state."""
        if not self._buffers:
            return None
        theta = theta.detach().to("cpu", torch.float64)
        rows = max(1, _CHUNK_ENTRIES // max(1, theta.numel()))
        distances = torch.cat(
            [((chunk.double() - theta) ** 2).sum(1) for chunk in self._thetas.split(rows)]
        )
        return int(torch.argmin(distances))

    def plane_coordinates(self, plane: Plane) -> np.ndarray | None:
        """``(a, b, r²)`` of every stored state on ``plane``, shape (3, n); None: no state."""
        if not self._buffers:
            return None
        origin, u, v = (
            torch.tensor(x, dtype=torch.float64) for x in (plane.origin, plane.u, plane.v)
        )
        a, b, r2 = [], [], []
        rows = max(1, _CHUNK_ENTRIES // max(1, origin.numel()))
        for chunk in self._thetas.split(rows):
            d = chunk.double() - origin
            a.append(d @ u)
            b.append(d @ v)
            r2.append((d**2).sum(1) - a[-1] ** 2 - b[-1] ** 2)
        return torch.stack([torch.cat(x) for x in (a, b, r2)]).numpy()

    @staticmethod
    def nearest_on_plane(coordinates: np.ndarray | None, a: float, b: float) -> int | None:
        """The index of the stored state nearest the plane's point (a, b), from
        :meth:`plane_coordinates`: ‖θ0 + a·u + b·v − θs‖² = r_s² + (a − a_s)² + (b − b_s)²."""
        if coordinates is None:
            return None
        a_s, b_s, r2 = coordinates
        return int(np.argmin(np.maximum(r2, 0.0) + (a - a_s) ** 2 + (b - b_s) ** 2))

    def load(self, module: nn.Module, index: int | None) -> None:
        """Copy state ``index``'s buffers into ``module`` (nothing for None)."""
        if index is not None:
            self._layout.load(module, self._buffers[index])


def _summary(layout: BufferLayout) -> str:
    kinds = sorted({name.rpartition(".")[2] for name in layout.names})
    return ", ".join(kinds[:4]) + (", ..." if len(kinds) > 4 else "")
