"""GradientStats against hand computations on least squares, whose per-sample gradients are
known in closed form: g_i = r_i·(x_i, 1) with r_i = w·x_i + c − y_i for ½ r_i²."""

import csv

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, TensorDataset

import dynamics
from dynamics import open_run
from dynamics.callbacks import DynamicsRecorder, GradientStats, check_probe
from dynamics.callbacks.gradient_stats import first_dimension
from dynamics.experiments import TeacherStudentData, TeacherStudentModule
from dynamics.integrations.huggingface import DynamicsCallback
from dynamics.store import names
from tests import tiny_gpt2

G = names.GRADIENT_STATS
NOISE = (
    names.GRADIENT_NOISE_SCALE,
    names.GRADIENT_SQUARED_NORM,
    names.GRADIENT_TRACE_COVARIANCE,
    names.GRADIENT_BATCH_SMALL,
    names.GRADIENT_BATCH_BIG,
)


class LeastSquares(pl.LightningModule):
    """A linear model under the mean of ½(w·x + c − y)²; its optimizer records the norms of
    the gradients it is handed when it steps (after Lightning's closure and clipping)."""

    def __init__(self, lr: float = 0.1, d: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(d, 1)
        self.lr = lr
        self.handed: list[list[float]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return 0.5 * (self.linear(x).squeeze(-1) - y).square().mean()

    def configure_optimizers(self):
        module = self

        class Recorded(torch.optim.SGD):
            def step(self, closure=None):
                if closure is not None:
                    closure()  # Lightning's: forward, backward, on_before_optimizer_step, clip
                module.handed.append(
                    [float(torch.linalg.vector_norm(p.grad)) for p in module.parameters()]
                )
                return super().step()

        return Recorded(self.parameters(), lr=self.lr)


def _batches(sizes, seed=1, d=3):
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(b, d, generator=generator), torch.randn(b, generator=generator)) for b in sizes
    ]


def _per_sample(w, c, x, y):
    """The per-sample gradients (rows) of ½(w·x + c − y)² in float64: r·(x, 1)."""
    r = x @ w + c - y
    return np.concatenate([r[:, None] * x, r[:, None]], axis=1)


def _fit(module, loader, probes, path, quiet_trainer, **trainer):
    recorder = DynamicsRecorder(path, probes)
    quiet_trainer(callbacks=[recorder], **trainer).fit(module, loader)
    return open_run(path)


def test_norms_and_noise_scale_match_a_hand_computation_over_unequal_micro_batches(
    tmp_path, quiet_trainer
):
    sizes, k, lr = [4, 2, 6], 3, 0.1
    batches = _batches(sizes * 2)
    module = LeastSquares(lr)
    w = module.linear.weight.detach().double().numpy()[0]
    c = float(module.linear.bias.detach().double())
    loader = DataLoader(batches, batch_size=None)
    run = _fit(
        module,
        loader,
        [GradientStats()],
        tmp_path / "r.h5",
        quiet_trainer,
        max_steps=2,
        accumulate_grad_batches=k,
    )
    rows = run.series(G)
    np.testing.assert_array_equal(rows.step, [0, 1])
    assert rows.columns[names.GRADIENT_NORM_PER_TENSOR] == ("linear.weight", "linear.bias")
    for step in range(2):
        micro = [
            _per_sample(w, c, x.double().numpy(), y.double().numpy()).mean(0)
            for x, y in batches[step * k : (step + 1) * k]
        ]
        mean = np.mean(micro, axis=0)  # what .grad holds: Lightning divides each loss by k
        a = np.mean([m @ m for m in micro])
        inverse = np.mean([1 / b for b in sizes])
        trace = (a - mean @ mean) / (inverse * (1 - 1 / k))
        squared = (k * mean @ mean - a) / (k - 1)
        expected = {
            names.GRADIENT_NORM: np.linalg.norm(mean),
            names.GRADIENT_NORM_BEFORE_CLIP: np.linalg.norm(mean),
            names.GRADIENT_NOISE_SCALE: trace / squared,
            names.GRADIENT_SQUARED_NORM: squared,
            names.GRADIENT_TRACE_COVARIANCE: trace,
            names.GRADIENT_BATCH_SMALL: 1 / inverse,
            names.GRADIENT_BATCH_BIG: k / inverse,
        }
        for name, value in expected.items():  # float32 training against float64
            np.testing.assert_allclose(rows[name][step], value, rtol=2e-5, err_msg=name)
        np.testing.assert_allclose(
            rows[names.GRADIENT_NORM_PER_TENSOR][step],
            [np.linalg.norm(mean[:3]), abs(mean[3])],
            rtol=1e-6,
        )
        w, c = w - lr * mean[:3], c - lr * mean[3]
    assert rows[names.GRADIENT_BATCH_SMALL][0] == pytest.approx(36 / 11)  # not the mean, 4


