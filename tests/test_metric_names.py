"""Any metric name Lightning can log is recorded under a safe, reversible dataset name (issue 22
item 1): two validation loaders, names with slashes, dots, spaces and unicode, and names a
group reserves; the values are Lightning's own, and every view shows the names as logged."""

from __future__ import annotations

import json
import re

import h5py
import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dynamics import open_run
from dynamics.callbacks import DynamicsRecorder, LoggedMetrics, TrainingLoss
from dynamics.store import names
from dynamics.store.schema import SERIES, RunFileError
from tests.conftest import make_quiet_trainer

ODD_NAMES = [
    "val_loss",
    "val_loss/dataloader_idx_0",
    "a/b/c",
    "acc.top1",
    "my metric",
    "λ₁ loss",
    "",
    " ",
    ".",
    "..",
    "step",
    "%",
    "50%",
    "%25",
    "a%2Fb",
    "tab\there",
    "[json]",
    '{"x": 1}',
    "\ud800",
]


@pytest.mark.parametrize("name", ODD_NAMES)
def test_series_names_are_safe_and_reversible(name):
    safe = names.series_name(name)
    assert names.declared_name(safe) == name
    assert safe and "/" not in safe and safe not in (".", "..", "step") and safe.isascii()


def test_series_names_never_collide():
    safe = [names.series_name(n) for n in ODD_NAMES]
    assert len(set(safe)) == len(ODD_NAMES)
    assert names.series_name("val_loss") == "val_loss"  # plain names stay readable in h5dump


class TwoLoaders(pl.LightningModule):
    """Logs, from each of two validation loaders, metrics named as users name them."""

    METRICS = ("val_loss", "acc.top1", "my metric", "λ₁ loss", "a/b")

    def __init__(self, log_without_index: bool = False):
        super().__init__()
        self.log_without_index = log_without_index
        self.net = nn.Linear(4, 1)
        self.logged: list[dict[str, float]] = []  # callback_metrics after each validation

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        if self.log_without_index:  # Lightning refuses one such key from two loaders
            if dataloader_idx == 0:
                self.log("val_loss", loss, add_dataloader_idx=False)
            return
        for i, name in enumerate(self.METRICS):
            self.log(name, loss * (i + 1) + dataloader_idx)

    def on_validation_end(self):
        if not self.trainer.sanity_checking:
            metrics = self.trainer.callback_metrics
            self.logged.append({k: float(v) for k, v in metrics.items()})

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return _loader(0)

    def val_dataloader(self):
        return [_loader(1), _loader(2)]


def _loader(seed: int) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 4, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def _fit_with(path, probes, num_sanity_val_steps=0, log_without_index=False) -> TwoLoaders:
    """Four steps of :class:`TwoLoaders`, validated after steps 2 and 4."""
    module = TwoLoaders(log_without_index)
    make_quiet_trainer(
        max_steps=4,
        val_check_interval=2,
        num_sanity_val_steps=num_sanity_val_steps,
        callbacks=[DynamicsRecorder(path, probes)],
    ).fit(module)
    return module


def test_two_loaders_record_every_metric_as_lightning_logged_it(tmp_path):
    path = tmp_path / "run.h5"
    keys = [*TwoLoaders.METRICS, "val_loss/dataloader_idx_0", "step"]
    module = _fit_with(path, [TrainingLoss(), LoggedMetrics(keys)], num_sanity_val_steps=1)

    run = open_run(path)
    metrics = run.validation_metrics()
    expected = [f"{m}/dataloader_idx_{i}" for m in TwoLoaders.METRICS for i in (0, 1)]
    assert sorted(metrics) == sorted([*expected, "step/dataloader_idx_0", "step/dataloader_idx_1"])
    assert len(module.logged) == 2
    for key in expected:  # every value is the one Lightning logged, per validation run
        np.testing.assert_array_equal(metrics[key].values, [m[key] for m in module.logged])
    # By hand: metric j of loader i is (j + 1) * loss_i + i, so no series holds another's.
    for i in (0, 1):
        loss = metrics[f"val_loss/dataloader_idx_{i}"].values - i
        lam, ab = metrics[f"λ₁ loss/dataloader_idx_{i}"], metrics[f"a/b/dataloader_idx_{i}"]
        np.testing.assert_allclose(lam.values, 4 * loss + i, 1e-6)
        np.testing.assert_allclose(ab.values, 5 * loss + i, 1e-6)
    assert np.isnan(metrics["step/dataloader_idx_1"].values).all()  # not logged: NaN, a note
    assert any("'step/dataloader_idx_1' was not logged" in e.message for e in run.events())
    with h5py.File(path) as file:  # the datasets carry the names as logged
        group = file[SERIES][names.VALIDATION]
        stored = {group[d].attrs[names.ATTR_NAME] for d in group if d != "step"}
    assert stored == set(metrics)


