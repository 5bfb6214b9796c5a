"""The Hugging Face Trainer's callback: a tiny GPT-2 trained through ``transformers.Trainer``
records the file a Lightning fit of the same model records, without changing the training."""

import multiprocessing
import os
import socket
import subprocess
import traceback

import numpy as np
import pytest
import torch
from transformers import TrainerCallback, TrainingArguments

from dynamics import open_run
from dynamics.callbacks import (
    GradientPlane,
    HessianSpectrum,
    HiddenStateNorms,
    LoggedMetrics,
    ParameterDisplacement,
    TrainingLoss,
)
from dynamics.integrations.huggingface import DynamicsCallback
from dynamics.store import RunFileError, names
from tests import tiny_gpt2
from tests.conftest import DYNAMICS

STEPS = 6


def arguments(folder, **overrides) -> TrainingArguments:
    options = dict(
        output_dir=str(folder),
        use_cpu=True,
        report_to=[],
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        learning_rate=tiny_gpt2.LR,
        weight_decay=0.0,
        per_device_train_batch_size=tiny_gpt2.BATCH,
        max_steps=STEPS,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    return TrainingArguments(**(options | overrides))


def train(folder, callbacks=(), resume=None, eval_data=None, as_lightning=False, **overrides):
    """The tiny GPT-2 trained by the Trainer: its final parameters, and the Trainer.

    ``as_lightning``: on the loss and optimizer the Lightning module trains on. The Trainer
    divides each step's summed token losses by its count of labels, and counts the first
    position's too unless the model's ``loss_type`` is a causal LM's (``GPT2LMHeadModel`` reads
    as ``"LMHead"``); its default optimizer is the fused AdamW in two parameter groups.
    """
    model = tiny_gpt2.model()
    if as_lightning:
        model.loss_type = "ForCausalLM"
    trainer = tiny_gpt2.InOrderTrainer(
        model=model,
        args=arguments(folder, **overrides),
        train_dataset=tiny_gpt2.examples(),
        eval_dataset=eval_data,
        data_collator=tiny_gpt2.collate,
        callbacks=list(callbacks),
        optimizers=(tiny_gpt2.optimizer(model), None) if as_lightning else (None, None),
    )
    trainer.train(resume_from_checkpoint=resume)
    return {name: p.detach().clone() for name, p in model.named_parameters()}, trainer


def probes():
    return [
        TrainingLoss(),
        HiddenStateNorms(),
        ParameterDisplacement(),
        HessianSpectrum(k=2, every_n_steps=3),
        GradientPlane(every_n_steps=2, grid=3),
    ]


def test_the_trainer_records_a_run_file_and_trains_as_without_the_callback(tmp_path):
    path = tmp_path / "hf.h5"
    recorded, _ = train(tmp_path / "a", [DynamicsCallback(path, probes())])
    plain, _ = train(tmp_path / "b")
    assert all(torch.equal(recorded[name], plain[name]) for name in plain)
    run = open_run(path)
    assert run.status().state == names.FINISHED
    assert run.attrs[names.ATTR_LOOP] == "huggingface"
    assert run.attrs[names.ATTR_LOSS_RULE] == {"rule": "output"}
    assert list(run.series(names.LOSS).step) == list(range(STEPS))
    assert np.isfinite(run.series(names.LOSS)[names.LOSS_TRAIN]).all()
    assert not [e for e in run.events() if e.kind in (names.EVENT_ERROR, names.EVENT_DISABLED)]
    # compare's loss barriers rebuild the model from the GPT2Config the file keeps
    for command in (["report", str(path)], ["compare", str(path), str(path)]):
        out = tmp_path / f"{command[0]}.html"
        done = subprocess.run(
            [DYNAMICS, *command, "--out", str(out)], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert out.stat().st_size > 0


def token_weighted_loss(model, batches, count_first):
    """The loss of one accumulated step, by hand: every micro-batch's summed token losses (of
    the labels after the first position that are not padding) over the step's count of labels
    (``count_first``: with the first positions', as the Trainer counts for GPT-2)."""
    total, count = 0.0, 0
    for batch in batches:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"][:, 1:]
        losses = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
        )
        counted = batch["labels"] if count_first else labels
        total, count = total + losses.item(), count + int((counted != -100).sum())
    return total / count


def test_under_accumulation_the_loss_is_the_token_weighted_step_loss_trained_on(tmp_path):
    path = tmp_path / "accumulated.h5"
    options = dict(gradient_accumulation_steps=2, logging_strategy="steps", logging_steps=1)
    _, trainer = train(tmp_path, [DynamicsCallback(path, [TrainingLoss()])], **options)
    recorded = open_run(path).series(names.LOSS)[names.LOSS_TRAIN]
    assert len(recorded) == STEPS
    # The loss the Trainer trained on at each step (what its training steps returned, summed).
    trained = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    np.testing.assert_allclose(recorded, trained, rtol=1e-6)
    # At θ0, by hand, from the first two batches of four; their two means' mean differs.
    batches = [tiny_gpt2.collate(tiny_gpt2.examples()[i : i + 4]) for i in (0, 4)]
    count_first = not trainer._loss_shifts_labels  # GPT-2's "LMHead" loss type, see train()
    with torch.no_grad():
        by_hand = token_weighted_loss(tiny_gpt2.model(), batches, count_first)
        means = [tiny_gpt2.loss(tiny_gpt2.model(), batch).item() for batch in batches]
    assert recorded[0] == pytest.approx(by_hand, rel=1e-6)
    assert abs(np.mean(means) - by_hand) > 1e-4


def test_evaluation_metrics_are_recorded_by_logged_metrics(tmp_path):
    path = tmp_path / "eval.h5"
    callback = DynamicsCallback(path, [TrainingLoss(), LoggedMetrics(["eval_loss"])])
    held_out = tiny_gpt2.examples(8, seed=2)
    _, trainer = train(
        tmp_path, [callback], eval_data=held_out, eval_strategy="steps", eval_steps=2
    )
    rows = open_run(path).series(names.VALIDATION)
    evaluated = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert list(rows.step) == [e["step"] for e in evaluated] == [2, 4, 6]
    np.testing.assert_allclose(rows["eval_loss"], [e["eval_loss"] for e in evaluated], rtol=1e-6)


class Interrupt(TrainerCallback):
    """Raises after step 4 (past the checkpoint at step 3): a fit that crashed."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 4:
            raise KeyboardInterrupt("interrupted at step 4")


def test_resuming_from_a_trainer_checkpoint_continues_the_run_file(tmp_path):
    saving = dict(save_strategy="steps", save_steps=3)
    straight = tmp_path / "straight.h5"
    train(tmp_path / "straight", [DynamicsCallback(straight, probes())], **saving)
    resumed = tmp_path / "resumed.h5"
    callback = DynamicsCallback(resumed, probes())
    with pytest.raises(KeyboardInterrupt):
        try:
            train(tmp_path / "resumed", [callback, Interrupt()], **saving)
        except KeyboardInterrupt as error:
            callback.crashed(error)
            raise
    assert open_run(resumed).status().state == names.CRASHED
    checkpoint = tmp_path / "resumed" / "checkpoint-3"
    train(
        tmp_path / "resumed",
        [DynamicsCallback(resumed, probes())],
        resume=str(checkpoint),
        **saving,
    )
    a, b = open_run(straight), open_run(resumed)
    assert b.status().state == names.FINISHED
    assert a.groups == b.groups
    for group in a.groups:
        assert list(b.series(group).step) == list(a.series(group).step), group
        for name, values in a.series(group).values.items():
            np.testing.assert_array_equal(b.series(group)[name], values, err_msg=group)
    np.testing.assert_array_equal(b.vector("theta_final"), a.vector("theta_final"))


def test_a_checkpoint_without_recorder_state_does_not_continue_an_existing_file(tmp_path):
    path = tmp_path / "run.h5"
    train(tmp_path / "first", [DynamicsCallback(path, [TrainingLoss()])])
    train(tmp_path / "plain", save_strategy="steps", save_steps=3, max_steps=3)
    with pytest.raises(RunFileError, match="holds no DynamicsRecorder state"):
        train(
            tmp_path / "plain",
            [DynamicsCallback(path, [TrainingLoss()])],
            resume=str(tmp_path / "plain" / "checkpoint-3"),
        )
    assert open_run(path).status().state == names.FINISHED  # left as it was


def test_a_checkpoint_outside_the_output_folder_is_refused_in_one_line(tmp_path):
    saving = dict(save_strategy="steps", save_steps=3)
    path = tmp_path / "run.h5"
    train(tmp_path / "first", [DynamicsCallback(path, [TrainingLoss()])], **saving)
    with pytest.raises(RunFileError, match="from a checkpoint outside"):
        train(
            tmp_path / "elsewhere",
            [DynamicsCallback(path, [TrainingLoss()])],
            resume=str(tmp_path / "first" / "checkpoint-3"),
            **saving,
        )


def test_label_smoothing_is_refused_in_one_warning_and_training_goes_on(tmp_path):
    path = tmp_path / "smoothed.h5"
    with pytest.warns(UserWarning, match="under label smoothing"):
        train(tmp_path, [DynamicsCallback(path)], label_smoothing_factor=0.1)
    assert not path.exists()


def causal_lm_loss(outputs, labels, num_items_in_batch=None):
    logits = outputs.logits[:, :-1].flatten(0, 1)
    return torch.nn.functional.cross_entropy(logits, labels[:, 1:].flatten(), ignore_index=-100)


def test_a_loss_computed_outside_the_model_stops_the_recording_in_one_warning(tmp_path):
    path = tmp_path / "outside.h5"
    model = tiny_gpt2.model()
    trainer = tiny_gpt2.InOrderTrainer(
        model=model,
        args=arguments(tmp_path),
        train_dataset=tiny_gpt2.examples(),
        data_collator=tiny_gpt2.collate,
        callbacks=[DynamicsCallback(path)],
        compute_loss_func=causal_lm_loss,
    )
    with pytest.warns(UserWarning, match="compute_loss_func") as caught:
        trainer.train()
    assert len([w for w in caught if "DynamicsCallback" in str(w.message)]) == 1
    assert trainer.state.global_step == STEPS  # training went on
    status = open_run(path).status()
    assert status.state == names.CRASHED
    assert "returned no loss" in status.exception


def test_the_trainer_and_lightning_record_the_same_series(tmp_path, quiet_trainer):
    """The same model, data order, loss and optimizer (see train()): the same training, bit for
    bit, and the same rows but the Hessian's Lanczos residuals (and the error bounds from them:
    all below 1e-6, measured 2.5e-7), which depend on the solver's
    random start vector, drawn from a generator the two loops leave in different states (the
    Trainer seeds it with ``args.seed``); the eigenvalues converge to the same bits."""
    from dynamics.callbacks import DynamicsRecorder

    def series():
        return [
            TrainingLoss(),
            HiddenStateNorms(),
            ParameterDisplacement(),
            HessianSpectrum(k=2, every_n_steps=3),
        ]

    hf_path, pl_path = tmp_path / "hf.h5", tmp_path / "pl.h5"
    hf_final, _ = train(tmp_path, [DynamicsCallback(hf_path, series())], as_lightning=True)
    module = tiny_gpt2.LightningGPT2()
    trainer = quiet_trainer(max_steps=STEPS, callbacks=[DynamicsRecorder(pl_path, series())])
    trainer.fit(module, tiny_gpt2.loader())
    assert all(torch.equal(hf_final[n], p) for n, p in module.model.named_parameters())
    hf, pl = open_run(hf_path), open_run(pl_path)
    assert hf.groups == pl.groups
    for group in pl.groups:
        assert list(hf.series(group).step) == list(pl.series(group).step)
        for name, values in pl.series(group).values.items():
            if group == "hessian" and name in ("residuals", "error_bounds"):
                np.testing.assert_allclose(hf.series(group)[name], values, rtol=0, atol=1e-6)
            else:
                np.testing.assert_array_equal(hf.series(group)[name], values, err_msg=group)
    for vector in ("theta0", "theta_final"):
        np.testing.assert_array_equal(hf.vector(vector), pl.vector(vector))


def _ddp_rank(rank, port, folder, path):
    """One rank of a two-process DDP fit through the Trainer (gloo, forked)."""
    try:
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(True)  # the parent's single-process state, forked
        callback = DynamicsCallback(
            path, [TrainingLoss(), HiddenStateNorms(), ParameterDisplacement()]
        )
        train(folder, [callback], ddp_backend="gloo", ddp_find_unused_parameters=False)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def test_ddp_through_the_trainer_records_what_one_process_accumulating_both_batches_does(
    tmp_path,
):
    """Two ranks of batch 4 (the Trainer's sampler gives rank r every other batch) take the
    steps one process takes over the same 8 examples in two micro-batches: the same token
    weighting (every rank's tokens counted, ``average_tokens_across_devices``), and on the CPU
    the same rows, bit for bit."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    fork = multiprocessing.get_context("fork")
    ddp = tmp_path / "ddp.h5"
    ranks = [fork.Process(target=_ddp_rank, args=(r, port, tmp_path / "ddp", ddp)) for r in (0, 1)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(120)
    assert [rank.exitcode for rank in ranks] == [0, 0]
    one = tmp_path / "one.h5"
    probes_ = [TrainingLoss(), HiddenStateNorms(), ParameterDisplacement()]
    train(tmp_path / "one", [DynamicsCallback(one, probes_)], gradient_accumulation_steps=2)
    a, b = open_run(ddp), open_run(one)
    assert a.status().state == names.FINISHED
    assert a.groups == b.groups
    for group in b.groups:
        assert list(a.series(group).step) == list(range(STEPS))
        for name, values in b.series(group).values.items():
            np.testing.assert_array_equal(a.series(group)[name], values, err_msg=group)
