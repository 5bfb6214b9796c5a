"""HessianSpectrum's extras as measurements on its one operator: the list and the old keywords
give the same rows, a user's measurement adds its own series, and bad ones are refused by name."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from dynamics.callbacks import (
    EigenspaceOverlap,
    GradientShare,
    HessianDensity,
    HessianMeasurement,
    HessianSpectrum,
    HessianTrace,
    SeriesSpec,
)
from dynamics.errors import ParameterError


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()

    def training_step(self, batch, _):
        return F.mse_loss(self.net(batch[0]), batch[1])


def _ready(probe: HessianSpectrum) -> Regressor:
    torch.manual_seed(0)
    module = Regressor()
    batch = (torch.randn(32, 4, dtype=torch.float64), torch.randn(32, 2, dtype=torch.float64))
    probe.setup(SimpleNamespace(strategy=None), module, batch)
    return module


def _rows(probe: HessianSpectrum, steps=(0, 1)) -> list[dict]:
    module = _ready(probe)
    rows = []
    for step in steps:
        rows.append(probe.measure(module, step))
        with torch.no_grad():
            module.net[0].weight.add_(0.01)
    return rows


def test_the_measurements_list_and_the_old_keywords_give_identical_rows() -> None:
    listed = HessianSpectrum(
        k=2,
        tol=1e-8,
        measurements=[HessianTrace(9), GradientShare(), HessianDensity(2, 5), EigenspaceOverlap()],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = HessianSpectrum(
            k=2,
            tol=1e-8,
            trace_hvp=9,
            gradient_share=True,
            density_runs=2,
            density_steps=5,
            eigenspace_overlap=True,
        )
    assert list(listed.series()["hessian"]) == list(old.series()["hessian"])
    for a, b in zip(_rows(listed), _rows(old), strict=True):
        assert list(a) == list(b)
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert np.isnan(a["overlap_previous"]) is np.False_  # the second row has a previous one


class Curvature(HessianMeasurement):
    """A user's measurement in a group of its own: λ1 over the trace of the top-k."""

    def series(self, k, size):
        return {"hessian_ratio": {"top_share": SeriesSpec()}}

    def measure(self, row):
        values = row.pairs.eigenvalues
        return {"hessian_ratio": {"top_share": (values[0] / values.sum()).item()}}


def test_a_measurement_of_its_own_group_is_declared_and_returned_at_step_end() -> None:
    probe = HessianSpectrum(k=2, tol=1e-8, measurements=[Curvature()])
    assert probe.series()["hessian_ratio"] == {"top_share": SeriesSpec()}
    module = _ready(probe)
    probe.on_step_start(None, module, None, 0)
    rows = probe.on_step_end(None, module, None, None, 0)
    assert set(rows) == {"hessian", "hessian_ratio"}
    values = rows["hessian"]["eigenvalues"].astype(np.float64)
    assert rows["hessian_ratio"]["top_share"] == pytest.approx(values[0] / values.sum(), rel=1e-6)


def test_bad_measurements_are_refused_by_name() -> None:
    with pytest.raises(ParameterError, match="^hvp must be at least 4"):
        HessianTrace(3)
    with pytest.warns(DeprecationWarning), pytest.raises(ParameterError, match="^trace_hvp "):
        HessianSpectrum(trace_hvp=3)
    with pytest.raises(ParameterError, match="^measurements must hold HessianMeasurement"):
        HessianSpectrum(measurements=["trace"])
    with pytest.raises(ParameterError, match="^measurements hold HessianTrace more than once"):
        HessianSpectrum(measurements=[HessianTrace(8), HessianTrace(16)])
    with pytest.raises(TypeError, match="unexpected keyword argument 'trace'"):
        HessianSpectrum(trace=60)
