"""The bias toolkit used as a new user would (issue 12 test campaign): problems found on
models defined outside the package, each pinned by a tiny, fast test."""

from __future__ import annotations

import random

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.cli import LightningCLI
from torch import nn

from dynamics.analysis.measures.run_comparison import SAME, comparability
from dynamics.bias import shift_activations
from dynamics.bias.init import constant
from dynamics.callbacks import (
    BiasAudit,
    BiasComponent,
    DynamicsRecorder,
    InitBiases,
    ShiftActivations,
    check_probe,
)
from dynamics.errors import DynamicsError
from dynamics.model.rebuild import build_module
from dynamics.model.record import module_record
from dynamics.store import names, open_run
from tests.conftest import TinyClassifier, make_quiet_trainer


@pytest.fixture(autouse=True)
def _global_state_restored(monkeypatch):
    """These tests seed and run LightningCLI in-process: the global random states and
    ``PL_GLOBAL_SEED`` are put back so that later test modules see what they would alone."""
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng():
        yield
    random.setstate(python_state)
    np.random.set_state(numpy_state)


class ScalarRegressor(pl.LightningModule):
    """Linear → Tanh (``act``) → Linear to one output per example; ``squeeze`` drops the
    output's size-1 axis, so (N, 1) and (N,) outputs describe the same predictions."""

    def __init__(self, squeeze: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.act, self.out = nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)
        self.squeeze = squeeze

    def training_step(self, batch, batch_idx):
        x, y = batch
        prediction = self.out(self.act(self.inp(x)))
        if self.squeeze:
            return F.mse_loss(prediction.squeeze(1), y.squeeze(1))
        return F.mse_loss(prediction, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _scalar_batch():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(16, 4, generator=generator)
    return x, torch.randn(16, 1, generator=generator)


def _row(module, batch):
    series = check_probe(BiasComponent(["act"]), module, batch)[names.BIAS_COMPONENT]
    return {key: np.asarray(values)[0] for key, values in series.values.items()}


def test_bias_component_similarities_of_one_value_per_example_are_over_the_batch():
    """With one output value per example a per-example cosine is only the sign agreement
    (±1, so batch means in steps of 2/N) and the per-example correlation is 0/0: the
    similarities are taken over the batch as one vector, for (N, 1) and (N,) outputs alike."""
    batch = _scalar_batch()
    x, y = batch
    column, flat = _row(ScalarRegressor(), batch), _row(ScalarRegressor(squeeze=True), batch)
    module = ScalarRegressor()
    with torch.no_grad():
        h = module.act(module.inp(x))
        bias = h.mean(-1, keepdim=True).expand_as(h)
        full, decode = module.out(h).flatten().double(), module.out(bias).flatten().double()
    target = y.flatten().double()

    def cos(a, b):
        return float(a @ b / (a.norm() * b.norm()))

    for row in (column, flat):
        assert row["bias_cos_full"][0] == pytest.approx(cos(decode, full), abs=1e-6)
        assert row["full_cos_target"] == pytest.approx(cos(full, target), abs=1e-6)
        centred = [t - t.mean() for t in (decode, target)]
        assert row["bias_corr_target"][0] == pytest.approx(cos(*centred), abs=1e-6)
    for key in column:
        np.testing.assert_allclose(column[key], flat[key], rtol=1e-6, atol=1e-7)


class CLIModel(pl.LightningModule):
    def __init__(self, width: int = 3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(2, width)


def test_a_lightningcli_model_is_rebuilt_from_its_recorded_init_args():
    cli = LightningCLI(
        args={"model": {"class_path": f"{__name__}.CLIModel", "init_args": {"width": 5}}},
        run=False,
        save_config_callback=None,
        trainer_defaults={"logger": False, "enable_checkpointing": False},
    )
    record = module_record(cli.model)
    assert record["init_args"] == {"width": 5}
    module, _, name = record["class_path"].rpartition(".")
    assert build_module(f"{module}:{name}", record["init_args"]).layer.out_features == 5


def test_a_missing_class_in_a_script_is_named_by_the_users_path(tmp_path):
    script = tmp_path / "net.py"
    script.write_text("import torch\nclass Net(torch.nn.Linear):\n    pass\n")
    with pytest.raises(DynamicsError) as error:
        build_module(f"{script}:Nope")
    assert "_dynamics_model_" not in str(error.value)


def test_runs_set_up_alike_do_not_differ_in_their_probes_by_the_audits_measurements(tmp_path):
    runs = []
    for seed in (0, 1):
        pl.seed_everything(seed)
        path = tmp_path / f"seed{seed}.h5"
        recorder = DynamicsRecorder(path, probes=[BiasAudit(draws=1)])
        make_quiet_trainer(max_steps=1, callbacks=[recorder]).fit(TinyClassifier())
        runs.append(open_run(path))
    probes = next(c for c in comparability(*runs) if c.name == "probes")
    assert probes.status == SAME, probes.details


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2, 1))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"shift": float("nan")}, "finite"),
        ({"shift": float("inf")}, "finite"),
        ({"shift": "adaptive", "dim": 1.5}, "dim must be an integer"),
        ({"include": "1"}, "include must be a list"),
        ({"exclude": "1"}, "exclude must be a list"),
    ],
)
def test_shift_settings_that_cannot_work_are_refused_in_one_message(options, message):
    """A NaN shift made a NaN network, dim=1.5 failed at the first forward, and a pattern
    given as a string was read letter by letter; the YAML callback refuses them when built."""
    with pytest.raises(DynamicsError, match=message):
        shift_activations(_cnn(), **{"shift": "expected", **options})
    with pytest.raises(DynamicsError, match=message):
        ShiftActivations(**{"shift": "expected", **options})


def test_bias_recipe_patterns_given_as_a_string_are_refused_in_one_message():
    with pytest.raises(DynamicsError, match="exclude must be a list"):
        constant(_cnn(), 0.01, exclude="3")


def test_init_biases_refuses_options_its_recipe_does_not_take_when_built():
    """A misspelt option in YAML failed only at fit setup, inside Lightning's traceback."""
    with pytest.raises(DynamicsError, match="valu"):
        InitBiases(recipe="constant", options={"valu": 0.01})
    with pytest.raises(DynamicsError, match="priors"):
        InitBiases(recipe="log_odds")
    assert InitBiases(recipe="constant", options={"value": 0.1, "exclude": ["head"]}).options
