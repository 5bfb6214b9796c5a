"""Offline tools read run files of every loop alike (issue 25 item 4): a Hugging Face model
recorded under ``model(**batch).loss`` and a plain ``nn.Module`` under a loss function rebuild
from their files, their loss is taken by the rule the file keeps, and ``info``, ``plane``,
``report`` and ``compare`` work on them."""

from __future__ import annotations

import html
import json
import shutil
from pathlib import Path

import h5py
import pytest
import torch
from transformers import GPT2LMHeadModel

from dynamics import open_run
from dynamics.analysis.measures.rebuilt_loss import rebuilt_surface
from dynamics.analysis.measures.run_comparison import DIFFERS, comparability, verdict
from dynamics.analysis.measures.run_setup import setup_rows
from dynamics.callbacks import GradientPlane, ParameterDisplacement, TrainingLoss
from dynamics.errors import DynamicsError
from dynamics.model import rebuild_module
from dynamics.model.rebuild import recorded_loss_rule
from dynamics.model.record import module_record
from dynamics.passes.loss_rule import FunctionLoss, OutputLoss
from dynamics.store import names
from dynamics.store.schema import encode_attr
from tests import loop_driver, tiny_gpt2

REPO = Path(__file__).resolve().parents[1]


def _probes():
    return [TrainingLoss(), GradientPlane(), ParameterDisplacement(snapshot_every_n_steps=1)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Files as a Hugging Face Trainer (two learning rates), accelerate, and a plain loop (a
    module-level loss function, two learning rates, and a lambda) write them."""
    folder = tmp_path_factory.mktemp("loops")
    gpt2 = list(tiny_gpt2.loader(12))
    paths = {}
    for name, loop, lr in (("hf", "huggingface", 1e-2), ("hf_fast", "huggingface", 3e-2)):
        paths[name] = loop_driver.record(
            folder / f"{name}.h5",
            tiny_gpt2.model(0),
            gpt2,
            tiny_gpt2.loss,
            loop=loop,
            loss_rule=OutputLoss(),
            probes=_probes(),
            lr=lr,
        )
    paths["accelerate"] = loop_driver.record(
        folder / "accelerate.h5",
        tiny_gpt2.model(0),
        gpt2,
        tiny_gpt2.loss,
        loop="accelerate",
        loss_rule=OutputLoss(),
        probes=_probes(),
    )
    plain = loop_driver.plain_batches()
    rules = {
        "plain": (FunctionLoss(loop_driver.plain_loss), 1e-2),
        "plain_fast": (FunctionLoss(loop_driver.plain_loss), 3e-2),
        "lambda": (FunctionLoss(lambda m, b: loop_driver.plain_loss(m, b)), 1e-2),
    }
    for name, (rule, lr) in rules.items():
        torch.manual_seed(0)
        paths[name] = loop_driver.record(
            folder / f"{name}.h5",
            loop_driver.PlainNet(),
            plain,
            loop_driver.plain_loss,
            loop="plain",
            loss_rule=rule,
            probes=_probes(),
            lr=lr,
        )
    return paths


def test_a_hugging_face_model_rebuilds_from_its_config_and_gives_its_recorded_loss(runs):
    run = open_run(runs["hf"])
    module = run.attrs[names.ATTR_MODULE]
    assert module["unrecorded_init_args"] == [] and module["hf_config"]["values"]["n_layer"] == 2
    model = rebuild_module(run)  # transformers is installed: trusted without --trust
    assert type(model) is GPT2LMHeadModel and model.config._attn_implementation == "sdpa"
    assert isinstance(recorded_loss_rule(run), OutputLoss)
    # The padded dict probe batch, by model(**batch).loss at θ0: the first step's training loss.
    surface = rebuilt_surface(run)
    first = float(run.train_loss().values[0])
    assert surface.loss(run.vector(names.THETA0)) == pytest.approx(first, rel=1e-5)


def test_a_recorded_config_class_that_is_no_config_is_never_called(runs, tmp_path):
    crafted = tmp_path / "crafted.h5"
    shutil.copy(runs["hf"], crafted)
    with h5py.File(crafted, "r+") as file:
        module = json.loads(file.attrs[names.ATTR_MODULE])
        module["hf_config"]["class_path"] = "torch.nn.Linear"
        file.attrs[names.ATTR_MODULE] = encode_attr(module)
    with pytest.raises(DynamicsError, match="not a transformers config class; refusing"):
        rebuild_module(open_run(crafted))


def test_a_plain_loops_loss_function_is_imported_only_when_trusted(runs):
    run = open_run(runs["plain"])
    with pytest.raises(DynamicsError, match="outside the installed packages.*trust_recorded_model"):
        recorded_loss_rule(run)
    rule = recorded_loss_rule(run, trust_recorded_model=True)
    assert isinstance(rule, FunctionLoss) and rule.loss_fn is loop_driver.plain_loss
    surface = rebuilt_surface(run, trust=True)
    first = float(run.train_loss().values[0])
    assert surface.loss(run.vector(names.THETA0)) == pytest.approx(first, rel=1e-6)
    with pytest.raises(DynamicsError, match="lambda or a local function"):
        recorded_loss_rule(open_run(runs["lambda"]), trust_recorded_model=True)


def test_plane_of_two_hugging_face_files_and_of_two_plain_files(runs, tmp_path, dynamics):
    out = tmp_path / "hf.html"
    result = dynamics("plane", runs["hf"], runs["hf_fast"], "-o", out, "--grid", "5")
    assert result.returncode == 0, result.stderr
    assert out.exists()
    out = tmp_path / "plain.html"
    args = ("plane", runs["plain"], runs["plain_fast"], "-o", out, "--grid", "5")
    result = dynamics(*args, "--trust-recorded-model", cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert out.exists()


def test_plane_of_a_lambda_loss_is_one_line(runs, tmp_path, dynamics, one_line_error):
    out = tmp_path / "lambda.html"
    args = ("plane", runs["lambda"], runs["plain"], "-o", out, "--grid", "5")
    result = dynamics(*args, "--trust-recorded-model", cwd=REPO)
    one_line_error(result)
    assert "lambda" in result.stderr and not out.exists()


def test_info_shows_the_loop_and_the_loss_rule(runs, tmp_path, dynamics):
    text = dynamics("info", runs["hf"]).stdout
    assert "loop huggingface, loss rule model(**batch).loss" in text
    summary = json.loads(dynamics("info", runs["plain"], "--json").stdout)
    assert summary["setup"] == {
        "loop": "plain",
        "loss_rule": {"rule": "function", "function": "tests.loop_driver:plain_loss"},
    }
    # A file from before loops other than Lightning were recorded: Lightning's, by its rule.
    older = tmp_path / "older.h5"
    shutil.copy(runs["hf"], older)
    with h5py.File(older, "r+") as file:
        del file.attrs[names.ATTR_LOOP], file.attrs[names.ATTR_LOSS_RULE]
    text = dynamics("info", older).stdout
    assert "loop lightning, loss rule Lightning rule (dynamics_loss, else training_step)" in text
    setup = dict(setup_rows(open_run(runs["hf"])))
    assert setup["loop"] == "huggingface" and setup["loss rule"] == "model(**batch).loss"
    values = len(tiny_gpt2.config().to_dict())
    assert setup["init args"] == f"config GPT2Config ({values} values recorded)"


def test_compare_shows_a_difference_in_loop_alone(runs):
    checks = {c.name: c for c in comparability(open_run(runs["hf"]), open_run(runs["accelerate"]))}
    assert checks["loop"].status == DIFFERS
    assert checks["loop"].details == "huggingface vs accelerate"
    assert [c.name for c in checks.values() if c.status == DIFFERS] == ["loop"]
    assert checks["loss rule"].details == "model(**batch).loss"
    assert verdict(list(checks.values())).startswith("differs in: loop (huggingface vs accelerate)")


def test_report_and_compare_of_every_loops_files(runs, tmp_path, dynamics):
    shown = {"hf": "model(**batch).loss", "plain": "loss_fn tests.loop_driver:plain_loss"}
    for name, rule in shown.items():
        out = tmp_path / f"{name}.html"
        result = dynamics("report", runs[name], "-o", out, cwd=REPO)
        assert result.returncode == 0, result.stderr
        assert rule in html.unescape(out.read_text())  # the setup table's loss rule
    out = tmp_path / "compare.html"
    result = dynamics("compare", runs["hf"], runs["hf_fast"], runs["accelerate"], "-o", out)
    assert result.returncode == 0, result.stderr
    page = out.read_text()
    assert "differs in: loop (accelerate vs huggingface)" in page  # the pair: other vs reference
    assert "θT(hf) → θT(hf_fast)" in page  # the loss barriers, by model(**batch).loss
    # The audit's loss pass on the probe batch, by model(**batch).loss: the token ids reach GPT-2.
    result = dynamics("audit", runs["hf"])
    assert result.returncode == 0, result.stderr
    assert "origin: not checked (the input is not all floating point" in result.stdout
    out = tmp_path / "compare_plain.html"
    args = ("compare", runs["plain"], runs["plain_fast"], "-o", out, "--trust-recorded-model")
    result = dynamics(*args, cwd=REPO)
    assert result.returncode == 0, result.stderr


def test_module_records_of_a_plain_module_and_of_a_config_json_cannot_hold():
    assert module_record(loop_driver.PlainNet()) == {
        "class_path": "tests.loop_driver.PlainNet",
        "init_args": {},
        "unrecorded_init_args": [],
    }
    model = tiny_gpt2.model(0)
    model.config.tokenizer = object()  # a custom setting no JSON holds: the config unrecorded
    record = module_record(model)
    assert "hf_config" not in record and record["unrecorded_init_args"] == ["config"]
