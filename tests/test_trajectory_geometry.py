"""TrajectoryGeometry: path length, tortuosity and update cosines against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dynamics
from dynamics import open_run
from dynamics.analysis.pages.run_comparison import write_comparison
from dynamics.analysis.pages.run_report import write_report
from dynamics.callbacks import (
    DynamicsRecorder,
    ParameterDisplacement,
    TrainingLoss,
    TrajectoryGeometry,
    check_probe,
)
from dynamics.store import names
from tests.conftest import make_quiet_trainer
from tests.test_real_projects import DigitsCNN, DigitsData

CURVATURE = np.array([1.0, 4.0, 0.5, 2.0])
TARGETS = np.random.default_rng(0).normal(size=(16, 4))  # one sample per row
THETA0 = np.array([1.0, -2.0, 0.5, 3.0])
LR, MOMENTUM = 0.1, 0.9
TENSORS = (slice(0, 2), slice(2, 4))  # the entries of Quadratic's two parameter tensors


class Quadratic(pl.LightningModule):
    """loss = mean over the batch of ½ Σᵢ aᵢ (wᵢ − xᵢ)², w held as two tensors (2,) and (2, 1):
    the gradient is a ⊙ (w − mean x), known in closed form at every step."""

    def __init__(self, batch_size: int = 2) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.first = nn.Parameter(torch.tensor(THETA0[:2], dtype=torch.float32))
        self.second = nn.Parameter(torch.tensor(THETA0[2:, None], dtype=torch.float32))
        self.register_buffer("curvature", torch.tensor(CURVATURE, dtype=torch.float32))

    def compute_loss(self, batch) -> torch.Tensor:
        (x,) = batch
        w = torch.cat([self.first, self.second.reshape(-1)])
        return (0.5 * self.curvature * (w - x) ** 2).sum(1).mean()

    def training_step(self, batch, batch_idx):
        return self.compute_loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)

    def train_dataloader(self):
        data = TensorDataset(torch.tensor(TARGETS, dtype=torch.float32))
        return DataLoader(data, batch_size=self.batch_size, shuffle=False)


class ManualQuadratic(Quadratic):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(self.compute_loss(batch))
        optimizer.step()


def hand_computed(steps: int, batch_size: int, accumulate: int = 1, clip: float | None = None):
    """The expected rows at every step: SGD with momentum on the quadratic, in float64."""
    theta, velocity = THETA0.copy(), None
    path, rows, previous = 0.0, [], None
    tensor_path = np.zeros(len(TENSORS))
    micro = batch_size
    for t in range(steps):
        first = t * accumulate * micro % len(TARGETS)  # epochs restart the unshuffled data
        means = [
            TARGETS[first + k * micro : first + (k + 1) * micro].mean(0) for k in range(accumulate)
        ]
        raw = sum(CURVATURE * (theta - m) / accumulate for m in means)
        gradient = raw if clip is None else np.clip(raw, -clip, clip)
        velocity = gradient if velocity is None else MOMENTUM * velocity + gradient
        update = -LR * velocity
        theta = theta + update
        path += np.linalg.norm(update)
        tensor_path += [np.linalg.norm(update[t]) for t in TENSORS]
        rows.append(
            {
                "path_length": path,
                "tortuosity": path / np.linalg.norm(theta - THETA0),
                "update_cosine": np.nan if previous is None else _cos(previous, update),
                "gradient_cosine": _cos(update, -gradient),
                "unclipped": _cos(update, -raw),
                names.TRAJECTORY_PATH_LENGTH_PER_TENSOR: tensor_path.copy(),
                names.TRAJECTORY_UPDATE_COSINE_PER_TENSOR: [
                    np.nan if previous is None else _cos(previous[t], update[t]) for t in TENSORS
                ],
                names.TRAJECTORY_GRADIENT_COSINE_PER_TENSOR: [
                    _cos(update[t], -gradient[t]) for t in TENSORS
                ],
            }
        )
        previous = update
    return rows


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def fit(module, path, probes, **options):
    trainer = make_quiet_trainer(callbacks=[DynamicsRecorder(path, probes)], **options)
    trainer.fit(module)
    return open_run(path)


def assert_rows(run, expected, steps):
    recorded = run.series(names.TRAJECTORY)
    np.testing.assert_array_equal(recorded.step, steps)
    for name in recorded.values:
        want = [expected[s][name] for s in steps]
        np.testing.assert_allclose(recorded[name], want, rtol=2e-5, atol=2e-6, err_msg=name)


def test_every_row_matches_the_hand_computed_path(tmp_path):
    """Rows every 2 steps, but the path length counts the updates of the steps between."""
    run = fit(Quadratic(), tmp_path / "run.h5", [TrajectoryGeometry(every_n_steps=2)], max_steps=7)
    assert set(run.series(names.TRAJECTORY).values) == {
        names.TRAJECTORY_PATH_LENGTH,
        names.TRAJECTORY_TORTUOSITY,
        names.TRAJECTORY_UPDATE_COSINE,
        names.TRAJECTORY_GRADIENT_COSINE,
    }
    assert_rows(run, hand_computed(7, batch_size=2), [0, 2, 4, 6])
    assert np.isnan(run.series(names.TRAJECTORY)[names.TRAJECTORY_UPDATE_COSINE][0])
    assert not run.events()


def test_per_tensor_rows_match_the_hand_computed_path_and_leave_the_totals_unchanged(tmp_path):
    """Per tensor, every row against float64; the total rows are those of a run without the
    option, bit for bit."""
    probe = TrajectoryGeometry(every_n_steps=2, per_tensor=True)
    run = fit(Quadratic(), tmp_path / "run.h5", [probe], max_steps=7)
    recorded = run.series(names.TRAJECTORY)
    assert set(recorded.values) == {
        names.TRAJECTORY_PATH_LENGTH,
        names.TRAJECTORY_TORTUOSITY,
        names.TRAJECTORY_UPDATE_COSINE,
        names.TRAJECTORY_GRADIENT_COSINE,
        names.TRAJECTORY_PATH_LENGTH_PER_TENSOR,
        names.TRAJECTORY_UPDATE_COSINE_PER_TENSOR,
        names.TRAJECTORY_GRADIENT_COSINE_PER_TENSOR,
    }
    assert recorded[names.TRAJECTORY_PATH_LENGTH_PER_TENSOR].shape == (4, 2)
    assert_rows(run, hand_computed(7, batch_size=2), [0, 2, 4, 6])
    assert np.isnan(recorded[names.TRAJECTORY_UPDATE_COSINE_PER_TENSOR][0]).all()
    views = run.views(names.TRAJECTORY)
    assert views[names.TRAJECTORY_PATH_LENGTH_PER_TENSOR].kind == "lines"
    (settings,) = [p["settings"] for p in run.attrs[names.ATTR_PROBES]]
    assert settings["per_tensor"] is True
    plain = fit(
        Quadratic(), tmp_path / "plain.h5", [TrajectoryGeometry(every_n_steps=2)], max_steps=7
    )
    totals = plain.series(names.TRAJECTORY)
    for name in totals.values:
        np.testing.assert_array_equal(recorded[name], totals[name], err_msg=name)
    assert "per_tensor" not in plain.attrs[names.ATTR_PROBES][0]["settings"]


def test_a_tensor_outside_the_optimizer_has_no_direction(tmp_path):
    """A tensor the optimizer does not hold never moves: its path stays 0 and its cosines
    are NaN (no direction), while the other tensor's match the hand computation."""

    class FirstOnly(Quadratic):
        def configure_optimizers(self):
            return torch.optim.SGD([self.first], lr=LR, momentum=MOMENTUM)

    run = fit(FirstOnly(), tmp_path / "run.h5", [TrajectoryGeometry(per_tensor=True)], max_steps=3)
    recorded = run.series(names.TRAJECTORY)
    np.testing.assert_array_equal(recorded[names.TRAJECTORY_PATH_LENGTH_PER_TENSOR][:, 1], 0)
    assert np.isnan(recorded[names.TRAJECTORY_UPDATE_COSINE_PER_TENSOR][:, 1]).all()
    assert np.isnan(recorded[names.TRAJECTORY_GRADIENT_COSINE_PER_TENSOR][:, 1]).all()
    # The first tensor alone is the whole update: its rows are the totals.
    np.testing.assert_allclose(
        recorded[names.TRAJECTORY_PATH_LENGTH_PER_TENSOR][:, 0],
        recorded[names.TRAJECTORY_PATH_LENGTH],
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        recorded[names.TRAJECTORY_GRADIENT_COSINE_PER_TENSOR][:, 0],
        recorded[names.TRAJECTORY_GRADIENT_COSINE],
        atol=1e-6,
    )
    assert (
        abs(recorded[names.TRAJECTORY_GRADIENT_COSINE_PER_TENSOR][0, 0] - 1) < 1e-6
    )  # momentum's first step


