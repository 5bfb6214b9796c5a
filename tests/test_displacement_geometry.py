"""The angle between two runs' displacements and their in-plane shares over time, against a
scripted trajectory whose geometry is known in closed form."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from dynamics.analysis.measures.displacement_geometry import displacement_geometry
from dynamics.callbacks import DynamicsRecorder, GradientPlane, ParameterDisplacement, TrainingLoss
from dynamics.store import open_run
from tests.conftest import make_quiet_trainer

E1, E2, E3 = np.eye(3)


class ScriptedSteps(pl.LightningModule):
    """θ ∈ R³ from 0; step k's loss is −d_k·θ, so SGD with lr 1 moves θ by exactly d_k."""

    def __init__(self, directions: np.ndarray) -> None:
        super().__init__()
        self.directions = torch.tensor(directions, dtype=torch.float32)
        self.theta = torch.nn.Parameter(torch.zeros(3))

    def training_step(self, batch, batch_idx):
        return -(self.directions[batch[0]] * self.theta).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)

    def train_dataloader(self):
        return DataLoader(list(range(len(self.directions))), batch_size=1)


def _record(path: Path, directions: np.ndarray) -> Path:
    probes = [
        TrainingLoss(),
        ParameterDisplacement(snapshot_every_n_steps=1),
        GradientPlane(),  # g0 = −d_0: the first step's gradient
    ]
    recorder = DynamicsRecorder(path, probes)
    make_quiet_trainer(max_steps=len(directions), callbacks=[recorder]).fit(
        ScriptedSteps(directions)
    )
    return path


@pytest.fixture(scope="module")
def scripted(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("scripted")
    # A: e1, then out of the plane along e3 twice; B: e2 twice, then e1.
    a = _record(folder / "a.h5", np.array([E1, E3, E3]))
    b = _record(folder / "b.h5", np.array([E2, E2, E1]))
    return a, b


def test_angle_and_in_plane_shares_match_the_closed_form(scripted) -> None:
    a, b = map(open_run, scripted)
    geometry = displacement_geometry(a, b)
    assert not isinstance(geometry, str), geometry
    np.testing.assert_array_equal(geometry.steps, [0, 1, 2, 3])
    assert np.isnan(geometry.angle_deg[0])  # no one has moved at θ0
    # θ1: e1 ⟂ e2; θ2: e1+e3 ⟂ 2e2; θ3: (1,0,2)·(1,2,0) = 1 over √5·√5.
    expected = [90.0, 90.0, np.degrees(np.arccos(1 / 5))]
    np.testing.assert_allclose(geometry.angle_deg[1:], expected, rtol=1e-6)
    # The plane of g0 = −e1 and −e2 is the (e1, e2) plane.
    (steps_a, share_a), (steps_b, share_b) = geometry.in_plane
    np.testing.assert_array_equal(steps_a, [0, 1, 2, 3])
    np.testing.assert_allclose(share_a[1:], [1.0, 1 / 2, 1 / 5], rtol=1e-6)
    np.testing.assert_allclose(share_b[1:], [1.0, 1.0, 1.0], rtol=1e-6)


def test_the_in_plane_paths_angle_in_both_coordinates_and_the_gradients_angle(tmp_path) -> None:
    # g0 of A is −e1, of B −(e1 + e2): 45° apart. θ1 of A is e1 = −ĝA, of B e1 + e2 = −√2 ĝB,
    # so in the unit gradients' oblique coordinates the paths are (−1, 0) and (0, −√2), at 90°,
    # where the plane's orthonormal coordinates (−1, 0) and (−1, −1) put them at 45°. A then
    # leaves the plane along e3 (its in-plane path unchanged), B doubles its step.
    a = open_run(_record(tmp_path / "a.h5", np.array([E1, E3])))
    b = open_run(_record(tmp_path / "b.h5", np.array([E1 + E2, E1 + E2])))
    geometry = displacement_geometry(a, b)
    assert not isinstance(geometry, str), geometry
    np.testing.assert_allclose(geometry.gradient_cosine, 1 / np.sqrt(2), rtol=1e-6)
    np.testing.assert_allclose(geometry.path_cosine[1:], [1 / np.sqrt(2)] * 2, rtol=1e-6)
    np.testing.assert_allclose(geometry.oblique_cosine[1:], [0.0, 0.0], atol=1e-6)
    # θ2 of A is e1 + e3, of B 2(e1 + e2): cos = 2 / (√2 · 2√2) = 1/2 for the whole displacements
    np.testing.assert_allclose(geometry.cosine[1:], [1 / np.sqrt(2), 0.5], rtol=1e-6)
    assert np.isnan(geometry.path_cosine[0]) and np.isnan(geometry.oblique_cosine[0])


def test_compare_shows_the_angle_in_its_table_and_figures(scripted, dynamics, tmp_path) -> None:
    out = tmp_path / "compare.html"
    result = dynamics("compare", *scripted, "-o", out, "--barrier-points", "0")
    assert result.returncode == 0, result.stderr
    page = out.read_text()
    assert "displacement angle, final" in page
    assert f"{np.degrees(np.arccos(1 / 5)):.1f}° (step 3)" in page
    assert "Angle between the runs" in page and "In-plane share of" in page


def test_runs_not_sharing_theta0_get_a_reason_not_an_angle(scripted, tmp_path) -> None:
    other = tmp_path / "other.h5"
    torch.manual_seed(1)
    module = ScriptedSteps(np.array([E1, E2]))
    with torch.no_grad():
        module.theta.add_(1.0)
    recorder = DynamicsRecorder(other, [TrainingLoss(), ParameterDisplacement()])
    make_quiet_trainer(max_steps=2, callbacks=[recorder]).fit(module)
    assert displacement_geometry(open_run(scripted[0]), open_run(other)) == (
        "the runs do not share θ0"
    )
