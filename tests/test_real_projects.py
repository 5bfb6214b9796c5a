"""Recording the projects people really train (issue 9), every probe attached.

Each test trains a small version of a model users train — a CNN with BatchNorm, dropout, a
DataModule of dict batches and an LR scheduler; a nanoGPT-style character transformer using
``F.scaled_dot_product_attention``; manual optimization; gradient accumulation; bf16-mixed and
bf16-true on CPU; a model above 8.4M parameters; both Lightning namespaces and LightningCLI — and
asserts that the fit
completes, that numbers are right where a reference exists, and that a probe which cannot measure
steps aside with an event in the run file saying why, rather than ending the fit or recording a
wrong number.
"""

from __future__ import annotations

import copy
import functools
import importlib
import math

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
import yaml
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import DataLoader, Dataset, TensorDataset

from dynamics import open_run
from dynamics.callbacks import (
    DynamicsRecorder,
    GradientPlane,
    HessianSpectrum,
    HiddenStateNorms,
    LoggedMetrics,
    ParameterDisplacement,
    TrainingLoss,
)
from dynamics.hessian import top_eigenvalues
from dynamics.model import load_into

HESSIAN_STEPS = [0, 2]  # HessianSpectrum(every_n_steps=2) over a 4-step fit
PROBE_FAILURE = "probe-only op not supported here"


# ---------------------------------------------------------------------------------------------
# Recording helpers


def all_probes(hidden: HiddenStateNorms | None = None, metrics=("val_loss",)) -> list:
    """Every probe the toolkit ships, as a user who wants everything attaches them."""
    return [
        TrainingLoss(),
        hidden or HiddenStateNorms(),
        ParameterDisplacement(),
        LoggedMetrics(metrics),
        HessianSpectrum(k=2, every_n_steps=2),
        GradientPlane(),
    ]


def make_trainer(namespace=pl, **options):
    """A quiet CPU Trainer of the given Lightning namespace."""
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return namespace.Trainer(**(defaults | options))


def fit_recorded(module, path, probes, datamodule=None, namespace=pl, **trainer_options):
    """Fit ``module`` with a recorder holding ``probes``; return the Trainer and the opened run."""
    trainer = make_trainer(namespace, callbacks=[DynamicsRecorder(path, probes)], **trainer_options)
    trainer.fit(module, datamodule=datamodule)
    return trainer, open_run(path)


def lightning_namespace(name: str):
    """``pytorch_lightning`` or ``lightning.pytorch`` (the latter skipped if not installed)."""
    if name == "lightning.pytorch":
        pytest.importorskip("lightning")
    return importlib.import_module(name)


def events_of(run, probe: str, kind: str) -> list:
    return [e for e in run.events() if e.probe == probe and e.kind == kind]


def assert_all_probes_measured(run, steps, hessian_steps=HESSIAN_STEPS) -> None:
    """Every probe of :func:`all_probes` recorded finite rows at the steps it was due."""
    steps = list(steps)
    for group in ("loss", "hidden_norms", "displacement"):
        np.testing.assert_array_equal(run.series(group).step, steps, err_msg=group)
    assert np.isfinite(run.series("loss")["train"]).all()
    assert np.isfinite(run.series("hidden_norms")["norm"]).all()
    assert run.series("displacement")["total"][0] == 0.0
    hessian = run.series("hessian")
    np.testing.assert_array_equal(hessian.step, hessian_steps)
    assert np.isfinite(hessian["eigenvalues"]).all(), hessian["eigenvalues"]
    g0 = run.vector("g0")
    assert g0 is not None and np.isfinite(g0).all() and np.linalg.norm(g0) > 0


def assert_no_finite_rows_from(run, group: str, series: str, step: int) -> None:
    """A disabled probe records nothing (or NaN) from ``step`` on: never a made-up number."""
    if group not in run.groups:
        return
    rows = run.series(group)
    later = rows[series][rows.step >= step]
    assert not np.isfinite(later).any(), (rows.step, rows[series])


def detached(batch):
    return apply_to_collection(batch, torch.Tensor, lambda t: t.detach().clone())


class RecordsTrainerSteps:
    """Mixin: the batches and losses of the Trainer's own training steps.

    Lightning calls ``on_train_batch_start`` only for its own (micro-)batches, never for a
    probe's extra pass, so a loss is noted only by the training step that follows it.
    """

    def on_train_batch_start(self, batch, batch_idx):
        if not hasattr(self, "batches"):
            self.batches, self.losses = [], []
        self.batches.append(detached(batch))
        self._trainer_step_pending = True

    def note_loss(self, loss: torch.Tensor) -> None:
        if getattr(self, "_trainer_step_pending", False):
            self.losses.append(loss.item())
            self._trainer_step_pending = False


