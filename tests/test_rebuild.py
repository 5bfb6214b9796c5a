"""Rebuilding a run's model offline: buffers, init args, models that do not import, dict
batches, and ``Run.load_into`` (issue 10).

The models are defined here, in a test file that is no package: a ``dynamics`` process started
elsewhere can only reach them through ``--model path/to/test_rebuild.py:Class``.
"""

from __future__ import annotations

import collections
import sys
import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dynamics import cli, open_run
from dynamics.callbacks import DynamicsRecorder, GradientPlane, ParameterDisplacement
from dynamics.errors import DynamicsError, ParameterError
from dynamics.geometry.nearest_buffers import NearestBuffers
from dynamics.model import load_into
from dynamics.model.probe_batch import probe_batch
from dynamics.model.rebuild import rebuild_module
from dynamics.params.batch_tree import flatten_batch, named_tuple_classes, unflatten_batch
from dynamics.params.layout import BufferLayout, ParameterLayout
from dynamics.passes.loss_rule import module_loss
from dynamics.store import names

THIS_FILE = Path(__file__).resolve()
Pair = collections.namedtuple("Pair", ["x", "y"])


class DictDigits(Dataset):
    """6×6 one-channel images whose class is set by a bright quadrant, as dict items."""

    def __init__(self, n: int = 48) -> None:
        generator = torch.Generator().manual_seed(0)
        self.y = torch.randint(0, 3, (n,), generator=generator)
        self.x = torch.randn(n, 1, 6, 6, generator=generator) * 0.5 + 2.0
        for i, label in enumerate(self.y.tolist()):
            self.x[i, 0, 3 * (label % 2) :, 2 * label :] += 2.0

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"image": self.x[i], "label": self.y[i]}


