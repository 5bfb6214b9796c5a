"""Plane views for models that are not ours: evaluated in training at the end of fit
(``GradientPlane(at_end=True)``), planes for runs whose initial gradients coincide, and long
grids (progress, rows written as they finish, processes)."""

from __future__ import annotations

import copy
import re

import h5py
import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dynamics import open_run
from dynamics.callbacks import DynamicsRecorder, GradientPlane, ParameterDisplacement
from dynamics.geometry.plane import plane_from_gradients
from dynamics.params.layout import ParameterLayout
from dynamics.params.vectors import load_vector, parameter_vector
from dynamics.passes.loss_rule import module_loss
from dynamics.store import names


class DictDigits(Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 1, 6, 6, generator=generator)
        self.y = torch.randint(0, 3, (64,), generator=generator)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


class DictBatchCNN(pl.LightningModule):
    """Conv → BatchNorm → ReLU → Dropout → Linear whose training_step reads a dict batch.

    Defined in a test file, so a ``dynamics`` process cannot import it to rebuild it.
    """

    def __init__(self, lr: float = 0.2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.features = nn.Sequential(
            nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Dropout(0.25)
        )
        self.head = nn.Linear(3 * 6 * 6, 3)

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self.head(self.features(batch["x"]).flatten(1)), batch["y"])
        self.log("train_loss", loss)
        return {"loss": loss}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(1)
        return DataLoader(DictDigits(), batch_size=16, shuffle=True, generator=generator)


def fit_cnn(quiet_trainer, path, probes, seed=0, lr=0.2, **trainer_options):
    torch.manual_seed(seed)
    module = DictBatchCNN(lr)
    options = dict(max_epochs=2, deterministic=True) | trainer_options
    quiet_trainer(callbacks=[DynamicsRecorder(path, probes)], **options).fit(module)
    return module


@pytest.fixture(scope="module")
def cnn_runs(tmp_path_factory, quiet_trainer):
    """Run ``a`` (g0 only) and run ``b`` (partner ``a``, views evaluated at the end of fit)."""
    folder = tmp_path_factory.mktemp("cnn")
    fit_cnn(quiet_trainer, folder / "a.h5", [GradientPlane(), ParameterDisplacement()])
    other_batch = {"x": DictDigits().x[-16:], "y": DictDigits().y[-16:]}  # another g0
    plane = GradientPlane(
        partner=folder / "a.h5", batch=other_batch, at_end=True, grid=5, checkpoints=4
    )
    module = fit_cnn(quiet_trainer, folder / "b.h5", [plane, ParameterDisplacement()], lr=0.1)
    return folder, module


def direct_loss(module, theta, batch) -> float:
    """The loss of a copy of ``module`` (its buffers as they are) at θ, in eval mode."""
    copied = copy.deepcopy(module).eval()
    load_vector(copied, torch.from_numpy(theta).float(), ParameterLayout.of(copied))
    with torch.no_grad():
        return module_loss(copied, batch).item()


def test_views_evaluated_at_the_end_of_fit_equal_a_direct_evaluation(cnn_runs):
    folder, module = cnn_runs
    run = open_run(folder / "b.h5")
    batch = {"x": torch.from_numpy(run.vector("probe_batch.0")), "y": None}
    batch["y"] = torch.from_numpy(run.vector("probe_batch.1"))
    theta0 = run.vector("theta0").astype(np.float64)
    steps = run.vector(names.PLANE_END_STEPS)
    kept = steps[~np.isnan(steps)]
    assert kept[0] == 0 and kept[-1] == 8 and len(kept) <= 5  # thinned to 4, then θT
    for view in names.PLANE_END_VIEWS:
        if view == "plane":
            u, v = run.vector("plane_u"), run.vector("plane_v")
        else:
            u, v = (run.vector(names.plane_end(view, w)) for w in ("u", "v"))
        alphas, betas = (run.vector(names.plane_end(view, f)) for f in ("alphas", "betas"))
        losses = run.vector(names.plane_end(view, "losses"))
        assert losses.shape == (5, 5) and len(np.unique(losses)) == 25
        for i, j in [(0, 0), (4, 1), (2, 3), (1, 4)]:
            theta = theta0 + alphas[j] * u + betas[i] * v
            assert losses[i, j] == pytest.approx(direct_loss(module, theta, batch), rel=1e-5)
        rows = run.vector(names.plane_end(view, "trajectory"))[: len(kept)]
        a, b, r, loss, plane_loss = rows.T
        final = run.vector("theta_final").astype(np.float64)
        assert loss[-1] == pytest.approx(direct_loss(module, final, batch), rel=1e-5)
        d = final - theta0
        assert a[-1] == pytest.approx(d @ u, rel=1e-6) and b[-1] == pytest.approx(d @ v, rel=1e-6)
        projection = theta0 + a[-1] * u + b[-1] * v
        assert plane_loss[-1] == pytest.approx(direct_loss(module, projection, batch), rel=1e-5)
    assert run.vector(names.plane_end("out_of_plane", "trajectory"))[len(kept) - 1, 2] < 1e-4
    (probe, _) = run.attrs["probes"]
    assert probe["settings"]["at_end"] == {
        "kind": "gradients",
        "grid": 5,
        "margin": 0.25,
        "checkpoints": 4,
    }


