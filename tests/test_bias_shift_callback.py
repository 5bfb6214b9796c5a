"""ShiftActivations: shifting a model from a config, recorded in the run file, replayed offline.

The models here are ones the callback was not designed for: a GELU MLP under either Lightning
namespace, a BatchNorm CNN with in-place ReLUs reading dict batches, and (in a script file run
as a user runs it) a GPT-style block with ``nn.GELU`` and ``F.scaled_dot_product_attention``.
"""

from __future__ import annotations

import functools
import importlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from dynamics import open_run
from dynamics.analysis.measures.run_comparison import DIFFERS, SAME, VARIANT, comparability, verdict
from dynamics.analysis.measures.run_setup import setup_rows
from dynamics.bias import shift_activations
from dynamics.bias.activations import ShiftedActivation, expected_value
from dynamics.callbacks import (
    DynamicsRecorder,
    GradientPlane,
    InitBiases,
    ParameterDisplacement,
    ShiftActivations,
    TrainingLoss,
)
from dynamics.errors import DynamicsError
from dynamics.model import load_into
from dynamics.model.probe_batch import probe_batch
from dynamics.model.rebuild import rebuild_module
from dynamics.params.vectors import load_state, parameter_vector, vector_hash
from dynamics.passes.loss_rule import module_loss
from dynamics.store import RunFileError

THIS_FILE = Path(__file__).resolve()
GELU_C = expected_value(nn.GELU())
RELU_C = expected_value(nn.ReLU())


def quiet(namespace=pl, **options):
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return namespace.Trainer(**(defaults | options))


def regression_batches(batch_size: int = 8) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=generator)
    return DataLoader(TensorDataset(x, torch.sin(x[:, :2])), batch_size=batch_size)


@functools.cache
def gelu_mlp_class(namespace_name: str = "pytorch_lightning"):
    """A GELU MLP subclassing the given namespace's ``LightningModule``."""
    namespace = importlib.import_module(namespace_name)

    class GeluMLP(namespace.LightningModule):
        def __init__(self, width: int = 8, lr: float = 0.1) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = nn.Sequential(
                nn.Linear(4, width),
                nn.GELU(),
                nn.Linear(width, width),
                nn.GELU(),
                nn.Linear(width, 2),
            )

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.training_step(batch, batch_idx))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

        def train_dataloader(self):
            return regression_batches()

    return GeluMLP


def cli_config(order: str, namespace_name: str) -> dict:
    prefix = "dynamics.callbacks" + (".lightning" if namespace_name == "lightning.pytorch" else "")
    recorder = {
        "class_path": f"{prefix}.DynamicsRecorder",
        "init_args": {
            "path": "run.h5",
            "probes": [{"class_path": "dynamics.callbacks.TrainingLoss"}],
        },
    }
    shift = {
        "class_path": f"{prefix}.ShiftActivations",
        "init_args": {"shift": "expected", "exclude": ["net.3"]},
    }
    callbacks = [recorder, shift] if order == "recorder first" else [shift, recorder]
    return {
        "trainer": {
            "max_steps": 3,
            "accelerator": "cpu",
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "callbacks": callbacks,
        }
    }


