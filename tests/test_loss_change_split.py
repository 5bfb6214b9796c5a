"""LossChangeSplit (issue 12, part 5): one step's loss change, split exactly by parameter group.

References that cannot agree by accident: the closed form of a quadratic loss, the run's own
measured ΔL (and the chain L(θ_s) + ΔL_s = L(θ_{s+1}) across rows), direct float64 evaluations
of the loss at the trained parameters, and a step that moves only the biases.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dynamics import open_run
from dynamics.analysis.pages.run_report import write_report
from dynamics.callbacks import DynamicsRecorder, LossChangeSplit, ProbeUnavailable, check_probe
from dynamics.experiments.teacher_student.data import TeacherStudentData
from dynamics.experiments.teacher_student.module import TeacherStudentModule
from dynamics.params.groups import group_parameters
from dynamics.params.vectors import parameter_vector
from dynamics.passes.loss_change import split_loss_change
from tests.conftest import SmallCNN, TinyClassifier, make_quiet_trainer
from tests.test_real_projects import CharGPT, DigitsCNN, DigitsData, ManualMLP
from tests.test_resume import fit as fit_checkpointed

TINY_TEACHER = dict(width=8, expansion=2, depth=2)


def fit(module, probes, path, datamodule=None, **trainer_options):
    """Fit ``module`` recording ``probes`` into ``path``; the opened run."""
    recorder = DynamicsRecorder(path, probes, on_probe_error="raise")
    make_quiet_trainer(callbacks=[recorder], **trainer_options).fit(module, datamodule=datamodule)
    return open_run(path)


def float64_loss(module: nn.Module, loss_of, batch) -> float:
    """``loss_of(model, batch)`` on a float64 copy of ``module`` in eval mode."""
    model = copy.deepcopy(module).double().eval()
    batch = [t.double() if t.is_floating_point() else t for t in batch]
    with torch.no_grad():
        return float(loss_of(model, batch))


def assert_split_sums_to_delta(rows, rtol: float = 1e-6) -> None:
    """The file's own terms sum to its own ΔL within ``rtol``, and the stored residual says so."""
    delta, terms = rows["delta"], rows["terms"]
    np.testing.assert_array_equal(rows["converged"], 1)
    np.testing.assert_allclose(terms.sum(axis=1), delta, rtol=rtol, atol=0)
    np.testing.assert_allclose(rows["residual"], terms.sum(axis=1) - delta, atol=1e-15)


# ---------------------------------------------------------------------------------------------
# The quadrature against closed forms


