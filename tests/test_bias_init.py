"""Bias initialization recipes against exact values: priors, mean target, PyTorch's gates."""

import copy
import math

import pytest
import pytorch_lightning as pl
import torch
import yaml
from pytorch_lightning.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dynamics import open_run
from dynamics.analysis.measures.run_setup import setup_rows
from dynamics.bias import BiasSet, init_biases
from dynamics.bias.init import constant, log_odds, lstm_forget_gate, mean_target, normal, zeros
from dynamics.callbacks import DynamicsRecorder, InitBiases, TrainingLoss
from dynamics.errors import DynamicsError
from dynamics.experiments import TeacherStudentModule
from dynamics.params.vectors import parameter_vector, vector_hash


def mlp(outputs: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, outputs))


def biases(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for n, p in model.named_parameters() if n.endswith("bias")]


def test_zeros_and_constant_set_every_bias_and_leave_weights() -> None:
    model = mlp()
    weights = [model[0].weight.detach().clone(), model[2].weight.detach().clone()]
    table = constant(model, 0.01)
    assert table == [BiasSet("0", "bias", "constant 0.01"), BiasSet("2", "bias", "constant 0.01")]
    assert all(torch.equal(b, torch.full_like(b, 0.01)) for b in biases(model))
    assert torch.equal(model[0].weight, weights[0]) and torch.equal(model[2].weight, weights[1])
    zeros(model)
    assert all(torch.equal(b, torch.zeros_like(b)) for b in biases(model))


def test_normal_is_reproducible_and_leaves_the_global_rng_alone() -> None:
    model = mlp()
    torch.manual_seed(123)
    state = torch.get_rng_state()
    normal(model, 0.5, 0.01, seed=7)
    assert torch.equal(torch.get_rng_state(), state)
    expected = torch.randn(5, generator=torch.Generator().manual_seed(7)) * 0.01 + 0.5
    assert torch.equal(model[0].bias.detach(), expected)
    first = biases(model)
    normal(model, 0.5, 0.01, generator=torch.Generator().manual_seed(7))
    assert all(torch.equal(a, b) for a, b in zip(first, biases(model), strict=True))


def test_log_odds_softmax_output_equals_the_priors() -> None:
    model = mlp(3)
    priors = [0.5, 0.3, 0.2]
    assert log_odds(model, priors) == [BiasSet("2", "bias", "log prior (softmax)")]
    assert torch.allclose(
        model[2].bias.softmax(0).double(), torch.tensor(priors, dtype=torch.float64)
    )
    with torch.no_grad():
        model[
            2
        ].weight.zero_()  # the head's weights contribute nothing: the prediction is the prior
    prediction = model(torch.randn(6, 4)).softmax(1)
    assert torch.allclose(prediction, torch.tensor(priors).expand(6, 3))


def test_log_odds_sigmoid_on_a_named_layer() -> None:
    model = nn.Sequential()
    model.add_module("body", nn.Linear(4, 5))
    model.add_module("head", nn.Linear(5, 1))
    model.add_module("other", nn.Linear(1, 1))
    log_odds(model, [0.8, 0.2], layer="head")
    assert model.head.bias.item() == pytest.approx(math.log(0.2 / 0.8))
    assert torch.sigmoid(model.head.bias).item() == pytest.approx(0.2)


def test_log_odds_lowers_the_step0_cross_entropy_to_the_prior_entropy() -> None:
    priors = torch.tensor([0.5, 0.25, 0.125, 0.125])
    labels = torch.tensor([0, 0, 0, 0, 1, 1, 2, 3])  # frequencies exactly the priors
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    model = mlp(4)
    default = nn.functional.cross_entropy(model(x), labels).item()
    with torch.no_grad():
        model[2].weight.zero_()  # the prediction is then the bias alone
    log_odds(model, priors)
    after = nn.functional.cross_entropy(model(x), labels).item()
    entropy = -(priors * priors.log()).sum().item()
    assert after == pytest.approx(entropy, abs=1e-6)
    assert default > after + 0.1  # PyTorch's default init starts near log(4), above the entropy


def test_mean_target_mean_prediction_equals_the_mean_target() -> None:
    torch.manual_seed(0)
    # BatchNorm without affine in training mode: the head's input has zero mean over the batch
    model = nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6, affine=False), nn.Linear(6, 2))
    x = torch.randn(16, 3)
    y = torch.randn(16, 2) * 3 + torch.tensor([10.0, -4.0])
    assert mean_target(model, y) == [BiasSet("2", "bias", "mean target")]
    assert torch.allclose(model[2].bias.detach(), y.mean(0))
    assert torch.allclose(model(x).mean(0), y.mean(0), atol=1e-5)


