"""HiddenStateNorms(unit_health=True): dead, saturated and non-finite fractions against layers
built so that the answer is known by hand."""

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dynamics import open_run
from dynamics.bias.activations import ShiftedActivation
from dynamics.callbacks import DynamicsRecorder, HiddenStateNorms, TrainingLoss
from dynamics.cli import main
from dynamics.store import names

UNITS = 4


class Net(pl.LightningModule):
    """x (16 × 3, every entry in [1, 2]) → Linear(3, 4) → activation → Linear(4, 1), lr 0 so every
    step sees the same θ and the same first batch."""

    def __init__(self, activation: nn.Module, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.up = nn.Linear(3, UNITS)
        self.act = activation
        self.down = nn.Linear(UNITS, 1)
        with torch.no_grad():
            self.up.weight.copy_(weight)
            self.up.bias.copy_(bias)
        generator = torch.Generator().manual_seed(0)
        self.x = 1 + torch.rand(16, 3, generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x), batch_size=16)


def record(tmp_path, quiet_trainer, module, probe=None, steps=3):
    path = tmp_path / "run.h5"
    probes = [TrainingLoss(), probe or HiddenStateNorms(modules=["up", "down"], unit_health=True)]
    quiet_trainer(max_steps=steps, callbacks=[DynamicsRecorder(path, probes)]).fit(module)
    return open_run(path)


# Units 1 and 3 have zero weights and bias −1: negative for every sample. Units 0 and 2 see
# positive and negative pre-activations across the batch (x in [1, 2], weights of both signs).
DEAD_WEIGHT = torch.tensor([[1.0, -1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 1.0, -1.0], [0.0, 0.0, 0.0]])
DEAD_BIAS = torch.tensor([0.0, -1.0, 0.0, -1.0])


@pytest.mark.parametrize(
    "activation", [nn.ReLU(), nn.ReLU6(), ShiftedActivation("relu", shift=0.37)], ids=str
)
def test_units_below_zero_for_every_sample_are_exactly_the_dead_ones(
    tmp_path, quiet_trainer, activation
):
    module = Net(activation, DEAD_WEIGHT, DEAD_BIAS)
    pre = module.up(module.x).detach()
    assert (pre[:, [1, 3]] < 0).all() and (pre[:, [0, 2]] > 0).any(0).all()  # as designed
    run = record(tmp_path, quiet_trainer, module)
    health = run.series(names.UNIT_HEALTH)
    assert health.columns[names.UNIT_DEAD] == ("act",)
    np.testing.assert_array_equal(health[names.UNIT_DEAD][:, 0], [0.5, 0.5, 0.5])
    assert names.UNIT_SATURATED not in health.columns  # no saturating activation
    assert health.columns[names.UNIT_NONFINITE] == ("up", "down", "act")
    np.testing.assert_array_equal(health[names.UNIT_NONFINITE], np.zeros((3, 3)))


def test_tanh_units_at_either_bound_for_every_sample_are_saturated(tmp_path, quiet_trainer):
    # Unit 0: +1000·Σx > 0 for every sample → tanh = 1. Unit 1: ±1000 with the sign of x0 − 1.5,
    # which differs across samples → at −1 or +1, saturated either way. Units 2 and 3: small
    # pre-activations (|z| ≤ 0.06), far from both bounds.
    weight = torch.tensor(
        [[1000.0, 1000.0, 1000.0], [1e4, 0, 0], [0.01, 0.01, 0.01], [-0.01, 0, 0]]
    )
    bias = torch.tensor([0.0, -1.5e4, 0.0, 0.0])
    module = Net(nn.Tanh(), weight, bias)
    y = torch.tanh(module.up(module.x)).detach()
    assert (y[:, 1] > 0).any() and (y[:, 1] < 0).any()  # both bounds are met
    reference = ((y.abs() >= 1 - 1e-3).all(0)).float().mean().item()
    assert reference == 0.5
    health = record(tmp_path, quiet_trainer, module).series(names.UNIT_HEALTH)
    assert health.columns[names.UNIT_SATURATED] == ("act",)
    np.testing.assert_array_equal(health[names.UNIT_SATURATED][:, 0], [0.5, 0.5, 0.5])
    assert names.UNIT_DEAD not in health.columns