def test_default_logged_metrics_records_each_loaders_held_out_loss(tmp_path):
    path = tmp_path / "run.h5"
    module = _fit_with(path, [LoggedMetrics()])
    metrics = open_run(path).validation_metrics()
    assert sorted(metrics) == ["val_loss/dataloader_idx_0", "val_loss/dataloader_idx_1"]
    for key, metric in metrics.items():
        assert np.isfinite(metric.values).all()
        np.testing.assert_array_equal(metric.values, [m[key] for m in module.logged])


def test_report_and_info_show_the_names_as_logged(tmp_path, dynamics):
    path = tmp_path / "run.h5"
    _fit_with(path, [LoggedMetrics(["λ₁ loss", "a/b", "my metric"])])
    info = dynamics("info", str(path), "--json")
    assert info.returncode == 0, info.stderr
    series = json.loads(info.stdout)["series"][names.VALIDATION]["series"]
    assert "λ₁ loss/dataloader_idx_1" in series and "a/b/dataloader_idx_0" in series
    plain = dynamics("info", str(path))
    assert "my metric/dataloader_idx_0" in plain.stdout, plain.stdout
    out = tmp_path / "report.html"
    report = dynamics("report", str(path), "-o", str(out))
    assert report.returncode == 0, report.stderr
    page = out.read_text()
    assert "λ₁ loss/dataloader_idx_1" in page and "a/b/dataloader_idx_0" in page
    assert "%CE%BB%E2%82%81" not in page  # the dataset's escaped name is never shown
    other = tmp_path / "other.h5"
    _fit_with(other, [LoggedMetrics(["λ₁ loss", "a/b", "my metric"])])
    compared = tmp_path / "compare.html"
    result = dynamics(
        "compare", str(path), str(other), "-o", str(compared), "--barrier-points", "0"
    )
    assert result.returncode == 0, result.stderr
    # Plotly's JSON writes "/" and non-ASCII text as \\uXXXX escapes.
    page = re.sub(r"\\u([0-9a-f]{4})", lambda m: chr(int(m[1], 16)), compared.read_text())
    assert "λ₁ loss/dataloader_idx_1" in page and "Validation: my metric/dataloader_idx_0" in page
    assert "loss%2Fdataloader" not in page and "%CE%BB%E2%82%81" not in page


def test_tables_and_trees_name_the_series_as_logged(tmp_path):
    pytest.importorskip("xarray")
    path = tmp_path / "run.h5"
    module = _fit_with(path, [LoggedMetrics()])
    run = open_run(path)
    frame = run.series(names.VALIDATION).to_pandas()
    assert list(frame.columns.get_level_values(0)) == [
        "val_loss/dataloader_idx_0",
        "val_loss/dataloader_idx_1",
    ]
    # A DataTree refuses "/" in a variable's name: the dataset's safe name, the logged one kept.
    variable = run.to_xarray()[names.VALIDATION]["val_loss%2Fdataloader_idx_1"]
    assert variable.attrs[names.ATTR_NAME] == "val_loss/dataloader_idx_1"
    np.testing.assert_array_equal(
        variable.values, [m["val_loss/dataloader_idx_1"] for m in module.logged]
    )


def test_names_a_group_reserves_are_series_like_any_other(tmp_path):
    path = tmp_path / "run.h5"
    keys = ["step", ".", "", "val_loss"]
    _fit_with(path, [LoggedMetrics(keys, per_loader=False)])
    run = open_run(path)
    assert sorted(run.validation_metrics()) == sorted(keys)
    assert len(run.series(names.VALIDATION).step) == 2  # the step index is its own
    assert np.isnan(run.validation_metrics()["step"].values).all()


def test_a_bare_key_logged_without_the_loader_index_says_how_to_record_it(tmp_path):
    path = tmp_path / "run.h5"
    _fit_with(path, [LoggedMetrics(["val_loss"])], log_without_index=True)
    messages = [e.message for e in open_run(path).events()]
    assert any("pass LoggedMetrics(per_loader=False)" in m for m in messages), messages
    path = tmp_path / "plain.h5"
    probe = LoggedMetrics(["val_loss"], per_loader=False)
    module = _fit_with(path, [probe], log_without_index=True)
    recorded = open_run(path).validation_metrics()["val_loss"].values
    np.testing.assert_array_equal(recorded, [m["val_loss"] for m in module.logged])


def test_a_stored_name_that_is_not_the_datasets_own_is_refused(tmp_path):
    path = tmp_path / "run.h5"
    _fit_with(path, [LoggedMetrics(["a", "b"], per_loader=False)])
    with h5py.File(path, "r+") as file:  # a tampered file: two datasets claiming one name
        file[SERIES][names.VALIDATION]["b"].attrs[names.ATTR_NAME] = "a"
    with pytest.raises(RunFileError, match="which is not its own"):
        open_run(path)