def test_quadratic_loss_split_equals_its_closed_form() -> None:
    """L = ‖Xw + b − y‖²/2N is quadratic, so ∇L(θ + tΔ) = ∇L(θ) + tHΔ and each group's term is
    ∇_g L(θ)·Δ_g + ½ (HΔ)_g·Δ_g exactly; one Gauss–Legendre node already integrates it."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 5, generator=generator, dtype=torch.float64)
    y = torch.randn(32, generator=generator, dtype=torch.float64)
    start = [torch.randn(5, generator=generator, dtype=torch.float64), torch.tensor([0.3])]
    start[1] = start[1].double()
    step = [0.5 * torch.randn(5, generator=generator, dtype=torch.float64), torch.tensor([-0.7])]
    step[1] = step[1].double()
    end = [s + d for s, d in zip(start, step)]

    def loss(tensors):
        w, b = tensors
        return ((x @ w + b - y) ** 2).sum() / (2 * len(y))

    z = torch.cat([x, torch.ones(len(y), 1, dtype=torch.float64)], dim=1)
    theta, delta = torch.cat(start), torch.cat(step)
    gradient = z.T @ (z @ theta - y) / len(y)
    hessian_step = z.T @ z @ delta / len(y)
    closed = (gradient * delta + 0.5 * hessian_step * delta).numpy()
    expected = np.array([closed[:5].sum(), closed[5]])
    for nodes in (1, 2, 4):
        split = split_loss_change(loss, start, end, [0, 1], nodes=nodes)
        assert split.gradient_evaluations == nodes and split.panels == 1
        np.testing.assert_allclose(split.terms, expected, rtol=1e-12)
        assert split.converged and abs(split.residual) < 1e-14
    assert split.delta == pytest.approx(float(loss(end) - loss(start)), rel=1e-14)


def test_bisection_until_the_measured_change_is_met_or_the_budget_is_spent() -> None:
    """L(t) = cos(3t) along the step, two nodes per panel: the panels are bisected until the sum
    meets rtol; with a budget too small the result says it did not converge."""
    start, end = [torch.zeros(1, dtype=torch.float64)], [torch.ones(1, dtype=torch.float64)]

    def loss(tensors):
        return torch.cos(3 * tensors[0]).sum()

    split = split_loss_change(
        loss, start, end, [0], nodes=2, rtol=1e-9, max_gradient_evaluations=4096
    )
    assert split.converged and split.panels > 4
    assert split.terms[0] == pytest.approx(np.cos(3.0) - 1.0, rel=1e-9)
    short = split_loss_change(loss, start, end, [0], nodes=2, rtol=1e-9, max_gradient_evaluations=5)
    assert not short.converged and short.gradient_evaluations == 2
    assert abs(short.residual) > 1e-9 * abs(short.delta)


# ---------------------------------------------------------------------------------------------
# Groups


class Zoo(nn.Module):
    """One parameter of each kind the grouping must tell apart."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.ln = nn.LayerNorm(4)
        self.attn = nn.MultiheadAttention(4, 2)
        self.lstm = nn.LSTM(4, 4)
        self.rms = RMSNorm()


class RMSNorm(nn.Module):
    """A user's own normalization class, known by its name."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))


def test_kinds_biases_weights_and_normalization() -> None:
    groups = group_parameters(Zoo())
    assert groups.names == ("bias", "weight", "normalization")
    assert groups.members("bias") == [
        "fc.bias",
        "attn.in_proj_bias",
        "attn.out_proj.bias",
        "lstm.bias_ih_l0",
        "lstm.bias_hh_l0",
    ]
    assert groups.members("normalization") == [
        "bn.weight",
        "bn.bias",
        "ln.weight",
        "ln.bias",
        "rms.scale",
    ]
    assert "embed.weight" in groups.members("weight") and "fc.weight" in groups.members("weight")


def test_layer_and_pattern_groups() -> None:
    zoo = Zoo()
    assert group_parameters(zoo, "layer").names[:3] == ("embed", "fc", "bn")
    patterns = group_parameters(zoo, {"fc": ["fc.*"], "norms": ["bn.*", "ln.*"]})
    assert patterns.names == ("fc", "norms", "other")
    assert patterns.members("fc") == ["fc.weight", "fc.bias"]
    assert "rms.scale" in patterns.members("other")
    with pytest.raises(ValueError, match="no parameter matches"):
        group_parameters(zoo, {"head": ["head.*"]})
    with pytest.raises(ValueError, match="kind"):
        group_parameters(zoo, "kinds")


class BiasOnlySteps(TinyClassifier):
    """The optimizer holds only the biases: every step leaves every weight exactly where it was."""

    def configure_optimizers(self):
        biases = [p for n, p in self.named_parameters() if n.endswith("bias")]
        return torch.optim.SGD(biases, lr=0.5)


def test_a_step_that_moves_only_biases_is_all_bias_term(tmp_path) -> None:
    torch.manual_seed(0)
    run = fit(BiasOnlySteps(), [LossChangeSplit(every_n_steps=1)], tmp_path / "b.h5", max_steps=3)
    rows = run.series("loss_change")
    assert list(run.columns("loss_change", "terms")) == ["bias", "weight"]
    assert_split_sums_to_delta(rows)
    np.testing.assert_array_equal(rows["terms"][:, 1], 0.0)
    np.testing.assert_allclose(rows["terms"][:, 0], rows["delta"], rtol=1e-6)
    np.testing.assert_array_equal(rows["cumulative_share"][:, 1], 0.0)
    bias_share = rows["terms"][:, 0].cumsum() / rows["delta"].cumsum()
    np.testing.assert_allclose(rows["cumulative_share"][:, 0], bias_share, rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# The teacher–student model


def teacher_student_run(tmp_path, activation: str, **probe_args):
    pl.seed_everything(0, verbose=False)
    module = TeacherStudentModule(activation=activation, lr=3e-3, **TINY_TEACHER)
    data = TeacherStudentData(activation=activation, batch_size=32, **TINY_TEACHER)
    module0 = copy.deepcopy(module)
    probe = LossChangeSplit(every_n_steps=1, **probe_args)
    run = fit(module, [probe], tmp_path / f"{activation}.h5", data, max_steps=6)
    return module0, module, probe, run


def test_teacher_student_terms_sum_to_the_measured_change_and_chain(tmp_path) -> None:
    """Smooth activation: every row's terms sum to ΔL within 1e-6; the losses the rows measure
    are the module's own at θ_s (L(θ_s) + ΔL_s = L(θ_{s+1})), from θ0 to the trained θT."""
    module0, module, probe, run = teacher_student_run(tmp_path, "gelu")
    rows = run.series("loss_change")
    np.testing.assert_array_equal(rows.step, range(6))
    assert_split_sums_to_delta(rows)
    assert list(run.columns("loss_change", "terms")) == ["bias", "weight", "normalization"]
    ends = rows["loss"] + rows["delta"]
    np.testing.assert_allclose(ends[:-1], rows["loss"][1:], rtol=1e-12)

    def mse(model, batch):
        return F.mse_loss(model(batch[0]), batch[1])

    batch = next(
        iter(
            TeacherStudentData(activation="gelu", **TINY_TEACHER, batch_size=32).train_dataloader()
        )
    )
    assert rows["loss"][0] == pytest.approx(float64_loss(module0, mse, batch), rel=1e-12)
    assert ends[-1] == pytest.approx(float64_loss(module, mse, batch), rel=1e-12)
    shares = rows["terms"].cumsum(axis=0) / rows["delta"].cumsum()[:, None]
    np.testing.assert_allclose(rows["cumulative_share"], shares, rtol=1e-12)


