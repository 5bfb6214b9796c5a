"""Loss heatmaps over planes (dynamics.geometry.landscape)."""

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from dynamics.geometry.landscape import LossSurface, evaluate_grid
from dynamics.geometry.plane import Grid, Plane, plane_from_gradients
from dynamics.params.layout import ParameterLayout
from dynamics.params.vectors import parameter_vector


class Regressor(nn.Module):
    """A small pre-norm residual regressor whose loss comes through the toolkit's loss rule."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))

    def dynamics_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)


class Vector(nn.Module):
    """Parameters without a forward: losses are written directly in terms of them."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(size))


def _gradient(module: nn.Module, batch) -> np.ndarray:
    grads = torch.autograd.grad(module.dynamics_loss(batch), list(module.parameters()))
    return torch.cat([g.reshape(-1) for g in grads]).double().numpy()


@pytest.fixture
def setup() -> tuple[Regressor, ParameterLayout, tuple, Plane]:
    torch.manual_seed(0)
    model = Regressor()
    x = torch.randn(64, 8)
    batch = (x, torch.sin(x))
    other = (x, torch.cos(x))
    plane = plane_from_gradients(
        parameter_vector(model), _gradient(model, batch), _gradient(model, other)
    )
    return model, ParameterLayout.of(model), batch, plane


def test_heatmap_equals_a_direct_loss_evaluation_at_every_point(setup):
    model, layout, batch, plane = setup
    before = parameter_vector(model)
    grid = Grid(np.linspace(-2.0, 3.0, 5), np.linspace(-1.0, 1.0, 3))

    heatmap = evaluate_grid(LossSurface(model, layout, batch), plane, grid)

    assert heatmap.shape == (3, 5) and heatmap.dtype == np.float64
    for i, b in enumerate(grid.betas):
        for j, a in enumerate(grid.alphas):
            fresh = Regressor()
            vector = torch.from_numpy(plane.point(a, b)).float()
            fresh.load_state_dict(dict(zip(layout.names, layout.split(vector))))
            with torch.no_grad():
                direct = fresh.dynamics_loss(batch).item()
            assert heatmap[i, j] == pytest.approx(direct, rel=1e-5), (i, j)
    assert len(np.unique(heatmap)) == heatmap.size
    assert torch.equal(parameter_vector(model), before)


@pytest.mark.parametrize("axis", ["a", "b"])
def test_non_square_heatmap_puts_alphas_on_columns_and_betas_on_rows(axis):
    e = np.eye(6)
    plane = Plane(np.zeros(6), e[2], e[4], "axes")
    grid = Grid(np.array([-1.0, 0.0, 0.5, 2.0, 3.0]), np.array([-4.0, 1.0, 7.0]))
    index = 2 if axis == "a" else 4
    surface = LossSurface(
        Vector(6), ParameterLayout.of(Vector(6)), None, lambda module, _: module.w[index]
    )

    heatmap = evaluate_grid(surface, plane, grid)

    expected = grid.alphas[None, :] if axis == "a" else grid.betas[:, None]
    np.testing.assert_array_equal(heatmap, np.broadcast_to(expected, (3, 5)))


def test_a_stochastic_loss_sees_the_same_draws_at_every_point_and_leaves_the_rng_alone():
    e = np.eye(3)
    surface = LossSurface(
        Vector(3),
        ParameterLayout.of(Vector(3)),
        None,
        lambda module, _: module.w.sum() * 0 + torch.randn(()),
    )
    torch.manual_seed(123)
    expected_next = torch.rand(4)
    torch.manual_seed(123)

    heatmap = evaluate_grid(surface, Plane(np.zeros(3), e[0], e[1], "axes"), Grid([0, 1], [0, 1]))

    assert np.all(heatmap == heatmap[0, 0])
    assert surface.loss(np.ones(3)) == heatmap[0, 0]
    assert torch.equal(torch.rand(4), expected_next)


def test_surface_rejects_a_module_of_another_layout(setup):
    model, layout, batch, _ = setup
    with pytest.raises(ValueError, match="has no parameter 'norm.weight'"):
        LossSurface(Vector(layout.size), layout, batch)
    with pytest.raises(ValueError, match="has shape"):
        LossSurface(Regressor(width=4), layout, batch)
    partial = ParameterLayout(layout.names[1:], layout.shapes[1:])
    with pytest.raises(ValueError, match="trainable parameter 'norm.weight' outside the layout"):
        LossSurface(model, partial, batch)


def test_evaluation_rejects_a_plane_or_vector_of_another_size(setup):
    model, layout, batch, _ = setup
    surface = LossSurface(model, layout, batch)
    e = np.eye(layout.size + 1)
    with pytest.raises(ValueError, match="plane vectors have"):
        evaluate_grid(surface, Plane(e[0], e[1], e[2], "axes"), Grid([0, 1], [0, 1]))
    with pytest.raises(ValueError, match="layout has"):
        surface.loss(e[0])


def test_distributed_flag_needs_a_process_group(setup):
    model, layout, batch, plane = setup
    with pytest.raises(ValueError, match="initialized torch.distributed process group"):
        evaluate_grid(
            LossSurface(model, layout, batch), plane, Grid([0, 1], [0, 1]), distributed=True
        )


def _evaluate_on_rank(rank: int, world: int, surface, plane, grid, tmp: Path, where=None) -> None:
    # One thread in every process so a point is computed by the same kernels on every rank.
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp / 'store'}", rank=rank, world_size=world
    )
    try:
        heatmap = evaluate_grid(surface, plane, grid, distributed=True, where=where)
        np.save(tmp / f"rank{rank}.npy", heatmap)
        if rank == 0:
            np.save(tmp / "single.npy", evaluate_grid(surface, plane, grid))
    finally:
        dist.destroy_process_group()


def test_distributed_evaluation_equals_one_process(setup, tmp_path):
    model, layout, batch, plane = setup
    surface = LossSurface(model, layout, batch)
    grid = Grid(np.linspace(-1.0, 1.0, 5), np.linspace(-0.5, 0.5, 3))  # 15 points: 8 + 7

    mp.start_processes(
        _evaluate_on_rank,
        args=(2, surface, plane, grid, tmp_path),
        nprocs=2,
        start_method="fork",
    )

    single = np.load(tmp_path / "single.npy")
    assert single.shape == (3, 5) and np.all(np.isfinite(single))
    for rank in range(2):
        np.testing.assert_array_equal(np.load(tmp_path / f"rank{rank}.npy"), single)


def test_refined_points_alone_are_evaluated_alike_on_every_rank(setup, tmp_path):
    model, layout, batch, plane = setup
    surface = LossSurface(model, layout, batch)
    grid = Grid(np.linspace(-1.0, 1.0, 5), np.linspace(-0.5, 0.5, 4))
    where = np.zeros(grid.shape, dtype=bool)
    where[0, :3] = where[2, 1:] = where[3, 4] = True  # row 1 has no point: no rank may wait

    mp.start_processes(
        _evaluate_on_rank,
        args=(2, surface, plane, grid, tmp_path, where),
        nprocs=2,
        start_method="fork",
    )

    full = np.load(tmp_path / "single.npy")
    for rank in range(2):
        refined = np.load(tmp_path / f"rank{rank}.npy")
        np.testing.assert_array_equal(refined[where], full[where])
        assert np.isnan(refined[~where]).all()