def test_the_estimates_are_unbiased_over_many_steps(tmp_path, quiet_trainer):
    """With lr = 0 every step draws fresh micro-batches (with replacement) at the same θ: the
    means of the estimates over the steps converge to the population's ‖G‖² and tr Σ."""
    n, b, k, steps = 48, 2, 4, 150
    generator = torch.Generator().manual_seed(3)
    x, y = torch.randn(n, 3, generator=generator), torch.randn(n, generator=generator)
    data = TensorDataset(x, y)
    sampler = RandomSampler(data, replacement=True, num_samples=b * k * steps, generator=generator)
    module = LeastSquares(lr=0.0)
    w = module.linear.weight.detach().double().numpy()[0]
    c = float(module.linear.bias.detach().double())
    run = _fit(
        module,
        DataLoader(data, batch_size=b, sampler=sampler),
        [GradientStats()],
        tmp_path / "r.h5",
        quiet_trainer,
        max_steps=steps,
        accumulate_grad_batches=k,
    )
    rows = run.series(G)
    g = _per_sample(w, c, x.double().numpy(), y.double().numpy())
    population = g.mean(0)
    truth = {
        names.GRADIENT_SQUARED_NORM: population @ population,
        names.GRADIENT_TRACE_COVARIANCE: np.mean(((g - population) ** 2).sum(1)),
    }
    for name, value in truth.items():
        estimates = rows[name]
        error = estimates.std(ddof=1) / np.sqrt(len(estimates))
        assert abs(estimates.mean() - value) < 4 * error, (name, estimates.mean(), value, error)
        assert error < 0.25 * value  # the check has power
    np.testing.assert_array_equal(rows[names.GRADIENT_BATCH_BIG], b * k)


def test_clipping_shows_the_norm_before_above_the_norm_after_at_the_clip_value(
    tmp_path, quiet_trainer
):
    module = LeastSquares()
    clip = 1e-2
    run = _fit(
        module,
        DataLoader(_batches([8] * 4), batch_size=None),
        [GradientStats()],
        tmp_path / "r.h5",
        quiet_trainer,
        max_steps=2,
        accumulate_grad_batches=2,
        gradient_clip_val=clip,
    )
    rows = run.series(G)
    before, after = rows[names.GRADIENT_NORM_BEFORE_CLIP], rows[names.GRADIENT_NORM]
    assert (before > 10 * clip).all()
    # clip_grad_norm_ scales by clip / (‖g‖ + 1e-6)
    np.testing.assert_allclose(after, clip * before / (before + 1e-6), rtol=1e-5)
    # the per-tensor norms are those of what the optimizer was handed
    np.testing.assert_allclose(rows[names.GRADIENT_NORM_PER_TENSOR], module.handed, rtol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(module.handed, axis=1), after, rtol=1e-6)


def test_the_contract_holds_and_one_micro_batch_steps_the_noise_scale_aside(tmp_path):
    batch = _batches([8])[0]
    series = check_probe(GradientStats(), LeastSquares(), batch, steps=3)
    rows = series[G]
    assert not set(NOISE) & set(rows.values)
    assert np.isfinite(rows[names.GRADIENT_NORM_BEFORE_CLIP]).all()


def test_one_micro_batch_notes_why_the_noise_scale_is_missing(tmp_path, quiet_trainer):
    run = _fit(
        LeastSquares(),
        DataLoader(_batches([8] * 2), batch_size=None),
        [GradientStats()],
        tmp_path / "r.h5",
        quiet_trainer,
        max_steps=2,
    )
    messages = [e.message for e in run.events() if e.probe == G]
    assert len(messages) == 1 and "B_small = B_big" in messages[0]


def test_training_is_bit_identical_with_and_without_the_probe(tmp_path, quiet_trainer):
    arch = dict(width=8, expansion=2, depth=2)
    params = []
    for probes in ([], [GradientStats()]):
        pl.seed_everything(0)
        module = TeacherStudentModule(**arch)
        quiet_trainer(
            max_steps=3,
            accumulate_grad_batches=2,
            gradient_clip_val=0.1,
            callbacks=[DynamicsRecorder(tmp_path / f"r{len(probes)}.h5", probes)],
        ).fit(module, TeacherStudentData(**arch, batch_size=8))
        params.append([p.detach().clone() for p in module.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*params))
    rows = open_run(tmp_path / "r1.h5").series(G)
    assert all(np.isfinite(rows[name]).all() for name in rows.values)


