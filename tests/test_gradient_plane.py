"""Recording the initial gradient and plane coordinates, and `dynamics plane` on two runs."""

import copy
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import torch

from dynamics import open_run
from dynamics.callbacks import DynamicsRecorder, GradientPlane, ParameterDisplacement
from dynamics.experiments import TeacherStudentData, TeacherStudentModule
from dynamics.geometry.plane import plane_from_gradients
from dynamics.model.probe_batch import probe_batch
from dynamics.model.rebuild import rebuild_module
from dynamics.params.layout import ParameterLayout
from dynamics.params.vectors import parameter_vector
from dynamics.passes.loss_rule import module_loss

ARCH = dict(width=8, expansion=2, depth=2)


def fit(quiet_trainer, path, probes, shift="none", steps=8):
    module = TeacherStudentModule(**ARCH, shift=shift)
    data = TeacherStudentData(**ARCH, batch_size=16)
    quiet_trainer(max_steps=steps, callbacks=[DynamicsRecorder(path, probes)]).fit(module, data)
    return module, data


def test_g0_and_probe_batch_are_the_first_batch_and_its_gradient(tmp_path, quiet_trainer):
    fit(quiet_trainer, tmp_path / "a.h5", [GradientPlane()])
    run = open_run(tmp_path / "a.h5")
    first = next(iter(TeacherStudentData(**ARCH, batch_size=16).train_dataloader()))
    batch = probe_batch(run)
    assert all(torch.equal(s, f) for s, f in zip(batch, first))
    reference = TeacherStudentModule(**ARCH)
    loss = module_loss(reference, first)
    grads = torch.autograd.grad(loss, [p for p in reference.parameters()])
    np.testing.assert_allclose(
        run.vector("g0"), torch.cat([g.reshape(-1) for g in grads]).numpy(), rtol=1e-6
    )
    assert "plane" not in run.groups  # no plane known: g0 and the batch only
    (probe,) = run.attrs["probes"]
    assert probe["settings"] == {
        "mode": "eval",
        "loss": "dynamics_loss",
        "probe_batch_structure": {"list": [{"tensor": 0}, {"tensor": 1}]},
    }
    assert isinstance(batch, list)  # as the DataLoader gave it


def _g0(module, batch, mode: str) -> torch.Tensor:
    probe = GradientPlane(batch=batch, mode=mode)
    probe.setup(SimpleNamespace(strategy=None), module, batch)
    return torch.from_numpy(probe.initial_vectors()["g0"])