def test_accumulation_and_clipping_use_the_gradient_the_optimizer_was_handed(tmp_path):
    """Under accumulation the gradient is the mean over micro-batches; clipping by value
    changes its direction, and the row follows the clipped one."""
    run = fit(
        Quadratic(),
        tmp_path / "run.h5",
        [TrajectoryGeometry()],
        max_steps=4,
        accumulate_grad_batches=2,
        gradient_clip_val=0.8,
        gradient_clip_algorithm="value",
    )
    expected = hand_computed(4, batch_size=2, accumulate=2, clip=0.8)
    assert_rows(run, expected, [0, 1, 2, 3])
    recorded = run.series(names.TRAJECTORY)[names.TRAJECTORY_GRADIENT_COSINE]
    unclipped = [row["unclipped"] for row in expected]
    assert np.all(np.abs(recorded - unclipped) > 1e-2)  # the clipped gradient, not the raw one


def test_manual_optimization_records_the_path_and_says_why_not_the_gradient(tmp_path):
    probe = TrajectoryGeometry(per_tensor=True)
    run = fit(ManualQuadratic(), tmp_path / "run.h5", [probe], max_steps=4)
    recorded = run.series(names.TRAJECTORY)
    assert names.TRAJECTORY_GRADIENT_COSINE not in recorded.values
    assert names.TRAJECTORY_GRADIENT_COSINE_PER_TENSOR not in recorded.values
    assert (
        names.TRAJECTORY_PATH_LENGTH_PER_TENSOR in recorded.values
    )  # checked against the hand computation
    assert_rows(run, hand_computed(4, batch_size=2), [0, 1, 2, 3])
    (probe,) = run.attrs[names.ATTR_PROBES]
    assert probe["settings"]["gradient"].startswith("not measured: manual optimization")
    (event,) = run.events()
    assert event.kind == names.EVENT_WARNING and "gradient_cosine not recorded" in event.message