def test_per_tensor_norms_reach_the_csv_logger_one_column_per_tensor(tmp_path, quiet_trainer):
    logger = CSVLogger(tmp_path, name="csv")
    recorder = DynamicsRecorder(tmp_path / "r.h5", [GradientStats()], log_to_loggers=True)
    quiet_trainer(
        max_steps=3,
        accumulate_grad_batches=2,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[recorder],
    ).fit(LeastSquares(), DataLoader(_batches([4] * 6), batch_size=None))
    rows = open_run(tmp_path / "r.h5").series(G)
    with open(f"{logger.log_dir}/metrics.csv") as handle:
        logged = list(csv.DictReader(handle))
    for i, tensor in enumerate(("linear.weight", "linear.bias")):
        key = f"dynamics/{G}/{names.GRADIENT_NORM_PER_TENSOR}/{tensor}"
        values = [float(r[key]) for r in logged if r.get(key)]
        np.testing.assert_allclose(values, rows[names.GRADIENT_NORM_PER_TENSOR][:, i], rtol=1e-6)
    key = f"dynamics/{G}/{names.GRADIENT_NOISE_SCALE}"
    np.testing.assert_allclose(
        [float(r[key]) for r in logged if r.get(key)], rows[names.GRADIENT_NOISE_SCALE], rtol=1e-6
    )


def test_an_sdpa_transformer_records_finite_rows(tmp_path, quiet_trainer):
    module = tiny_gpt2.LightningGPT2()
    assert module.model.config._attn_implementation == "sdpa"
    run = _fit(
        module,
        tiny_gpt2.loader(count=16, batch_size=4),
        [GradientStats(batch_size=lambda batch: batch["attention_mask"].sum())],
        tmp_path / "r.h5",
        quiet_trainer,
        max_steps=2,
        accumulate_grad_batches=2,
    )
    rows = run.series(G)
    assert len(rows.columns[names.GRADIENT_NORM_PER_TENSOR]) == len(list(module.model.parameters()))
    assert all(np.isfinite(rows[name]).all() for name in rows.values)
    assert (rows[names.GRADIENT_BATCH_SMALL] > 4).all()  # tokens, not sequences


def _rank_batches(data, k, b, steps):
    """Each step's micro-batches of each rank, as Lightning's shuffled DistributedSampler deals
    them (seed PL_GLOBAL_SEED = 0): [step][rank][micro-batch] → sample indices."""
    ranks = [list(DistributedSampler(data, 2, r, shuffle=True, seed=0)) for r in range(2)]
    return [
        [[order[(s * k + j) * b : (s * k + j + 1) * b] for j in range(k)] for order in ranks]
        for s in range(steps)
    ]


