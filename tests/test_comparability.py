"""Comparing runs of any project (issue 10, items 7 and 8): what the recorder stores about a fit
(module class, init args, submodules, optimizer, scheduler, precision, data) and the verdicts
``dynamics compare`` draws from it — "not comparable", "different init", "differs in: …" — with
nothing claimed about what a run did not record. Every pair is recorded through the recorder
from tiny Lightning models that genuinely differ."""

import re

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dynamics import open_run
from dynamics.analysis.measures.run_comparison import comparability, verdict
from dynamics.analysis.pages.run_comparison import write_comparison
from dynamics.analysis.pages.run_report import write_report
from dynamics.callbacks import DynamicsRecorder, TrainingLoss
from dynamics.store import RunWriter, SeriesSpec, names

VOCAB, CONTEXT = 8, 6


class CenteredGELU(nn.Module):
    """GELU minus its mean under a standard normal input: no parameters, a different function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x) - 0.2821


class TokenData(pl.LightningDataModule):
    """Random token windows; the batch size is its one hyperparameter."""

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, VOCAB, (16, CONTEXT + 1), generator=generator)
        data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
        return DataLoader(data, batch_size=self.hparams.batch_size)


class TinyGPT(pl.LightningModule):
    """One pre-norm attention block and MLP; activation, optimizer, lr and scheduler chosen by
    its saved init args."""

    def __init__(
        self,
        centered: bool = False,
        lr: float = 0.1,
        optimizer: str = "sgd",
        step_lr: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(VOCAB, 8)
        self.norm = nn.LayerNorm(8)
        self.qkv = nn.Linear(8, 24)
        self.up = nn.Linear(8, 16)
        self.act = CenteredGELU() if centered else nn.GELU()
        self.down = nn.Linear(16, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        q, k, v = self.qkv(self.norm(x)).split(8, dim=-1)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + self.down(self.act(self.up(x))))

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        return F.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())

    def configure_optimizers(self):
        kind = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[self.hparams.optimizer]
        optimizer = kind(self.parameters(), lr=self.hparams.lr)
        if not self.hparams.step_lr:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


class PlainGPT(TinyGPT):
    """The same block with the activation passed in and no hyperparameters saved, as many
    projects write it: only the submodules tell the activations apart."""

    def __init__(self, activation: nn.Module) -> None:
        pl.LightningModule.__init__(self)
        self.embed = nn.Embedding(VOCAB, 8)
        self.norm = nn.LayerNorm(8)
        self.qkv = nn.Linear(8, 24)
        self.up = nn.Linear(8, 16)
        self.act = activation
        self.down = nn.Linear(16, 8)
        self.head = nn.Linear(8, VOCAB)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class TinyCNN(pl.LightningModule):
    """A conv net on 8×8 images that brings its own data."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.conv = nn.Conv2d(1, channels, 3)
        self.head = nn.Linear(channels * 36, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(F.relu(self.conv(x)).flatten(1)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        x, y = torch.randn(24, 1, 8, 8, generator=generator), torch.randint(0, 3, (24,))
        return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, generator=generator)


def record(path, module_class, *args, data=None, probes=None, **kwargs):
    torch.manual_seed(0)  # one seed for every run: equal layouts give equal θ0
    module = module_class(*args, **kwargs)
    recorder = DynamicsRecorder(path, probes or [TrainingLoss()])
    trainer = pl.Trainer(
        max_steps=3,
        callbacks=[recorder],
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("comparable")
    return {
        "gpt": record(folder / "gpt.h5", TinyGPT, data=TokenData()),
        "rerun": record(folder / "rerun.h5", TinyGPT, data=TokenData()),
        "centered": record(folder / "centered.h5", TinyGPT, centered=True, data=TokenData()),
        "lr": record(folder / "lr.h5", TinyGPT, lr=0.3, data=TokenData()),
        "adamw": record(folder / "adamw.h5", TinyGPT, optimizer="adamw", data=TokenData()),
        "step_lr": record(folder / "step_lr.h5", TinyGPT, step_lr=True, data=TokenData()),
        "batch8": record(folder / "batch8.h5", TinyGPT, data=TokenData(batch_size=8)),
        "plain_gelu": record(folder / "plain_gelu.h5", PlainGPT, nn.GELU(), data=TokenData()),
        "plain_centered": record(
            folder / "plain_centered.h5", PlainGPT, CenteredGELU(), data=TokenData()
        ),
        "cnn": record(folder / "cnn.h5", TinyCNN),
        "every2": record(
            folder / "every2.h5", TinyGPT, data=TokenData(), probes=[TrainingLoss(every_n_steps=2)]
        ),
    }


def checks_of(runs, a, b):
    checks = comparability(open_run(runs[a]), open_run(runs[b]), (a, b))
    return {check.name: check for check in checks}, verdict(checks)


def test_the_recorder_stores_what_the_fit_is(runs):
    gpt, step_lr, cnn = (open_run(runs[k]).attrs for k in ("gpt", "step_lr", "cnn"))
    assert gpt[names.ATTR_MODULE]["class_path"].endswith("TinyGPT")
    assert gpt[names.ATTR_MODULE]["init_args"] == {
        "centered": False,
        "lr": 0.1,
        "optimizer": "sgd",
        "step_lr": False,
    }
    assert gpt[names.ATTR_SUBMODULES]["act"] == [
        "torch.nn.modules.activation.GELU",
        "approximate='none'",
    ]
    assert gpt[names.ATTR_SUBMODULES]["qkv"][1] == "in_features=8, out_features=24, bias=True"
    (optimizer,) = gpt[names.ATTR_OPTIMIZERS]
    assert optimizer["class_path"] == "torch.optim.sgd.SGD"
    (group,) = optimizer["param_groups"]
    assert group["lr"] == 0.1 and group["momentum"] == 0 and group["n_tensors"] == 11
    assert "params" not in group
    assert gpt[names.ATTR_SCHEDULERS] == [] and gpt[names.ATTR_PRECISION] == "32-true"
    (scheduler,) = step_lr[names.ATTR_SCHEDULERS]
    assert scheduler["class_path"] == "torch.optim.lr_scheduler.StepLR"
    assert scheduler["interval"] == "epoch" and scheduler["frequency"] == 1
    assert scheduler["state"]["step_size"] == 2 and scheduler["state"]["gamma"] == 0.5
    assert scheduler["state"]["base_lrs"] == [0.1]
    assert gpt[names.ATTR_DATA]["datamodule"]["init_args"] == {"batch_size": 4}
    assert gpt[names.ATTR_DATA]["train"] == [
        {
            "dataset": "torch.utils.data.dataset.TensorDataset",
            "length": 16,
            "batch_size": 4,
            "sampler": "torch.utils.data.sampler.SequentialSampler",
            "drop_last": False,
        }
    ]
    assert "datamodule" not in cnn[names.ATTR_DATA]
    assert cnn[names.ATTR_DATA]["train"][0]["sampler"].endswith("RandomSampler")


def test_a_cnn_and_a_transformer_are_not_comparable(runs):
    checks, line = checks_of(runs, "gpt", "cnn")
    assert line.startswith("not comparable: the parameter layouts differ")
    assert checks["parameter layout"].status == "differs"
    assert "11 tensors" in checks["parameter layout"].details
    assert "4 tensors" in checks["parameter layout"].details
    for name in ("module", "init args", "submodules", "data"):
        assert checks[name].status == "differs", name
        assert f"{name} (" in line, name
    assert "TinyGPT" in checks["module"].details and "TinyCNN" in checks["module"].details
    # both SGD at lr 0.1: only the number of tensors they update differs
    assert checks["optimizer"].details == "param_groups.0.n_tensors: 11 vs 4"
    assert checks["precision"].status == "same" and checks["scheduler"].status == "same"
    # the recorder was given no config=: that is said, not taken for agreement
    assert checks["config"].status == "not recorded" and line.endswith("not recorded: config")


def test_gelu_and_a_centred_gelu_differ(runs):
    checks, line = checks_of(runs, "gpt", "centered")
    assert checks["parameter layout"].status == checks["θ0"].status == "same"
    assert checks["init args"].details == "centered: false vs true"
    assert checks["submodules"].details == "act: GELU(approximate='none') vs CenteredGELU()"
    assert line.startswith("differs in: init args (centered: false vs true); submodules (")

    # A module that saves no hyperparameters: its init args are unknown, its submodules tell.
    checks, line = checks_of(runs, "plain_gelu", "plain_centered")
    assert checks["init args"].status == "not recorded"
    assert checks["submodules"].status == "differs"
    assert line == (
        "differs in: submodules (act: GELU(approximate='none') vs CenteredGELU()); "
        "not recorded: init args, config"
    )


def test_learning_rates_optimizers_schedulers_and_data_are_told_apart(runs):
    checks, line = checks_of(runs, "gpt", "lr")
    assert checks["optimizer"].details == "param_groups.0.lr: 0.1 vs 0.3"
    assert line == (
        "differs in: init args (lr: 0.1 vs 0.3); optimizer (param_groups.0.lr: 0.1 vs 0.3); "
        "not recorded: config"
    )
    checks, _ = checks_of(runs, "gpt", "adamw")
    assert checks["optimizer"].status == "differs"
    assert 'class_path: "torch.optim.sgd.SGD" vs "torch.optim.adamw.AdamW"' in (
        checks["optimizer"].details
    )
    checks, _ = checks_of(runs, "gpt", "step_lr")
    assert checks["scheduler"].details == "none vs StepLR"
    # a scheduler sets its optimizer's initial_lr: that is recorded as it is
    assert checks["optimizer"].details == "param_groups.0.initial_lr: absent vs 0.1"
    checks, line = checks_of(runs, "gpt", "every2")
    assert line == "differs in: probes (loss.every_n_steps: 1 vs 2); not recorded: config"
    checks, line = checks_of(runs, "gpt", "batch8")
    assert checks["data"].status == "differs"
    assert "datamodule.init_args.batch_size: 4 vs 8" in checks["data"].details
    assert line.startswith("differs in: data (")


def test_a_rerun_claims_agreement_only_on_what_was_recorded(runs):
    checks, line = checks_of(runs, "gpt", "rerun")
    assert line == "no difference in what both runs recorded; not recorded: config"
    assert checks["data"].details == (
        'same description: TokenData {"batch_size": 4}; TensorDataset of 16, batch 4, '
        "SequentialSampler; samples not compared"
    )


def write_legacy(path, theta0="0" * 64, config=None):
    """A run file as written before the fit's setup was recorded: a loss, θ0's hash and a
    config at most."""
    attrs = {names.ATTR_THETA0_SHA256: theta0, names.ATTR_CONFIG: config or {}}
    writer = RunWriter.create(path, {"loss": {"train": SeriesSpec()}}, {}, attrs)
    for step in range(5):
        writer.append("loss", step, {"train": np.float32(1.0 / (1 + step))})
    writer.close()
    return path


def test_old_files_compare_saying_what_is_not_recorded(runs, tmp_path):
    old = write_legacy(tmp_path / "old.h5")
    older = write_legacy(tmp_path / "older.h5")
    checks = comparability(open_run(old), open_run(older), ("old", "older"))
    assert [c.name for c in checks if c.status != "not recorded"] == ["θ0"]
    assert checks[1].status == "same"
    line = verdict(checks)
    assert line.startswith("no difference in what both runs recorded; not recorded: ")
    assert "parameter layout" in line and "optimizer" in line and "data" in line
    mixed = {c.name: c for c in comparability(open_run(runs["gpt"]), open_run(old), ("gpt", "old"))}
    assert mixed["module"].details == "not recorded in old"
    assert mixed["θ0"].status == "differs"

    page = write_comparison([old, older], tmp_path / "old.html").path.read_text()
    assert "not recorded" in page
    for claim in ("same data config", "no difference beyond the variant", "configs are identical"):
        assert claim not in page


def test_compare_page_shows_verdict_setup_and_no_false_agreement(runs, dynamics, tmp_path):
    out = tmp_path / "compare.html"
    result = dynamics("compare", runs["gpt"], runs["cnn"], runs["centered"], "-o", out)
    assert result.returncode == 0, result.stderr
    page = out.read_text()
    verdicts = dict(re.findall(r"<tr[^>]*><td>(\w+ vs gpt)</td><td>([^<]*)</td></tr>", page))
    assert verdicts["cnn vs gpt"].startswith("not comparable: the parameter layouts differ")
    # read as named: the run, then the reference
    assert verdicts["centered vs gpt"].startswith("differs in: init args (centered: true vs false)")
    assert (
        "module (tests.test_comparability.TinyCNN vs tests.test_comparability.TinyGPT)"
        in (verdicts["cnn vs gpt"])
    )
    assert "⚠ parameter layout differs: cnn vs gpt" in page
    setup = page[page.index("<h2>Setup</h2>") : page.index("<h2>Overlaid</h2>")]
    for text in (
        "test_comparability.TinyGPT",
        "test_comparability.TinyCNN",
        "{&quot;channels&quot;: 4}",
        "&quot;centered&quot;: true",
        "SGD(dampening=0",
        "32-true",
        "TensorDataset of 24, batch 8, RandomSampler",
    ):
        assert text in setup, text
    assert "No run recorded a config" in page
    for claim in ("same data config", "no difference beyond the variant", "configs are identical"):
        assert claim not in page


def test_report_shows_module_class_init_args_and_setup(runs, tmp_path):
    page = write_report([runs["step_lr"]], tmp_path / "report.html").path.read_text()
    assert re.search(
        r"module [\w.]*test_comparability\.TinyGPT · init args \{&quot;centered&quot;: false", page
    )
    assert "StepLR(base_lrs=[0.1], gamma=0.5, step_size=2" in page
    assert "every 1 epoch(s)" in page
    assert "TokenData {&quot;batch_size&quot;: 4}; TensorDataset of 16, batch 4" in page


class UndescribedScheduler(torch.optim.lr_scheduler.StepLR):
    """A scheduler whose state cannot be read at fit start."""

    def state_dict(self):
        raise RuntimeError("no state here")


class CNNWithOddScheduler(TinyCNN):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": optimizer, "lr_scheduler": UndescribedScheduler(optimizer, 1)}


def test_what_cannot_be_described_is_not_recorded_and_the_fit_goes_on(runs, tmp_path):
    with pytest.warns(UserWarning, match="schedulers is not recorded .RuntimeError: no state"):
        path = record(tmp_path / "odd.h5", CNNWithOddScheduler)
    run = open_run(path)
    assert run.status().state == "finished" and len(run.train_loss().values) == 3
    assert names.ATTR_SCHEDULERS not in run.attrs and names.ATTR_OPTIMIZERS in run.attrs
    checks, line = checks_of({"cnn": runs["cnn"], "odd": path}, "cnn", "odd")
    assert checks["scheduler"].details == "not recorded in odd"
    assert line.endswith("not recorded: scheduler, config")


def halve(x):
    return x / 2


def test_recorded_values_are_stable_json():
    from pathlib import Path

    from dynamics.callbacks.fit_description import plain

    value = {
        "fn": halve,  # its str holds its address, which differs between equal runs
        "path": Path("/data/x"),
        "lr": torch.tensor(0.5),
        "weight": torch.zeros(3, 2),
        "betas": (0.9, 0.99),
        "act": nn.GELU(),
    }
    assert plain(value) == {
        "fn": "<halve>",
        "path": "/data/x",
        "lr": 0.5,
        "weight": "tensor(3, 2)",
        "betas": [0.9, 0.99],
        "act": "GELU(approximate='none')",
    }
