"""check_probe, the helper users run on their own probes, and the docs' probe example."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pytorch_lightning.demos.boring_classes import BoringModel

from dynamics.callbacks import (
    GradientPlane,
    HessianSpectrum,
    HiddenStateNorms,
    LoggedMetrics,
    ParameterDisplacement,
    Probe,
    SeriesSpec,
    TrainingLoss,
    check_probe,
)

WRITING_A_PROBE = Path(__file__).resolve().parents[1] / "docs" / "writing-a-probe.md"


def test_the_docs_probe_example_runs_as_written():
    page = WRITING_A_PROBE.read_text()
    code = "\n".join(re.findall(r"```python\n(.*?)```", page, flags=re.DOTALL))
    namespace: dict = {}
    exec(compile(code, str(WRITING_A_PROBE), "exec"), namespace)
    tests = [f for name, f in namespace.items() if name.startswith("test_")]
    assert tests
    for test in tests:
        test()


def cnn_batch():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(16, 1, 8, 8, generator=generator), torch.randint(0, 3, (16,))


class LogsValidation(BoringModel):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.step(batch))


@pytest.mark.parametrize(
    "probe",
    [
        TrainingLoss(),
        ParameterDisplacement(snapshot_every_n_steps=1),
        HiddenStateNorms(),
        HiddenStateNorms(unit_health=True),
        HessianSpectrum(k=2, every_n_steps=2),
        GradientPlane(),
    ],
    ids=lambda probe: type(probe).__name__,
)
def test_the_shipped_probes_keep_the_contract(small_cnn, probe):
    series = check_probe(probe, small_cnn(), cnn_batch(), steps=3)
    assert all(len(rows) for rows in series.values())


def test_validation_probes_are_checked_on_a_validation_run():
    series = check_probe(LoggedMetrics(["val_loss"]), LogsValidation(), torch.randn(4, 32))
    assert len(series["validation"]) == 1


def test_neither_the_probe_nor_the_module_is_modified(small_cnn):
    module, probe = small_cnn(), ParameterDisplacement()
    before = [p.clone() for p in module.parameters()]
    check_probe(probe, module, cnn_batch())
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))
    assert probe.layout is None


class Rogue(Probe):
    """Records a scalar each step, and breaks the contract in the way it is told."""

    name = "rogue"

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.fault = fault
        self.seen = 0

    def series(self):
        return {self.name: {"x": SeriesSpec(dtype="int32" if self.fault == "dtype" else "float32")}}

    def on_step_start(self, trainer, pl_module, batch, step):
        if self.fault == "rng":
            torch.rand(1)
        elif self.fault == "mode":
            pl_module.eval()
        elif self.fault == "buffers":
            x, _ = batch
            pl_module(x)  # a training-mode forward updates BatchNorm's running statistics

    def on_step_end(self, trainer, pl_module, batch, outputs, step):
        if self.fault == "grad":
            next(pl_module.parameters()).grad.zero_()
        if self.fault == "parameters":
            with torch.no_grad():
                next(pl_module.parameters()).add_(1.0)
        self.seen += 1
        value = torch.ones(2) if self.fault == "shape" else F.relu(torch.tensor(0.5))
        return {self.name: {"x": value}}

    def state_dict(self):
        if self.fault == "numpy_state":
            return {"seen": np.int64(self.seen)}
        return {"seen": self.seen}

    def load_state_dict(self, state):
        if self.fault != "state":
            self.seen = state["seen"]


@pytest.mark.parametrize(
    "fault, message",
    [
        ("rng", "on_step_start changed the torch RNG"),
        ("mode", "on_step_start changed train/eval flag of the module"),
        ("buffers", "on_step_start changed buffer features.1.running_mean"),
        ("grad", "on_step_end changed .grad of features.0.weight"),
        ("parameters", "on_step_end changed parameter features.0.weight"),
        ("shape", "rogue/x has shape (2,), declared ()"),
        ("dtype", "row rogue/x has dtype kind 'f', declared int32"),
        ("state", "load_state_dict(state) then state_dict() differs"),
        ("numpy_state", "Rogue.state_dict() holds more than tensors and plain values"),
    ],
)
def test_contract_breaches_are_caught(small_cnn, fault, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        check_probe(Rogue(fault), small_cnn(), cnn_batch())
