"""The recorder under FSDP1 and FSDP2 on two forked gloo processes: the run file's attributes
and the rows of the forward-hook and loss probes equal a DDP run's of the same seed and global
batches, training is unchanged by the recorder, a sharding the file cannot describe (or
DeepSpeed) is refused at fit start in one line, and the offline tools read a sharded run as
they read an unsharded one."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard

from dynamics.analysis.measures.run_comparison import comparability, verdict
from dynamics.callbacks import (
    ActivationBias,
    DynamicsRecorder,
    HiddenStateNorms,
    LoggedMetrics,
    TrainingLoss,
    UnitHealth,
)
from dynamics.errors import DynamicsError
from dynamics.experiments import TeacherStudentData, TeacherStudentModule
from dynamics.experiments.teacher_student.model import ResidualBlock
from dynamics.model.loading import check_frozen_parameters, submodule_differences
from dynamics.params.vectors import parameter_vector, vector_hash
from dynamics.sharding import UnsupportedSharding
from dynamics.store import names, open_run
from tests import sharded
from tests.conftest import run_dynamics

ARCH = dict(width=8, expansion=2, depth=3)
#: A validation run after steps 2 and 4 (LoggedMetrics' rows), and a sanity check before the fit.
FIT = dict(max_steps=4, limit_val_batches=1, val_check_interval=2, check_val_every_n_epoch=None)
#: Attributes that differ between two runs by design (the file's identity and name).
OWN = {names.ATTR_RUN_ID, names.ATTR_RUN_NAME}


class NormedStudent(TeacherStudentModule):
    """The teacher-student model behind a BatchNorm (buffers), its first layer frozen (the
    frozen hash); under ``ModelParallelStrategy`` it shards itself with ``fully_shard``, the
    root too (FSDP2 swaps every class), so that every strategy fits one class."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.bn = nn.BatchNorm1d(self.hparams.width)
        self.student.blocks[0].up.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.student(self.bn(x))

    def dynamics_loss(self, batch):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_model(self) -> None:
        if isinstance(self.trainer.strategy, ModelParallelStrategy):
            for block in self.student.blocks:
                fully_shard(block)
            fully_shard(self.student)
            fully_shard(self)  # the BatchNorm's parameters: the root's own


class HalfSharded(NormedStudent):
    """Under FSDP2, the blocks sharded and the BatchNorm left whole on every rank."""

    def configure_model(self) -> None:
        for block in self.student.blocks:
            fully_shard(block)
        fully_shard(self.student)


def _probes() -> tuple[list, list]:
    """Two recorders' probes: ActivationBias and UnitHealth write groups HiddenStateNorms
    writes too, so they record into a second file of the same fit."""
    first = [TrainingLoss(), HiddenStateNorms(unit_health=True), LoggedMetrics()]
    return first, [ActivationBias(), UnitHealth()]


#: The fits compared with DDP's: FSDP1 as one unit and with each block its own (the names of
#: the blocks' parameters, buffers and modules then pass through FSDP1's wrappers), and FSDP2.
SHARDED = ("fsdp1", "fsdp1_nested", "fsdp2")


def _strategy(name: str):
    if name == "fsdp1_nested":
        return sharded.CPUFSDPStrategy(auto_wrap_policy={ResidualBlock})
    return sharded.strategy(name)