def test_g0_is_the_eval_mode_gradient_unless_train_mode_is_asked(small_cnn):
    torch.manual_seed(0)
    module = small_cnn().train()
    batch = next(iter(module.train_dataloader()))
    reference = copy.deepcopy(module).eval()
    loss = module_loss(reference, batch)
    expected = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, reference.parameters())])
    torch.testing.assert_close(_g0(module, batch, "eval"), expected, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(_g0(module, batch, "train"), expected, rtol=1e-2)
    assert all(m.training for m in module.modules())


def test_a_non_finite_g0_is_refused_at_setup(small_cnn):
    module = small_cnn()
    with torch.no_grad():
        module.head.weight[0, 0] = float("inf")
    batch = next(iter(module.train_dataloader()))
    with pytest.raises(FloatingPointError, match="initial gradient is not finite"):
        _g0(module, batch, "eval")


def test_declarations_before_setup_are_well_defined():
    assert GradientPlane().series() == {} and GradientPlane().vectors() == {}
    assert GradientPlane().initial_vectors() == {}  # g0 and its size come at setup
    basis = plane_from_gradients(np.zeros(3), np.array([1.0, 0, 0]), np.array([0, 1.0, 0]))
    assert set(GradientPlane(basis=basis).series()["plane"]) == {"a", "b", "r"}
    assert GradientPlane(mode="train").settings() == {"mode": "train", "loss": None}


def test_partner_plane_coordinates_decompose_the_displacement(tmp_path, quiet_trainer):
    fit(quiet_trainer, tmp_path / "a.h5", [GradientPlane()])
    probes = [GradientPlane(partner=tmp_path / "a.h5"), ParameterDisplacement()]
    fit(quiet_trainer, tmp_path / "b.h5", probes, shift="expected", steps=12)
    a, b = open_run(tmp_path / "a.h5"), open_run(tmp_path / "b.h5")
    expected = plane_from_gradients(b.vector("theta0"), a.vector("g0"), b.vector("g0"))
    np.testing.assert_allclose(b.vector("plane_u"), expected.u, atol=1e-12)
    np.testing.assert_allclose(b.vector("plane_v"), expected.v, atol=1e-12)
    plane, total = b.series("plane"), b.series("displacement")["total"]
    assert plane["a"][0] == plane["b"][0] == plane["r"][0] == 0
    squares = plane["a"] ** 2 + plane["b"] ** 2 + plane["r"] ** 2
    np.testing.assert_allclose(squares[1:], total[1:] ** 2, rtol=1e-5)


def test_partner_with_another_theta0_is_refused(tmp_path, quiet_trainer):
    fit(quiet_trainer, tmp_path / "a.h5", [GradientPlane()])
    other = TeacherStudentModule(**ARCH, seed=5)
    plane = GradientPlane(partner=tmp_path / "a.h5")
    recorder = DynamicsRecorder(tmp_path / "b.h5", [plane], on_probe_error="raise")
    with pytest.raises(ValueError, match="does not share"):
        quiet_trainer(max_steps=2, callbacks=[recorder]).fit(
            other, TeacherStudentData(**ARCH, batch_size=16)
        )


def test_recording_the_plane_never_perturbs_training(tmp_path, small_cnn, quiet_trainer):
    def train(callbacks):
        torch.manual_seed(3)
        model = small_cnn()
        quiet_trainer(max_epochs=2, callbacks=callbacks, deterministic=True).fit(model)
        return parameter_vector(model), [b.clone() for b in model.buffers()]

    plain = train([])
    recorded = train([DynamicsRecorder(tmp_path / "p.h5", [GradientPlane()])])
    assert torch.equal(plain[0], recorded[0])
    assert all(torch.equal(x, y) for x, y in zip(plain[1], recorded[1]))


def test_dynamics_run_gives_both_students_the_same_plane_from_step_zero(demo):
    folder, _ = demo
    runs = [open_run(folder / "runs" / f"{v}.h5") for v in ("unshifted", "shifted")]
    np.testing.assert_array_equal(runs[0].vector("plane_u"), runs[1].vector("plane_u"))
    np.testing.assert_array_equal(runs[0].vector("plane_v"), runs[1].vector("plane_v"))
    for run in runs:
        np.testing.assert_array_equal(run.series("plane").step, np.arange(30))


def test_plane_command_writes_views_matching_direct_losses(demo, dynamics, tmp_path):
    folder, _ = demo
    runs = [folder / "runs" / f"{v}.h5" for v in ("unshifted", "shifted")]
    out = tmp_path / "plane.html"
    result = dynamics("plane", *runs, "-o", out, "--grid", "5", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "in-plane share of ‖θT − θ0‖², shifted" in result.stdout
    assert out.stat().st_size > 100_000 and "plotly" in out.read_text()[:5_000_000]
    run = open_run(runs[1])
    module = rebuild_module(run)
    layout = ParameterLayout.of(module)
    batch = probe_batch(run)
    with h5py.File(tmp_path / "plane.plane.h5") as views:
        view = views["view1"]  # the initial-gradient plane under the shifted student's loss
        assert view.attrs["run"] == "shifted"
        alphas, betas, losses = view["alphas"][:], view["betas"][:], view["losses"][:]
        u, v = view["u"][:], view["v"][:]
        assert abs(u @ v) < 1e-6 and abs(u @ u - 1) < 1e-6
        theta0 = run.vector("theta0").astype(np.float64)
        for i, j in [(0, 0), (4, 1), (2, 3)]:
            theta = torch.from_numpy((theta0 + alphas[j] * u + betas[i] * v).astype(np.float32))
            for p, chunk in zip(layout.parameters(module), layout.split(theta)):
                p.data.copy_(chunk)
            with torch.no_grad():
                direct = module_loss(module.eval(), batch).item()
            assert losses[i, j] == pytest.approx(direct, rel=1e-5)
        out_of_plane = views["view3"]
        w = out_of_plane["v"][:]
        assert abs(w @ u) < 1e-6 and abs(w @ v) < 1e-6 and abs(w @ w - 1) < 1e-6


def test_plane_command_bad_input(demo, dynamics, one_line_error, tmp_path, quiet_trainer):
    folder, _ = demo
    good, partner = folder / "runs" / "shifted.h5", folder / "runs" / "unshifted.h5"
    data = TeacherStudentData(**ARCH, batch_size=16)
    recordings = {  # same architecture and seed as the demo's students, unless said otherwise
        "other_theta0": (7, [GradientPlane(), ParameterDisplacement()]),
        "no_snapshots": (0, [GradientPlane(), ParameterDisplacement(snapshot_budget_mb=0)]),
        "no_g0": (0, [ParameterDisplacement()]),
    }
    for name, (seed, probes) in recordings.items():
        recorder = DynamicsRecorder(tmp_path / f"{name}.h5", probes)
        module = TeacherStudentModule(**ARCH, seed=seed)
        quiet_trainer(max_steps=3, callbacks=[recorder]).fit(module, data)
    out = ["-o", tmp_path / "x.html"]
    cases = {
        "do not share θ0": [good, tmp_path / "other_theta0.h5", *out],
        "no parameter snapshots": [good, tmp_path / "no_snapshots.h5", *out],
        "no initial gradient g0": [good, tmp_path / "no_g0.h5", *out],
        "at least 2": [good, partner, *out, "--grid", "1"],
        "no such file": [good, tmp_path / "missing.h5", *out],
        "does not exist": [good, partner, "-o", tmp_path / "nodir" / "x.html"],
        "--processes must be at least 1": [good, partner, *out, "--processes", "0"],
    }
    for message, args in cases.items():
        result = dynamics("plane", *args)
        one_line_error(result)
        assert message in result.stderr, result.stderr
    assert not (tmp_path / "x.html").exists()
    existing = tmp_path / "keep.html"
    existing.write_text("mine")
    one_line_error(dynamics("plane", good, partner, "-o", existing))
    assert existing.read_text() == "mine"


def test_plane_grids_split_across_processes_equal_one_process(demo, dynamics, tmp_path):
    folder, _ = demo
    runs = [folder / "runs" / f"{v}.h5" for v in ("unshifted", "shifted")]
    for processes in (1, 2):
        out = tmp_path / f"p{processes}.html"
        result = dynamics(
            "plane", *runs, "-o", out, "--grid", "5", "--no-progress", "--processes", processes
        )
        assert result.returncode == 0, result.stderr
    with h5py.File(tmp_path / "p1.plane.h5") as one, h5py.File(tmp_path / "p2.plane.h5") as two:
        for view in one:
            np.testing.assert_array_equal(one[view]["losses"][:], two[view]["losses"][:])
