"""``GradientPlane(partner=...)`` on runs that differ only in the learning rate (issue 22,
item 9): their initial gradients are one vector, so they span no plane. The probe disabled
itself at step 0 and stored no g0 and no probe batch, so ``dynamics plane`` and the barriers
failed afterwards; now only the coordinates step aside.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
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
from dynamics.store import names
from tests.conftest import cli_in_process as cli
from tests.conftest import make_quiet_trainer

THIS_FILE = Path(__file__).resolve()


class Classifier(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(32, 4, generator=generator)
        return DataLoader(list(zip(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())), batch_size=8)


def fit(path: Path, lr: float, partner: Path | None = None, at_end: bool = False) -> Path:
    torch.manual_seed(0)  # one θ0, one data order: the runs differ in lr alone
    plane = GradientPlane(partner=partner, at_end=at_end, grid=3)
    probes = [ParameterDisplacement(snapshot_every_n_steps=2), plane, TrainingLoss()]
    make_quiet_trainer(
        max_steps=4,
        callbacks=[DynamicsRecorder(path, probes)],
    ).fit(Classifier(lr))
    return path


def test_a_partner_of_the_same_gradient_keeps_g0_and_the_probe_batch(tmp_path, capsys):
    a = fit(tmp_path / "a.h5", 0.1)
    with_partner = fit(tmp_path / "b.h5", 0.4, partner=a, at_end=True)
    alone = fit(tmp_path / "c.h5", 0.4)  # the same run without partner=
    run = open_run(with_partner)
    assert run.vector(names.G0) is not None
    assert np.array_equal(run.vector(names.G0), open_run(alone).vector(names.G0))
    assert any(n.startswith(names.PROBE_BATCH_PREFIX) for n in run.vector_names)
    assert names.PLANE_END_STEPS not in run.vector_names
    assert names.PLANE not in run.summary()["series"]  # no coordinates on a plane of none
    [event] = [e for e in run.events() if e.probe == names.PLANE]
    assert event.kind == names.EVENT_WARNING and "span none" in event.message
    assert "at_end" in event.message and "--plane auto" in event.message

    # `dynamics plane --plane auto` draws what it draws for the run recorded without partner=.
    model = ["--model", f"{THIS_FILE}:Classifier", "--grid", "3", "--processes", "1"]
    grids = {}
    for name, path in (("partnered", with_partner), ("alone", alone)):
        out = tmp_path / f"{name}.html"
        code, err = cli(capsys, "plane", a, path, "-o", out, "--no-progress", *model)
        assert code == 0, err
        with h5py.File(grid_path(out)) as views:
            grids[name] = [views[v]["losses"][:] for v in sorted(views)]
    assert len(grids["alone"]) == len(grids["partnered"]) > 0
    for partnered, alone_grid in zip(grids["partnered"], grids["alone"]):
        assert np.array_equal(partnered, alone_grid)

    # And the loss barriers have the probe batch they need.
    out = tmp_path / "compare.html"
    code, err = cli(capsys, "compare", a, with_partner, "-o", out, *model[:2])
    assert code == 0, err
    page = out.read_text()
    assert "θ0 → θT (b)" in page and "no loss barrier for b" not in page
