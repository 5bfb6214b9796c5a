"""Each run's own init args when several runs are rebuilt together (issue 22, item 3).

Two runs of one class from one θ0, trained with different label smoothing that neither saved
(no ``save_hyperparameters``): one ``--init-args`` for both rebuilt run b as run a's loss and
drew its heatmap of the wrong function with exit 0.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

import h5py
import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from dynamics import open_run
from dynamics.analysis.pages.plane import grid_path
from dynamics.callbacks import (
    DynamicsRecorder,
    GradientPlane,
    ParameterDisplacement,
    TrainingLoss,
)
from dynamics.model.probe_batch import probe_batch
from dynamics.params.layout import ParameterLayout
from dynamics.params.vectors import load_vector
from tests.conftest import cli_in_process as cli
from tests.conftest import make_quiet_trainer

THIS_FILE = Path(__file__).resolve()
SMOOTHING = {"a": 0.0, "b": 0.3}


class Smoothed(pl.LightningModule):
    """Saves no hyperparameters: its label smoothing is unknown to the run file."""

    def __init__(self, label_smoothing: float, width: int = 6) -> None:
        super().__init__()
        self.label_smoothing = label_smoothing
        self.net = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y, label_smoothing=self.label_smoothing)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(32, 4, generator=generator)
        return DataLoader(list(zip(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())), batch_size=8)


def direct_loss(smoothing: float, theta: np.ndarray, batch) -> float:
    """The loss of a freshly built model at ``theta``: no rebuild involved."""
    model = Smoothed(smoothing)
    load_vector(model, torch.from_numpy(theta).float(), ParameterLayout.of(model))
    x, y = batch
    with torch.no_grad():
        return F.cross_entropy(model.net(x), y, label_smoothing=smoothing).item()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("smoothed")
    paths = {}
    for name, smoothing in SMOOTHING.items():
        torch.manual_seed(0)  # one θ0
        probes = [ParameterDisplacement(snapshot_every_n_steps=2), GradientPlane(), TrainingLoss()]
        paths[name] = folder / f"{name}.h5"
        make_quiet_trainer(
            max_steps=4,
            callbacks=[DynamicsRecorder(paths[name], probes)],
        ).fit(Smoothed(smoothing))
    return paths


def per_run(paths: dict[str, Path], names=("a", "b")) -> list[str]:
    """``--init-args RUN=JSON`` of the runs ``names``, each with its own label smoothing."""
    options = []
    for name in names:
        args = f'{{"label_smoothing": {SMOOTHING[name]}, "width": 6}}'
        options += ["--init-args", f"{paths[name]}={args}"]
    return options


def test_plane_rebuilds_each_run_with_its_own_args(runs, tmp_path, capsys):
    out = tmp_path / "plane.html"
    common = ["plane", runs["a"], runs["b"], "-o", out, "--model", f"{THIS_FILE}:Smoothed"]
    common += ["--grid", "3", "--processes", "1", "--no-progress"]
    code, err = cli(capsys, *common, *per_run(runs))
    assert code == 0, err
    with h5py.File(grid_path(out)) as views:
        checked = 0
        for view in views.values():
            run = open_run(runs[view.attrs["run"]])
            smoothing, batch = SMOOTHING[view.attrs["run"]], probe_batch(run)
            theta0 = run.stored_states()[0].theta.astype(np.float64)
            alphas, betas, losses = view["alphas"][:], view["betas"][:], view["losses"][:]
            for i, j in [(0, 0), (1, 2), (2, 1)]:
                theta = theta0 + alphas[j] * view["u"][:] + betas[i] * view["v"][:]
                assert losses[i, j] == pytest.approx(direct_loss(smoothing, theta, batch), 1e-5)
            checked += view.attrs["run"] == "b"
    assert checked  # run b's heatmaps are of run b's loss


def test_plane_refuses_a_run_whose_args_are_neither_recorded_nor_given(runs, tmp_path, capsys):
    out = tmp_path / "plane.html"
    common = ["plane", runs["a"], runs["b"], "-o", out, "--model", f"{THIS_FILE}:Smoothed"]
    common += ["--grid", "3", "--processes", "1", "--no-progress"]
    code, err = cli(capsys, *common, *per_run(runs, names=("a",)))
    assert code == 2 and err.count("\n") == 1, err
    assert "b.h5: init args label_smoothing, width of Smoothed were not recorded" in err
    assert f"--init-args {runs['b']}=" in err
    # One set for both runs cannot say they were trained alike: refused, not guessed.
    code, err = cli(capsys, *common, "--init-args", '{"label_smoothing": 0.0, "width": 6}')
    assert code == 2 and err.count("\n") == 1, err
    assert "cannot say label_smoothing, width had the same value in each" in err
    # A run that is not one of those given is a typo, not silently unused.
    code, err = cli(capsys, *common, *per_run(runs), "--init-args", 'c.h5={"width": 6}')
    assert code == 2 and "--init-args c.h5=: not one of the runs given" in err, err
    assert not out.exists()


def barrier_row(page: str, line: str) -> list[str]:
    """The cells of the barrier table's row ``line``."""
    row = re.search(rf"<tr><td>{re.escape(html.escape(line))}</td>(.*?)</tr>", page).group(1)
    return re.findall(r"<td>(.*?)</td>", row)


def test_compare_barriers_use_each_runs_own_args(runs, tmp_path, capsys):
    out = tmp_path / "compare.html"
    common = ["compare", runs["a"], runs["b"], "-o", out, "--model", f"{THIS_FILE}:Smoothed"]
    code, err = cli(capsys, *common, "--barrier-points", "3", *per_run(runs))
    assert code == 0, err
    page = out.read_text()
    for name in ("a", "b"):
        run = open_run(runs[name])
        states, batch = run.stored_states(), probe_batch(run)
        start, end = barrier_row(page, f"θ0 → θT ({name})")[:2]
        for cell, state in ((start, states[0]), (end, states[-1])):
            assert cell == f"{direct_loss(SMOOTHING[name], state.theta, batch):.5g}"
    # Run b's args missing: one line and exit 2, not a page whose barrier is of another loss.
    code, err = cli(capsys, *common, "--overwrite", *per_run(runs, names=("a",)))
    assert code == 2 and err.count("\n") == 1, err
    assert "b.h5: init args label_smoothing, width of Smoothed were not recorded" in err
    assert err.rstrip().endswith("(or --barrier-points 0: no loss barriers)")
