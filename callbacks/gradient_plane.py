"""The initial gradient g0, and the run's coordinates on a plane of initial gradients."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch

from dynamics import world
from dynamics.callbacks.fit import Fit
from dynamics.callbacks.probe import Probe, Rows, SeriesSpec
from dynamics.callbacks.probe_loss import ProbeLoss
from dynamics.geometry.landscape import LossSurface, Trajectory, evaluate_grid, trajectory
from dynamics.geometry.plane import (
    CollinearGradients,
    Plane,
    covering_grid,
    out_of_plane_view,
    plane_from_gradients,
    project,
)
from dynamics.params.batch_tree import flatten_batch
from dynamics.params.layout import ParameterLayout
from dynamics.params.vectors import module_device, parameter_vector, storable, vector_hash
from dynamics.passes.initial_gradient import initial_gradient
from dynamics.passes.isolation import Mode, side_effect_free
from dynamics.sharding import ParameterShards
from dynamics.store import RunFileError, names, open_run


class GradientPlane(Probe):
    """Stores g0 and the probe batch; records (a, b, r) of θt − θ0 on a known plane.

    What it records, cost, when it steps aside and pitfalls: ``docs/probes/gradient_plane.md``.
    Under FSDP each rank projects its own entries of θ (one all-reduce per due step); g0 and
    the end-of-fit views are taken on a whole-parameter copy, and every vector is written whole.

    Example::

        GradientPlane(partner="runs/lr0.1.h5", every_n_steps=10, at_end=True)

    Args:
        partner: a finished run file of the same θ0 whose ``g0`` spans the plane with ours.
        basis: an explicit plane (as ``dynamics run`` passes both students).
        batch: the probe batch; default: a copy of the first training batch.
        every_n_steps: period of the (a, b, r) series.
        mode: ``"eval"`` or ``"train"``, the :data:`~dynamics.passes.isolation.Mode` of the module
            while g0 is taken (and the end-of-fit views are evaluated).
        at_end: evaluate the plane views at the end of fit (needs ``partner`` or ``basis``).
        grid: grid points per axis of the end-of-fit heatmaps.
        margin: extra fraction of the trajectories' range on each side of those grids.
        checkpoints: most checkpoints kept for the end-of-fit trajectories (≥ 2).
    """

    name = names.PLANE

    def __init__(
        self,
        partner: str | os.PathLike | None = None,
        basis: Plane | None = None,
        batch: Any = None,
        every_n_steps: int = 1,
        mode: Mode = "eval",
        at_end: bool = False,
        grid: int = 41,
        margin: float = 0.25,
        checkpoints: int = 32,
    ) -> None:
        super().__init__(every_n_steps)
        if partner is not None and basis is not None:
            raise ValueError("give GradientPlane a partner run or a basis, not both")
        if at_end and partner is None and basis is None:
            raise ValueError("GradientPlane(at_end=True) needs the plane: give partner or basis")
        if grid < 2 or checkpoints < 2 or not margin >= 0:
            raise ValueError(
                f"need grid >= 2, checkpoints >= 2 and margin >= 0, got {grid}, {checkpoints}, "
                f"{margin}"
            )
        self.partner = Path(partner) if partner is not None else None
        self.plane = basis
        self.at_end = at_end
        self.grid = grid
        self.margin = margin
        self.checkpoints = checkpoints
        # (step, θ_step on the CPU) for the end-of-fit trajectories, every _stride-th due step;
        # θ_step is None off rank zero under sharding (gathered there only).
        self._kept: list[tuple[int, torch.Tensor | None]] = []
        self._stride = 1
        self._loss = ProbeLoss("GradientPlane", mode, batch)
        # Known from setup on (or, for g0 and θ0, from a checkpoint's state). The full g0, θ0
        # and plane are kept where vectors are written: on rank zero alone under sharding.
        self.layout: ParameterLayout | None = None
        self._shards: ParameterShards | None = None
        self._g0: torch.Tensor | None = None
        self._theta0: torch.Tensor | None = None
        self._local: _LocalPlane | None = None  # this rank's part of θ0, u and v
        self._row: dict[str, torch.Tensor] | None = None  # coordinates of θ_step, taken pre-update

    @property
    def mode(self) -> Mode:
        return self._loss.mode

    def setup(self, fit: Fit, pl_module: pl.LightningModule, batch: Any) -> None:
        self._loss.setup(fit, pl_module, batch)
        self._shards = self._loss.shards
        self.layout = self._shards.layout
        if self._g0 is None:  # a resumed fit restored g0 and θ0 from the checkpoint
            # On whole parameters (every rank, under sharding too), averaged over the ranks as
            # under DDP; the copy is freed when the block ends.
            with self._loss.whole(pl_module) as module:
                self._theta0 = parameter_vector(module, self.layout)
                self._g0 = initial_gradient(
                    module, self._loss.batch, self.layout, self.mode, self._loss.rule
                )
        if self.partner is not None and self.plane is None:
            try:
                self.plane = self._plane_with_partner()
            except CollinearGradients as error:
                # Runs that differ only in the learning rate or the optimizer share g0: no plane,
                # but g0 and the probe batch are this run's as ever, for the offline views.
                self.note(
                    fit.global_step,
                    f"no coordinates on the plane of this run's and the partner's initial "
                    f"gradients, which span none ({error}){self._at_end_skipped()}; g0 and the "
                    "probe batch are stored, so dynamics plane --plane auto draws the plane of "
                    "g0 and the endpoints' direction",
                )
        if self.plane is not None:
            if self.plane.size != self.layout.size:  # the same on every rank
                raise ValueError(
                    f"GradientPlane basis has {self.plane.size} entries, the model's trainable "
                    f"parameters {self.layout.size}"
                )
            theta0 = self._theta0.to(module_device(pl_module))  # a checkpoint's is on the CPU
            self._local = _LocalPlane.of(self.plane, self._shards, theta0)
        if self._shards.sharded and world.rank() != 0:  # full vectors only where written
            self._g0 = self._theta0 = self.plane = None
            self._kept = [(step, None) for step, _ in self._kept]

    def series(self) -> dict[str, dict[str, SeriesSpec]]:
        if not self._planar:
            return {}
        # Drawn by the report's dedicated plane view, so no generic view is declared.
        return {
            names.PLANE: {
                names.PLANE_A: SeriesSpec(),
                names.PLANE_B: SeriesSpec(),
                names.PLANE_R: SeriesSpec(),
            }
        }

    def vectors(self) -> dict[str, SeriesSpec]:
        """g0, the probe batch and the plane; none before setup, which finds their sizes."""
        if self.layout is None:
            return {}
        size = (self.layout.size,)
        vectors = {names.G0: SeriesSpec(size)}
        for name, array in self._batch_arrays():
            vectors[name] = SeriesSpec(array.shape, str(array.dtype))
        if self._planar:
            vectors |= {
                names.PLANE_U: SeriesSpec(size, "float64"),
                names.PLANE_V: SeriesSpec(size, "float64"),
            }
        if self.at_end and self._planar:
            rows = self.checkpoints + 1  # and θT
            columns = len(names.PLANE_END_TRAJECTORY_COLUMNS)
            vectors[names.PLANE_END_STEPS] = SeriesSpec((rows,), "float64")
            for view in names.PLANE_END_VIEWS:
                shapes = {
                    "alphas": (self.grid,),
                    "betas": (self.grid,),
                    "losses": (self.grid, self.grid),
                    "trajectory": (rows, columns),
                }
                if view != names.PLANE_END_VIEWS[0]:
                    shapes |= {"u": size, "v": size}
                for field, shape in shapes.items():
                    vectors[names.plane_end(view, field)] = SeriesSpec(shape, "float64")
        return vectors

    def initial_vectors(self) -> dict[str, np.ndarray]:
        """g0, the probe batch and the plane, whole (called on rank zero)."""
        if self._g0 is None:
            return {}
        vectors = {names.G0: self._g0.cpu().numpy(), **dict(self._batch_arrays())}
        if self.plane is not None:
            vectors |= {names.PLANE_U: self.plane.u, names.PLANE_V: self.plane.v}
        return vectors

    def settings(self) -> dict[str, Any]:
        settings = self._loss.settings()
        if self._loss.batch is not None:
            settings[names.PROBE_BATCH_STRUCTURE], _ = flatten_batch(self._loss.batch)
        if self.at_end:
            settings["at_end"] = {
                "kind": None if self.plane is None else self.plane.kind,
                "grid": self.grid,
                "margin": self.margin,
                "checkpoints": self.checkpoints,
            }
        return settings

    def is_due(self, step: int) -> bool:
        return self._planar and super().is_due(step)

    def on_step_start(self, fit, pl_module, batch, step) -> None:
        # Every rank: under sharding the coordinates and the kept θ_step are collectives.
        self._row = self._coordinates(pl_module)
        if self.at_end and (step // self.every_n_steps) % self._stride == 0:
            self._kept.append((step, self._whole_theta(pl_module)))
            if len(self._kept) > self.checkpoints:
                self._kept, self._stride = self._kept[::2], 2 * self._stride

    def on_step_end(self, fit, pl_module, batch, outputs, step) -> Rows:
        row, self._row = self._row, None
        return {names.PLANE: row} if row is not None else {}

    def final_vectors(self, fit, pl_module) -> dict[str, np.ndarray]:
        """The end-of-fit plane views (``at_end``), evaluated on global rank zero on a module
        with whole parameters (every rank takes part in gathering them)."""
        if not (self.at_end and self._planar):
            return {}
        theta_final = self._whole_theta(pl_module)
        with self._loss.whole(pl_module) as module:
            if not fit.is_global_zero:
                return {}
            # A whole-parameter copy (under sharding) is the surface's own: no second copy.
            copied = module is not pl_module
            return self._end_views(module, copied, theta_final, fit.global_step)

    def teardown(self) -> None:
        self._kept = []

    def state_dict(self) -> dict[str, Any]:
        # Tensors and plain values only: Lightning loads checkpoints with ``weights_only``.
        loss = self._loss.state_dict()  # every rank: it gathers the ranks' probe batches
        if self._g0 is None:
            return {}
        plane = {}
        if self.plane is not None:
            plane = {
                "plane_u": torch.from_numpy(np.array(self.plane.u)),
                "plane_v": torch.from_numpy(np.array(self.plane.v)),
                "plane_kind": self.plane.kind,
                "plane_metadata": json.dumps(dict(self.plane.metadata), default=_plain),
            }
        return {
            "g0": self._g0.cpu(),
            "theta0": self._theta0.cpu(),
            **plane,
            "kept_steps": [step for step, _ in self._kept],
            "kept_thetas": [theta for _, theta in self._kept],
            "stride": self._stride,
            **loss,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self._g0, self._theta0 = state["g0"], state["theta0"]
            self._kept = list(zip(state["kept_steps"], state["kept_thetas"], strict=True))
            self._stride = state["stride"]
            self._loss.load_state_dict(state)
            if "plane_u" in state:
                self.plane = Plane(
                    self._theta0.double().numpy(),
                    state["plane_u"].numpy(),
                    state["plane_v"].numpy(),
                    kind=state["plane_kind"],
                    metadata=json.loads(state["plane_metadata"]),
                )

    def _end_views(
        self, module: torch.nn.Module, copied: bool, theta_final: torch.Tensor, last_step: int
    ) -> dict[str, np.ndarray]:
        """The end-of-fit views on ``module`` with whole parameters (``copied``: a throwaway
        copy, evaluated in place), through θ_final."""
        steps = np.array([step for step, _ in self._kept] + [last_step])
        # float32 rows: projections and losses take each row to float64 one at a time.
        stacked = torch.stack([theta for _, theta in self._kept] + [theta_final])
        thetas = (stacked if stacked.dtype == torch.float64 else stacked.float()).numpy()
        with side_effect_free(module, self.mode):
            surface = LossSurface(
                module,
                self.layout,
                self._loss.batch,
                self._loss.rule,
                mode=self.mode,
                in_place=copied,
            )
            first = trajectory(names.PLANE, self.plane, steps, thetas, surface)
            second_plane, _ = out_of_plane_view(self.plane, thetas[-1])
            second = trajectory(names.PLANE, second_plane, steps, thetas, surface)
            views = {
                names.PLANE_END_VIEWS[0]: (self.plane, first, self._partner_paths()),
                names.PLANE_END_VIEWS[1]: (second_plane, second, []),
            }
            vectors = {names.PLANE_END_STEPS: self._padded(steps)}
            for view, (plane, path, others) in views.items():
                grid = covering_grid(
                    [(path.a, path.b), *others],
                    num_alphas=self.grid,
                    num_betas=self.grid,
                    margin=self.margin,
                )
                vectors |= {
                    names.plane_end(view, "alphas"): grid.alphas,
                    names.plane_end(view, "betas"): grid.betas,
                    names.plane_end(view, "losses"): evaluate_grid(surface, plane, grid),
                    names.plane_end(view, "trajectory"): self._padded(_columns(path)),
                }
        vectors[names.plane_end(names.PLANE_END_VIEWS[1], "u")] = second_plane.u
        vectors[names.plane_end(names.PLANE_END_VIEWS[1], "v")] = second_plane.v
        return vectors

    @property
    def _planar(self) -> bool:
        """Whether coordinates are recorded: a plane is known (on every rank alike)."""
        return self._local is not None or self.plane is not None

    def _coordinates(self, pl_module: pl.LightningModule) -> dict[str, torch.Tensor]:
        """a, b and r of θ_step − θ0, from this rank's entries and one sum over the ranks."""
        d = self._shards.local(pl_module).double() - self._local.theta0
        dot_u, dot_v, square = self._shards.sum([d @ self._local.u, d @ self._local.v, d @ d])
        uu, vv, uv = self._local.gram
        # ‖d − a·u − b·v‖² with a = d·u, b = d·v, from sums alone (exact for any basis).
        residual = square - 2 * (dot_u**2 + dot_v**2) + dot_u**2 * uu + dot_v**2 * vv
        residual = residual + 2 * dot_u * dot_v * uv
        return {
            names.PLANE_A: dot_u,
            names.PLANE_B: dot_v,
            names.PLANE_R: residual.clamp(min=0).sqrt(),
        }

    def _whole_theta(self, pl_module: pl.LightningModule) -> torch.Tensor | None:
        """θ whole on the CPU on rank zero (None elsewhere; every rank must call it)."""
        if not self._shards.sharded and world.rank() != 0:
            return None
        theta = self._shards.gather(self._shards.local(pl_module))
        return None if theta is None else theta.cpu()

    def _batch_arrays(self) -> list[tuple[str, np.ndarray]]:
        _, leaves = flatten_batch(self._loss.batch)
        # The offline views evaluate the loss in float64 anyway: a bf16 batch as float32 loses
        # nothing.
        return [
            (f"{names.PROBE_BATCH_PREFIX}{i}", storable(t.detach()).cpu().numpy())
            for i, t in enumerate(leaves)
        ]

    def _at_end_skipped(self) -> str:
        """What a degenerate plane costs ``at_end``, as part of a sentence."""
        return " and no end-of-fit views on it (at_end)" if self.at_end else ""

    def _padded(self, values: np.ndarray) -> np.ndarray:
        """``values`` (one row per checkpoint) NaN-padded to the declared checkpoint rows."""
        padded = np.full((self.checkpoints + 1, *values.shape[1:]), np.nan)
        padded[: len(values)] = values
        return padded

    def _partner_paths(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The partner's snapshots and θT on the plane, so the heatmap covers both runs."""
        if self.partner is None:
            return []
        partner = open_run(self.partner)
        snapshots = partner.recorded(names.SNAPSHOTS)
        thetas = [] if snapshots is None else [snapshots[names.SNAPSHOT_THETA]]
        final = partner.vector(names.THETA_FINAL)
        thetas += [] if final is None else [final[None]]
        if not thetas:
            return []
        a, b, _ = project(self.plane, np.vstack(thetas))
        return [(a, b)]

    def _plane_with_partner(self) -> Plane:
        try:
            partner = open_run(self.partner)
        except RunFileError as error:
            raise ValueError(f"GradientPlane partner: {error}") from None
        if partner.attrs.get(names.ATTR_THETA0_SHA256) != vector_hash(self._theta0):
            raise ValueError(f"GradientPlane partner {self.partner} does not share this run's θ0")
        g_partner = partner.vector(names.G0)
        if g_partner is None:
            raise ValueError(f"GradientPlane partner {self.partner} stores no initial gradient g0")
        theta0 = self._theta0.double().cpu().numpy()
        return plane_from_gradients(theta0, g_partner, self._g0.double().cpu().numpy())


class _LocalPlane:
    """This rank's part of θ0, u and v in float64, and the basis's inner products over all."""

    def __init__(
        self, theta0: torch.Tensor, u: torch.Tensor, v: torch.Tensor, gram: tuple[float, ...]
    ) -> None:
        self.theta0, self.u, self.v, self.gram = theta0, u, v, gram

    @classmethod
    def of(cls, plane: Plane, shards: ParameterShards, theta0: torch.Tensor) -> _LocalPlane:
        """From the full ``plane`` (on every rank) and θ0 on its device."""
        u, v = (np.array(w, dtype=np.float64) for w in (plane.u, plane.v))  # writable
        gram = (float(u @ u), float(v @ v), float(u @ v))
        parts = (shards.part(theta0).double(), *(shards.part(w).to(theta0.device) for w in (u, v)))
        return cls(*parts, gram)


def _plain(value: Any) -> Any:
    """A NumPy value in a plane's metadata as JSON takes it."""
    return np.asarray(value).tolist()


def _columns(path: Trajectory) -> np.ndarray:
    return np.stack([getattr(path, c) for c in names.PLANE_END_TRAJECTORY_COLUMNS], axis=1)
