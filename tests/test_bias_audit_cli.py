"""The bias audit as users meet it: ``dynamics audit`` on a class, a script file and a run file,
the ``BiasAudit`` probe under the probe contract, and its section in ``dynamics report``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dynamics import open_run
from dynamics.analysis.measures.bias_audit import recorded_audit
from dynamics.bias import audit
from dynamics.bias.auditing import audit_batch
from dynamics.callbacks import (
    BiasAudit,
    DynamicsRecorder,
    GradientPlane,
    ParameterDisplacement,
    TrainingLoss,
    check_probe,
)
from dynamics.experiments import TeacherStudentData, TeacherStudentModule
from dynamics.model.probe_batch import probe_batch
from dynamics.model.rebuild import rebuild_module

SEED_MLP = """
from torch import nn


class SeedMLP(nn.Sequential):
    \"\"\"Seed 000's 784-512-256-128-10 ReLU MLP.\"\"\"

    def __init__(self, bias: bool = True):
        widths = [784, 512, 256, 128, 10]
        layers = []
        for i, (a, b) in enumerate(zip(widths, widths[1:])):
            layers += [nn.Linear(a, b, bias=bias)] + ([nn.ReLU()] if i < 3 else [])
        super().__init__(*layers)


if __name__ == "__main__":
    raise SystemExit("a training script: never run by the audit")
