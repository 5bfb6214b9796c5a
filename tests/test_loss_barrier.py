"""Loss barriers between runs in ``dynamics compare``: closed-form line losses, ends equal to
the trained models' losses (buffers included), and the page as a user gets it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dynamics import open_run
from dynamics.analysis.measures.loss_barrier import load_batch, loss_barriers
from dynamics.analysis.pages.run_comparison import write_comparison
from dynamics.callbacks import (
    DynamicsRecorder,
    GradientPlane,
    ParameterDisplacement,
    TrainingLoss,
)
from dynamics.cli import main
from dynamics.model.probe_batch import probe_batch
from dynamics.model.rebuild import rebuild_module
from dynamics.passes.loss_rule import module_loss
from dynamics.store import names
from tests.conftest import make_quiet_trainer
from tests.test_rebuild import BatchNormDictCNN
from tests.test_rebuild import fit as fit_bn

CURVATURE = np.array([1.0, -2.0, 0.5])  # a saddle: lines between the runs bend down
TARGETS = np.random.default_rng(1).normal(size=(8, 3))
HELD_OUT = np.random.default_rng(2).normal(size=(5, 3))  # another batch for the same loss


class SaddleQuadratic(pl.LightningModule):
    """loss = mean over the batch of ½ Σᵢ dᵢ (wᵢ − xᵢ)²: along any line it is a quadratic in α
    whose coefficients follow from the ends and the batch mean."""

    def __init__(self, lr: float = 0.05, side: float = 1.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        ridge = float(TARGETS[:, 1].astype(np.float32).mean())
        self.w = nn.Parameter(torch.tensor([1.0, ridge + 0.5 * side, 2.0]))
        self.register_buffer("curvature", torch.tensor(CURVATURE, dtype=torch.float32))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return (0.5 * self.curvature * (self.w - x) ** 2).sum(1).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.tensor(TARGETS, dtype=torch.float32)), batch_size=8)


def closed_form(
    start: np.ndarray, end: np.ndarray, alphas: np.ndarray, batch: np.ndarray = TARGETS
) -> np.ndarray:
    """L(α) = a α² + b α + c on the line start + α (end − start), for the batch ``batch``."""
    x = batch.astype(np.float32).astype(np.float64)
    delta, offset = end - start, start - x.mean(0)
    a = 0.5 * np.sum(CURVATURE * delta**2)
    b = np.sum(CURVATURE * delta * offset)
    c = np.mean(0.5 * np.sum(CURVATURE * (start - x) ** 2, axis=1))
    return a * alphas**2 + b * alphas + c


class Pickled:
    """An object a batch file must not hold."""


def save(path: Path, batch) -> Path:
    torch.save(batch, path)
    return path


def held_out_file(folder: Path) -> Path:
    return save(folder / "held.pt", (torch.tensor(HELD_OUT, dtype=torch.float32),))


def saddle_runs(folder):
    runs = []
    # Started on either side of the ridge along the negative curvature, the runs roll down
    # opposite sides of it: the line between their ends climbs over it.
    for name, lr, side in (("slow", 0.05, 1.0), ("fast", 0.2, -1.0)):
        trainer = make_quiet_trainer(
            max_steps=5,
            callbacks=[
                DynamicsRecorder(
                    folder / f"{name}.h5",
                    [TrainingLoss(), ParameterDisplacement(), GradientPlane()],
                )
            ],
        )
        trainer.fit(SaddleQuadratic(lr, side))
        runs.append(open_run(folder / f"{name}.h5"))
    return runs


def test_line_losses_are_the_closed_form_quadratic(tmp_path):
    runs = saddle_runs(tmp_path)
    barriers = loss_barriers(runs, ["slow", "fast"], points=11, trust_recorded_model=True)
    assert not barriers.remarks
    lines = {line.name: line for line in barriers.lines}
    assert set(lines) == {"θ0 → θT (slow)", "θ0 → θT (fast)", "θT(slow) → θT(fast)"}
    theta = {r.name: (r.vector(names.THETA0), r.vector(names.THETA_FINAL)) for r in runs}
    ends = {
        "θ0 → θT (slow)": theta["slow"],
        "θ0 → θT (fast)": theta["fast"],
        "θT(slow) → θT(fast)": (theta["slow"][1], theta["fast"][1]),
    }
    for name, (start, end) in ends.items():
        line = lines[name]
        expected = closed_form(start.astype(np.float64), end.astype(np.float64), line.alphas)
        np.testing.assert_allclose(line.losses, expected, rtol=1e-5, atol=1e-6, err_msg=name)
        barrier = expected.max() - (expected[0] + expected[-1]) / 2
        assert abs(line.barrier - barrier) < 1e-5 * max(1.0, abs(barrier)), name
        # Above the chord, in closed form: a·α² + b·α + c minus its chord is a·α(α − 1),
        # largest at α = 1/2 (−a/4) when it curves down (a < 0), else 0 at the ends.
        # (11 points: α = 1/2 is one of them.) a = 2·(f(0) + f(1) − 2·f(1/2)).
        f0, f_half, f1 = closed_form(
            start.astype(np.float64), end.astype(np.float64), np.array([0.0, 0.5, 1.0])
        )
        chord_height = max(-2 * (f0 + f1 - 2 * f_half) / 4, 0.0)
        assert abs(line.above_chord - chord_height) < 1e-5 * max(1.0, chord_height), name
    between = lines["θT(slow) → θT(fast)"]
    assert between.barrier > 0.1 and 0 < between.peak_alpha < 1  # a real bump, inside


def test_held_out_lines_are_the_closed_form_quadratic_of_that_batch(tmp_path):
    """Every line on the held-out batch, not the stored probe batches: the closed form of
    HELD_OUT, which differs from that of the probe batch TARGETS."""
    runs = saddle_runs(tmp_path)
    held_out = load_batch(held_out_file(tmp_path))
    assert held_out.name == "held-out batch held.pt (5 samples)"
    barriers = loss_barriers(
        runs, ["slow", "fast"], points=11, trust_recorded_model=True, held_out=held_out
    )
    assert not barriers.remarks and len(barriers.lines) == 3
    theta = {r.name: (r.vector(names.THETA0), r.vector(names.THETA_FINAL)) for r in runs}
    ends = {
        "θ0 → θT (slow)": theta["slow"],
        "θ0 → θT (fast)": theta["fast"],
        "θT(slow) → θT(fast)": (theta["slow"][1], theta["fast"][1]),
    }
    for line in barriers.lines:
        start, end = (v.astype(np.float64) for v in ends[line.name])
        expected = closed_form(start, end, line.alphas, HELD_OUT)
        np.testing.assert_allclose(line.losses, expected, rtol=1e-5, atol=1e-6, err_msg=line.name)
        assert np.max(np.abs(expected - closed_form(start, end, line.alphas))) > 0.05
        barrier = expected.max() - (expected[0] + expected[-1]) / 2
        assert abs(line.barrier - barrier) < 1e-5 * max(1.0, abs(barrier)), line.name
        assert line.batch == held_out.name


@pytest.fixture(scope="module")
def trained_bn(tmp_path_factory):
    """Two BatchNorm CNNs with dict batches at two learning rates: {name: (module, run)}."""
    folder = tmp_path_factory.mktemp("bn")
    trained = {}
    for name, lr, seed in (("slow", 0.05, 1), ("fast", 0.3, 2)):
        torch.manual_seed(3)
        module = BatchNormDictCNN(lr=lr, data_seed=seed)
        trained[name] = (module.eval(), fit_bn(module, folder / f"{name}.h5"))
    return trained


def test_ends_are_the_trained_models_losses_with_their_own_buffers(trained_bn):
    """BatchNorm: each end is evaluated with its run's final running statistics, so it equals
    the trained model's eval loss; a line between the runs is on the reference's probe batch."""
    trained = trained_bn
    runs = [trained["slow"][1], trained["fast"][1]]
    barriers = loss_barriers(runs, ["slow", "fast"], points=5, trust_recorded_model=True)
    lines = {line.name: line for line in barriers.lines}
    batches = {name: probe_batch(run) for name, (_, run) in trained.items()}

    def loss(model: str, batch: str) -> float:
        with torch.no_grad():
            return module_loss(trained[model][0], batches[batch]).item()

    np.testing.assert_allclose(lines["θ0 → θT (slow)"].losses[-1], loss("slow", "slow"), rtol=1e-6)
    np.testing.assert_allclose(lines["θ0 → θT (fast)"].losses[-1], loss("fast", "fast"), rtol=1e-6)
    between = lines["θT(slow) → θT(fast)"].losses
    np.testing.assert_allclose(
        [between[0], between[-1]], [loss("slow", "slow"), loss("fast", "slow")], rtol=1e-6
    )
    assert "stored state nearest" in lines["θT(slow) → θT(fast)"].buffers
    assert lines["θ0 → θT (fast)"].batch == "stored probe batch of fast (12 samples)"
    assert lines["θT(slow) → θT(fast)"].batch == "stored probe batch of slow (12 samples)"


def test_held_out_dict_batch_ends_are_the_models_losses_on_it(trained_bn, tmp_path):
    """A dict batch saved with torch.save: θ0's end is the rebuilt θ0 model's loss on it, each
    θT end the trained model's, with their own buffers."""
    generator = torch.Generator().manual_seed(5)
    batch = {
        "image": torch.randn(7, 1, 6, 6, generator=generator),
        "label": torch.randint(0, 3, (7,), generator=generator),
    }
    held_out = load_batch(save(tmp_path / "dict.pt", batch))
    assert held_out.name == "held-out batch dict.pt (7 samples)"
    runs = [trained_bn["slow"][1], trained_bn["fast"][1]]
    barriers = loss_barriers(
        runs, ["slow", "fast"], points=3, trust_recorded_model=True, held_out=held_out
    )
    lines = {line.name: line for line in barriers.lines}

    def loss(module) -> float:
        with torch.no_grad():
            return module_loss(module.eval(), batch).item()

    slow, fast = (trained_bn[name][0] for name in ("slow", "fast"))
    start = loss(rebuild_module(runs[0], trust_recorded_model=True))
    np.testing.assert_allclose(
        lines["θ0 → θT (slow)"].losses[[0, -1]], [start, loss(slow)], rtol=1e-6
    )
    np.testing.assert_allclose(
        lines["θT(slow) → θT(fast)"].losses[[0, -1]], [loss(slow), loss(fast)], rtol=1e-6
    )
    # Not the probe batch's losses.
    assert abs(loss(slow) - module_loss(slow, probe_batch(runs[0])).item()) > 1e-3


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        (
            {"image": torch.zeros(4, 1, 6, 6)},
            "cannot take the held-out batch batch.pt (4 samples): KeyError: 'label'",
        ),
        (
            [torch.zeros(4, 1, 6, 6), torch.zeros(4, dtype=torch.long)],
            "cannot take the held-out batch batch.pt (4 samples): TypeError",
        ),
    ],
)
def test_cli_refuses_a_held_out_batch_the_dict_model_cannot_read(tmp_path, capsys, batch, message):
    """A dict-batch model handed a dict without a key its training step reads (KeyError) or a
    list: one line, exit 2, nothing written (the KeyError was a traceback, exit 1)."""
    runs = []
    for name, lr in (("slow", 0.05), ("fast", 0.3)):
        path = tmp_path / f"{name}.h5"
        probes = [TrainingLoss(), ParameterDisplacement(snapshot_budget_mb=0)]
        torch.manual_seed(3)
        trainer = make_quiet_trainer(max_steps=2, callbacks=[DynamicsRecorder(path, probes)])
        trainer.fit(BatchNormDictCNN(lr=lr))
        runs.append(str(path))
    out = tmp_path / "page.html"
    out.write_text("the user's page")
    path = save(tmp_path / "batch.pt", batch)
    argv = ["compare", *runs, "-o", str(out), "--overwrite", "--trust-recorded-model"]
    assert main([*argv, "--barrier-points", "3", "--barrier-batch", str(path)]) == 2
    stderr = capsys.readouterr().err
    assert stderr.count("\n") == 1 and message in stderr, stderr
    assert out.read_text() == "the user's page"


