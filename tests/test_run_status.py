"""Run status and events in the run file: written under SWMR, read while live and after."""

import os
import signal
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest
import torch
from pytorch_lightning.demos.boring_classes import BoringModel

from dynamics import open_run
from dynamics.callbacks import DynamicsRecorder
from dynamics.store import RunWriter, SeriesSpec

LIVE_WRITER = textwrap.dedent(
    """
    import sys, time
    from dynamics.store import RunWriter, SeriesSpec
    writer = RunWriter.create(sys.argv[1], {"loss": {"train": SeriesSpec()}}, {}, {},
                              flush_interval_s=1e9)
    for step in range(6):
        writer.append("loss", step, {"train": float(step)})
    writer.append_event(3, "probe", "warning", "a note written while live")
    writer.flush()
    print("flushed", flush=True)
    time.sleep(60)
    """
)


@pytest.fixture
def live_writer(tmp_path):
    path = tmp_path / "live.h5"
    process = subprocess.Popen(
        [sys.executable, "-c", LIVE_WRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "flushed"
    yield path, process
    process.kill()
    process.wait()


def test_a_live_run_reads_as_running_with_its_rows_and_events(live_writer):
    path, _ = live_writer
    run = open_run(path)
    status = run.status()
    assert status.state == "running" and status.last_step == 5 and status.wall_time_s >= 0
    np.testing.assert_array_equal(run.series("loss")["train"], np.arange(6.0))
    assert [(e.step, e.kind, e.message) for e in run.events()] == [
        (3, "warning", "a note written while live")
    ]
    assert run.summary()["status"]["state"] == "running"


def test_a_killed_writer_reads_as_killed(live_writer):
    path, process = live_writer
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    status = open_run(path).status()
    assert status.state == "killed" and status.last_step == 5


def test_finished_fit_records_status_and_wall_time(tmp_path, quiet_trainer):
    path = tmp_path / "done.h5"
    quiet_trainer(max_steps=4, callbacks=[DynamicsRecorder(path)]).fit(BoringModel())
    status = open_run(path).status()
    assert status.state == "finished" and status.exception == ""
    assert status.last_step == 3
    assert status.wall_time_s > 0 and status.updated_at >= status.started_at


class CrashesAtStepThree(BoringModel):
    def training_step(self, batch, batch_idx):
        if self.global_step == 3:
            raise FloatingPointError("loss diverged")
        return super().training_step(batch, batch_idx)


def test_a_crashed_fit_records_the_exception_and_the_rows_before_it(tmp_path, quiet_trainer):
    path = tmp_path / "crash.h5"
    trainer = quiet_trainer(max_steps=10, callbacks=[DynamicsRecorder(path)])
    with pytest.raises(FloatingPointError):
        trainer.fit(CrashesAtStepThree())
    run = open_run(path)
    status = run.status()
    assert status.state == "crashed"
    assert status.exception == "FloatingPointError: loss diverged"
    np.testing.assert_array_equal(run.series("loss").step, [0, 1, 2])
    assert status.last_step == 2
    assert run.summary()["status"]["exception"].startswith("FloatingPointError")


def test_events_are_cut_at_the_checkpoint_on_resume_and_text_is_cut_to_its_field(tmp_path):
    path = tmp_path / "run.h5"
    writer = RunWriter.create(path, {"loss": {"train": SeriesSpec()}}, {}, {})
    for step in range(6):
        writer.append("loss", step, {"train": float(step)})
        writer.append_event(step, "probe", "warning", f"step {step} ‖θ‖ " + "x" * 600)
    writer.close()
    writer = RunWriter.resume(path, {"loss": 3, "events": 3})
    writer.append_event(4, "other", "error", "after the resume")
    writer.close()
    events = open_run(path).events()
    assert [e.step for e in events] == [0, 1, 2, 3, 4]
    assert events[0].message.startswith("step 0 ‖θ‖ xxx") and len(events[0].message.encode()) <= 512
    assert (events[-1].probe, events[-1].kind) == ("other", "error")
    status = open_run(path).status()
    assert status.state == "finished" and status.last_step == 3


def test_a_file_from_before_status_and_events_reads_as_unknown(tmp_path):
    path = tmp_path / "old.h5"
    RunWriter.create(path, {"loss": {"train": SeriesSpec()}}, {}, {}).close()
    with h5py.File(path, "r+") as file:
        del file["status"], file["events"]
    run = open_run(path)
    assert run.status().state == "unknown" and run.events() == []
    writer = RunWriter.resume(path, {"loss": -1})  # resuming one adds them
    writer.close()
    assert open_run(path).status().state == "finished"


@pytest.mark.parametrize("dtype, rtol", [("float16", 2**-11), ("bfloat16", 2**-8)])
def test_half_precision_series_read_back_as_float32_within_their_rounding(tmp_path, dtype, rtol):
    path = tmp_path / "half.h5"
    values = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 100
    values[1, 7] = float("nan")
    writer = RunWriter.create(path, {"s": {"theta": SeriesSpec((50,), dtype)}}, {}, {})
    writer.append("s", 0, {"theta": values[0]})  # a tensor
    writer.append("s", 1, {"theta": values[1].numpy()})  # an array
    writer.append("s", 2, {"theta": values[2].to(torch.bfloat16)})  # already half
    writer.close()
    stored = open_run(path).series("s")["theta"]
    assert stored.dtype == np.float32
    np.testing.assert_allclose(stored[:2], values[:2].numpy(), rtol=rtol, equal_nan=True)
    np.testing.assert_allclose(stored[2], values[2].numpy(), rtol=2**-8)
    if dtype == "bfloat16":  # rounded as torch rounds
        np.testing.assert_array_equal(stored[:2], values[:2].to(torch.bfloat16).float().numpy())
    assert np.isnan(stored[1, 7])
