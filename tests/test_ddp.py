import numpy as np
import torch.distributed

from dynamics import open_run
from dynamics.callbacks import DynamicsRecorder
from dynamics.experiments import TeacherStudentData, TeacherStudentModule


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