class Inject(nn.Module):
    """Puts NaN, +inf and −inf at three fixed entries of its input."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h.clone()
        h[0, 0], h[1, 1], h[2, 2] = float("nan"), float("inf"), -float("inf")
        return h


class Injected(Net):
    def __init__(self) -> None:
        super().__init__(nn.GELU(), DEAD_WEIGHT, DEAD_BIAS)
        self.inject = Inject()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The loss never sees the injected values: training stays finite.
        return self.down(torch.nan_to_num(self.act(self.inject(self.up(x))), 0.0, 0.0, 0.0))


def test_injected_nan_and_inf_are_counted_per_output_and_gelu_has_no_dead_units(
    tmp_path, quiet_trainer
):
    probe = HiddenStateNorms(modules=["up", "inject"], unit_health=True)
    run = record(tmp_path, quiet_trainer, Injected(), probe)
    health = run.series(names.UNIT_HEALTH)
    # GELU has no exact flat region: neither dead nor saturated is reported for it.
    assert set(health.columns) == {names.UNIT_NONFINITE}
    assert health.columns[names.UNIT_NONFINITE] == ("up", "inject", "act")
    # inject: 3 of its 16 × 4 entries; GELU maps NaN to NaN and ±inf to +inf and NaN: 3 too.
    np.testing.assert_array_equal(
        health[names.UNIT_NONFINITE], np.tile([0.0, 3 / 64, 3 / 64], (3, 1))
    )
    [settings] = [p["settings"] for p in run.attrs["probes"] if p["name"] == "hidden"]
    assert settings["unit_health"]["kinds"] == {}
    assert "GELU" in settings["unit_health"]["not_reported"]


def test_unit_health_is_off_by_default_and_drawn_by_report_and_compare(tmp_path, quiet_trainer):
    plain = record(
        tmp_path / "a",
        quiet_trainer,
        Net(nn.ReLU(), DEAD_WEIGHT, DEAD_BIAS),
        HiddenStateNorms(modules=["up"]),
    )
    assert names.UNIT_HEALTH not in plain.groups
    runs = [
        record(tmp_path / side, quiet_trainer, Net(nn.ReLU(), DEAD_WEIGHT, DEAD_BIAS))
        for side in ("b", "c")
    ]
    for command, inputs in (("report", runs[:1]), ("compare", runs)):
        out = tmp_path / f"{command}.html"
        assert main([command, *(str(r.path) for r in inputs), "-o", str(out)]) == 0
        page = out.read_text()
        assert "Dead units per activation" in page
        assert "Non-finite values per recorded output" in page


def test_a_unit_axis_no_module_fixes_is_measured_on_2d_outputs_only():
    probe = HiddenStateNorms(unit_health=True)
    rules = {}
    for module, dim in ((nn.Sequential(nn.Identity(), nn.ReLU()), -1), (CONV, 1)):
        axis = probe._unit_axis("1", dict(module.named_modules()), module)
        assert axis.dim == dim
        rules[dim] = axis.rule
    assert "2-D" in rules[-1] and "Conv2d" in rules[1]


CONV = nn.Sequential(nn.Conv2d(1, 2, 1), nn.ReLU())


def test_fractions_match_direct_evaluation_on_a_random_batch():
    from dynamics.callbacks.unit_health import nonfinite_per_position, unit_fraction, unit_kind

    generator = torch.Generator().manual_seed(3)
    z = torch.randn(8, 5, 6, generator=generator)
    z[:, :, 2] = -1.0  # feature 2 dead at every sample and position
    y = F.relu(z)
    kind = unit_kind(nn.ReLU())
    expected = (y == 0).all(dim=(0, 1)).float().mean()
    assert unit_fraction(y, kind, -1).item() == expected.item() == pytest.approx(1 / 6)
    y[3, 1, 4] = float("nan")
    per_position = nonfinite_per_position(y, -1)
    assert per_position.shape == (8, 5) and per_position[3, 1].item() == pytest.approx(1 / 6)
    assert per_position.mean().item() == pytest.approx(1 / y.numel(), rel=1e-6)


class Unplaced(Net):
    """Its activation is registered first (no module before it fixes the unit axis) and sees
    3-D outputs: its dead fraction is not measured."""

    def __init__(self) -> None:
        super().__init__(nn.ReLU(), DEAD_WEIGHT, DEAD_BIAS)
        activation = self.act
        del self.act
        self._modules = {"act": activation, **self._modules}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)[:, None, :].expand(-1, 2, -1))).mean(1)


def test_a_unit_axis_nothing_fixes_records_nan_with_one_warning_event(tmp_path, quiet_trainer):
    run = record(tmp_path, quiet_trainer, Unplaced())
    health = run.series(names.UNIT_HEALTH)
    assert np.isnan(health[names.UNIT_DEAD]).all()
    np.testing.assert_array_equal(health[names.UNIT_NONFINITE], np.zeros((3, 3)))
    events = [e for e in run.events() if "unit health of act" in e.message]
    assert len(events) == 1 and "2-D" in events[0].message
