import csv

import numpy as np
import pytest
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.demos.boring_classes import BoringModel
from pytorch_lightning.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

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
from dynamics.callbacks.parameter_displacement import SizeGroups
from dynamics.experiments import TeacherStudentData, TeacherStudentModule
from dynamics.params.layout import ParameterLayout
from dynamics.params.vectors import parameter_vector, vector_hash


def tiny_teacher_student(shift="none"):
    arch = dict(width=8, expansion=2, depth=3)
    return TeacherStudentModule(**arch, shift=shift), TeacherStudentData(
        **arch, batch_size=16, heldout_size=32
    )


def test_boring_model_records_default_probes(tmp_path, quiet_trainer):
    path = tmp_path / "boring.h5"
    trainer = quiet_trainer(max_steps=12, callbacks=[DynamicsRecorder(path)])
    model = BoringModel()
    theta0 = parameter_vector(model)
    trainer.fit(model)
    run = open_run(path)
    assert {"loss", "hidden_norms", "displacement", "snapshots"} <= set(run.groups)
    np.testing.assert_array_equal(run.series("loss").step, np.arange(12))
    # BoringModel has no block stack: its direct child, the Linear layer, is recorded
    assert run.series("hidden_norms").columns["norm"] == ("layer",)
    np.testing.assert_array_equal(run.vector("theta0"), theta0.numpy())
    np.testing.assert_allclose(run.vector("theta_final"), parameter_vector(model).numpy())
    assert run.attrs["theta0_sha256"] == vector_hash(theta0)
    assert run.layout == ParameterLayout.of(model)


def test_teacher_student_series_describe_the_parameters_each_step_used(tmp_path, quiet_trainer):
    module, data = tiny_teacher_student()
    path = tmp_path / "ts.h5"
    probes = [TrainingLoss(), HiddenStateNorms(), ParameterDisplacement(snapshot_every_n_steps=1)]
    quiet_trainer(max_steps=6, callbacks=[DynamicsRecorder(path, probes)]).fit(module, data)
    run = open_run(path)
    norms = run.series("hidden_norms")
    assert norms.columns["norm"] == ("student.blocks.0", "student.blocks.1", "student.blocks.2")
    assert run.series("activation_bias").columns["mean"] == tuple(
        f"student.blocks.{i}.act" for i in range(3)
    )
    snapshots = run.series("snapshots")["theta"]
    theta0 = run.vector("theta0")
    np.testing.assert_array_equal(snapshots[0], theta0)
    displacement = run.series("displacement")
    # ‖θ_s − θ0‖ from the snapshots, and the update of step s is θ_{s+1} − θ_s
    np.testing.assert_allclose(
        displacement["total"], np.linalg.norm(snapshots - theta0, axis=1), rtol=1e-5, atol=1e-7
    )
    np.testing.assert_allclose(
        displacement["update"][:-1], np.linalg.norm(np.diff(snapshots, axis=0), axis=1), rtol=1e-5
    )
    np.testing.assert_allclose(
        displacement["update"][-1],
        np.linalg.norm(run.vector("theta_final") - snapshots[-1]),
        rtol=1e-5,
    )
    per_tensor = displacement["per_tensor"]
    np.testing.assert_allclose(np.linalg.norm(per_tensor, axis=1), displacement["total"], rtol=1e-6)
    # the hidden norm at step 0 is that of θ0's forward on the first batch
    module.student.load_state_dict(module.student.state_dict())  # unchanged module, reused below
    first_batch = next(iter(data.train_dataloader()))
    fresh, _ = tiny_teacher_student()
    with torch.no_grad():
        h = first_batch[0]
        for block in fresh.student.blocks:
            h = block(h)
    assert norms["norm"][0, -1] == pytest.approx(h.norm(dim=-1).mean().item(), rel=1e-5)