def test_evaluating_at_the_end_of_fit_never_perturbs_training(tmp_path, quiet_trainer):
    def train(callbacks):
        torch.manual_seed(3)
        module = DictBatchCNN()
        quiet_trainer(max_epochs=2, callbacks=callbacks, deterministic=True).fit(module)
        return parameter_vector(module), [b.clone() for b in module.buffers()]

    size = ParameterLayout.of(DictBatchCNN()).size
    rng = np.random.default_rng(0)
    torch.manual_seed(3)
    basis = plane_from_gradients(
        parameter_vector(DictBatchCNN()).double().numpy(),
        rng.standard_normal(size),
        rng.standard_normal(size),
    )
    plain = train([])
    probes = [GradientPlane(basis=basis, at_end=True, grid=3), ParameterDisplacement()]
    recorded = train([DynamicsRecorder(tmp_path / "p.h5", probes)])
    assert torch.equal(plain[0], recorded[0])
    assert all(torch.equal(x, y) for x, y in zip(plain[1], recorded[1]))
    run = open_run(tmp_path / "p.h5")
    assert run.vector(names.plane_end("plane", "losses")) is not None and not run.events()


def test_at_end_needs_a_plane_during_the_run():
    with pytest.raises(ValueError, match="needs the plane"):
        GradientPlane(at_end=True)


