"""The command line, run the way a user runs it: the installed console script, in a subprocess."""

import json

import numpy as np
import pytest

from dynamics import open_run
from dynamics.callbacks import DynamicsRecorder, GradientPlane, ParameterDisplacement
from dynamics.experiments import TeacherStudentData, TeacherStudentModule


def test_run_trains_every_variant_and_prints_a_summary(demo):
    folder, result = demo
    assert "unshifted" in result.stdout and "shifted" in result.stdout
    assert "all variants share θ0" in result.stdout
    unshifted, shifted = (open_run(folder / "runs" / f"{v}.h5") for v in ("unshifted", "shifted"))
    assert unshifted.attrs["theta0_sha256"] == shifted.attrs["theta0_sha256"]
    assert shifted.config["variant"] == "shifted" and shifted.config["optimizer"]["lr"] == 3e-3
    assert shifted.series("loss").step[-1] == 29
    # the students differ in the shift alone: the unshifted activation bias is positive
    assert unshifted.series("activation_bias")["mean"][0].min() > 0.2
    assert abs(shifted.series("activation_bias")["mean"][0]).max() < 0.1
    hessian = shifted.series("hessian")
    np.testing.assert_array_equal(hessian.step, [0, 10, 20])
    assert (np.diff(hessian["eigenvalues"], axis=1) <= 0).all()  # top-5, largest first


def test_info_text_and_json(demo, dynamics):
    folder, _ = demo
    text = dynamics("info", folder / "runs" / "shifted.h5")
    assert text.returncode == 0 and "hidden_norms" in text.stdout and "steps 0..29" in text.stdout
    assert "status finished, last flushed step 30" in text.stdout  # the last validation
    summary = json.loads(dynamics("info", folder / "runs" / "shifted.h5", "--json").stdout)
    assert summary["series"]["loss"]["rows"] == 30
    assert summary["status"]["state"] == "finished" and summary["events"] == []
    assert summary["attrs"]["config"]["steps"] == 30


def test_run_refuses_to_overwrite_existing_results(demo, dynamics):
    folder, _ = demo
    before = (folder / "runs" / "shifted.h5").read_bytes()
    result = dynamics("run", folder / "tiny.yaml", "--out", folder / "runs", "--no-progress")
    assert result.returncode == 2 and "exists" in result.stderr
    assert (folder / "runs" / "shifted.h5").read_bytes() == before


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("steps: -3\n", "steps must be >= 1"),
        ("stepz: 3\n", "unknown config key 'stepz'"),
        ("model: {width: wide}\n", "'model.width' must be an integer"),
        ("steps: [\n", "not valid YAML"),
        ("variants: {a: sideways}\n", "shift must be one of"),
        (
            "experiment: nope\n",
            "unknown experiment 'nope'; known: autoencoder, char_gpt, teacher_student, vit_digits",
        ),
        ("model: {activation: softmax}\n", "model.activation must be one of relu"),
        ("optimizer: {name: rmsprop}\n", "optimizer.name must be one of adam"),
        ("variants: {a: none, b: none}\n", "variants a and b: g_a and g_b are collinear"),
    ],
)
def test_bad_configs_get_one_line(tmp_path, config, message, dynamics, one_line_error):
    (tmp_path / "bad.yaml").write_text(config)
    result = dynamics("run", tmp_path / "bad.yaml", "--out", tmp_path / "out", "--no-progress")
    one_line_error(result)
    assert message in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["info", "missing.h5"],
        ["info", "not_a_run.h5"],
        ["run", "missing.yaml", "--out", "x"],
        ["run", "--out", "x"],
        ["frobnicate"],
        ["run", "cfg.yaml", "--out", "x", "--steps", "many"],
        ["run", "tiny.yaml", "--out", "a_file", "--no-progress"],
        ["run", "tiny.yaml", "--out", "a_file/below", "--no-progress"],
    ],
)
def test_bad_input_gets_one_line_and_exit_2(tmp_path, args, dynamics, one_line_error):
    (tmp_path / "not_a_run.h5").write_text("plain text")
    (tmp_path / "tiny.yaml").write_text("steps: 2\n")
    (tmp_path / "a_file").write_text("mine")
    one_line_error(dynamics(*args, cwd=tmp_path))


def test_plane_of_runs_with_collinear_initial_gradients_is_one_line(
    tmp_path, quiet_trainer, dynamics, one_line_error
):
    architecture = dict(width=8, expansion=2, depth=2)
    for name in ("first", "again"):  # the same student twice: the same g0 under two names
        recorder = DynamicsRecorder(
            tmp_path / f"{name}.h5", [GradientPlane(), ParameterDisplacement()]
        )
        module = TeacherStudentModule(**architecture)
        data = TeacherStudentData(**architecture, batch_size=16)
        quiet_trainer(max_steps=3, callbacks=[recorder]).fit(module, data)
    out = tmp_path / "plane.html"
    result = dynamics("plane", tmp_path / "first.h5", tmp_path / "again.h5", "-o", out)
    one_line_error(result)  # nor do their endpoints give the fallback plane a direction
    assert "collinear" in result.stderr and "endpoints coincide" in result.stderr
    assert not out.exists() and not out.with_suffix(".plane.h5").exists()
