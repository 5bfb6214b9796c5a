"""A probe that cannot run never ends the fit: it is disabled with an event; training goes on."""

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pytorch_lightning import LightningModule
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.demos.boring_classes import BoringModel
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dynamics import RunFileError, open_run
from dynamics.callbacks import (
    DynamicsRecorder,
    Probe,
    ProbeUnavailable,
    SeriesSpec,
    TrainingLoss,
)
from dynamics.params.vectors import flatten
from dynamics.passes.isolation import side_effect_free
from dynamics.passes.loss_rule import module_loss


class TinyAttention(LightningModule):
    """One self-attention layer through F.scaled_dot_product_attention, no dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 2, 4).permute(2, 0, 3, 1, 4)
        mixed = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return self.out(mixed).mean(1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x, y = torch.randn(32, 5, 8, generator=generator), torch.randn(32, 1, generator=generator)
        return DataLoader(TensorDataset(x, y), batch_size=8)


class GradientCurvature(Probe):
    """gᵀHg on the current batch: a double backward, as curvature probes take."""

    name = "curvature"

    def series(self):
        return {self.name: {"gHg": SeriesSpec()}}

    def on_step_start(self, trainer, pl_module, batch, step):
        params = list(pl_module.parameters())
        with side_effect_free(pl_module):
            grads = torch.autograd.grad(module_loss(pl_module, batch), params, create_graph=True)
            dot = sum((g * g.detach()).sum() for g in grads)
            self._row = sum((h * g).sum() for h, g in zip(torch.autograd.grad(dot, params), grads))

    def on_step_end(self, trainer, pl_module, batch, outputs, step):
        return {self.name: {"gHg": self._row.detach()}}


def fit_attention(tmp_path, quiet_trainer, probes, name):
    torch.manual_seed(0)
    module = TinyAttention()
    path = tmp_path / f"{name}.h5"
    quiet_trainer(max_steps=4, callbacks=[DynamicsRecorder(path, probes)]).fit(module)
    return open_run(path), flatten(module.parameters())


def test_an_op_without_double_backward_disables_the_probe_and_training_goes_on(
    tmp_path, quiet_trainer
):
    with pytest.warns(UserWarning, match="disabled for the rest of the run") as caught:
        run, theta = fit_attention(
            tmp_path, quiet_trainer, [TrainingLoss(), GradientCurvature()], "curvature"
        )
    assert sum("disabled for the rest" in str(w.message) for w in caught) == 1
    [event] = run.events()
    assert (event.step, event.probe, event.kind) == (0, "curvature", "error")
    assert event.message.startswith("RuntimeError: derivative for aten::_scaled_dot_product")
    assert len(run.series("curvature")) == 0
    np.testing.assert_array_equal(run.series("loss").step, np.arange(4))
    # the failed extra pass left the training exactly as it would have been without it
    _, plain = fit_attention(tmp_path, quiet_trainer, [TrainingLoss()], "plain")
    assert torch.equal(theta, plain)


HOOKS_BEFORE_THE_FILE = ["validate", "setup", "series", "vectors", "settings"]
HOOKS_AFTER = [
    "initial_vectors",
    "is_due",
    "on_step_start",
    "on_micro_batch_end",
    "on_step_end",
    "on_validation_end",
    "final_vectors",
]


class FailsIn(Probe):
    """Records a row every step and a vector, and raises in one hook from step 2 on."""

    name = "fails"

    def __init__(self, hook: str, error: Exception) -> None:
        super().__init__()
        self.hook, self.error = hook, error

    def _maybe_fail(self, hook: str, step: int = 2) -> None:
        if hook == self.hook and step >= 2:
            raise self.error

    def validate(self, trainer, pl_module):
        self._maybe_fail("validate")

    def setup(self, trainer, pl_module, batch):
        self._maybe_fail("setup")

    def series(self):
        self._maybe_fail("series")
        return {self.name: {"x": SeriesSpec()}}

    def vectors(self):
        self._maybe_fail("vectors")
        return {"fails_vector": SeriesSpec((2,))}

    def settings(self):
        self._maybe_fail("settings")
        return {}

    def initial_vectors(self):
        self._maybe_fail("initial_vectors")
        return {}

    def is_due(self, step):
        self._maybe_fail("is_due", step)
        return True

    def on_step_start(self, trainer, pl_module, batch, step):
        self._maybe_fail("on_step_start", step)

    def on_micro_batch_end(self, trainer, pl_module, batch, outputs, step):
        self._maybe_fail("on_micro_batch_end", step)

    def on_step_end(self, trainer, pl_module, batch, outputs, step):
        self._maybe_fail("on_step_end", step)
        return {self.name: {"x": float(step)}}

    def on_validation_end(self, trainer, pl_module):
        self._maybe_fail("on_validation_end", trainer.global_step)
        return {}

    def final_vectors(self, trainer, pl_module):
        self._maybe_fail("final_vectors")
        return {"fails_vector": np.ones(2)}


def fit_boring(path, quiet_trainer, probes, **options):
    trainer = quiet_trainer(
        max_steps=4,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        callbacks=[DynamicsRecorder(path, probes, **options)],
    )
    trainer.fit(BoringModel())
    return open_run(path)


@pytest.mark.parametrize("hook", HOOKS_BEFORE_THE_FILE + HOOKS_AFTER)
def test_a_probe_failing_in_any_hook_is_disabled_with_an_event(tmp_path, quiet_trainer, hook):
    error = RuntimeError(f"fails in {hook}")
    with pytest.warns(UserWarning, match=f"disabled for the rest of the run.*fails in {hook}"):
        run = fit_boring(tmp_path / "r.h5", quiet_trainer, [TrainingLoss(), FailsIn(hook, error)])
    np.testing.assert_array_equal(run.series("loss").step, np.arange(4))
    [event] = run.events()
    assert (event.probe, event.kind, event.message) == ("fails", "error", f"RuntimeError: {error}")
    if hook in HOOKS_BEFORE_THE_FILE:  # disabled before the file existed: declares nothing
        assert event.step == 0
        assert "fails" not in run.groups and "fails_vector" not in run.vector_names
        return
    assert event.step == (0 if hook == "initial_vectors" else 4 if hook == "final_vectors" else 2)
    rows_before = {"initial_vectors": 0, "final_vectors": 4}.get(hook, 2)
    assert len(run.series("fails")) == rows_before
    assert run.vector("fails_vector") is None  # declared, never filled: disabled before the end


@pytest.mark.parametrize(
    "error",
    [torch.OutOfMemoryError("CUDA out of memory"), FloatingPointError("the loss is NaN")],
    ids=["out-of-memory", "nan"],
)
def test_out_of_memory_and_nan_in_a_probe_are_events(tmp_path, quiet_trainer, error):
    with pytest.warns(UserWarning, match="disabled"):
        run = fit_boring(tmp_path / "r.h5", quiet_trainer, [FailsIn("on_step_end", error)])
    [event] = run.events()
    assert event.kind == "error" and event.message == f"{type(error).__name__}: {error}"
    assert run.status().state == "finished"


def test_a_probe_that_steps_aside_says_why(tmp_path, quiet_trainer):
    unavailable = ProbeUnavailable("needs dynamics_loss under manual optimization")
    with pytest.warns(UserWarning, match="needs dynamics_loss"):
        run = fit_boring(tmp_path / "r.h5", quiet_trainer, [FailsIn("setup", unavailable)])
    [event] = run.events()
    assert (event.kind, event.message) == ("disabled", str(unavailable))


class Returns(Probe):
    name = "returns"

    def __init__(self, rows=None, vectors=None):
        super().__init__()
        self.rows, self.final = rows or {}, vectors or {}

    def series(self):
        return {self.name: {"norm": SeriesSpec((3,))}}

    def vectors(self):
        return {"returns_vector": SeriesSpec((4,))}

    def on_step_end(self, trainer, pl_module, batch, outputs, step):
        return self.rows

    def final_vectors(self, trainer, pl_module):
        return self.final


@pytest.mark.parametrize(
    "probe, message",
    [
        (
            Returns({"returns": {"norm": torch.ones(4)}}),
            "returns/norm has shape (4,), declared (3,)",
        ),
        (Returns({"returns": {"nrm": torch.ones(3)}}), "hold ['nrm'], but ['norm'] were declared"),
        (Returns({"loss": {"train": 1.0}}), "group 'loss', which 'returns' did not declare"),
        (Returns(vectors={"returns_vector": np.ones(5)}), "has shape (5,), declared (4,)"),
        (Returns(vectors={"theta0": np.ones(4)}), "'theta0', which 'returns' did not declare"),
    ],
)
def test_rows_unlike_the_declaration_disable_the_probe(tmp_path, quiet_trainer, probe, message):
    with pytest.warns(UserWarning, match="disabled"):
        run = fit_boring(tmp_path / "r.h5", quiet_trainer, [TrainingLoss(), probe])
    [event] = run.events()
    assert event.kind == "error" and message in event.message
    assert len(run.series("loss")) == 4  # another probe's group was not written by it


class Notes(Probe):
    name = "notes"

    def on_step_end(self, trainer, pl_module, batch, outputs, step):
        self.note(step, "the batch has a single class")
        return {}


def test_notes_are_warning_events_and_warn_once(tmp_path, quiet_trainer):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = fit_boring(tmp_path / "r.h5", quiet_trainer, [Notes()])
    assert sum("single class" in str(w.message) for w in caught) == 1
    assert [(e.step, e.kind) for e in run.events()] == [(s, "warning") for s in range(4)]


def test_on_probe_error_raise_ends_the_fit_with_the_probe_error_recorded(tmp_path, quiet_trainer):
    path = tmp_path / "r.h5"
    with pytest.raises(RuntimeError, match="fails in on_step_end"):
        fit_boring(
            path,
            quiet_trainer,
            [FailsIn("on_step_end", RuntimeError("fails in on_step_end"))],
            on_probe_error="raise",
        )
    run = open_run(path)
    assert run.status().state == "crashed"
    assert run.status().exception == "RuntimeError: fails in on_step_end"
    assert [(e.step, e.kind) for e in run.events()] == [(2, "error")]
    with pytest.raises(ValueError, match="on_probe_error"):
        DynamicsRecorder(path, on_probe_error="retry")


class CountsValidation(BoringModel):
    def __init__(self, log):
        super().__init__()
        self.calls = log

    def validation_step(self, batch, batch_idx):
        self.calls.append("validation_step")
        return super().validation_step(batch, batch_idx)

    def training_step(self, batch, batch_idx):
        self.calls.append("training_step")
        return super().training_step(batch, batch_idx)


class LogsValidate(Probe):
    name = "early"

    def __init__(self, log):
        super().__init__()
        self.calls = log

    def validate(self, trainer, pl_module):
        self.calls.append("validate")
        raise ProbeUnavailable("the partner run has another θ0")


def test_an_existing_file_is_refused_before_the_sanity_check(tmp_path, quiet_trainer):
    path = tmp_path / "keep.h5"
    path.write_bytes(b"precious")
    calls = []
    trainer = quiet_trainer(max_steps=2, num_sanity_val_steps=2, callbacks=[DynamicsRecorder(path)])
    with pytest.raises(RunFileError, match="exists"):
        trainer.fit(CountsValidation(calls))
    assert calls == [] and path.read_bytes() == b"precious"


def test_probes_validate_before_the_sanity_check(tmp_path, quiet_trainer):
    path = tmp_path / "r.h5"
    calls = []
    recorder = DynamicsRecorder(path, [TrainingLoss(), LogsValidate(calls)])
    trainer = quiet_trainer(max_steps=2, num_sanity_val_steps=1, callbacks=[recorder])
    with pytest.warns(UserWarning, match="another θ0"):
        trainer.fit(CountsValidation(calls))
    assert calls[:2] == ["validate", "validation_step"]
    assert [(e.step, e.probe, e.kind) for e in open_run(path).events()] == [
        (0, "early", "disabled")
    ]


def test_a_disabled_probe_stays_disabled_when_the_fit_resumes(tmp_path, quiet_trainer):
    def fit(max_steps, ckpt_path=None):
        probes = [TrainingLoss(), FailsIn("on_step_end", RuntimeError("fails"))]
        checkpoint = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
        trainer = quiet_trainer(
            max_steps=max_steps,
            enable_checkpointing=True,
            callbacks=[DynamicsRecorder(tmp_path / "r.h5", probes), checkpoint],
        )
        trainer.fit(BoringModel(), ckpt_path=ckpt_path)

    with pytest.warns(UserWarning, match="fails"):
        fit(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # disabled before the checkpoint: no warning
        warnings.filterwarnings("ignore", ".*(workers|LeafSpec|checkpoint).*")
        fit(8, ckpt_path=tmp_path / "ckpt" / "epoch=0-step=3.ckpt")
    run = open_run(tmp_path / "r.h5")
    np.testing.assert_array_equal(run.series("loss").step, np.arange(8))
    np.testing.assert_array_equal(run.series("fails").step, [0, 1])
    assert [(e.step, e.kind) for e in run.events()] == [(2, "error")]


class GoesWrong(Probe):
    """Rows as declared for three steps, then one of another shape."""

    name = "goes_wrong"

    def series(self):
        return {self.name: {"norm": SeriesSpec((3,))}}

    def on_step_end(self, trainer, pl_module, batch, outputs, step):
        return {self.name: {"norm": torch.ones(3 if step < 3 else 4)}}


def test_a_row_that_goes_wrong_later_disables_the_probe_at_its_step(tmp_path, quiet_trainer):
    """Declared shapes are looked up once per group, but every row is still checked."""
    with pytest.warns(UserWarning, match="disabled"):
        run = fit_boring(tmp_path / "r.h5", quiet_trainer, [TrainingLoss(), GoesWrong()])
    [event] = run.events()
    assert (event.step, event.kind) == (3, "error")
    assert "goes_wrong/norm has shape (4,), declared (3,)" in event.message
    np.testing.assert_array_equal(run.series("goes_wrong").step, [0, 1, 2])
    assert len(run.series("loss")) == 4