def test_teacher_student_relu_is_converged_or_says_by_how_much(tmp_path) -> None:
    """ReLU makes the integrand jump: a row either meets 1e-6 or keeps converged = 0, its
    residual (equal to Σ terms − ΔL in the file) and a warning event; never a silent miss."""
    _, _, _, run = teacher_student_run(tmp_path, "relu", max_gradient_evaluations=8)
    rows = run.series("loss_change")
    residual = rows["terms"].sum(axis=1) - rows["delta"]
    np.testing.assert_allclose(rows["residual"], residual, atol=1e-15)
    met = np.abs(residual) <= 1e-6 * np.abs(rows["delta"])
    np.testing.assert_array_equal(rows["converged"], met)
    assert not met.all(), "8 evaluations were expected to miss on a ReLU student"
    warnings = [e.message for e in run.events() if e.probe == "loss_change"]
    assert any("converged = 0" in message for message in warnings), run.events()


def test_report_draws_the_terms_and_the_cumulative_share(tmp_path) -> None:
    _, _, _, run = teacher_student_run(tmp_path, "gelu")
    page = write_report([run.path], tmp_path / "report.html").path.read_text()
    assert "Loss change of one step per parameter group" in page
    assert "Cumulative share of the loss change per parameter group" in page


# ---------------------------------------------------------------------------------------------
# Isolation


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_check_probe_on_a_batchnorm_dropout_cnn(mode) -> None:
    """check_probe: .grad, RNG, buffers, flags and parameters untouched by every hook; with
    ``mode="train"`` every evaluation draws the same dropout masks, so the split still closes."""
    module = SmallCNN()
    batch = next(iter(module.train_dataloader()))
    probe = LossChangeSplit(every_n_steps=1, mode=mode, max_gradient_evaluations=1024)
    rows = check_probe(probe, module, batch)["loss_change"]
    assert_split_sums_to_delta(rows)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_training_is_bit_identical_with_and_without_the_probe(tmp_path, mode) -> None:
    def trained(callbacks) -> torch.Tensor:
        pl.seed_everything(0, verbose=False)
        module = DigitsCNN()
        make_quiet_trainer(max_steps=4, callbacks=callbacks).fit(module, datamodule=DigitsData())
        return parameter_vector(module)

    probe = LossChangeSplit(every_n_steps=1, mode=mode, max_gradient_evaluations=16)
    recorded = trained([DynamicsRecorder(tmp_path / "cnn.h5", [probe])])
    assert torch.equal(recorded, trained([]))
    rows = open_run(tmp_path / "cnn.h5").series("loss_change")
    np.testing.assert_array_equal(rows.step, range(4))
    assert np.isfinite(rows["terms"]).all()