class BatchNormDictCNN(pl.LightningModule):
    """Conv → BatchNorm → ReLU → Linear; its training step reads a dict batch."""

    def __init__(self, channels: int = 4, lr: float = 0.2, data_seed: int = 1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.conv = nn.Conv2d(1, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels, momentum=0.5)
        self.head = nn.Linear(channels * 36, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.norm(self.conv(x))).flatten(1))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch["image"]), batch["label"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(self.hparams.data_seed)
        return DataLoader(DictDigits(), batch_size=12, shuffle=True, generator=generator)


class UnsavedArgsMLP(pl.LightningModule):
    """A module that does not call ``save_hyperparameters``: its init args are not recorded."""

    def __init__(self, width: int = 4, label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.label_smoothing = label_smoothing
        self.body = nn.Sequential(nn.Linear(5, width), nn.Tanh(), nn.Linear(width, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.body(x), y, label_smoothing=self.label_smoothing)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(32, 5, generator=generator)
        y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
        return DataLoader(list(zip(x, y)), batch_size=8)


def fit(module, path, steps=6, snapshot_every=2):
    torch.manual_seed(0)
    probes = [ParameterDisplacement(snapshot_every_n_steps=snapshot_every), GradientPlane()]
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[DynamicsRecorder(path, probes)],
    )
    trainer.fit(module)
    return open_run(path)


def buffers_of(module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in module.named_buffers()}


@pytest.fixture(scope="module")
def bn_runs(tmp_path_factory):
    """Two BatchNorm CNNs from one θ0, at two learning rates on differently shuffled data:
    {name: (trained module, run)}."""
    folder = tmp_path_factory.mktemp("bn")
    runs = {}
    for name, lr, seed in (("slow", 0.05, 1), ("fast", 0.3, 2)):
        torch.manual_seed(3)
        module = BatchNormDictCNN(lr=lr, data_seed=seed)
        runs[name] = (module, fit(module, folder / f"{name}.h5"))
    return folder, runs


# ---------------------------------------------------------------------------------------------
# 1. Buffers


def test_buffers_are_stored_with_theta0_snapshots_and_theta_final(bn_runs):
    _, runs = bn_runs
    module, run = runs["fast"]
    assert run.buffer_layout == BufferLayout.of(module)
    states = run.stored_states()
    assert [(s.source, s.step) for s in states] == [
        ("theta0", 0),
        ("snapshot", 0),
        ("snapshot", 2),
        ("snapshot", 4),
        ("theta_final", 6),
    ]
    initial = states[0].buffers["float32"]
    np.testing.assert_array_equal(initial, np.r_[np.zeros(4), np.ones(4)])  # mean 0, var 1
    assert states[-1].buffers["int64"].tolist() == [6]  # num_batches_tracked
    np.testing.assert_array_equal(
        states[-1].buffers["float32"],
        torch.cat([module.norm.running_mean, module.norm.running_var]).numpy(),
    )
    assert [int(s.buffers["int64"][0]) for s in states[1:4]] == [0, 2, 4]  # before each step
    settings = next(p["settings"] for p in run.attrs["probes"] if p["name"] == "displacement")
    parameters = ParameterLayout.of(module).size
    assert settings["snapshots"]["bytes_each"] == 4 * parameters + 4 * 8 + 8


def test_loss_at_theta_final_is_the_trained_models_eval_loss(bn_runs):
    """The rebuilt model at θT, with θT's buffers, is the model training ended with."""
    _, runs = bn_runs
    module, run = runs["fast"]
    batch = probe_batch(run)
    with torch.no_grad():
        trained = module_loss(module.eval(), batch).item()
    rebuilt = rebuild_module(run, trust_recorded_model=True)  # a class of this test module
    load_into(run, rebuilt)
    with torch.no_grad():
        assert module_loss(rebuilt.eval(), batch).item() == trained
    # Without the buffers (what a parameters-only rebuild gave) the loss is another one.
    rebuilt.norm.reset_running_stats()
    with torch.no_grad():
        assert abs(module_loss(rebuilt, batch).item() - trained) > 1e-3


def test_plane_through_a_model_file_matches_direct_evaluation(bn_runs, dynamics, one_line_error):
    """`dynamics plane --model file.py:Class` on BatchNorm CNNs reading dict batches: the loss
    at θT is the trained model's eval loss, and every heatmap value is a direct evaluation of
    the rebuilt model with the buffers of the stored state nearest to the point."""
    folder, runs = bn_runs
    paths = [folder / "slow.h5", folder / "fast.h5"]
    out = folder / "plane.html"
    # A test module is no installed package: refused without the user's word, and started
    # elsewhere, trusted or not, the process cannot import it by its recorded path.
    refused = dynamics("plane", *paths, "-o", out, "--grid", "3", cwd=folder)
    one_line_error(refused)
    assert "outside the installed packages" in refused.stderr
    assert "--model path/to/file.py:BatchNormDictCNN" in refused.stderr
    trusted = [*paths, "-o", out, "--grid", "3", "--trust-recorded-model"]
    refused = dynamics("plane", *trusted, cwd=folder)
    one_line_error(refused)
    assert "cannot import model" in refused.stderr and "BatchNormDictCNN" in refused.stderr
    assert "--model path/to/file.py:BatchNormDictCNN" in refused.stderr
    model = f"{THIS_FILE}:BatchNormDictCNN"
    result = dynamics(
        "plane", *paths, "-o", out, "--grid", "3", "--no-progress", "--model", model, cwd=folder
    )
    assert result.returncode == 0, result.stderr
    module, run = runs["fast"]
    batch = probe_batch(run)
    with torch.no_grad():
        trained = module_loss(module.eval(), batch).item()
    states = run.stored_states()
    thetas = np.stack([s.theta for s in states]).astype(np.float64)
    rebuilt = rebuild_module(run, model=model)
    layout = ParameterLayout.of(rebuilt)
    with h5py.File(folder / "plane.plane.h5") as views:
        view = views["view1"]  # the initial-gradient plane under the fast run's model
        assert view.attrs["run"] == "fast"
        assert "nearest to it in parameter space" in view.attrs["buffers"]
        trajectory = view["trajectory/fast"]
        assert trajectory["loss"][-1] == pytest.approx(trained, rel=1e-6, abs=0)
        alphas, betas, losses = view["alphas"][:], view["betas"][:], view["losses"][:]
        u, v = view["u"][:], view["v"][:]
        for i, j in [(0, 0), (1, 1), (2, 2), (0, 2)]:
            theta = thetas[0] + alphas[j] * u + betas[i] * v
            nearest = states[int(np.argmin(((thetas - theta) ** 2).sum(1)))]
            for p, chunk in zip(
                layout.parameters(rebuilt), layout.split(torch.from_numpy(theta).float())
            ):
                p.data.copy_(chunk)
            run.buffer_layout.load(rebuilt, nearest.buffers)
            with torch.no_grad():
                direct = module_loss(rebuilt.eval(), batch).item()
            assert losses[i, j] == pytest.approx(direct, rel=1e-5)
    assert "<p class='note'>Buffers: fast: each point uses the buffers" in out.read_text()


# ---------------------------------------------------------------------------------------------
# 11. Run.load_into


def test_load_into_loads_the_nearest_stored_state(bn_runs):
    _, runs = bn_runs
    module, run = runs["slow"]
    fresh = BatchNormDictCNN(lr=0.05)
    layout = ParameterLayout.of(fresh)
    state = load_into(run, fresh, 3)  # snapshots at 0, 2, 4: the earlier on a tie
    assert (state.source, state.step) == ("snapshot", 2)
    np.testing.assert_array_equal(
        torch.cat([p.detach().reshape(-1) for p in fresh.parameters()]), state.theta
    )
    assert fresh.norm.num_batches_tracked.item() == 2
    assert load_into(run, fresh, 0).source == "theta0"
    assert torch.equal(fresh.norm.running_var, torch.ones(4))
    state = load_into(run, fresh)  # θT
    assert (state.source, state.step) == ("theta_final", 6)
    for name, buffer in buffers_of(module).items():
        assert torch.equal(dict(fresh.named_buffers())[name], buffer), name
    for p, q in zip(layout.parameters(fresh), layout.parameters(module)):
        assert torch.equal(p, q)
    with pytest.raises(
        DynamicsError, match=r"submodules differ from the run's \(conv: Conv2d\(1, 4"
    ):
        load_into(run, BatchNormDictCNN(channels=5))


def test_a_file_without_buffers_says_so_and_loads_parameters(bn_runs, tmp_path):
    folder, runs = bn_runs
    module, run = runs["slow"]
    old = tmp_path / "old.h5"
    old.write_bytes((folder / "slow.h5").read_bytes())
    with h5py.File(old, "r+") as file:  # as written before buffers were stored
        del file.attrs[names.ATTR_BUFFERS]
        for name in list(file["vectors"]):
            if "buffers" in name or name == names.THETA_FINAL_STEP:
                del file["vectors"][name]
    fresh = BatchNormDictCNN()
    with pytest.warns(UserWarning, match="no buffers recorded"):
        state = load_into(open_run(old), fresh)
    # θT's step was not stored either: estimated as one past the last recorded step.
    assert state.buffers is None and state.step == 5
    assert torch.equal(fresh.norm.running_var, torch.ones(4))  # its own, not guessed
    buffers = NearestBuffers.of_run(open_run(old), fresh)  # what the plane's page states
    assert "slow: no buffers recorded" in buffers.note
    assert buffers.nearest(torch.from_numpy(state.theta)) is None
    layout = ParameterLayout.of(fresh)
    for p, q in zip(layout.parameters(fresh), layout.parameters(module)):
        assert torch.equal(p, q)


# ---------------------------------------------------------------------------------------------
# 2. Init args that were not recorded


def test_unrecorded_init_args_are_refused_and_can_be_given(tmp_path, dynamics, one_line_error):
    torch.manual_seed(0)
    module = UnsavedArgsMLP(width=6, label_smoothing=0.1)
    run = fit(module, tmp_path / "a.h5", steps=4)
    record = run.attrs[names.ATTR_MODULE]
    assert record["init_args"] == {}
    assert record["unrecorded_init_args"] == ["label_smoothing", "width"]
    with pytest.raises(DynamicsError, match="init args label_smoothing, width of UnsavedArgsMLP"):
        rebuild_module(run, trust_recorded_model=True)
    rebuilt = rebuild_module(
        run, init_args={"width": 6, "label_smoothing": 0.1}, trust_recorded_model=True
    )
    load_into(run, rebuilt)
    batch = probe_batch(run)
    with torch.no_grad():
        assert module_loss(rebuilt.eval(), batch).item() == module_loss(module.eval(), batch).item()
    with pytest.raises(DynamicsError, match="were these its init args"):
        rebuild_module(
            run, init_args={"width": 5, "label_smoothing": 0.1}, trust_recorded_model=True
        )
    # The CLI, run from this folder and trusting the file: the module imports from the
    # working directory.
    torch.manual_seed(0)
    fit(UnsavedArgsMLP(width=6, label_smoothing=0.3), tmp_path / "b.h5", steps=4)
    args = ["plane", tmp_path / "a.h5", tmp_path / "b.h5", "--grid", "2", "--no-progress"]
    args.append("--trust-recorded-model")
    refused = dynamics(*args, "-o", tmp_path / "x.html", cwd=THIS_FILE.parent.parent)
    one_line_error(refused)
    assert "--init-args" in refused.stderr and "label_smoothing, width" in refused.stderr
    assert not (tmp_path / "x.html").exists()


def test_a_factory_builds_the_model_with_the_given_args_only(tmp_path, monkeypatch):
    torch.manual_seed(0)
    module = UnsavedArgsMLP(width=6)
    run = fit(module, tmp_path / "a.h5", steps=2)
    rebuilt = rebuild_module(run, model=f"{THIS_FILE}:make_unsaved", init_args={"width": 6})
    assert rebuilt.body[0].out_features == 6
    monkeypatch.chdir(THIS_FILE.parent)  # a module of the working directory imports by name
    rebuilt = rebuild_module(run, model="test_rebuild:make_unsaved", init_args={"width": 6})
    assert rebuilt.body[0].out_features == 6
    assert str(THIS_FILE.parent) not in sys.path  # importable while importing only
    with pytest.raises(ParameterError, match="^model must be"):  # the CLI prints --model
        rebuild_module(run, model="no_colon")
    with pytest.raises(DynamicsError, match="no such file"):
        rebuild_module(run, model=f"{tmp_path / 'missing.py'}:X")


def make_unsaved(width: int) -> UnsavedArgsMLP:
    return UnsavedArgsMLP(width=width)


# ---------------------------------------------------------------------------------------------
# 3. A model defined in the training script


def test_a_model_of_the_training_script_is_named_with_its_file(tmp_path):
    class ScriptCNN(BatchNormDictCNN):
        pass

    ScriptCNN.__module__, ScriptCNN.__qualname__ = "__main__", "BatchNormDictCNN"
    torch.manual_seed(0)
    run = fit(ScriptCNN(), tmp_path / "a.h5", steps=2)
    with pytest.raises(DynamicsError, match=r"training script \(__main__\).*pass model path/to/"):
        rebuild_module(run)
    rebuilt = rebuild_module(run, model=f"{THIS_FILE}:BatchNormDictCNN")
    assert type(rebuilt).__name__ == "BatchNormDictCNN"


# ---------------------------------------------------------------------------------------------
# 4. Dict and nested batches


def test_batch_structure_round_trips_exactly():
    t = [torch.arange(3), torch.ones(2, 2), torch.zeros(1)]
    batch = {
        "x": t[0],
        "nested": [(t[1], "label"), {3: t[2], "none": None}],
        "pair": Pair(x=t[0], y=2.5),
    }
    tree, leaves = flatten_batch(batch)
    rebuilt = unflatten_batch(tree, [leaf.clone() for leaf in leaves], named_tuple_classes(batch))
    assert list(rebuilt) == ["x", "nested", "pair"]
    assert torch.equal(rebuilt["x"], t[0]) and rebuilt["nested"][0][1] == "label"
    assert isinstance(rebuilt["nested"][0], tuple) and isinstance(rebuilt["nested"], list)
    assert torch.equal(rebuilt["nested"][1][3], t[2]) and rebuilt["nested"][1]["none"] is None
    assert type(rebuilt["pair"]) is Pair and rebuilt["pair"].y == 2.5
    # From the tree alone (as read from a file): a named tuple of the same name and fields.
    alone = unflatten_batch(tree, leaves)["pair"]
    assert (
        type(alone) is not Pair and type(alone).__name__ == "Pair" and alone._fields == ("x", "y")
    )
    assert torch.equal(alone.x, t[0]) and alone.y == 2.5


def test_a_dict_probe_batch_is_rebuilt_as_a_dict(bn_runs):
    _, runs = bn_runs
    _, run = runs["slow"]
    batch = probe_batch(run)
    assert list(batch) == ["image", "label"]
    first = next(iter(BatchNormDictCNN().train_dataloader()))
    assert torch.equal(batch["image"], first["image"]) and torch.equal(
        batch["label"], first["label"]
    )


def test_an_unsupported_batch_type_is_refused_with_one_line():
    class Custom:
        pass

    tree, _ = flatten_batch({"x": Custom()})
    with pytest.raises(ValueError, match="cannot store"):
        unflatten_batch(tree, [])


def test_recording_buffers_never_perturbs_training(tmp_path):
    def train(recorded: bool):
        torch.manual_seed(3)
        module = BatchNormDictCNN()
        if recorded:
            fit(module, tmp_path / "r.h5", steps=4, snapshot_every=1)
        else:
            torch.manual_seed(0)
            pl.Trainer(
                accelerator="cpu",
                max_steps=4,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
            ).fit(module)
        return module.state_dict()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain, recorded = train(False), train(True)
    for name, value in plain.items():
        assert torch.equal(value, recorded[name]), name


def test_init_args_must_be_a_json_object(tmp_path, capsys):
    for text, message in (("{width: 6}", "is not JSON"), ("[6]", "must be a JSON object")):
        args = ["plane", "a.h5", "b.h5", "-o", str(tmp_path / "x.html"), "--init-args", text]
        assert cli.main(args) == 2
        assert message in capsys.readouterr().err