def test_mean_target_one_output_from_a_vector() -> None:
    model = mlp(1)
    mean_target(model, torch.tensor([1.0, 2.0, 6.0]))
    assert model[2].bias.item() == pytest.approx(3.0)


@pytest.mark.parametrize("value", [1.0, 2.0])
@pytest.mark.parametrize("cell", [False, True])
def test_lstm_forget_gate_changes_only_the_forget_quarter(value: float, cell: bool) -> None:
    torch.manual_seed(0)
    hidden = 3
    lstm = nn.LSTMCell(2, hidden) if cell else nn.LSTM(2, hidden, num_layers=2, bidirectional=True)
    model = nn.Sequential(lstm)
    before = {n: p.detach().clone() for n, p in lstm.named_parameters()}
    table = lstm_forget_gate(model, value)
    pairs = [(n, n.replace("bias_ih", "bias_hh")) for n in before if n.startswith("bias_ih")]
    assert len(pairs) == (1 if cell else 4)
    assert len(table) == 2 * len(pairs)
    params = dict(lstm.named_parameters())
    forget = slice(hidden, 2 * hidden)  # PyTorch's gate order: input, forget, cell, output
    for ih, hh in pairs:
        assert torch.equal(params[ih][forget] + params[hh][forget], torch.full((hidden,), value))
        for name in (ih, hh):
            for gate in (slice(0, hidden), slice(2 * hidden, 4 * hidden)):
                assert torch.equal(params[name][gate], before[name][gate])
    for name, p in params.items():
        if not name.startswith("bias"):
            assert torch.equal(p, before[name])


def test_lstm_forget_gate_opens_the_gate_in_the_forward_pass() -> None:
    # With zero weights the forget gate is sigmoid(value) exactly: the cell state decays by it
    lstm = nn.LSTMCell(2, 3)
    with torch.no_grad():
        for p in lstm.parameters():
            p.zero_()
        lstm.bias_ih[6:9] = 1.0  # cell gate g = tanh(1), input gate sigmoid(0) = 1/2
    lstm_forget_gate(lstm, 2.0)
    c0 = torch.ones(1, 3)
    _, c1 = lstm(torch.zeros(1, 2), (torch.zeros(1, 3), c0))
    expected = torch.sigmoid(torch.tensor(2.0)) * c0 + 0.5 * math.tanh(1.0)
    assert torch.allclose(c1, expected)


def test_init_biases_by_name() -> None:
    model = mlp(2)
    init_biases(model, "log_odds", priors=[0.25, 0.75])
    assert model[2].bias.tolist() == pytest.approx([math.log(0.25), math.log(0.75)])
    init_biases(model, "constant", value=0.5)
    assert model[0].bias.tolist() == [0.5] * 5


def deep_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)
    )


def test_generic_recipes_choose_modules_by_name_pattern() -> None:
    """``include``/``exclude`` patterns, as shift_activations reads them: the hidden layers'
    biases only (the output layer and the normalization's shift left as they were)."""
    model = deep_mlp()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    table = constant(model, 0.01, include=["0", "3"])
    assert [(row.module, row.parameter) for row in table] == [("0", "bias"), ("3", "bias")]
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {"0.bias", "3.bias"}
    assert torch.equal(model[3].bias, torch.full((4,), 0.01))
    model = deep_mlp()
    table = zeros(model, exclude=["5", "1"])
    assert [row.module for row in table] == ["0", "3"]
    assert torch.equal(model[5].bias, before["5.bias"]) and not model[0].bias.any()
    model = deep_mlp()
    table = normal(model, 0.0, 0.1, seed=3, include=["*"], exclude=["1"])
    assert [row.module for row in table] == ["0", "3", "5"]
    draws = torch.Generator().manual_seed(3)
    for name in ("0", "3", "5"):  # drawn in module order from the one generator
        expected = torch.randn(model.get_submodule(name).bias.shape, generator=draws) * 0.1
        assert torch.equal(model.get_submodule(name).bias.detach(), expected)
    assert torch.equal(model[1].bias, before["1.bias"])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: init_biases(mlp(), "ones"), "unknown bias recipe 'ones'"),
        (lambda: zeros(nn.Linear(2, 2, bias=False)), "has no bias parameters"),
        (lambda: log_odds(mlp(3), [0.5, 0.5]), "2 class priors for the output layer '2' with 3"),
        (lambda: log_odds(mlp(2), [0.5, 0.6]), "must sum to 1"),
        (lambda: log_odds(mlp(2), [1.0, 0.0]), "must be positive"),
        (lambda: log_odds(mlp(2), [1.0]), "at least 2 class priors"),
        (lambda: log_odds(mlp(2), [0.5, 0.5], layer="head"), "no module named 'head'"),
        (lambda: log_odds(mlp(2), [0.5, 0.5], layer="1"), "is a ReLU, not an nn.Linear"),
        (lambda: log_odds(nn.Linear(2, 2, bias=False), [0.5, 0.5]), "has no bias"),
        (lambda: log_odds(nn.ReLU(), [0.5, 0.5]), "no nn.Linear output layer"),
        (lambda: mean_target(mlp(2), torch.zeros(4, 3)), "targets with 3 outputs"),
        (lambda: lstm_forget_gate(mlp()), "no nn.LSTM or nn.LSTMCell"),
        (lambda: lstm_forget_gate(nn.LSTM(2, 2, bias=False)), "has no biases"),
        (lambda: normal(mlp(), std=-1.0), "std >= 0"),
        (lambda: zeros(mlp(), include=["hidden.*"]), r"pattern\(s\) \['hidden.\*'\] match no"),
        (lambda: constant(mlp(), 0.1, include=["1"]), "no bias parameters .* patterns choose"),
    ],
)
def test_bad_input_one_clear_error(call, message: str) -> None:
    with pytest.raises(DynamicsError, match=message):
        call()