class StatesBeforeSteps(DigitsCNN):
    """Keeps its state (parameters and BatchNorm statistics) before each training batch."""

    def on_train_batch_start(self, batch, batch_idx):
        super().on_train_batch_start(batch, batch_idx)
        self.states = [*getattr(self, "states", []), copy.deepcopy(self.state_dict())]


def test_eval_mode_holds_the_running_statistics_of_before_the_step(tmp_path) -> None:
    """BatchNorm in eval mode: both ends of a row's segment use the buffers of before its step,
    so ΔL is the parameters' doing: L(θ_s; b_s) + ΔL_s = L(θ_{s+1}; b_s), which differs from
    L(θ_{s+1}; b_{s+1})."""
    pl.seed_everything(0, verbose=False)
    module = StatesBeforeSteps()
    probe = LossChangeSplit(every_n_steps=1, max_gradient_evaluations=16)
    run = fit(module, [probe], tmp_path / "cnn.h5", DigitsData(), max_steps=3)
    rows = run.series("loss_change")
    data = DigitsData()
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))  # the first training batch: the probe batch

    def loss(parameters_from: int, buffers_from: int) -> float:
        model = copy.deepcopy(module).double().eval()
        buffers = dict(module.named_buffers())
        state = {
            k: module.states[buffers_from if k in buffers else parameters_from][k]
            for k in module.states[0]
        }
        model.load_state_dict(state)
        with torch.no_grad():
            return float(F.cross_entropy(model(batch["x"].double()), batch["y"]))

    for s in range(2):
        assert rows["loss"][s] == pytest.approx(loss(s, s), rel=1e-12)
        assert rows["loss"][s] + rows["delta"][s] == pytest.approx(loss(s + 1, s), rel=1e-12)
        assert loss(s + 1, s + 1) != pytest.approx(loss(s + 1, s), rel=1e-9)


# ---------------------------------------------------------------------------------------------
# Models the probe was not designed on


def test_gpt_with_sdpa_tied_embeddings_and_adamw(tmp_path) -> None:
    """A nanoGPT-style model: F.scaled_dot_product_attention, GELU, tied input/output
    embeddings, AdamW (Δθ includes the decoupled weight decay): the split closes in float64."""
    torch.manual_seed(0)
    run = fit(CharGPT(), [LossChangeSplit(every_n_steps=1)], tmp_path / "gpt.h5", max_steps=3)
    rows = run.series("loss_change")
    assert_split_sums_to_delta(rows)
    settings = next(p for p in run.attrs["probes"] if p["name"] == "loss_change")["settings"]
    assert "wte.weight" in settings["groups"]["weight"]
    assert "lm_head.weight" not in sum(settings["groups"].values(), [])  # tied: counted once


def test_adamw_steps_are_split_with_their_weight_decay(tmp_path) -> None:
    """AdamW with a strong decoupled weight decay: Δθ is what the optimizer did, decay included,
    so the rows chain from step to step and close."""
    torch.manual_seed(0)
    module = WeightDecayed(activation="gelu", optimizer="adamw", lr=1e-2, **TINY_TEACHER)
    data = TeacherStudentData(activation="gelu", batch_size=16, **TINY_TEACHER)
    run = fit(module, [LossChangeSplit(every_n_steps=1)], tmp_path / "w.h5", data, max_steps=3)
    rows = run.series("loss_change")
    assert_split_sums_to_delta(rows)
    ends = rows["loss"] + rows["delta"]
    np.testing.assert_allclose(ends[:-1], rows["loss"][1:], rtol=1e-12)