@pytest.mark.parametrize("order", ["recorder first", "shift first"])
@pytest.mark.parametrize("namespace_name", ["pytorch_lightning", "lightning.pytorch"])
def test_lightning_cli_yaml_shifts_before_theta0_and_the_run_says_how(
    tmp_path, monkeypatch, order, namespace_name
):
    """Listed in a LightningCLI YAML (either namespace, either order), the callback shifts the
    model before step 0: the loss recorded at step 0 is the shifted model's at θ0, θ0 is the
    unshifted model's, and the run file says which activations were shifted and by how much."""
    cli = importlib.import_module(f"{namespace_name}.cli")
    model_class = gelu_mlp_class(namespace_name)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cli_config(order, namespace_name)))
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    reference = model_class()  # the same draw the CLI's model gets below
    torch.manual_seed(0)
    result = cli.LightningCLI(
        model_class, args=["fit", "--config", "config.yaml"], save_config_callback=None
    )
    module = result.model
    assert isinstance(module.net[1], ShiftedActivation) and isinstance(module.net[1].phi, nn.GELU)
    assert isinstance(module.net[3], nn.GELU)  # excluded
    run = open_run(tmp_path / "run.h5")
    assert run.theta0_sha256 == vector_hash(parameter_vector(reference))
    x, y = next(iter(regression_batches()))
    with torch.no_grad():
        unshifted = F.mse_loss(reference.net(x), y).item()
        shift_activations(reference, exclude=["net.3"])
        shifted = F.mse_loss(reference.net(x), y).item()
    assert run.series("loss")["train"][0] == pytest.approx(shifted, rel=1e-6)
    assert abs(shifted - unshifted) > 1e-3  # the shift did change the step-0 loss
    (edit,) = run.model_edits
    assert edit["class_path"].endswith("ShiftActivations") and edit["edit"] == "shift_activations"
    assert edit["settings"] == {"shift": "expected", "include": [], "exclude": ["net.3"], "dim": -1}
    assert edit["table"] == [
        {
            "module": "net.1",
            "activation": "GELU(approximate='none')",
            "replaced": True,
            "shift": "expected",
            "c": GELU_C,
            "note": "",
        },
        {
            "module": "net.3",
            "activation": "GELU(approximate='none')",
            "replaced": False,
            "shift": None,
            "c": None,
            "note": "excluded by pattern",
        },
    ]
    text = dict(setup_rows(run))["model edits"]
    assert text == (
        'ShiftActivations(dim=-1, exclude=["net.3"], shift="expected"): '
        f"GELU(approximate='none') − {GELU_C:.6g} at net.1; "
        "GELU(approximate='none') not shifted (excluded by pattern) at net.3"
    )


def test_setup_twice_shifts_once_and_every_stage_is_shifted(tmp_path):
    """``trainer.validate`` after ``trainer.fit`` sets the same module up again: it is not
    shifted twice. A new module given to the same callback is shifted."""
    model_class = gelu_mlp_class()
    callback = ShiftActivations("expected")
    module = model_class()
    trainer = quiet(max_steps=2, callbacks=[callback], default_root_dir=tmp_path)
    trainer.fit(module)
    table = callback.table
    trainer.validate(module, regression_batches(), verbose=False)
    assert callback.table is table
    assert type(module.net[1].phi) is nn.GELU  # one wrapper, not two
    assert [r.module for r in table if r.replaced] == ["net.1", "net.3"]
    other = model_class()
    quiet(max_steps=1, callbacks=[callback], default_root_dir=tmp_path).fit(other)
    assert isinstance(other.net[1], ShiftedActivation) and callback.table is not table
    # A module shifted in its __init__ already: nothing to shift is an error, not a no-op.
    shift_activations(third := model_class())
    with pytest.raises(DynamicsError, match="shifted no activation of GeluMLP: net.1: already"):
        quiet(max_steps=1, callbacks=[ShiftActivations()]).fit(third)


def test_a_model_of_functional_activations_is_refused_in_one_line():
    """A model whose activations are functional calls (here a hand-written centered GELU, as
    in nanoGPT variants) has nothing to swap: the fit stops rather than record an unshifted
    run as shifted."""

    class CenteredGELU(nn.Module):
        def forward(self, x):
            return F.gelu(x) - 0.2821

    module = gelu_mlp_class()()
    module.net[1], module.net[3] = CenteredGELU(), CenteredGELU()
    with pytest.raises(DynamicsError, match="no activation module .*F.gelu"):
        quiet(max_steps=1, callbacks=[ShiftActivations()]).fit(module)
    with pytest.raises(DynamicsError, match="shift must be"):
        ShiftActivations("mean")