def test_plane_command_draws_views_evaluated_in_training_without_the_model(
    cnn_runs, dynamics, one_line_error, tmp_path
):
    folder, _ = cnn_runs
    out = tmp_path / "plane.html"
    # The model's module (tests.test_plane_at_end) is no installed package: not imported.
    result = dynamics(
        "plane", folder / "a.h5", folder / "b.h5", "-o", out, "--no-progress", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "no heatmaps of a: " in result.stdout
    assert "outside the installed packages" in result.stdout
    page = out.read_text()
    assert "evaluated in the training process at the end of fit (eval mode" in page
    run = open_run(folder / "b.h5")
    with h5py.File(tmp_path / "plane.plane.h5") as views:
        assert [views[v].attrs["run"] for v in views] == ["b", "b"]
        assert views.attrs["complete"]
        for index, view in enumerate(names.PLANE_END_VIEWS):
            np.testing.assert_array_equal(
                views[f"view{index}"]["losses"][:], run.vector(names.plane_end(view, "losses"))
            )
        a_path = views["view0"]["trajectory"]["a"]  # projected from a's snapshots, no losses
        assert np.isfinite(a_path["a"][:]).all() and np.isnan(a_path["loss"][:]).all()
    swapped = dynamics(
        "plane", folder / "b.h5", folder / "a.h5", "-o", tmp_path / "s.html", cwd=tmp_path
    )
    one_line_error(swapped)  # u from b's g0: not the plane b evaluated in training
    assert "outside the installed packages" in swapped.stderr
    # The same plane in another basis (u from a's g0): the refusal names the order that draws it.
    order = f"in the other order: dynamics plane {folder / 'a.h5'} {folder / 'b.h5'}"
    assert f"b stored views on this plane with the runs {order}" in swapped.stderr


# ---------------------------------------------------------------------------------------------
# Runs whose initial gradients coincide: the same model at two learning rates

ARCH = dict(width=8, expansion=2, depth=2)


@pytest.fixture(scope="module")
def two_learning_rates(tmp_path_factory, quiet_trainer):
    from dynamics.experiments import TeacherStudentData, TeacherStudentModule

    folder = tmp_path_factory.mktemp("lrs")
    for name, lr in (("slow", 1e-3), ("fast", 1e-2)):
        module = TeacherStudentModule(**ARCH, lr=lr)
        recorder = DynamicsRecorder(
            folder / f"{name}.h5", [GradientPlane(), ParameterDisplacement()]
        )
        trainer = quiet_trainer(max_steps=12, callbacks=[recorder])
        trainer.fit(module, TeacherStudentData(**ARCH, batch_size=16))
    return folder / "slow.h5", folder / "fast.h5"


def test_coinciding_gradients_fall_back_to_the_gradient_endpoint_plane(
    two_learning_rates, dynamics, one_line_error, tmp_path
):
    slow, fast = two_learning_rates
    g = open_run(slow).vector("g0").astype(np.float64)
    np.testing.assert_array_equal(g, open_run(fast).vector("g0"))
    one_line_error(
        refused := dynamics("plane", slow, fast, "-o", tmp_path / "g.html", "--plane", "gradients")
    )
    assert "collinear" in refused.stderr and "--plane gradient-endpoints" in refused.stderr
    out = tmp_path / "auto.html"
    result = dynamics("plane", slow, fast, "-o", out, "--grid", "3", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "plane: initial gradients coincide" in result.stdout
    assert "initial gradients coincide" in out.read_text()
    ends = [open_run(p).vector("theta_final").astype(np.float64) for p in (slow, fast)]
    with h5py.File(tmp_path / "auto.plane.h5") as views:
        view = views["view0"]
        assert view.attrs["kind"] == "gradient-endpoints"
        u, v = view["u"][:], view["v"][:]
        np.testing.assert_allclose(u, g / np.linalg.norm(g), atol=1e-12)
        between = ends[1] - ends[0]
        inside = (between @ u) * u + (between @ v) * v
        np.testing.assert_allclose(inside, between, atol=1e-9 * np.linalg.norm(between))
        assert abs(u @ v) < 1e-12 and between @ v > 0


@pytest.mark.parametrize("kind", ["pca", "random-filter-normalized"])
def test_plane_choices_reach_the_pca_and_random_planes(
    two_learning_rates, dynamics, tmp_path, kind
):
    slow, fast = two_learning_rates
    out = tmp_path / "p.html"
    choice = "pca" if kind == "pca" else "random"
    result = dynamics(
        "plane", slow, fast, "-o", out, "--grid", "3", "--no-progress", "--plane", choice
    )
    assert result.returncode == 0, result.stderr
    with h5py.File(tmp_path / "p.plane.h5") as views:
        assert (
            views["view0"].attrs["kind"] == kind and views["view2"].attrs["kind"] == "out-of-plane"
        )
        assert np.isfinite(views["view0"]["losses"][:]).all()


# ---------------------------------------------------------------------------------------------
# Long grids: one progress bar with an estimate, rows written as they finish, every core


def test_progress_bar_counts_every_evaluation_with_an_estimate(
    two_learning_rates, dynamics, tmp_path
):
    result = dynamics(
        "plane", *two_learning_rates, "-o", tmp_path / "p.html", "--grid", "4", "--processes", "1"
    )
    assert result.returncode == 0, result.stderr
    checkpoints = len(open_run(two_learning_rates[0]).series("snapshots").step) + 1
    total = 2 * (4 * checkpoints + 2 * 4 * 4)  # trajectories on both planes, two grids, per run
    assert "plane losses: 100%" in result.stderr and f"{total}/{total}" in result.stderr
    assert "<00:00" in result.stderr  # tqdm's estimate of the time left


def test_an_interrupted_grid_keeps_its_finished_rows(two_learning_rates, tmp_path, monkeypatch):
    from dynamics.analysis.pages.plane import write_plane
    from dynamics.geometry.landscape import LossSurface

    write_plane(*two_learning_rates, tmp_path / "full.html", grid_side=5, processes=1)
    rows_done, evaluate = [], LossSurface.losses_on_plane

    def interrupted(self, plane, grid, points):
        if len(rows_done) == 3:
            raise KeyboardInterrupt
        rows_done.append(points)
        return evaluate(self, plane, grid, points)

    monkeypatch.setattr(LossSurface, "losses_on_plane", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_plane(*two_learning_rates, tmp_path / "cut.html", grid_side=5, processes=1)
    assert not (tmp_path / "cut.html").exists()
    with h5py.File(tmp_path / "cut.plane.h5") as cut, h5py.File(tmp_path / "full.plane.h5") as full:
        assert not cut.attrs["complete"] and full.attrs["complete"]
        np.testing.assert_array_equal(cut["view0"]["losses"][:3], full["view0"]["losses"][:3])
        assert np.isnan(cut["view0"]["losses"][3:]).all()
        assert np.isnan(cut["view1"]["losses"][:]).all()
        np.testing.assert_array_equal(cut["view0"]["alphas"][:], full["view0"]["alphas"][:])


def test_processes_default_to_the_available_cores(two_learning_rates, tmp_path, monkeypatch):
    import torch.multiprocessing as mp

    from dynamics.cli import main

    started = []

    class Started(Exception):
        pass

    def start_processes(fn, args, nprocs, start_method):
        started.append(nprocs)
        raise Started

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 2, 5})
    monkeypatch.setattr(mp, "start_processes", start_processes)
    with pytest.raises(Started):
        main(["plane", *map(str, two_learning_rates), "-o", str(tmp_path / "p.html")])
    assert started == [3]


def test_report_draws_the_views_evaluated_in_training(cnn_runs, dynamics, tmp_path):
    folder, _ = cnn_runs
    out = tmp_path / "r.html"
    result = dynamics("report", folder / "b.h5", "-o", out)
    assert result.returncode == 0, result.stderr
    page = out.read_text()
    assert "out-of-plane view of b" in page and "initial-gradient plane, loss of b" in page


def test_coarse_to_fine_refines_only_near_the_trajectories(two_learning_rates, dynamics, tmp_path):
    from dynamics.geometry.plane import Grid, near_paths

    runs = [*two_learning_rates, "--grid", "17", "--no-progress", "--processes", "1"]
    full = dynamics("plane", *runs[:2], "-o", tmp_path / "full.html", *runs[2:])
    refined = dynamics("plane", *runs[:2], "-o", tmp_path / "fine.html", *runs[2:], "--coarse", "9")
    assert full.returncode == 0 and refined.returncode == 0, refined.stderr
    with (
        h5py.File(tmp_path / "full.plane.h5") as whole,
        h5py.File(tmp_path / "fine.plane.h5") as fine,
    ):
        for name in whole:
            view, reference = fine[name], whole[name]
            done = np.isfinite(view["losses"][:])
            paths = [(t["a"][:], t["b"][:]) for t in view["trajectory"].values()]
            grid = Grid(view["alphas"][:], view["betas"][:])
            np.testing.assert_array_equal(done, near_paths(grid, paths, 2.0))
            np.testing.assert_array_equal(done, view["refined"][:])
            assert 0 < done.sum() < done.size
            np.testing.assert_array_equal(view["losses"][:][done], reference["losses"][:][done])
            assert view["coarse_losses"].shape == (9, 9)
            corners = reference["losses"][:][::2, ::2]  # the coarse grid is every 2nd fine point
            np.testing.assert_allclose(view["coarse_losses"][:], corners, rtol=1e-6)
    bad = dynamics("plane", *runs[:2], "-o", tmp_path / "bad.html", "--grid", "5", "--coarse", "9")
    assert bad.returncode == 2
    assert re.search(r"--coarse must be between 2 and [^(]*\(5\), got 9", bad.stderr)


def test_near_paths_measures_distance_to_segments_in_grid_steps():
    from dynamics.geometry.plane import Grid, near_paths

    grid = Grid(np.arange(5.0), 2 * np.arange(4.0))  # steps 1 along a, 2 along b
    near = near_paths(grid, [(np.array([0.0, 4.0]), np.array([2.0, 2.0]))], 0.5)
    np.testing.assert_array_equal(near, np.arange(4)[:, None] == 1 + 0 * np.arange(5)[None, :])
    one_point = near_paths(grid, [(np.array([2.0]), np.array([4.0]))], 1.0)
    assert sorted(zip(*np.nonzero(one_point))) == [(1, 2), (2, 1), (2, 2), (2, 3), (3, 2)]