def test_cnn_with_batchnorm_dropout_and_dict_output(tmp_path, small_cnn, quiet_trainer):
    path = tmp_path / "cnn.h5"
    recorder = DynamicsRecorder(path, [TrainingLoss(), HiddenStateNorms(types=[torch.nn.Conv2d])])
    quiet_trainer(max_epochs=1, callbacks=[recorder]).fit(small_cnn())
    run = open_run(path)
    assert run.series("hidden_norms").columns["norm"] == ("features.0", "features.4")
    assert len(run.series("loss")) == 4 and np.isfinite(run.series("loss")["train"]).all()
    assert run.series("activation_bias")["mean"].min() >= 0  # ReLU outputs


def run_cnn(quiet_trainer, small_cnn, callbacks, seed=7):
    torch.manual_seed(seed)
    model = small_cnn()
    quiet_trainer(max_epochs=3, callbacks=callbacks, deterministic=True).fit(model)
    return parameter_vector(model), [b.clone() for b in model.buffers()]


def test_recording_never_perturbs_training(tmp_path, small_cnn, quiet_trainer):
    plain, plain_buffers = run_cnn(quiet_trainer, small_cnn, [])
    recorder = DynamicsRecorder(
        tmp_path / "r.h5",
        [
            TrainingLoss(),
            HiddenStateNorms(),
            ParameterDisplacement(snapshot_every_n_steps=2),
        ],
    )
    recorded, recorded_buffers = run_cnn(quiet_trainer, small_cnn, [recorder])
    assert torch.equal(plain, recorded)
    assert all(torch.equal(a, b) for a, b in zip(plain_buffers, recorded_buffers))
    assert not torch.equal(
        plain, run_cnn(quiet_trainer, small_cnn, [], seed=8)[0]
    )  # the check can fail


def test_gradient_accumulation_records_once_per_optimizer_step(tmp_path, quiet_trainer):
    path = tmp_path / "acc.h5"
    module, data = tiny_teacher_student()
    trainer = quiet_trainer(
        max_steps=5, accumulate_grad_batches=3, callbacks=[DynamicsRecorder(path)]
    )
    trainer.fit(module, data)
    run = open_run(path)
    np.testing.assert_array_equal(run.series("loss").step, np.arange(5))
    assert (run.series("displacement")["update"] > 0).all()


def test_schedules_validation_and_sanity_check(tmp_path, quiet_trainer):
    path = tmp_path / "sched.h5"
    module, data = tiny_teacher_student()
    probes = [TrainingLoss(every_n_steps=3), LoggedMetrics(["val_loss"])]
    trainer = quiet_trainer(
        max_steps=10,
        val_check_interval=4,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=1,
        callbacks=[DynamicsRecorder(path, probes)],
    )
    trainer.fit(module, data)
    run = open_run(path)
    np.testing.assert_array_equal(run.series("loss").step, [0, 3, 6, 9])
    validation = run.series("validation")
    np.testing.assert_array_equal(validation.step, [4, 8])  # no sanity-check row at step 0
    assert np.isfinite(validation["val_loss"]).all()


def test_resume_continues_the_same_file_without_gaps_or_duplicates(tmp_path, quiet_trainer):
    # Full-batch training, so the resumed fit sees exactly the batches an uninterrupted one does.
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    full_batch = DataLoader(TensorDataset(x, x.flip(-1)), batch_size=32)

    def fit(path, max_steps, ckpt_path=None):
        module, _ = tiny_teacher_student()
        probes = [TrainingLoss(), ParameterDisplacement(snapshot_every_n_steps=2)]
        checkpoint = ModelCheckpoint(tmp_path / path.stem, every_n_train_steps=5, save_top_k=-1)
        trainer = quiet_trainer(
            max_steps=max_steps,
            enable_checkpointing=True,
            callbacks=[DynamicsRecorder(path, probes, flush_interval_s=1e9), checkpoint],
        )
        trainer.fit(module, full_batch, ckpt_path=ckpt_path)

    straight = tmp_path / "straight.h5"
    fit(straight, 12)
    resumed = tmp_path / "resumed.h5"
    fit(resumed, 8)  # rows 5..7 reach the file after the step-5 checkpoint
    assert open_run(resumed).series("loss").step[-1] == 7
    fit(resumed, 12, ckpt_path=tmp_path / "resumed" / "epoch=4-step=5.ckpt")
    a, b = open_run(straight), open_run(resumed)
    np.testing.assert_array_equal(a.series("loss").step, np.arange(12))
    for group in ("loss", "displacement", "snapshots"):
        np.testing.assert_array_equal(a.series(group).step, b.series(group).step)
        for name, values in a.series(group).values.items():
            np.testing.assert_array_equal(values, b.series(group)[name], err_msg=name)
    np.testing.assert_array_equal(a.vector("theta0"), b.vector("theta0"))
    np.testing.assert_array_equal(a.vector("theta_final"), b.vector("theta_final"))