def test_resumed_fit_is_shifted_again_and_continues_as_if_never_stopped(tmp_path):
    """A checkpoint holds parameters only; the resumed fit, its config listing the callback,
    is shifted at setup and ends where an uninterrupted shifted fit ends, bit for bit, its run
    file continuing the same loss series."""
    model_class = gelu_mlp_class()

    def fit(path, steps, ckpt_path=None, shift=True):
        torch.manual_seed(0)
        module = model_class()
        recorder = DynamicsRecorder(path, [TrainingLoss()], flush_interval_s=1e9)
        shifts = [ShiftActivations()] if shift else []
        trainer = quiet(max_steps=steps, callbacks=[*shifts, recorder])
        # Full batches: a fit resumed mid-epoch sees the batches an uninterrupted one does.
        trainer.fit(module, regression_batches(batch_size=32), ckpt_path=ckpt_path)
        return trainer, module

    _, straight = fit(tmp_path / "straight.h5", 4)
    trainer, _ = fit(tmp_path / "resumed.h5", 2)
    trainer.save_checkpoint(tmp_path / "half.ckpt")
    # Resumed without the shift, the model would change silently mid-run: refused in one line.
    with pytest.raises(RunFileError, match="edited the model with shift_activations") as error:
        fit(tmp_path / "resumed.h5", 4, ckpt_path=tmp_path / "half.ckpt", shift=False)
    assert "this fit with nothing; resume with the same" in str(error.value)
    _, resumed = fit(tmp_path / "resumed.h5", 4, ckpt_path=tmp_path / "half.ckpt")
    assert torch.equal(parameter_vector(resumed), parameter_vector(straight))
    assert isinstance(resumed.net[1], ShiftedActivation)
    runs = [open_run(tmp_path / name) for name in ("straight.h5", "resumed.h5")]
    np.testing.assert_array_equal(runs[1].series("loss").step, np.arange(4))
    np.testing.assert_array_equal(runs[1].series("loss")["train"], runs[0].series("loss")["train"])
    assert runs[1].model_edits == runs[0].model_edits


# ---------------------------------------------------------------------------------------------
# A BatchNorm CNN with in-place ReLUs, reading dict batches; rebuilt offline


class DictImages(Dataset):
    def __init__(self, n: int = 32) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 1, 6, 6, generator=generator)
        self.y = torch.randint(0, 3, (n,), generator=generator)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"image": self.x[i], "label": self.y[i]}