# ---------------------------------------------------------------------------------------------
# A small regression MLP, for either Lightning namespace


@functools.cache
def regression_mlp_class(namespace_name: str = "pytorch_lightning"):
    """A two-layer regression MLP subclassing the given namespace's ``LightningModule``."""
    namespace = importlib.import_module(namespace_name)

    class RegressionMLP(RecordsTrainerSteps, namespace.LightningModule):
        def __init__(self, width: int = 8, lr: float = 0.05, batches: int = 16) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 2))

        def compute_loss(self, batch) -> torch.Tensor:
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def training_step(self, batch, batch_idx):
            loss = self.compute_loss(batch)
            self.log("train_loss", loss)
            self.note_loss(loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

        def train_dataloader(self):
            return DataLoader(regression_data(8 * self.hparams.batches), batch_size=8)

    return RegressionMLP


RegressionMLP = regression_mlp_class()


def regression_data(n: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=generator)
    return TensorDataset(x, torch.sin(x[:, :2]) + 0.1 * torch.randn(n, 2, generator=generator))


# ---------------------------------------------------------------------------------------------
# 1. A CNN with BatchNorm, dropout, a DataModule of dict batches and a StepLR scheduler


class DictDataset(Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


class DigitsData(pl.LightningDataModule):
    """Tiny 6×10 one-channel 'digits' in dict batches; train shuffled, validation not."""

    def __init__(self, batch_size: int = 16) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(96, 1, 6, 10, generator=generator)
        y = torch.randint(0, 4, (96,), generator=generator)
        self.train_set, self.val_set = DictDataset(x[:64], y[:64]), DictDataset(x[64:], y[64:])

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(1)
        return DataLoader(self.train_set, self.batch_size, shuffle=True, generator=generator)

    def val_dataloader(self):
        return DataLoader(self.val_set, self.batch_size)


class DigitsCNN(RecordsTrainerSteps, pl.LightningModule):
    """Conv → BatchNorm → ReLU → Dropout → Conv → BatchNorm → ReLU → Linear, SGD + StepLR."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.features = nn.Sequential(
            nn.Conv2d(1, 6, 3, padding=1),
            nn.BatchNorm2d(6),
            nn.ReLU(),
            nn.Dropout(0.25),
            nn.Conv2d(6, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
        )
        self.head = nn.Linear(8 * 6 * 10, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch["x"]), batch["y"])
        self.log("train_loss", loss)
        return {"loss": loss}

    def validation_step(self, batch, batch_idx):
        logits = self(batch["x"])
        self.log("val_loss", F.cross_entropy(logits, batch["y"]))
        self.log("val_acc", (logits.argmax(1) == batch["y"]).float().mean())

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        schedule = {"scheduler": scheduler, "interval": "step"}
        return {"optimizer": optimizer, "lr_scheduler": schedule}


def reduced_outputs(module: nn.Module, names, reduce, run) -> dict[str, float]:
    """``reduce(output)`` of each named submodule during ``run()`` (its first call only)."""
    values: dict[str, float] = {}
    named = dict(module.named_modules())

    def hook_of(name):
        def hook(m, args, output) -> None:  # returns None: the output is left as it is
            values.setdefault(name, reduce(output).item())

        return hook

    handles = [named[name].register_forward_hook(hook_of(name)) for name in names]
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return values


def channel_norms_at_theta0(module0: DigitsCNN, batch, names) -> dict[str, float]:
    """Per module: ‖output‖ over the channel axis (dim 1), averaged over batch and positions."""
    module0.train()  # as in the training step: BatchNorm normalises with the batch's statistics
    return reduced_outputs(
        module0,
        names,
        lambda out: torch.linalg.vector_norm(out, dim=1).mean(),
        lambda: module0(batch["x"]),
    )


def test_cnn_batchnorm_dropout_scheduler_datamodule(tmp_path):
    """A digits-style CNN with every probe: the fit completes, the scheduler and validation
    metrics behave as without the recorder, and the hidden-state norm of a Conv2d and a
    BatchNorm2d output is taken over the channel axis (dim 1), averaged over batch and spatial
    positions — checked at θ0 against a forward hook of our own on the same first batch (the
    modules sit before the dropout, so the reference is exact)."""
    torch.manual_seed(0)
    module = DigitsCNN()
    module0 = copy.deepcopy(module)
    layers = ["features.0", "features.1"]
    probes = all_probes(HiddenStateNorms(modules=layers), metrics=("val_loss", "val_acc"))
    trainer, run = fit_recorded(module, tmp_path / "cnn.h5", probes, DigitsData(), max_epochs=1)

    assert trainer.global_step == 4
    assert_all_probes_measured(run, range(4))
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)

    validation = run.series("validation")
    np.testing.assert_array_equal(validation.step, [4])
    for key in ("val_loss", "val_acc"):
        assert validation[key][0] == pytest.approx(trainer.callback_metrics[key].item(), rel=1e-6)

    hidden = run.series("hidden_norms")
    assert hidden.columns["norm"] == tuple(layers)
    expected = channel_norms_at_theta0(module0, module.batches[0], layers)
    np.testing.assert_allclose(hidden["norm"][0], [expected[n] for n in layers], rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# 2. A nanoGPT-style character transformer (SDPA attention, no dropout, weight tying)

TEXT = "the quick brown fox jumps over the lazy dog; training dynamics of tiny transformers. " * 4
VOCAB = sorted(set(TEXT))


class CenteredGELU(nn.Module):
    """GELU minus its mean under a standard normal input: a hand-written activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x) - 0.2821


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        q, k, v = (
            t.view(batch, tokens, self.heads, width // self.heads).transpose(1, 2)
            for t in self.c_attn(x).split(width, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(batch, tokens, width))


class MLP(nn.Module):
    def __init__(self, width: int, centered: bool) -> None:
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width)
        self.act = CenteredGELU() if centered else nn.GELU()
        self.c_proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, centered: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = MLP(width, centered)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class CharGPT(RecordsTrainerSteps, pl.LightningModule):
    """nanoGPT in miniature: 2 pre-norm blocks of width 16, tied input/output embeddings."""

    def __init__(
        self, width: int = 16, depth: int = 2, heads: int = 2, context: int = 8, centered=False
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.wte = nn.Embedding(len(VOCAB), width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads, centered) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, len(VOCAB), bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def compute_loss(self, batch) -> torch.Tensor:
        idx, targets = batch
        return F.cross_entropy(self(idx).flatten(0, 1), targets.flatten())

    def training_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self):
        data = torch.tensor([VOCAB.index(c) for c in TEXT])
        starts = range(0, 16 * 8, 8)
        x = torch.stack([data[s : s + self.hparams.context] for s in starts])
        y = torch.stack([data[s + 1 : s + 1 + self.hparams.context] for s in starts])
        return DataLoader(TensorDataset(x, y), batch_size=4)


def fit_transformer(tmp_path, hidden: HiddenStateNorms | None = None, **module_args):
    torch.manual_seed(0)
    module = CharGPT(**module_args)
    module0 = copy.deepcopy(module)
    _, run = fit_recorded(module, tmp_path / "gpt.h5", all_probes(hidden), max_steps=4)
    return module, module0, run


def test_transformer_sdpa_hessian_matches_math_backend_reference(tmp_path):
    """The SDPA transformer with every probe: the fit completes (the CPU flash-attention kernel
    has no double backward, so Hessian-vector products must avoid it), and the eigenvalues
    recorded at step 0 equal ``top_eigenvalues`` of the same loss on the same probe batch at θ0,
    computed directly under the math SDPA backend, to 1e-4 relative."""
    module, module0, run = fit_transformer(tmp_path)
    assert_all_probes_measured(run, range(4))

    params = [p for p in module0.parameters() if p.requires_grad]
    with sdpa_kernel(SDPBackend.MATH):
        reference = top_eigenvalues(
            lambda: module0.compute_loss(module.batches[0]), params, k=2, module=module0
        )
    np.testing.assert_allclose(
        run.series("hessian")["eigenvalues"][0], reference.eigenvalues.numpy(), rtol=1e-4
    )


def test_top_eigenvalues_through_sdpa_without_a_backend_context():
    """``dynamics.hessian.top_eigenvalues`` itself takes double backward through SDPA on CPU (the
    user should not have to know about backends) and gives what the math backend gives."""
    torch.manual_seed(0)
    module = CharGPT()
    batch = next(iter(module.train_dataloader()))
    params = [p for p in module.parameters() if p.requires_grad]

    def loss():
        return module.compute_loss(batch)

    with sdpa_kernel(SDPBackend.MATH):
        reference = top_eigenvalues(loss, params, k=2, module=module)
    pairs = top_eigenvalues(loss, params, k=2, module=module)
    np.testing.assert_allclose(pairs.eigenvalues, reference.eigenvalues, rtol=1e-4)


def test_module_pattern_star_matches_one_name_segment(tmp_path):
    """``modules=["blocks.*"]`` records exactly the two blocks — ``*`` matches one dotted name
    segment, as in path globs — not every descendant (``blocks.0.attn``, ``blocks.0.mlp.c_fc``,
    ...), as fnmatch's dot-crossing ``*`` would."""
    _, _, run = fit_transformer(tmp_path, HiddenStateNorms(modules=["blocks.*"]))
    assert run.series("hidden_norms").columns["norm"] == ("blocks.0", "blocks.1")
    assert np.isfinite(run.series("hidden_norms")["norm"]).all()


def test_module_pattern_double_star_matches_descendants(tmp_path):
    """``modules=["blocks.**"]`` records every module below ``blocks``, at any depth."""
    module, _, run = fit_transformer(tmp_path, HiddenStateNorms(modules=["blocks.**"]))
    below = {n for n, _ in module.named_modules() if n.startswith("blocks.")}
    assert {"blocks.0", "blocks.1", "blocks.0.attn.c_attn", "blocks.1.mlp.act"} <= below
    assert set(run.series("hidden_norms").columns["norm"]) == below


def test_hand_written_activation_marked_by_type_gets_activation_bias(tmp_path):
    """A hand-written activation class (``CenteredGELU``) that the user marks with
    ``activation_types=`` gets an ``activation_bias`` column per instance, whose step-0 value is
    the mean of its output over the first batch at θ0 (checked with a hook of our own)."""
    hidden = HiddenStateNorms(activation_types=[CenteredGELU])
    module, module0, run = fit_transformer(tmp_path, hidden, centered=True)
    acts = ["blocks.0.mlp.act", "blocks.1.mlp.act"]
    bias = run.series("activation_bias")
    assert bias.columns["mean"] == tuple(acts)

    means = reduced_outputs(
        module0, acts, torch.mean, lambda: module0.compute_loss(module.batches[0])
    )
    np.testing.assert_allclose(bias["mean"][0], [means[n] for n in acts], rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# 3. Manual optimization


class ManualMLP(RecordsTrainerSteps, pl.LightningModule):
    """``automatic_optimization = False``: training_step backpropagates, steps the optimizer and
    the scheduler itself, logs ``train_loss`` and returns nothing. Counts real optimizer steps."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        self.optimizer_steps = 0

    def compute_loss(self, batch) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def training_step(self, batch, batch_idx):
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        loss = self.compute_loss(batch)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        scheduler.step()
        self.log("train_loss", loss)
        self.note_loss(loss)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        optimizer.register_step_post_hook(self._count_step)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}

    def train_dataloader(self):
        return DataLoader(regression_data(48), batch_size=8)

    def _count_step(self, optimizer, args, kwargs) -> None:
        self.optimizer_steps += 1


class ManualMLPWithDynamicsLoss(ManualMLP):
    def dynamics_loss(self, batch) -> torch.Tensor:
        return self.compute_loss(batch)


def fit_manual(module: ManualMLP, path):
    trainer, run = fit_recorded(module, path, all_probes(), max_epochs=1)
    batches = len(module.batches)
    assert batches == 6
    assert module.optimizer_steps == batches, "a probe stepped the real optimizer"
    assert trainer.global_step == batches
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    assert lr == pytest.approx(0.05 * 0.5 ** (batches // 2)), "a probe stepped the scheduler"
    series = run.series("loss")
    np.testing.assert_array_equal(series.step, range(batches))
    np.testing.assert_allclose(series["train"], module.losses, rtol=1e-6)
    return run


def test_manual_optimization_with_dynamics_loss(tmp_path):
    """Manual optimization with ``dynamics_loss``: one optimizer (and scheduler) step per batch,
    ``TrainingLoss`` records the logged ``train_loss`` although training_step returns nothing
    (not NaN), and the curvature probes measure through ``dynamics_loss``."""
    torch.manual_seed(0)
    run = fit_manual(ManualMLPWithDynamicsLoss(), tmp_path / "manual.h5")
    hessian = run.series("hessian")
    np.testing.assert_array_equal(hessian.step, [0, 2, 4])
    assert np.isfinite(hessian["eigenvalues"]).all()
    assert np.isfinite(run.vector("g0")).all()


def test_manual_optimization_without_dynamics_loss_disables_curvature_probes(tmp_path):
    """Manual optimization without ``dynamics_loss``: calling training_step would run
    ``manual_backward`` and step the real optimizer, so HessianSpectrum and GradientPlane must
    not call it — they step aside with a 'disabled' event that says why, and the fit completes
    with one optimizer step per batch."""
    torch.manual_seed(0)
    run = fit_manual(ManualMLP(), tmp_path / "manual.h5")
    for probe in (HessianSpectrum.name, GradientPlane.name):
        reasons = [e.message for e in events_of(run, probe, "disabled")]
        assert reasons, f"{probe} ran or stepped aside silently: {run.events()}"
        assert any("manual" in reason.lower() for reason in reasons), reasons
    assert_no_finite_rows_from(run, "hessian", "eigenvalues", 0)
    assert run.vector("g0") is None
    for probe in (TrainingLoss.name, HiddenStateNorms.name, ParameterDisplacement.name):
        assert not events_of(run, probe, "disabled"), run.events()


# ---------------------------------------------------------------------------------------------
# 4. Gradient accumulation


class TwoOptimizerGAN(pl.LightningModule):
    """A GAN-like toy under manual optimization: the discriminator and the generator each take
    one optimizer step a batch, so ``global_step`` advances by two a batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 4))
        self.discriminator = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        (real,) = batch
        generator, discriminator = self.optimizers()
        fake = self.generator(torch.randn(len(real), 3))
        critic = F.softplus(-self.discriminator(real)).mean()
        critic = critic + F.softplus(self.discriminator(fake.detach())).mean()
        discriminator.zero_grad()
        self.manual_backward(critic)
        discriminator.step()
        loss = F.softplus(-self.discriminator(fake)).mean()
        generator.zero_grad()
        self.manual_backward(loss)
        generator.step()
        self.log("train_loss", loss)

    def configure_optimizers(self):
        return [
            torch.optim.Adam(self.generator.parameters(), lr=1e-2),
            torch.optim.SGD(self.discriminator.parameters(), lr=0.1),
        ]

    def train_dataloader(self):
        real = torch.randn(48, 4, generator=torch.Generator().manual_seed(0)) + 2
        return DataLoader(TensorDataset(real), batch_size=8)


def test_snapshot_budget_under_manual_optimization_with_two_optimizers(tmp_path):
    """The snapshot plan counts steps as global_step does (two a batch here): the budget of 4
    snapshots holds, and the plan's expected count is what was stored. It planned on batches
    before: period 2 over 12 global steps stored 6 snapshots where 4 fit, 3 expected."""
    torch.manual_seed(0)
    bytes_each = 4 * sum(p.numel() for p in TwoOptimizerGAN().parameters())
    probe = ParameterDisplacement(snapshot_budget_mb=4 * bytes_each / 2**20)
    trainer, run = fit_recorded(
        TwoOptimizerGAN(), tmp_path / "gan.h5", [TrainingLoss(), probe], max_epochs=1
    )
    assert trainer.global_step == 12
    stored = run.series("snapshots").step
    assert len(stored) <= 4
    (settings,) = [p["settings"] for p in run.attrs["probes"] if p["name"] == "displacement"]
    assert settings["snapshots"]["expected"] == len(stored)
    np.testing.assert_array_equal(run.series("loss").step, range(0, 12, 2))


def test_gradient_accumulation_records_mean_unscaled_loss(tmp_path):
    """With ``accumulate_grad_batches=4`` the recorded ``loss/train`` of a step is the mean of
    its four micro-batches' unscaled losses (each recomputed from inside training_step at the same
    parameters), not the last micro-batch's loss divided by 4, which Lightning hands callbacks."""
    torch.manual_seed(0)
    module = RegressionMLP(batches=16)
    trainer, run = fit_recorded(
        module, tmp_path / "accumulated.h5", all_probes(), max_steps=4, accumulate_grad_batches=4
    )
    assert trainer.global_step == 4 and len(module.losses) == 16
    assert_all_probes_measured(run, range(4))
    expected = np.asarray(module.losses).reshape(4, 4).mean(axis=1)
    np.testing.assert_allclose(run.series("loss")["train"], expected, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# 5. A probe whose extra pass fails


class FailingProbeLoss(RegressionMLP):
    """A module whose ``dynamics_loss`` — called only by probes — raises from a given step on."""

    fail_from_step = 0

    def dynamics_loss(self, batch) -> torch.Tensor:
        if self.global_step >= self.fail_from_step:
            raise RuntimeError(PROBE_FAILURE)
        return self.compute_loss(batch)


@pytest.mark.parametrize("fail_from_step", [0, 2])
def test_probe_failure_disables_the_probe_not_the_fit(tmp_path, fail_from_step):
    """An exception inside a probe's extra pass does not end the fit: the probe is disabled, an
    'error' event at the failing step says why (exception type and message), no number is
    recorded for it from then on, and every other probe goes on recording. Failing from step 0
    hits GradientPlane's g0 and the first Hessian row; from step 2, only a later Hessian row."""
    torch.manual_seed(0)
    module = FailingProbeLoss(batches=4)
    module.fail_from_step = fail_from_step
    trainer, run = fit_recorded(module, tmp_path / "failing.h5", all_probes(), max_steps=4)
    assert trainer.global_step == 4
    np.testing.assert_array_equal(run.series("loss").step, range(4))
    assert np.isfinite(run.series("loss")["train"]).all()

    failed = [HessianSpectrum.name] + ([GradientPlane.name] if fail_from_step == 0 else [])
    for probe in failed:
        errors = events_of(run, probe, "error")  # "error": it raised and was disabled
        assert errors, f"{probe} failed without an 'error' event: {run.events()}"
        assert any(PROBE_FAILURE in e.message and "RuntimeError" in e.message for e in errors)
    assert events_of(run, HessianSpectrum.name, "error")[0].step == fail_from_step
    assert_no_finite_rows_from(run, "hessian", "eigenvalues", fail_from_step)
    if fail_from_step > 0:
        hessian = run.series("hessian")
        assert np.isfinite(hessian["eigenvalues"][hessian.step < fail_from_step]).all()
        assert not [e for e in run.events() if e.probe == GradientPlane.name], run.events()
        assert np.isfinite(run.vector("g0")).all()


# ---------------------------------------------------------------------------------------------
# 6. A model above 8.4M float32 parameters with the default recorder


class WideLinear(pl.LightningModule):
    def __init__(self, width: int = 3000) -> None:
        super().__init__()
        self.layer = nn.Linear(width, width)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(8, self.layer.in_features, generator=generator)
        return DataLoader(TensorDataset(x, torch.randn(x.shape, generator=generator)), batch_size=4)


def test_default_recorder_on_a_model_above_the_snapshot_budget(tmp_path):
    """The recorder with no probe arguments, ``DynamicsRecorder(path)``, works on a 9M-
    parameter model (36 MB per float32 snapshot, so the default 64 MB snapshot
    budget holds fewer than two), and stores θ0 exactly."""
    torch.manual_seed(0)
    module = WideLinear()
    theta0 = torch.cat([p.detach().reshape(-1) for p in module.parameters()]).numpy().copy()
    assert theta0.size > 8.4e6
    trainer = make_trainer(callbacks=[DynamicsRecorder(tmp_path / "wide.h5")], max_steps=2)
    trainer.fit(module)
    run = open_run(tmp_path / "wide.h5")
    for group in ("loss", "hidden_norms", "displacement"):
        np.testing.assert_array_equal(run.series(group).step, [0, 1], err_msg=group)
    assert np.isfinite(run.series("loss")["train"]).all()
    assert run.series("displacement")["total"][0] == 0.0
    np.testing.assert_array_equal(run.vector("theta0"), theta0)


# ---------------------------------------------------------------------------------------------
# 7. bf16-mixed precision on CPU


def test_bf16_mixed_on_cpu(tmp_path):
    """bf16-mixed on CPU with every probe: the fit completes and the Hessian eigenvalues, which
    the probe computes in float32 with autocast off, equal ``top_eigenvalues`` of the float32
    loss at θ0 on the probe batch."""
    torch.manual_seed(0)
    module = RegressionMLP(batches=4)
    module0 = copy.deepcopy(module)
    _, run = fit_recorded(
        module, tmp_path / "bf16.h5", all_probes(), max_steps=4, precision="bf16-mixed"
    )
    assert_all_probes_measured(run, range(4))
    params = list(module0.parameters())
    reference = top_eigenvalues(
        lambda: module0.compute_loss(module.batches[0]), params, k=2, module=module0
    )
    np.testing.assert_allclose(
        run.series("hessian")["eigenvalues"][0], reference.eigenvalues.numpy(), rtol=1e-4
    )


def test_bf16_true_on_cpu(tmp_path):
    """bf16-true (weights and inputs in bfloat16) with every probe: no probe steps aside, θ0,
    θT and the displacement are the bfloat16 parameters' exact float32 values, and training is
    the same with and without the recorder."""
    torch.manual_seed(0)
    module = RegressionMLP(batches=4)
    bare = copy.deepcopy(module)
    make_trainer(max_steps=4, precision="bf16-true").fit(bare)
    _, run = fit_recorded(
        module, tmp_path / "bf16.h5", all_probes(), max_steps=4, precision="bf16-true"
    )
    assert not [e for e in run.events() if e.kind in ("error", "disabled")], run.events()
    assert_all_probes_measured(run, range(4))
    theta_final = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    assert theta_final.dtype == torch.bfloat16
    for p, q in zip(module.parameters(), bare.parameters()):
        assert torch.equal(p, q)
    np.testing.assert_array_equal(run.vector("theta_final"), theta_final.float().numpy())
    theta0 = run.vector("theta0").astype(np.float64)
    last = run.stored_states()[-2]  # the last snapshot before θT: the last row's θ
    assert last.step == 3 and last.source == "snapshot"
    expected = np.linalg.norm(last.theta.astype(np.float64) - theta0)
    assert run.series("displacement")["total"][-1] == pytest.approx(expected, rel=1e-6)


class FrozenTiedLM(pl.LightningModule):
    """Bag-of-tokens classifier: a frozen layer (its weight ``requires_grad=False``), the output
    head tied to the embedding, and tensors of the same sizes in irregular order."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 6)
        self.a = nn.Linear(6, 6)
        self.frozen = nn.Linear(6, 6)
        self.frozen.weight.requires_grad_(False)
        self.gain = nn.Parameter(torch.ones(6))
        self.head = nn.Linear(6, 8, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(self.emb(x).mean(1)))
        return self.head(torch.tanh(self.frozen(h)) * self.gain)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.01)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randint(0, 8, (32, 5), generator=generator)
        return DataLoader(TensorDataset(x, torch.randint(0, 8, (32,), generator=generator)), 8)


@pytest.mark.parametrize("precision", ["32", "bf16-true"])
def test_frozen_and_tied_parameters_in_the_extra_passes(tmp_path, precision):
    """The probes that substitute the trainable parameters in float32/float64 (HessianSpectrum,
    LossChangeSplit) cast the frozen ones along: before, LossChangeSplit failed on every model
    with a frozen parameter (float64 met float32) and HessianSpectrum on one under bf16-true
    (float32 met bfloat16), each disabled with an error event. The eigenvalues are those of the
    dense Hessian of the loss on the probe batch at each recorded θ, with the head tied."""
    from torch.func import functional_call

    from dynamics.callbacks import LossChangeSplit

    torch.manual_seed(0)
    module = FrozenTiedLM()
    probes = [
        TrainingLoss(),
        ParameterDisplacement(snapshot_every_n_steps=1),
        HessianSpectrum(k=2, every_n_steps=1, tol=1e-6),
        LossChangeSplit(every_n_steps=1),
    ]
    _, run = fit_recorded(module, tmp_path / "run.h5", probes, max_steps=3, precision=precision)
    assert not [e for e in run.events() if e.kind in ("error", "disabled")], run.events()
    assert np.isfinite(run.series("loss_change")["terms"]).all()
    x, y = next(iter(module.train_dataloader()))  # the probe batch: the fit's first batch
    module = module.double()
    layout = run.layout
    assert "head.weight" not in layout.names and "frozen.weight" not in layout.names

    def loss(theta: torch.Tensor) -> torch.Tensor:
        tensors = dict(zip(layout.names, layout.split(theta)))
        return F.cross_entropy(functional_call(module, tensors, (x,)), y)

    hessian, snapshots = run.series("hessian"), run.series("snapshots")
    np.testing.assert_array_equal(hessian.step, snapshots.step)
    for eigenvalues, theta in zip(hessian["eigenvalues"], snapshots["theta"]):
        dense = torch.autograd.functional.hessian(loss, torch.tensor(theta, dtype=torch.float64))
        top = torch.linalg.eigvalsh(dense).flip(0)[:2].numpy()
        np.testing.assert_allclose(eigenvalues, top, rtol=1e-5)


def test_frozen_parameters_drawn_afresh_are_refused_offline(tmp_path):
    """The run file holds frozen parameters only as a hash: a model whose constructor draws
    them afresh is refused by ``load_into`` and ``rebuild_module`` (before, its losses were
    other ones, silently: 2.188 against the trained 2.174 at θT on this model), and one that
    has the run's frozen values loads and computes the trained model's loss."""
    from dynamics.errors import DynamicsError
    from dynamics.model.rebuild import rebuild_module
    from dynamics.passes.loss_rule import module_loss

    torch.manual_seed(0)
    module = FrozenTiedLM()
    _, run = fit_recorded(module, tmp_path / "run.h5", [ParameterDisplacement()], max_steps=3)
    torch.manual_seed(1)
    with pytest.raises(DynamicsError, match=r"frozen parameters \(requires_grad=False\) are not"):
        load_into(run, FrozenTiedLM())
    with pytest.raises(DynamicsError, match="frozen parameters"):
        rebuild_module(run, model=f"{__file__}:FrozenTiedLM")
    same = FrozenTiedLM()
    same.frozen.weight.data.copy_(module.frozen.weight)
    load_into(run, same)
    batch = next(iter(module.train_dataloader()))
    assert module_loss(same.eval(), batch).item() == module_loss(module.eval(), batch).item()


# ---------------------------------------------------------------------------------------------
# 8. Both Lightning namespaces, Trainer and LightningCLI

NAMESPACES = ["pytorch_lightning", "lightning.pytorch"]


@pytest.mark.parametrize("namespace_name", NAMESPACES)
def test_trainer_of_either_namespace_accepts_the_recorder(tmp_path, namespace_name):
    """``dynamics.callbacks.DynamicsRecorder`` in the ``callbacks`` of a ``Trainer`` from
    ``pytorch_lightning`` or from ``lightning.pytorch`` (module subclassing that namespace's
    LightningModule): the fit completes and every probe records."""
    namespace = lightning_namespace(namespace_name)
    torch.manual_seed(0)
    module = regression_mlp_class(namespace_name)(batches=4)
    assert isinstance(module, namespace.LightningModule)
    trainer, run = fit_recorded(
        module, tmp_path / "run.h5", all_probes(), namespace=namespace, max_steps=4
    )
    assert trainer.global_step == 4
    assert_all_probes_measured(run, range(4))


#: The recorder class of each Lightning namespace, as a LightningCLI YAML names it.
RECORDER_CLASS_PATH = {
    "pytorch_lightning": "dynamics.callbacks.DynamicsRecorder",
    "lightning.pytorch": "dynamics.callbacks.lightning.DynamicsRecorder",
}


def cli_config(path, namespace_name: str) -> dict:
    """A LightningCLI config listing the recorder, with every probe, under trainer.callbacks."""
    probes = [
        {"class_path": "dynamics.callbacks.TrainingLoss"},
        {"class_path": "dynamics.callbacks.HiddenStateNorms"},
        {"class_path": "dynamics.callbacks.ParameterDisplacement"},
        {"class_path": "dynamics.callbacks.LoggedMetrics", "init_args": {"keys": ["val_loss"]}},
        {
            "class_path": "dynamics.callbacks.HessianSpectrum",
            "init_args": {"k": 2, "every_n_steps": 2},
        },
        {"class_path": "dynamics.callbacks.GradientPlane"},
    ]
    recorder = {
        "class_path": RECORDER_CLASS_PATH[namespace_name],
        "init_args": {"path": str(path), "probes": probes},
    }
    trainer = dict(
        max_steps=4,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
    )
    return {"trainer": trainer, "model": {"batches": 4}}


@pytest.mark.parametrize("namespace_name", NAMESPACES)
def test_lightning_cli_of_either_namespace_accepts_the_recorder(tmp_path, namespace_name):
    """A YAML config naming the namespace's recorder under ``trainer.callbacks``
    (``dynamics.callbacks.DynamicsRecorder`` for ``pytorch_lightning``,
    ``dynamics.callbacks.lightning.DynamicsRecorder`` for ``lightning.pytorch``: each CLI
    type-checks the entry against its own ``Callback`` class) is accepted, and the fit it runs
    records every probe."""
    cli = importlib.import_module(f"{lightning_namespace(namespace_name).__name__}.cli")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cli_config(tmp_path / "cli.h5", namespace_name)))
    torch.manual_seed(0)
    result = cli.LightningCLI(
        regression_mlp_class(namespace_name),
        args=["fit", "--config", str(config)],
        save_config_callback=None,
    )
    assert result.trainer.global_step == 4
    assert_all_probes_measured(open_run(tmp_path / "cli.h5"), range(4))
    assert math.isfinite(result.trainer.callback_metrics["train_loss"].item())