def test_existing_run_file_is_refused_and_kept(tmp_path, quiet_trainer):
    path = tmp_path / "keep.h5"
    path.write_bytes(b"precious")
    module, data = tiny_teacher_student()
    with pytest.raises(ValueError, match="exists"):
        quiet_trainer(max_steps=2, callbacks=[DynamicsRecorder(path)]).fit(module, data)
    assert path.read_bytes() == b"precious"


def test_scalar_series_mirrored_to_loggers(tmp_path, quiet_trainer):
    module, data = tiny_teacher_student()
    logger = CSVLogger(tmp_path, name="csv")
    recorder = DynamicsRecorder(tmp_path / "r.h5", log_to_loggers=True)
    quiet_trainer(max_steps=4, logger=logger, log_every_n_steps=1, callbacks=[recorder]).fit(
        module, data
    )
    with open(f"{logger.log_dir}/metrics.csv") as handle:
        header = next(csv.reader(handle))
    assert {"dynamics/loss/train", "dynamics/displacement/total"} <= set(header)


def test_two_recorders_have_distinct_state_keys(tmp_path):
    assert (
        DynamicsRecorder(tmp_path / "a.h5").state_key
        != DynamicsRecorder(tmp_path / "b.h5").state_key
    )


def test_probes_extra_passes_are_not_recorded_as_hidden_states(tmp_path, quiet_trainer):
    def hidden_norms(probes, name):
        module, data = tiny_teacher_student()
        path = tmp_path / f"{name}.h5"
        quiet_trainer(max_steps=6, callbacks=[DynamicsRecorder(path, probes)]).fit(module, data)
        return open_run(path).series("hidden_norms")["norm"]

    alone = hidden_norms([HiddenStateNorms()], "alone")
    with_hessian = hidden_norms(
        [HiddenStateNorms(), HessianSpectrum(k=2, every_n_steps=2), GradientPlane()], "with"
    )
    np.testing.assert_array_equal(alone, with_hessian)


def test_a_validation_metric_never_logged_is_nan_with_one_warning_event(tmp_path, quiet_trainer):
    path = tmp_path / "val.h5"
    module, data = tiny_teacher_student()
    trainer = quiet_trainer(
        max_steps=6,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        callbacks=[DynamicsRecorder(path, [LoggedMetrics(["val_loss", "val_accuracy"])])],
    )
    with pytest.warns(UserWarning, match="'val_accuracy' was not logged"):
        trainer.fit(module, data)
    run = open_run(path)
    validation = run.series("validation")
    assert np.isfinite(validation["val_loss"]).all() and np.isnan(validation["val_accuracy"]).all()
    assert [(e.step, e.kind) for e in run.events()] == [(2, "warning")]


def test_grouped_norms_equal_each_tensors_own_norm_bit_for_bit():
    """One norm kernel per size of tensor, over the contiguous block that size's tensors form in
    the grouped order, gives every tensor's norm exactly as a norm of that tensor alone, in the
    layout's order: repeated blocks, a size recurring at an irregular spacing, lone sizes, an
    empty tensor; and the grouped order round-trips to the layout's."""
    shapes = [(64,), (64,), (256, 64), (256,), (64, 256), (64,)] * 3
    shapes += [(7,), (64,), (5, 1), (0,), (64,), (64,), (3, 100)]
    layout = ParameterLayout(tuple(f"p{i}" for i in range(len(shapes))), tuple(shapes))
    groups = SizeGroups(layout)
    assert len(groups.blocks) == len(set(layout.numels))
    torch.manual_seed(0)
    vector = torch.randn(layout.size) * torch.rand(layout.size) * 10
    grouped = groups.grouped(vector)
    assert torch.equal(groups.in_layout_order(grouped), vector)
    for view, piece in zip(groups.views(grouped), layout.split(vector)):
        assert torch.equal(view, piece)
    assert torch.equal(
        groups.norms(grouped), torch.stack([piece.norm() for piece in layout.split(vector)])
    )