def test_training_is_bit_identical_and_lengths_agree_with_the_displacement(tmp_path):
    """A BatchNorm CNN with dict batches, dropout and a scheduler: the same parameters with and
    without the probe, and the path length is the sum of ParameterDisplacement's updates."""
    finals = []
    for i, probes in enumerate(
        [
            [TrainingLoss()],
            [TrainingLoss(), ParameterDisplacement(), TrajectoryGeometry()],
            [TrainingLoss(), ParameterDisplacement(), TrajectoryGeometry(per_tensor=True)],
        ]
    ):
        torch.manual_seed(0)
        module = DigitsCNN()
        trainer = make_quiet_trainer(
            max_steps=5, callbacks=[DynamicsRecorder(tmp_path / f"{i}.h5", probes)]
        )
        trainer.fit(module, datamodule=DigitsData())
        finals.append([p.detach().clone() for p in module.parameters()])
    for a, b, c in zip(*finals):
        assert torch.equal(a, b) and torch.equal(a, c)
    run = open_run(tmp_path / "1.h5")
    geometry, displacement = run.series(names.TRAJECTORY), run.series(names.DISPLACEMENT)
    np.testing.assert_allclose(
        geometry[names.TRAJECTORY_PATH_LENGTH],
        np.cumsum(displacement[names.DISPLACEMENT_UPDATE]),
        rtol=1e-5,
    )
    theta_final = run.vector(names.THETA_FINAL) - run.vector(names.THETA0)
    chords = [*displacement[names.DISPLACEMENT_TOTAL][1:], np.linalg.norm(theta_final)]
    np.testing.assert_allclose(
        geometry[names.TRAJECTORY_TORTUOSITY],
        geometry[names.TRAJECTORY_PATH_LENGTH] / np.array(chords),
        rtol=1e-5,
    )
    cosine = geometry[names.TRAJECTORY_GRADIENT_COSINE]
    assert np.all((cosine > 0) & (cosine <= 1))
    # Per tensor, the same run's totals recomputed from the per-tensor rows.
    per_tensor = open_run(tmp_path / "2.h5")
    tensors = per_tensor.series(names.TRAJECTORY)
    for name in geometry.values:
        np.testing.assert_array_equal(tensors[name], geometry[name], err_msg=name)
    steps = np.diff(tensors[names.TRAJECTORY_PATH_LENGTH_PER_TENSOR], axis=0, prepend=0)  # ‖Δt,i‖
    np.testing.assert_allclose(
        np.linalg.norm(steps, axis=1), displacement[names.DISPLACEMENT_UPDATE], rtol=1e-5
    )
    # One step from θ0: each tensor's path is its distance from θ0.
    np.testing.assert_allclose(
        tensors[names.TRAJECTORY_PATH_LENGTH_PER_TENSOR][0],
        displacement[names.DISPLACEMENT_PER_TENSOR][1],
        rtol=1e-5,
    )
    # cos(Δt−1, Δt) = Σᵢ ‖Δt−1,i‖ ‖Δt,i‖ cos(Δt−1,i, Δt,i) / (‖Δt−1‖ ‖Δt‖).
    # (A conv bias before BatchNorm has no gradient: it never moves, and its cosines are NaN.)
    cosines = tensors[names.TRAJECTORY_UPDATE_COSINE_PER_TENSOR][1:]
    weights = steps[:-1] * steps[1:]
    np.testing.assert_array_equal(np.isnan(cosines), weights == 0)
    combined = np.sum(np.where(weights > 0, weights * cosines, 0), axis=1) / (
        np.linalg.norm(steps[:-1], axis=1) * np.linalg.norm(steps[1:], axis=1)
    )
    np.testing.assert_allclose(combined, geometry[names.TRAJECTORY_UPDATE_COSINE][1:], atol=1e-5)
    gradient_cosines = tensors[names.TRAJECTORY_GRADIENT_COSINE_PER_TENSOR]
    np.testing.assert_array_equal(np.isnan(gradient_cosines), steps == 0)
    assert np.all(np.abs(gradient_cosines[steps > 0]) <= 1)