class DictCNN(pl.LightningModule):
    """Conv → BatchNorm → ReLU(inplace) → Conv → ReLU(inplace) → Linear, dict batches."""

    def __init__(self, channels: int = 4, lr: float = 0.2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.BatchNorm2d(channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(channels, channels, 3, padding=1),
            nn.ReLU(inplace=True),
        )
        self.head = nn.Linear(channels * 36, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch["image"]), batch["label"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(DictImages(), batch_size=8)


@pytest.fixture(scope="module")
def cnn_runs(tmp_path_factory):
    """Three 4-step fits of one θ0: unshifted, shifted by c, shifted adaptively over channels
    (``dim=1`` for both, as a user A/B-ing a CNN sets it once)."""
    folder = tmp_path_factory.mktemp("cnn")
    variants = {
        "plain": [],
        "expected": [ShiftActivations("expected", dim=1)],
        "adaptive": [ShiftActivations("adaptive", dim=1)],
    }
    runs = {}
    for name, shift in variants.items():
        torch.manual_seed(0)
        module = DictCNN()
        probes = [TrainingLoss(), ParameterDisplacement(), GradientPlane()]
        recorder = DynamicsRecorder(folder / f"{name}.h5", probes)
        quiet(max_steps=4, callbacks=[recorder, *shift]).fit(module)
        runs[name] = module, open_run(folder / f"{name}.h5")
    return runs


def eval_loss(module: nn.Module, batch) -> float:
    with torch.no_grad():
        return module_loss(module.eval(), batch).item()


@pytest.mark.parametrize("variant", ["expected", "adaptive"])
def test_rebuilt_model_is_shifted_again_and_its_loss_at_theta_final_is_the_trained_ones(
    cnn_runs, variant
):
    module, run = cnn_runs[variant]
    batch = probe_batch(run)
    trained = eval_loss(module, batch)
    rebuilt = rebuild_module(run, model=f"{THIS_FILE}:DictCNN")
    assert isinstance(rebuilt.features[2], ShiftedActivation)
    assert rebuilt.features[2].phi.inplace and rebuilt.features[2].shift == variant
    load_into(run, rebuilt)
    assert eval_loss(rebuilt, batch) == trained
    # The same parameters without the shift compute another loss: loading them into the
    # unshifted class is refused, the model left as it was.
    unshifted = DictCNN()
    untouched = [p.detach().clone() for p in unshifted.parameters()]
    with pytest.raises(DynamicsError, match=r"submodules differ .*ShiftedActivation"):
        load_into(run, unshifted)
    assert all(torch.equal(p, q) for p, q in zip(unshifted.parameters(), untouched))
    load_state(unshifted, run.stored_states()[-1].theta, run.layout)
    assert abs(eval_loss(unshifted, batch) - trained) > 1e-4
    if variant == "expected":
        assert rebuilt.features[2].constant == RELU_C == run.model_edits[0]["table"][0]["c"]


def test_a_shift_that_cannot_be_replayed_is_refused_in_one_line(cnn_runs, tmp_path):
    """A run whose model was shifted in the training script (no callback), and a run whose
    recorded shift gives another c on the rebuilt model, are refused, never rebuilt
    unshifted."""
    torch.manual_seed(0)
    module = DictCNN()
    shift_activations(module, "expected")  # in the script, before fit: no record of it
    recorder = DynamicsRecorder(tmp_path / "script.h5", [ParameterDisplacement()])
    quiet(max_steps=1, callbacks=[recorder]).fit(module)
    run = open_run(tmp_path / "script.h5")
    assert run.model_edits == []
    with pytest.raises(DynamicsError, match="submodules differ") as error:
        rebuild_module(run, model=f"{THIS_FILE}:DictCNN")
    assert "features.2: ShiftedActivation(ReLU, shift='expected'" in str(error.value)
    assert "\n" not in str(error.value)
    _, recorded = cnn_runs["expected"]
    edited = tmp_path / "edited.h5"
    edited.write_bytes(recorded.path.read_bytes())
    edits = recorded.model_edits
    edits[0]["table"][0]["c"] += 1e-6
    with h5py.File(edited, "r+") as file:
        file.attrs["model_edits"] = json.dumps(edits)
    with pytest.raises(DynamicsError, match="recorded shift of features.2 .* cannot be replayed"):
        rebuild_module(open_run(edited), model=f"{THIS_FILE}:DictCNN")


def test_comparison_says_how_runs_differ_in_shifting(cnn_runs):
    plain, expected, adaptive = (cnn_runs[name][1] for name in ("plain", "expected", "adaptive"))
    checks = {c.name: c for c in comparability(plain, expected)}
    assert checks["θ0"].status == SAME
    assert checks["model edits"].status == DIFFERS
    assert checks["model edits"].details == "none vs ShiftActivations"
    assert "model edits (none vs ShiftActivations)" in verdict(list(checks.values()))
    assert dict(setup_rows(adaptive))["model edits"] == (
        'ShiftActivations(dim=1, shift="adaptive"): '
        "ReLU(inplace=True) − its mean over dim 1 at features.2, features.4"
    )
    checks = {c.name: c for c in comparability(expected, adaptive)}
    assert checks["model edits"].status == VARIANT
    assert 'settings.shift: "expected" vs "adaptive"' in checks["model edits"].details
    assert checks["submodules"].status == VARIANT  # the shifted modules are the variant
    assert verdict(list(checks.values())).startswith(
        'differs only in the variant: model edits (settings.shift: "expected" vs "adaptive")'
    )


# ---------------------------------------------------------------------------------------------
# A module class defined in the training script, run as a user runs it, then `dynamics plane`

SCRIPT = '''
import json
import sys

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dynamics import open_run
from dynamics.callbacks import (
    DynamicsRecorder, GradientPlane, ParameterDisplacement, ShiftActivations, TrainingLoss
)
from dynamics.passes.loss_rule import module_loss
from dynamics.model.probe_batch import probe_batch


class GPTBlock(pl.LightningModule):
    """Token embedding, one pre-norm block (causal SDPA attention, GELU MLP), tied head."""

    def __init__(self, width: int = 8, heads: int = 2, vocab: int = 5) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.wte = nn.Embedding(vocab, width)
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.c_attn, self.c_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, idx):
        x = self.wte(idx)
        b, t, w = x.shape
        q, k, v = (
            s.view(b, t, self.hparams.heads, w // self.hparams.heads).transpose(1, 2)
            for s in self.c_attn(self.ln_1(x)).split(w, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, w))
        x = x + self.mlp(self.ln_2(x))
        return x @ self.wte.weight.T

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        return F.cross_entropy(self(idx).flatten(0, 1), targets.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        tokens = torch.arange(65) % 5
        x, y = tokens[:-1].reshape(8, 8), tokens[1:].reshape(8, 8)
        return DataLoader(TensorDataset(x, y), batch_size=4)


if __name__ == "__main__":
    path, shift = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    module = GPTBlock()
    probes = [TrainingLoss(), ParameterDisplacement(), GradientPlane()]
    callbacks = [DynamicsRecorder(path, probes, overwrite=True)]
    if shift != "none":
        callbacks.append(ShiftActivations(shift))
    pl.Trainer(
        max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks,
    ).fit(module)
    with torch.no_grad():
        loss = module_loss(module.eval(), probe_batch(open_run(path))).item()
    print(json.dumps({"loss": loss}))
'''


def test_plane_of_a_script_model_replays_its_shift(tmp_path, dynamics):
    """A GPT-style block defined in a training script, shifted by the callback: `dynamics plane
    --model script.py:GPTBlock` rebuilds it shifted, and its loss at θT is the trained model's."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    trained = {}
    for name, shift in (("plain", "none"), ("shifted", "expected")):
        done = subprocess.run(
            [sys.executable, str(script), str(tmp_path / f"{name}.h5"), shift],
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stderr
        trained[name] = json.loads(done.stdout.strip().splitlines()[-1])["loss"]
    out = tmp_path / "plane.html"
    result = dynamics(
        "plane",
        tmp_path / "shifted.h5",
        tmp_path / "plain.h5",
        "-o",
        out,
        "--grid",
        "3",
        "--no-progress",
        "--model",
        f"{script}:GPTBlock",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    with h5py.File(tmp_path / "plane.plane.h5") as views:
        view = views["view1"]
        for name in ("shifted", "plain"):
            loss = view[f"trajectory/{name}"]["loss"][-1]
            assert loss == pytest.approx(trained[name], rel=1e-6, abs=0), name
    assert trained["shifted"] != pytest.approx(trained["plain"], rel=1e-3)


# ---------------------------------------------------------------------------------------------
# A module that builds its layers in configure_model (Lightning's hook for large models)


class LateMLP(pl.LightningModule):
    """One GELU built in ``__init__``, the rest in ``configure_model`` (after ``setup``)."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.stem = nn.Sequential(nn.Linear(4, 8), nn.GELU())
        self.body: nn.Sequential | None = None

    def configure_model(self) -> None:
        if self.body is None:  # idempotent, as Lightning asks
            self.body = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.body(self.stem(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        return regression_batches()


@pytest.mark.parametrize("recorder_first", [True, False])
def test_layers_built_in_configure_model_are_shifted_and_recorded(tmp_path, recorder_first):
    """Every activation is shifted, the late ones included, before the recorder stores the
    edits (whatever the callbacks' order); training equals that of the model shifted by hand
    in configure_model; the rebuilt model (configure_model called offline) has the trained
    loss at θT."""
    torch.manual_seed(0)
    module = LateMLP()
    recorder = DynamicsRecorder(tmp_path / "late.h5", [TrainingLoss(), ParameterDisplacement()])
    shift = ShiftActivations("expected")
    callbacks = [recorder, shift] if recorder_first else [shift, recorder]
    quiet(max_steps=3, callbacks=callbacks).fit(module)
    assert isinstance(module.stem[1], ShiftedActivation)
    assert isinstance(module.body[1], ShiftedActivation)
    run = open_run(tmp_path / "late.h5")
    (edit,) = run.model_edits
    assert {row["module"] for row in edit["table"] if row["replaced"]} == {"stem.1", "body.1"}

    class ShiftedByHand(LateMLP):
        def configure_model(self) -> None:
            super().configure_model()
            shift_activations(self, "expected")

    torch.manual_seed(0)
    by_hand = ShiftedByHand()
    quiet(max_steps=3).fit(by_hand)
    for p, q in zip(module.parameters(), by_hand.parameters()):
        assert torch.equal(p, q)

    with pytest.raises(DynamicsError, match=r"call model.configure_model\(\) first"):
        load_into(run, LateMLP())
    rebuilt = rebuild_module(run, model=f"{THIS_FILE}:LateMLP")
    load_into(run, rebuilt)
    batch = next(iter(regression_batches()))
    assert module_loss(rebuilt, batch).item() == module_loss(module, batch).item()


def test_init_biases_refuses_a_module_that_builds_layers_in_configure_model(tmp_path):
    with pytest.raises(DynamicsError, match="before LateMLP.configure_model builds its layers"):
        quiet(max_steps=1, callbacks=[InitBiases("zeros")]).fit(LateMLP())