class WeightDecayed(TeacherStudentModule):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=5.0)


def test_gradient_accumulation_splits_the_whole_accumulated_step(tmp_path) -> None:
    """With accumulate_grad_batches=3 a row is one optimizer step (three micro-batches): the
    rows chain from θ0 to θT, which they would not if θ were taken after a micro-batch."""
    pl.seed_everything(0, verbose=False)
    module = TinyClassifier()
    module0 = copy.deepcopy(module)
    probe = LossChangeSplit(every_n_steps=1)
    run = fit(module, [probe], tmp_path / "acc.h5", max_steps=3, accumulate_grad_batches=3)
    rows = run.series("loss_change")
    np.testing.assert_array_equal(rows.step, range(3))
    np.testing.assert_array_equal(rows["optimizer_steps"], 1)
    assert_split_sums_to_delta(rows)

    def cross_entropy(model, batch):
        return F.cross_entropy(model(batch[0]), batch[1])

    batch = next(iter(module0.train_dataloader()))  # the first training batch: the probe batch
    ends = rows["loss"] + rows["delta"]
    np.testing.assert_allclose(ends[:-1], rows["loss"][1:], rtol=1e-12)
    assert rows["loss"][0] == pytest.approx(float64_loss(module0, cross_entropy, batch), rel=1e-12)
    assert ends[-1] == pytest.approx(float64_loss(module, cross_entropy, batch), rel=1e-12)


def test_manual_optimization_without_dynamics_loss_steps_aside(tmp_path) -> None:
    torch.manual_seed(0)
    module = ManualMLP()
    recorder = DynamicsRecorder(tmp_path / "m.h5", [LossChangeSplit(every_n_steps=1)])
    make_quiet_trainer(max_steps=2, callbacks=[recorder]).fit(module)
    assert module.optimizer_steps == 2
    run = open_run(tmp_path / "m.h5")
    [event] = [e for e in run.events() if e.probe == "loss_change"]
    assert event.kind == "disabled" and "dynamics_loss" in event.message
    assert "loss_change" not in run.groups


class TwoOptimizers(pl.LightningModule):
    """GAN-style manual optimization: two optimizers, each stepped once per training batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.first = nn.Linear(4, 8)
        self.second = nn.Linear(8, 2)

    def dynamics_loss(self, batch):
        x, y = batch
        return F.mse_loss(self.second(torch.tanh(self.first(x))), y)

    def training_step(self, batch, batch_idx):
        for optimizer in self.optimizers():
            optimizer.zero_grad()
            self.manual_backward(self.dynamics_loss(batch))
            optimizer.step()

    def configure_optimizers(self):
        return [
            torch.optim.SGD(self.first.parameters(), lr=0.1),
            torch.optim.Adam(self.second.parameters(), lr=0.01),
        ]

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(32, 4, generator=generator)
        return DataLoader(TensorDataset(x, torch.sin(x[:, :2])), batch_size=8)


def test_several_optimizers_per_batch_are_one_row_that_says_so(tmp_path) -> None:
    """Two optimizer steps per batch: the row splits the batch's whole change, records that it
    spans 2 optimizer steps, and a warning event says so."""
    torch.manual_seed(0)
    module = TwoOptimizers()
    probe = LossChangeSplit(groups="layer", every_n_steps=1)
    run = fit(module, [probe], tmp_path / "two.h5", max_steps=4)
    rows = run.series("loss_change")
    np.testing.assert_array_equal(rows.step, [0, 2])
    np.testing.assert_array_equal(rows["optimizer_steps"], 2)
    assert_split_sums_to_delta(rows)
    assert list(run.columns("loss_change", "terms")) == ["first", "second"]
    ends = rows["loss"] + rows["delta"]
    np.testing.assert_allclose(ends[0], rows["loss"][1], rtol=1e-12)
    assert any("several optimizer steps" in e.message for e in run.events())


def test_bad_arguments_are_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="nodes"):
        LossChangeSplit(nodes=0)
    for groups in (["bias"], "kinds"):
        with pytest.raises(ValueError, match="groups"):
            LossChangeSplit(groups=groups)
    assert issubclass(ProbeUnavailable, ValueError)


LIGHTNING_CLI_YAML = """
trainer:
  max_steps: 4
  accelerator: cpu
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: dynamics.callbacks.DynamicsRecorder
      init_args:
        path: split.h5
        probes:
          - class_path: dynamics.callbacks.LossChangeSplit
            init_args:
              every_n_steps: 2
              groups:
                biases: ["**.bias"]
                first_block: ["student.blocks.0.**"]