def test_probe_contract_and_resumable_state():
    batch = (torch.tensor(TARGETS[:2], dtype=torch.float32),)
    series = check_probe(TrajectoryGeometry(), Quadratic(), batch, steps=3)
    assert np.isfinite(series[names.TRAJECTORY][names.TRAJECTORY_PATH_LENGTH]).all()
    series = check_probe(TrajectoryGeometry(per_tensor=True), Quadratic(), batch, steps=3)
    assert np.isfinite(series[names.TRAJECTORY][names.TRAJECTORY_PATH_LENGTH_PER_TENSOR]).all()


def test_report_and_compare_draw_the_series(tmp_path):
    runs = [
        fit(
            Quadratic(batch_size=size),
            tmp_path / f"b{size}.h5",
            [TrainingLoss(), TrajectoryGeometry(per_tensor=True)],
            max_steps=4,
        ).path
        for size in (2, 4)
    ]
    report = write_report(runs[:1], tmp_path / "report.html").path.read_text()
    compare = write_comparison(runs, tmp_path / "compare.html").path.read_text()
    for title in (
        "Path length",
        "Tortuosity",
        "Cosine between consecutive updates",
        "descent direction",
        "Path length per tensor",
        "Cosine between consecutive updates per tensor",
        "descent direction per tensor",
    ):
        assert title in report and title in compare
    assert "second" in report  # the tensors' names label the lines


def test_a_resumed_fit_continues_the_same_path(tmp_path):
    """The path length and the previous update's direction come back from the checkpoint
    (saved at an epoch's end: Lightning restarts an unshuffled epoch it resumes in its middle)."""
    from pytorch_lightning.callbacks import ModelCheckpoint

    def fit_checkpointed(path, max_steps, ckpt_path=None, per_tensor=True):
        checkpoint = ModelCheckpoint(tmp_path / path.stem, every_n_train_steps=4, save_top_k=-1)
        probe = TrajectoryGeometry(per_tensor=per_tensor)
        recorder = DynamicsRecorder(path, [probe], flush_interval_s=1e9)
        trainer = make_quiet_trainer(
            max_steps=max_steps, enable_checkpointing=True, callbacks=[recorder, checkpoint]
        )
        trainer.fit(Quadratic(batch_size=4), ckpt_path=ckpt_path)

    straight, resumed = tmp_path / "straight.h5", tmp_path / "resumed.h5"
    fit_checkpointed(straight, 7)
    fit_checkpointed(resumed, 5)
    fit_checkpointed(resumed, 7, tmp_path / "resumed" / "epoch=0-step=4.ckpt")
    a, b = (open_run(p).series(names.TRAJECTORY) for p in (straight, resumed))
    np.testing.assert_array_equal(b.step, range(7))
    for name in a.values:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert_rows(open_run(resumed), hand_computed(7, batch_size=4), range(7))
    # Resumed with per_tensor from a fit without it: the per-tensor paths so far are unknown.
    partial = tmp_path / "partial.h5"
    fit_checkpointed(partial, 5, per_tensor=False)
    fit_checkpointed(partial, 7, tmp_path / "partial" / "epoch=0-step=4.ckpt")
    run = open_run(partial)
    assert names.TRAJECTORY_PATH_LENGTH_PER_TENSOR not in run.series(names.TRAJECTORY).values
    assert_rows(run, hand_computed(7, batch_size=4), range(7))
    assert any("per-tensor series not recorded: resumed" in e.message for e in run.events())