def test_cli_never_writes_the_page_over_the_held_out_batch(tmp_path, capsys):
    """``-o`` naming the batch file, even with --overwrite: one line, exit 2, the batch kept
    (it was replaced by the page)."""
    runs = [str(run.path) for run in saddle_runs(tmp_path)]
    held = held_out_file(tmp_path)
    content = held.read_bytes()
    model = f"{Path(__file__).resolve()}:SaddleQuadratic"
    argv = ["compare", *runs, "--model", model, "--barrier-batch", str(held)]
    assert main([*argv, "-o", str(held), "--overwrite"]) == 2
    stderr = capsys.readouterr().err
    assert stderr == f"dynamics: error: {held} is one of the input files; choose another output\n"
    assert held.read_bytes() == content


@pytest.mark.parametrize("held_out", [False, True])
@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("missing.py:SaddleQuadratic", "--model missing.py:SaddleQuadratic: no such file"),
        ("{this}:SaddleQuadratik", ":SaddleQuadratik: {this} has no SaddleQuadratik"),
    ],
)
def test_cli_refuses_a_model_it_cannot_find(
    tmp_path, capsys, monkeypatch, model, message, held_out
):
    """A --model naming no file or no class is the user's input: one line, exit 2, the page
    left as it was (it was a remark per run on a page written with exit 0)."""
    this = str(Path(__file__).resolve())
    runs = [str(run.path) for run in saddle_runs(tmp_path)]
    out = tmp_path / "page.html"
    out.write_text("the user's page")
    monkeypatch.chdir(tmp_path)
    argv = ["compare", *runs, "-o", str(out), "--overwrite", "--model", model.format(this=this)]
    if held_out:
        argv += ["--barrier-batch", str(held_out_file(tmp_path))]
    assert main(argv) == 2
    stderr = capsys.readouterr().err
    assert stderr.count("\n") == 1 and message.format(this=this) in stderr, stderr
    assert out.read_text() == "the user's page"