@pytest.mark.parametrize("k", [1, 2])
def test_ddp_records_the_per_rank_noise_scale_of_a_hand_computation(
    tmp_path, quiet_trainer, monkeypatch, k
):
    """Two ranks, k micro-batches each: the R·k small batches are each rank's micro-batches,
    the big batch their union; the norms are those of one process over the global batch."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")  # the seed of Lightning's DistributedSampler
    b, lr, steps = 4 // k, 0.1, 2
    x, y = _batches([16])[0]
    data = TensorDataset(x, y)
    module = LeastSquares(lr)
    w = module.linear.weight.detach().double().numpy()[0]
    c = float(module.linear.bias.detach().double())
    run = _fit(
        module,
        DataLoader(data, batch_size=b),
        [GradientStats()],
        tmp_path / "ddp.h5",
        quiet_trainer,
        max_steps=steps,
        strategy="ddp_fork",
        devices=2,
        accumulate_grad_batches=k,
    )
    rows = run.series(G)
    xs, ys = x.double().numpy(), y.double().numpy()
    n = 2 * k
    for step, ranks in enumerate(_rank_batches(data, k, b, steps)):
        small = [_per_sample(w, c, xs[i], ys[i]).mean(0) for rank in ranks for i in rank]
        mean = np.mean(small, axis=0)  # DDP's mean over ranks of each rank's mean over k
        a = np.mean([g @ g for g in small])
        trace = b * (a - mean @ mean) / (1 - 1 / n)
        squared = (n * mean @ mean - a) / (n - 1)
        expected = {
            names.GRADIENT_NORM: np.linalg.norm(mean),
            names.GRADIENT_NORM_BEFORE_CLIP: np.linalg.norm(mean),
            names.GRADIENT_NOISE_SCALE: trace / squared,
            names.GRADIENT_SQUARED_NORM: squared,
            names.GRADIENT_TRACE_COVARIANCE: trace,
            names.GRADIENT_BATCH_SMALL: b,
            names.GRADIENT_BATCH_BIG: n * b,
        }
        for name, value in expected.items():  # float32 training against float64
            np.testing.assert_allclose(rows[name][step], value, rtol=1e-5, err_msg=name)
        w, c = w - lr * mean[:3], c - lr * mean[3]


def test_ddp_training_is_bit_identical_with_and_without_the_probe(tmp_path, quiet_trainer):
    params = []
    for probes in ([], [GradientStats()]):
        module = LeastSquares()
        quiet_trainer(
            max_steps=3,
            accumulate_grad_batches=2,
            gradient_clip_val=0.05,
            strategy="ddp_fork",
            devices=2,
            callbacks=[DynamicsRecorder(tmp_path / f"r{len(probes)}.h5", probes)],
        ).fit(module, DataLoader(TensorDataset(*_batches([24])[0]), batch_size=2))
        params.append([p.detach().clone() for p in module.parameters()])  # rank 0's, returned
    assert not torch.equal(params[0][0], LeastSquares().linear.weight)  # it trained
    assert all(torch.equal(a, b) for a, b in zip(*params))
    rows = open_run(tmp_path / "r1.h5").series(G)
    assert all(np.isfinite(rows[name]).all() for name in NOISE)


def test_the_default_batch_size_is_the_first_dimension_of_the_first_tensor():
    assert first_dimension(({"ids": torch.zeros(5, 2)}, torch.zeros(7))) == 5
    with pytest.raises(ValueError, match="batch_size="):
        first_dimension({"n": 3})


def test_a_plain_loop_records_what_its_optimizer_was_handed_after_its_own_clipping(tmp_path):
    net = nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    handed = []
    opt.register_step_pre_hook(
        lambda o, a, k: handed.append(
            [float(torch.linalg.vector_norm(p.grad)) for p in net.parameters()]
        )
    )
    with dynamics.record(tmp_path / "r.h5", net, opt, probes=[GradientStats()]) as rec:
        for x, y in _batches([4] * 3):
            with rec.batch((x, y)) as b:
                loss = 0.5 * (net(x).squeeze(-1) - y).square().mean()
                loss.backward()
                nn.utils.clip_grad_norm_(net.parameters(), 1e-2)
                opt.step()
                opt.zero_grad()  # before the step ends: the probe read .grad at opt.step
                b.loss(loss)
    run = open_run(tmp_path / "r.h5")
    rows = run.series(G)
    np.testing.assert_allclose(rows[names.GRADIENT_NORM_PER_TENSOR], handed, rtol=1e-6)
    assert set(rows.values) == {names.GRADIENT_NORM, names.GRADIENT_NORM_PER_TENSOR}
    assert any("plain loop has no point" in e.message for e in run.events() if e.probe == G)


class ManualLeastSquares(LeastSquares):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        opt.step()


def test_manual_optimization_steps_aside_with_the_reason(tmp_path, quiet_trainer):
    run = _fit(
        ManualLeastSquares(),
        DataLoader(_batches([4] * 2), batch_size=None),
        [GradientStats()],
        tmp_path / "r.h5",
        quiet_trainer,
        max_steps=2,
    )
    assert G not in run.groups
    (event,) = [e for e in run.events() if e.probe == G]
    assert event.kind == "disabled" and "manual optimization" in event.message


def test_the_hugging_face_trainer_records_the_norms_after_its_clipping(tmp_path):
    from tests.test_huggingface import train

    path = tmp_path / "r.h5"
    train(tmp_path, [DynamicsCallback(path, [GradientStats()])], max_grad_norm=1e-3)
    run = open_run(path)
    rows = run.series(G)
    assert set(rows.values) == {names.GRADIENT_NORM, names.GRADIENT_NORM_PER_TENSOR}
    np.testing.assert_allclose(rows[names.GRADIENT_NORM], 1e-3, rtol=1e-3)  # clipped to it
    assert any("huggingface loop has no point" in e.message for e in run.events() if e.probe == G)