"""

ARCHITECTURE = dict(width=8, expansion=2, depth=2)


@pytest.fixture
def seed_mlp_file(tmp_path):
    path = tmp_path / "seed_mlp.py"
    path.write_text(textwrap.dedent(SEED_MLP))
    return path


def test_audit_of_a_class_in_a_script_prints_the_seed_000_line(seed_mlp_file, dynamics):
    result = dynamics("audit", f"{seed_mlp_file}:SeedMLP")
    assert result.returncode == 0, result.stderr
    assert "bias parameters: 906 of 567,434 = 0.16 %" in result.stdout
    assert "origin: not checked (no example input)" in result.stdout
    assert "order: registration order" in result.stdout


def test_audit_json_with_init_args_and_input_shape(seed_mlp_file, dynamics):
    spec = f"{seed_mlp_file}:SeedMLP"
    result = dynamics(
        "audit", spec, "--init-args", '{"bias": false}', "--input-shape", "4,784", "--json"
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["share"] == "0 of 566,528 = 0.00 %" and data["bias_free"]
    assert data["origin"]["pinned"] and data["origin"]["draws"] == 5
    assert data["order"].startswith("traced")
    assert [row["flagged"] for row in data["layers"]] == [True] * 4
    relu = data["activations"][0]
    assert relu["expected"] == pytest.approx(0.3989422804014327, abs=1e-12)
    assert "4,784" in data["input_note"]


def test_audit_of_a_dotted_class_path(dynamics):
    args = ("audit", "torch.nn.LSTM", "--init-args", '{"input_size": 3, "hidden_size": 5}')
    result = dynamics(*args, "--input-shape", "2,4,3", "--draws", "2")
    assert result.returncode == 0, result.stderr
    assert "bias parameters: 40 of 200 = 20.00 %" in result.stdout
    assert "‖f(0)‖ > 0 in 2 of 2 random weight draws" in result.stdout


def test_audit_of_a_language_model_on_token_ids(dynamics):
    args = (
        "audit",
        "dynamics.experiments.char_gpt.model.CharGPT",
        "--init-args",
        '{"context": 8, "width": 16}',
    )
    result = dynamics(*args, "--input-shape", "2,8", "--vocab", "256", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["order"].startswith("traced") and not data["origin"]["checked"]
    assert [row["module"] for row in data["layers"] if row["flagged"]] == ["head"]
    floats = dynamics(*args, "--input-shape", "2,8")
    assert floats.returncode == 2 and "reads token ids" in floats.stderr, floats.stderr
    assert "pass --vocab 256" in floats.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("torch.nn.Linear",), "missing 2 required positional arguments"),
        (("Linear",), "name the model as pkg.module:Class"),
        (("torch.nn:Nope",), "has no Nope"),
        (("torch.nn.Tanh", "--input-shape", "2,x"), "--input-shape must be positive integers"),
        (("torch.nn.Tanh", "--draws", "0"), "--draws must be at least 1"),
        (("torch.nn.Tanh", "--vocab", "5"), "--vocab must be at least 1 and go with"),
        (("torch.nn.Tanh", "--init-args", "[1]"), "--init-args must be a JSON object"),
        (("torch.nn.Tanh", "--model", "a:b"), "go with a run file"),
        (
            ("torch.nn.Linear", "--init-args", '{"in_features": 3, "out_features": 2}')
            + ("--input-shape", "2,5"),
            "on the example input failed: RuntimeError",
        ),
        (("missing.h5",), "missing.h5"),
    ],
)
def test_audit_bad_input_is_one_line(tmp_path, dynamics, one_line_error, args, message):
    result = dynamics("audit", *args, cwd=tmp_path)
    one_line_error(result)
    assert message in result.stderr


def fit_teacher_student(path, quiet_trainer, probes) -> None:
    torch.manual_seed(0)
    module = TeacherStudentModule(**ARCHITECTURE)
    data = TeacherStudentData(**ARCHITECTURE, batch_size=16)
    quiet_trainer(max_steps=2, callbacks=[DynamicsRecorder(path, probes)]).fit(module, data)


@pytest.fixture
def audited_run(tmp_path, quiet_trainer):
    path = tmp_path / "audited.h5"
    fit_teacher_student(
        path, quiet_trainer, [TrainingLoss(), GradientPlane(), ParameterDisplacement(), BiasAudit()]
    )
    return path


def test_probe_records_the_audit_of_the_first_batch_at_theta0(audited_run):
    run = open_run(audited_run)
    recorded = recorded_audit(run)
    # The same audit, offline: θ0 rebuilt from the file, the stored probe batch (the first one).
    module = rebuild_module(run)
    expected = audit_batch(module, probe_batch(run), source="the fit's first training batch")
    assert recorded == expected
    assert recorded.input_note.endswith("into student, which holds all the parameters")
    assert recorded.share() == audit(module.student).share() == "64 of 592 = 10.81 %"


def test_audit_of_a_run_file_prints_the_recorded_audit_or_rebuilds_on_request(
    audited_run, dynamics
):
    recorded = json.loads(json.dumps(recorded_audit(open_run(audited_run)).to_dict()))
    stored = dynamics("audit", audited_run, "--json")
    assert stored.returncode == 0, stored.stderr
    assert {k: v for k, v in json.loads(stored.stdout).items() if k != "model"} == recorded
    text = dynamics("audit", audited_run)
    assert "TeacherStudentModule, recorded at θ0 by BiasAudit" in text.stdout
    assert "64 of 592 = 10.81 %" in text.stdout
    # An option asks for a new audit: the recorded model rebuilt at θ0, on the stored batch.
    rebuilt = dynamics("audit", audited_run, "--json", "--draws", "5")
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert {k: v for k, v in json.loads(rebuilt.stdout).items() if k != "model"} == {
        **recorded,
        "input_note": "the run's probe batch, into student, which holds all the parameters",
    }
    assert "recorded at" not in dynamics("audit", audited_run, "--draws", "5").stdout


def test_report_has_a_bias_audit_section_only_when_recorded(
    audited_run, tmp_path, quiet_trainer, dynamics
):
    out = tmp_path / "report.html"
    # As every offline page, without importing torch.
    argv = ["report", str(audited_run), "-o", str(out)]
    script = f"from dynamics.cli import main\nassert main({argv!r}) == 0"
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", script], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert not re.findall(r"\|\s+torch$", result.stderr, re.M)
    page = out.read_text()
    assert "<h3>Bias audit</h3>" in page and "bias parameters: 64 of 592 = 10.81 %" in page
    plain = tmp_path / "plain.h5"
    fit_teacher_student(plain, quiet_trainer, [TrainingLoss()])
    assert dynamics("report", plain, "-o", tmp_path / "plain.html").returncode == 0
    assert "Bias audit" not in (tmp_path / "plain.html").read_text()


def test_probe_keeps_the_contract(small_cnn):
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 3, (4,))
    assert check_probe(BiasAudit(draws=2), small_cnn(), (x, y), steps=2) == {}


class UnsavedMLP(pl.LightningModule):
    """Saves no hyperparameters: its width is not in the run file."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, width, bias=False), nn.BatchNorm1d(width))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(32, 3, generator=generator)
        return DataLoader(TensorDataset(x, x[:, :1]), batch_size=8)


def test_run_file_without_init_args_is_refused_until_given(
    tmp_path, quiet_trainer, dynamics, one_line_error
):
    path = tmp_path / "unsaved.h5"
    recorder = DynamicsRecorder(path, [GradientPlane(), ParameterDisplacement()])
    quiet_trainer(max_steps=2, callbacks=[recorder]).fit(UnsavedMLP(width=6))
    model = f"{Path(__file__)}:UnsavedMLP"
    refused = dynamics("audit", path, "--model", model)
    one_line_error(refused)
    assert "init args width of UnsavedMLP were not recorded" in refused.stderr
    result = dynamics("audit", path, "--model", model, "--init-args", '{"width": 6}')
    assert result.returncode == 0, result.stderr
    # The probe batch (x, y) reaches forward as x; the BatchNorm supplies body.0's shift.
    assert "input: the run's probe batch" in result.stdout
    lines = result.stdout.splitlines()
    layers = lines[lines.index("Layers") :]
    assert next(line for line in layers if line.startswith("body.0 ")).split()[:5] == [
        "body.0",
        "Linear",
        "no",
        "body.1",
        "sound",
    ]