def test_lightning_skips_the_per_step_hooks_the_recorder_does_not_use(tmp_path):
    """Lightning calls a callback's hook (in a profiler context) only when it is callable."""
    from dynamics.callbacks.lightning import DynamicsRecorder as LightningRecorder

    for recorder in (DynamicsRecorder(tmp_path / "a.h5"), LightningRecorder(tmp_path / "b.h5")):
        for hook in (
            "on_before_backward",
            "on_after_backward",
            "on_before_optimizer_step",
            "on_before_zero_grad",
        ):
            assert not callable(getattr(recorder, hook))


def test_buffered_rows_equal_direct_evaluation_at_every_step(tmp_path, quiet_trainer):
    """Displacement from per-tensor foreach ops on preallocated buffers (norms per size of
    tensor, in a size-grouped order), and hidden norms, equal what a direct float64 evaluation
    on the stored snapshots gives (to float32 rounding, 1e-6)."""
    module, data = tiny_teacher_student()
    path = tmp_path / "direct.h5"
    probes = [HiddenStateNorms(), ParameterDisplacement(snapshot_every_n_steps=1)]
    quiet_trainer(max_steps=5, callbacks=[DynamicsRecorder(path, probes)]).fit(module, data)
    run = open_run(path)
    theta0 = torch.from_numpy(run.vector("theta0")).double()
    snapshots = torch.from_numpy(run.series("snapshots")["theta"]).double()
    final = torch.from_numpy(run.vector("theta_final")).double()
    thetas = torch.cat([snapshots, final[None]])
    displacement = run.series("displacement")
    numels = run.layout.numels
    for step, theta in enumerate(snapshots):
        direct = torch.stack([d.norm() for d in (theta - theta0).split(numels)])
        np.testing.assert_allclose(displacement["per_tensor"][step], direct, rtol=1e-6)
        assert displacement["total"][step] == pytest.approx(direct.norm().item(), rel=1e-6)
        update = (thetas[step + 1] - theta).norm().item()
        assert displacement["update"][step] == pytest.approx(update, rel=1e-6)
    # Hidden norms of each step's forward: θ_step on that step's batch, evaluated directly.
    fresh, fresh_data = tiny_teacher_student()
    layout = ParameterLayout.of(fresh)
    norms = run.series("hidden_norms")["norm"]
    for step, (theta, (x, _)) in enumerate(zip(snapshots, fresh_data.train_dataloader())):
        for p, chunk in zip(layout.parameters(fresh), layout.split(theta)):
            p.data.copy_(chunk)
        h, direct = x, []
        with torch.no_grad():
            for block in fresh.student.blocks:
                h = block(h)
                direct.append(h.norm(dim=-1).mean().item())
        np.testing.assert_allclose(norms[step], direct, rtol=1e-6)


def test_displacement_holds_only_theta0_and_theta_step_between_steps(tmp_path, quiet_trainer):
    """The difference θ_step − θ0 is a temporary of each step: between steps the probe holds two
    parameter vectors (θ0 and θ_step's buffer), not three."""
    module, data = tiny_teacher_student()
    probe = ParameterDisplacement(snapshot_budget_mb=0)
    recorder = DynamicsRecorder(tmp_path / "held.h5", [probe])
    quiet_trainer(max_steps=3, callbacks=[recorder]).fit(module, data)
    own = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in _tensors(vars(probe))
        if t.untyped_storage().data_ptr() not in own
    }
    param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    assert sum(storages.values()) <= 2 * param_bytes + 1024


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