class PlainQuadratic(nn.Module):
    """Quadratic's model as a plain module: no ``automatic_optimization`` to read."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Parameter(torch.tensor(THETA0[:2], dtype=torch.float32))
        self.second = nn.Parameter(torch.tensor(THETA0[2:, None], dtype=torch.float32))
        self.register_buffer("curvature", torch.tensor(CURVATURE, dtype=torch.float32))

    def forward(self, batch) -> torch.Tensor:
        return Quadratic.compute_loss(self, batch)


def plain_loop(path, steps, second_optimizer=False):
    """A plain loop under ``dynamics.record`` that zeroes .grad right after each step, as plain
    loops do; returns θ before each step, θ after the last and each step's gradient, captured
    inside the loop (the gradient concatenated over both tensors)."""
    net = PlainQuadratic()
    if second_optimizer:  # one optimizer per tensor: each hook reads its own tensor
        optimizers = [
            torch.optim.SGD([net.first], lr=LR, momentum=MOMENTUM),
            torch.optim.SGD([net.second], lr=LR, momentum=MOMENTUM),
        ]
    else:
        optimizers = [torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)]
    data = torch.tensor(TARGETS, dtype=torch.float32)
    thetas, gradients = [], []
    flat = lambda tensors: torch.cat([t.detach().reshape(-1) for t in tensors]).double().numpy()  # noqa: E731
    probes = [TrajectoryGeometry(per_tensor=True)]
    with dynamics.record(path, net, optimizers, probes=probes) as rec:
        for t in range(steps):
            batch = (data[2 * t % len(data) :][:2],)
            with rec.batch(batch):
                thetas.append(flat(net.parameters()))
                net(batch).backward()
                gradients.append(flat(p.grad for p in net.parameters()))
                for opt in optimizers:
                    opt.step()
                    opt.zero_grad()  # .grad is gone before the step ends
    thetas.append(flat(net.parameters()))
    return open_run(path), thetas, gradients


def test_a_plain_loop_that_zeroes_the_gradient_after_the_step_records_its_cosine(tmp_path):
    """cos(θt+1 − θt, −gt) by hand from the θ and .grad the loop saw: reading .grad at the
    step's end (zeros by then) would record NaN."""
    steps = 5
    run, thetas, gradients = plain_loop(tmp_path / "plain.h5", steps)
    recorded = run.series(names.TRAJECTORY)
    updates = [b - a for a, b in zip(thetas, thetas[1:])]
    want = [_cos(u, -g) for u, g in zip(updates, gradients)]
    np.testing.assert_allclose(recorded[names.TRAJECTORY_GRADIENT_COSINE], want, rtol=1e-5)
    want_tensors = [[_cos(u[t], -g[t]) for t in TENSORS] for u, g in zip(updates, gradients)]
    np.testing.assert_allclose(
        recorded[names.TRAJECTORY_GRADIENT_COSINE_PER_TENSOR], want_tensors, rtol=1e-5
    )
    assert not run.events()  # no note: the probe measured


def test_a_plain_loop_and_lightning_record_the_same_series(tmp_path):
    """The same model, data and optimizer: the plain loop (one optimizer, or one per tensor,
    each hook reading its own tensor) records Lightning's rows to the bit."""
    steps = 5
    lightning = fit(
        Quadratic(), tmp_path / "pl.h5", [TrajectoryGeometry(per_tensor=True)], max_steps=steps
    ).series(names.TRAJECTORY)
    for second in (False, True):
        run, _, _ = plain_loop(tmp_path / f"plain{second}.h5", steps, second_optimizer=second)
        plain = run.series(names.TRAJECTORY)
        assert set(plain.values) == set(lightning.values)
        np.testing.assert_array_equal(plain.step, lightning.step)
        for name, values in lightning.values.items():
            np.testing.assert_array_equal(plain[name], values, err_msg=f"{name} {second}")