model:
  class_path: dynamics.experiments.TeacherStudentModule
  init_args: {width: 8, expansion: 2, depth: 2, activation: gelu}
data:
  class_path: dynamics.experiments.TeacherStudentData
  init_args: {width: 8, expansion: 2, depth: 2, activation: gelu, batch_size: 8}
"""


def test_configured_from_lightning_cli_yaml_with_pattern_groups(tmp_path, monkeypatch) -> None:
    from pytorch_lightning.cli import LightningCLI

    (tmp_path / "config.yaml").write_text(LIGHTNING_CLI_YAML)
    monkeypatch.chdir(tmp_path)
    LightningCLI(args=["fit", "--config", "config.yaml"], save_config_callback=None)
    run = open_run(tmp_path / "split.h5")
    rows = run.series("loss_change")
    np.testing.assert_array_equal(rows.step, [0, 2])
    assert list(run.columns("loss_change", "terms")) == ["biases", "first_block", "other"]
    assert_split_sums_to_delta(rows)
    settings = next(p for p in run.attrs["probes"] if p["name"] == "loss_change")["settings"]
    assert "student.blocks.0.up.bias" in settings["groups"]["biases"]  # first match wins
    assert "student.blocks.0.up.weight" in settings["groups"]["first_block"]


def test_a_resumed_fit_continues_the_same_rows_and_cumulative_share(tmp_path, quiet_trainer):
    """Resumed from a checkpoint at step 5: the rows, the cumulative share included (its running
    sums are checkpointed), equal an uninterrupted fit's bit for bit."""
    straight, resumed = tmp_path / "straight.h5", tmp_path / "resumed.h5"

    def probes():
        return [LossChangeSplit(every_n_steps=2, max_gradient_evaluations=16)]

    fit_checkpointed(tmp_path, straight, probes(), 10, quiet_trainer=quiet_trainer)
    fit_checkpointed(tmp_path, resumed, probes(), 8, quiet_trainer=quiet_trainer)
    checkpoint = tmp_path / "resumed" / "epoch=4-step=5.ckpt"
    fit_checkpointed(tmp_path, resumed, probes(), 10, checkpoint, quiet_trainer)
    a, b = open_run(straight).series("loss_change"), open_run(resumed).series("loss_change")
    np.testing.assert_array_equal(a.step, [0, 2, 4, 6, 8])
    np.testing.assert_array_equal(a.step, b.step)
    for name, values in a.values.items():
        np.testing.assert_array_equal(values, b[name], err_msg=name)


def test_the_docs_yaml_builds_the_probe() -> None:
    page = Path(__file__).resolve().parents[1] / "docs" / "recording.md"
    config = yaml.safe_load(page.read_text().split("```yaml")[1].split("```")[0])
    [recorder] = config["trainer"]["callbacks"]
    config = recorder["init_args"]["probes"][-1]
    assert config["class_path"] == "dynamics.callbacks.LossChangeSplit"
    probe = LossChangeSplit(**config["init_args"])
    assert probe.every_n_steps == 10 and probe.groups == "kind"