def _fit(name: str, tmp_path, record: bool = True) -> dict:
    torch.manual_seed(0)
    module = NormedStudent(**ARCH)
    final = tmp_path / f"{name}-{record}.pt"
    callbacks = [sharded.FinalParameters(final)]
    if record:
        first, second = _probes()
        callbacks += [
            DynamicsRecorder(tmp_path / f"{name}.h5", first),
            DynamicsRecorder(tmp_path / f"{name}-units.h5", second),
        ]
    data = TeacherStudentData(**ARCH, batch_size=8)
    strategy = _strategy(name)
    sharded.fit(name.removesuffix("_nested"), module, data, callbacks, strategy=strategy, **FIT)
    return torch.load(final)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{strategy: (folder, final parameters)}`` of one recorded fit under each strategy."""
    folder = tmp_path_factory.mktemp("sharded_runs")
    return {name: (folder, _fit(name, folder)) for name in ("ddp", *SHARDED)}


def _attrs(path) -> dict:
    run = open_run(path)
    return {k: v for k, v in run.attrs.items() if k not in OWN}


@pytest.mark.parametrize("name", SHARDED)
def test_the_run_file_describes_the_fit_as_ddp_does(name, runs):
    folder = runs["ddp"][0]
    ddp, got = _attrs(folder / "ddp.h5"), _attrs(runs[name][0] / f"{name}.h5")
    assert got.keys() == ddp.keys()
    for key in ddp:
        assert json.dumps(got[key], sort_keys=True) == json.dumps(ddp[key], sort_keys=True), key
    # what the equality covers: an unsharded layout, a frozen layer, buffers, original classes
    layout = got[names.ATTR_LAYOUT]
    assert layout["shapes"][layout["names"].index("student.blocks.0.down.weight")] == [8, 16]
    assert "student.blocks.0.up.weight" not in layout["names"]
    assert got[names.ATTR_FROZEN_SHA256]
    assert "bn.running_mean" in got[names.ATTR_BUFFERS]["names"]
    assert got[names.ATTR_MODULE]["class_path"].endswith("NormedStudent")
    assert got[names.ATTR_SUBMODULES]["bn"][0] == "torch.nn.modules.batchnorm.BatchNorm1d"
    events = open_run(runs[name][0] / f"{name}.h5").events()
    assert not [e for e in events if e.kind in (names.EVENT_ERROR, names.EVENT_DISABLED)]


@pytest.mark.parametrize("name", SHARDED)
@pytest.mark.parametrize("file", ["{}.h5", "{}-units.h5"])
def test_rows_equal_the_ddp_run(name, file, runs):
    folder = runs["ddp"][0]
    ddp, got = open_run(folder / file.format("ddp")), open_run(folder / file.format(name))
    assert ddp.groups == got.groups and ddp.groups
    for group in ddp.groups:
        want, have = ddp.series(group), got.series(group)
        assert len(want) >= 2 and have.values.keys() == want.values.keys()
        np.testing.assert_array_equal(have.step, want.step)
        for series in want.values:
            assert np.isfinite(want[series]).all(), (group, series)
            np.testing.assert_allclose(have[series], want[series], rtol=1e-5, atol=1e-7)
    if names.HIDDEN_NORMS in ddp.groups:  # rows that training moves: no agreement by accident
        norms = ddp.series(names.HIDDEN_NORMS)[names.HIDDEN_NORM]
        assert not np.allclose(norms[0], norms[-1], rtol=1e-3)


@pytest.mark.parametrize("name", ["fsdp1", "fsdp2"])
def test_training_is_unchanged_by_the_recorder(name, runs, tmp_path):
    recorded = runs[name][1]
    plain = _fit(name, tmp_path, record=False)
    assert recorded.keys() == plain.keys()
    for key in plain:
        assert torch.equal(recorded[key], plain[key]), key


def _refusal(module_class, name: str, tmp_path, **trainer_options) -> str:
    """The one line a fit of ``module_class`` that the recorder refuses ends with."""
    torch.manual_seed(0)
    recorder = DynamicsRecorder(tmp_path / "run.h5", [TrainingLoss()])
    # A rank's exception reaches the test as the launcher's, holding the rank's traceback; the
    # fit ending at all shows that no rank waits in a collective the other never makes.
    with pytest.raises(Exception) as raised:
        data = TeacherStudentData(**ARCH, batch_size=8)
        sharded.fit(name, module_class(**ARCH), data, [recorder], **(FIT | trainer_options))
    last = str(raised.value).strip().splitlines()[-1]
    kind, _, message = last.partition(": ")
    assert kind.endswith(UnsupportedSharding.__name__), last
    assert message.startswith("DynamicsRecorder cannot record this fit: "), message
    assert not (tmp_path / "run.h5").exists()  # refused at fit start, before any file
    return message


def test_fsdp1_without_orig_params_is_refused_at_fit_start(tmp_path):
    # (FSDP itself refuses a frozen layer beside trainable ones there: the plain student)
    strategy = sharded.CPUFSDPStrategy(use_orig_params=False)
    message = _refusal(TeacherStudentModule, "fsdp1", tmp_path, strategy=strategy)
    assert "use_orig_params=True" in message


def test_parameters_partly_sharded_are_refused_at_fit_start(tmp_path):
    message = _refusal(HalfSharded, "fsdp2", tmp_path)
    assert "'bn.weight' is whole on every rank" in message


@pytest.mark.parametrize("name", ["fsdp1", "fsdp2"])
def test_dynamics_info_shows_the_unsharded_layout(name, runs):
    folder = runs[name][0]
    lines = {}
    for run in (name, "ddp"):
        result = run_dynamics("info", folder / f"{run}.h5")
        assert result.returncode == 0, result.stderr
        lines[run] = [line for line in result.stdout.splitlines() if "  parameters " in line]
    assert len(lines[name]) == 1 and lines[name] == lines["ddp"]
    torch.manual_seed(0)
    trainable = [p for p in NormedStudent(**ARCH).parameters() if p.requires_grad]
    size = sum(p.numel() for p in trainable)
    assert f"{size} trainable in {len(trainable)} tensors (θ0 sha256" in lines[name][0]
    assert "frozen ones too" in lines[name][0] and "buffers 17 in 3 tensors" in lines[name][0]


def test_dynamics_compare_finds_the_same_theta0(runs, tmp_path):
    folder = runs["ddp"][0]
    out = tmp_path / "compare.html"
    result = run_dynamics("compare", folder / "fsdp1.h5", folder / "ddp.h5", "-o", out)
    assert result.returncode == 0, result.stderr
    assert out.exists()
    theta0 = open_run(folder / "ddp.h5").theta0_sha256
    assert theta0 and f"sha256 {theta0[:12]}… in both" in out.read_text()
    # every check the comparison makes finds the two runs alike
    checks = comparability(open_run(folder / "ddp.h5"), open_run(folder / "fsdp1.h5"))
    assert verdict(checks) == "no difference in what both runs recorded; not recorded: config"


@pytest.mark.parametrize("name", ["fsdp1", "fsdp2"])
def test_an_unsharded_model_is_the_sharded_runs_model(name, runs):
    # What load_into checks before it loads a stored state (θ0's vector is ParameterDisplacement's)
    run = open_run(runs[name][0] / f"{name}.h5")
    model = NormedStudent(**ARCH)
    assert submodule_differences(run, model) == ""
    check_frozen_parameters(run, model)
    assert vector_hash(parameter_vector(model, run.layout)) == run.theta0_sha256
    with pytest.raises(DynamicsError, match="frozen"):
        check_frozen_parameters(run, NormedStudent(**ARCH, seed=1))