def test_init_biases_callback_from_lightning_cli_yaml_before_theta0(tmp_path, monkeypatch) -> None:
    # The recipe callback is listed after the recorder: setup still precedes the recorded θ0
    config = {
        "trainer": {
            "max_steps": 2,
            "accelerator": "cpu",
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "callbacks": [
                {
                    "class_path": "dynamics.callbacks.DynamicsRecorder",
                    "init_args": {"path": "run.h5", "probes": []},
                },
                {
                    "class_path": "dynamics.callbacks.InitBiases",
                    "init_args": {"recipe": "constant", "options": {"value": 0.25}},
                },
            ],
        },
        "model": {
            "class_path": "dynamics.experiments.TeacherStudentModule",
            "init_args": {"width": 4, "expansion": 2, "depth": 1},
        },
        "data": {
            "class_path": "dynamics.experiments.TeacherStudentData",
            "init_args": {"width": 4, "expansion": 2, "depth": 1, "batch_size": 4},
        },
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    cli = LightningCLI(args=["fit", "--config", "config.yaml"], save_config_callback=None)
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, InitBiases)]
    assert callback.table and all(row.value == "constant 0.25" for row in callback.table)
    expected = TeacherStudentModule(width=4, expansion=2, depth=1)
    constant(expected, 0.25)
    assert open_run(tmp_path / "run.h5").theta0_sha256 == vector_hash(parameter_vector(expected))


def test_init_biases_callback_patterns_and_the_run_records_what_was_set(tmp_path) -> None:
    """Through the callback's options, only the hidden layers' biases are set; the run file
    keeps the recipe, its options and each parameter set, and the report's setup says so."""
    module = TeacherStudentModule(width=4, expansion=2, depth=2)
    callback = InitBiases("constant", {"value": 0.25, "include": ["**.up"]})
    recorder = DynamicsRecorder(tmp_path / "run.h5", [TrainingLoss()])
    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 4)), batch_size=8)
    trainer = pl.Trainer(
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder, callback],
    )
    reference = copy.deepcopy(module)
    trainer.fit(module, data)
    set_here = [f"{row.module}.{row.parameter}" for row in callback.table]
    assert set_here == ["student.blocks.0.up.bias", "student.blocks.1.up.bias"]
    expected = constant(reference, 0.25, include=["**.up"])
    assert expected == callback.table
    run = open_run(tmp_path / "run.h5")
    assert run.theta0_sha256 == vector_hash(parameter_vector(reference))
    (edit,) = run.model_edits
    assert edit["edit"] == "init_biases" and edit["class_path"].endswith("InitBiases")
    assert edit["settings"] == {
        "recipe": "constant",
        "options": {"value": 0.25, "include": ["**.up"]},
    }
    assert edit["table"] == [row._asdict() for row in callback.table]
    text = dict(setup_rows(run))["model edits"]
    assert text == (
        'InitBiases(options={"include": ["**.up"], "value": 0.25}, recipe="constant"): '
        f"constant 0.25 at {', '.join(set_here)}"
    )


def test_init_biases_callback_refuses_an_unknown_recipe() -> None:
    with pytest.raises(DynamicsError, match="unknown bias recipe 'ones'"):
        InitBiases("ones")