def test_compare_page_shows_the_barriers_of_rebuildable_runs(demo, dynamics):
    folder, _ = demo
    runs = folder / "runs"
    out = folder / "barrier.html"
    result = dynamics(
        "compare", runs / "unshifted.h5", runs / "shifted.h5", "-o", out, "--overwrite"
    )
    assert result.returncode == 0, result.stderr
    page = out.read_text()
    assert "Loss barriers" in page and "θ0 → θT (shifted)" in page
    assert "Loss along straight lines between parameters" in page
    assert "no loss barrier" not in page
    # A shifted network computes another function: no line joins the two θT in one.
    assert "no θT line unshifted → shifted: their models differ in submodules" in page


def test_compare_says_in_one_line_why_there_is_no_barrier(tmp_path):
    """Classes of a test module are not imported without the user's word: the page says so and
    the comparison is written anyway."""
    runs = saddle_runs(tmp_path)
    page = write_comparison([r.path for r in runs], tmp_path / "page.html").path.read_text()
    assert "Loss barriers" in page
    assert page.count("no loss barrier for") == 2
    assert "outside the installed packages" in page


def test_runs_without_a_probe_batch_get_one_line_or_the_held_out_lines(tmp_path):
    paths = []
    for name, lr in (("slow", 0.05), ("fast", 0.2)):
        recorder = DynamicsRecorder(
            tmp_path / f"{name}.h5", [TrainingLoss(), ParameterDisplacement()]
        )
        make_quiet_trainer(max_steps=2, callbacks=[recorder]).fit(SaddleQuadratic(lr))
        paths.append(tmp_path / f"{name}.h5")
    page = write_comparison(paths, tmp_path / "page.html").path.read_text()
    assert page.count("no loss barrier") == 1
    assert (
        "no loss barrier for slow, fast: no probe batch (GradientPlane records it) stored" in page
    )
    held_out = load_batch(held_out_file(tmp_path))
    page = write_comparison(
        paths,
        tmp_path / "held.html",
        trust_recorded_model=True,
        barrier_batch=held_out,
    ).path.read_text()
    assert "no loss barrier" not in page and "θT(slow) → θT(fast)" in page
    assert "held-out batch held.pt (5 samples)" in page


