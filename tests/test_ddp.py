import numpy as np
import torch
import torch.distributed

from dynamics import open_run
from dynamics.callbacks import DynamicsRecorder, GradientPlane
from dynamics.experiments import TeacherStudentData, TeacherStudentModule
from dynamics.experiments.teacher_student import _TeacherStream, stream_seed


def test_two_process_ddp_writes_one_file_from_rank_zero(tmp_path, quiet_trainer):
    arch = dict(width=8, expansion=2, depth=2)
    path = tmp_path / "ddp.h5"
    trainer = quiet_trainer(
        max_steps=6, strategy="ddp_fork", devices=2, callbacks=[DynamicsRecorder(path)]
    )
    trainer.fit(TeacherStudentModule(**arch), TeacherStudentData(**arch, batch_size=8))
    assert not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ddp.h5"]
    run = open_run(path)
    np.testing.assert_array_equal(run.series("loss").step, np.arange(6))
    assert np.isfinite(run.series("hidden_norms")["norm"]).all()


def test_ddp_initial_gradient_is_the_average_over_ranks(tmp_path, quiet_trainer):
    arch = dict(width=8, expansion=2, depth=2)
    path = tmp_path / "plane.h5"
    trainer = quiet_trainer(
        max_steps=2,
        strategy="ddp_fork",
        devices=2,
        callbacks=[DynamicsRecorder(path, [GradientPlane()])],
    )
    data = TeacherStudentData(**arch, batch_size=8)
    trainer.fit(TeacherStudentModule(**arch), data)
    # rank r trains on its own spawn of the data seed; g0 is the mean of both ranks' gradients
    gradients = []
    for rank in range(2):
        stream = _TeacherStream(
            data.teacher, 8, 8, stream_seed(data.hparams.data_seed, "training data", rank)
        )
        module = TeacherStudentModule(**arch)
        loss = module.dynamics_loss(next(iter(stream)))
        grads = torch.autograd.grad(loss, list(module.parameters()))
        gradients.append(torch.cat([g.reshape(-1) for g in grads]))
    expected = (gradients[0] + gradients[1]) / 2
    np.testing.assert_allclose(open_run(path).vector("g0"), expected.numpy(), rtol=1e-5, atol=1e-7)
    assert not np.allclose(gradients[0].numpy(), gradients[1].numpy())  # the check can fail