def test_cli_compare_rebuilds_a_script_model_given_with_model(tmp_path, dynamics, one_line_error):
    """A user's model outside the installed packages: named with --model path/file.py:Class."""
    runs = saddle_runs(tmp_path)
    out = tmp_path / "page.html"
    model = f"{Path(__file__).resolve()}:SaddleQuadratic"
    args = ("compare", runs[0].path, runs[1].path, "-o", out, "--model", model)
    result = dynamics(*args, "--barrier-points", "5")
    assert result.returncode == 0, result.stderr
    page = out.read_text()
    assert "θT(slow) → θT(fast)" in page and "no loss barrier" not in page
    one_line_error(dynamics(*args, "--overwrite", "--barrier-points", "1"))


def test_cli_compare_on_a_held_out_batch(tmp_path, dynamics):
    runs = saddle_runs(tmp_path)
    out = tmp_path / "page.html"
    model = f"{Path(__file__).resolve()}:SaddleQuadratic"
    held = held_out_file(tmp_path)
    args = ("compare", runs[0].path, runs[1].path, "-o", out, "--model", model)
    result = dynamics(*args, "--barrier-batch", held, "--barrier-points", "5")
    assert result.returncode == 0, result.stderr
    page = out.read_text()
    assert "θT(slow) → θT(fast)" in page and "no loss barrier" not in page
    assert page.count("held-out batch held.pt (5 samples)") >= 3  # a row per line, the figure
    assert "stored probe batch of" not in page


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ("missing", "no such file"),
        (Pickled(), "refused, it holds a pickled tests.test_loss_barrier.Pickled"),
        ({"n": 3, "sizes": torch.Size([5, 3])}, "holds no tensor"),
        ([torch.zeros(5, 3), torch.device("cpu")], "holds a torch.device"),
        ("text", "not a file torch.save wrote"),
        (
            (torch.zeros(5, 4),),
            "slow.h5: the rebuilt model cannot take the held-out batch batch.pt",
        ),
        ("points 0", "--barrier-batch: no loss barrier is evaluated with --barrier-points 0"),
        # A mean over no samples is NaN: a page of NaN barriers, not a measurement.
        ((torch.zeros(0, 3),), "holds an empty tensor (shapes (0, 3))"),
    ],
)
def test_cli_refuses_a_bad_held_out_batch_and_changes_nothing(tmp_path, capsys, batch, message):
    runs = [run.path for run in saddle_runs(tmp_path)]
    out = tmp_path / "page.html"
    model = f"{Path(__file__).resolve()}:SaddleQuadratic"
    argv = ["compare", *map(str, runs), "-o", str(out), "--model", model, "--barrier-points", "5"]
    assert main(argv) == 0
    capsys.readouterr()
    before = {path: path.read_bytes() for path in [*runs, out]}
    path = tmp_path / "batch.pt"
    if batch == "text":
        path.write_text("x, y\n1, 2\n")
    elif batch == "points 0":
        held_out_file(tmp_path).rename(path)
        argv += ["--barrier-points", "0"]
    elif batch != "missing":
        save(path, batch)
    assert main([*argv, "--overwrite", "--barrier-batch", str(path)]) == 2
    stderr = capsys.readouterr().err
    assert stderr.count("\n") == 1 and message in stderr, stderr
    assert all(path.read_bytes() == content for path, content in before.items())
