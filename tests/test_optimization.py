"""The shared optimizer section: defaults train as before, every key reaches torch, schedules."""

from __future__ import annotations

import math

import pytest
import torch

from dynamics.experiments.autoencoder.module import AutoencoderModule
from dynamics.experiments.char_gpt.module import CharGPTModule
from dynamics.experiments.config import ConfigError
from dynamics.experiments.config_files import load_config
from dynamics.experiments.optimization import OptimizerConfig, build_optimization, lr_factor
from dynamics.experiments.teacher_student.module import TeacherStudentModule
from dynamics.experiments.vit_digits.module import ViTDigitsModule


class _Trainer:
    max_steps = 100


def _configured(module):
    module._trainer = _Trainer()  # configure_optimizers reads the trainer's max_steps
    return module.configure_optimizers()


def _groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


# (experiment, module class, the construction the module used before the shared section)
OLD = [
    ("teacher_student", TeacherStudentModule, lambda p: torch.optim.Adam(p, lr=1e-3)),
    ("autoencoder", AutoencoderModule, lambda p: torch.optim.Adam(p, lr=2e-3)),
    ("char_gpt", CharGPTModule, lambda p: torch.optim.AdamW(p, lr=1e-3)),
    ("vit_digits", ViTDigitsModule, lambda p: torch.optim.AdamW(p, lr=1e-3)),
]


@pytest.mark.parametrize(("name", "module_class", "old"), OLD, ids=[o[0] for o in OLD])
def test_default_configs_build_the_old_optimizer(name, module_class, old):
    experiment, config = load_config(name)
    module = experiment.module(config, "none")
    assert isinstance(module, module_class)
    built = _configured(module)
    reference = old(list(module.parameters()))
    assert type(built) is type(reference)  # no scheduler: a bare optimizer
    assert _groups(built) == _groups(reference)


def test_default_training_is_bit_identical_to_the_old_construction():
    torch.manual_seed(0)
    data = torch.randn(32, 8), torch.randn(32, 8)
    parameters = []
    for build in (
        lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
        lambda m: _configured(m),
    ):
        module = TeacherStudentModule(width=8, expansion=2, depth=2)
        optimizer = build(module)
        for _ in range(5):
            optimizer.zero_grad()
            module.dynamics_loss(data).backward()
            optimizer.step()
        parameters.append(torch.cat([p.detach().flatten() for p in module.parameters()]))
    assert torch.equal(*parameters)


def test_sgd_momentum_and_nesterov_reach_torch():
    parameters = [torch.nn.Parameter(torch.zeros(3))]
    config = OptimizerConfig(name="sgd", lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    optimizer = build_optimization(parameters, config.validate(10), 10)
    assert isinstance(optimizer, torch.optim.SGD)
    group = optimizer.param_groups[0]
    assert (group["momentum"], group["nesterov"], group["weight_decay"]) == (0.9, True, 1e-4)


def test_adam_betas_and_weight_decay_reach_torch():
    parameters = [torch.nn.Parameter(torch.zeros(3))]
    config = OptimizerConfig(name="adamw", betas=[0.9, 0.95], weight_decay=0.1).validate(10)
    group = build_optimization(parameters, config, 10).param_groups[0]
    assert (group["betas"], group["weight_decay"]) == ((0.9, 0.95), 0.1)


def test_cosine_schedule_follows_the_closed_form():
    lr, steps, warmup, low = 0.1, 100, 10, 0.1
    config = OptimizerConfig(
        lr=lr, warmup_steps=warmup, schedule="cosine", min_lr_ratio=low
    ).validate(steps)
    parameters = [torch.nn.Parameter(torch.zeros(1))]
    built = build_optimization(parameters, config, steps)
    optimizer, scheduler = built["optimizer"], built["lr_scheduler"]["scheduler"]
    seen = {}
    for step in range(steps + 1):
        seen[step] = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()

    def closed(t):
        if t < warmup:
            return lr * t / warmup
        progress = (t - warmup) / (steps - warmup)
        return lr * (low + (1 - low) * 0.5 * (1 + math.cos(math.pi * progress)))

    middle = warmup + (steps - warmup) // 2
    for step, expected in ((0, 0.0), (warmup, lr), (middle, lr * (low + (1 - low) / 2))):
        assert seen[step] == pytest.approx(expected) == pytest.approx(closed(step))
    assert seen[steps] == pytest.approx(low * lr)
    assert lr_factor(config, 5, steps) == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"name": "rmsprop"}, "optimizer.name must be one of adam, adamw, sgd"),
        ({"lr": 0.0}, "optimizer.lr must be > 0"),
        ({"momentum": 0.9}, "optimizer.momentum is SGD's"),
        ({"name": "sgd", "nesterov": True}, "optimizer.nesterov needs SGD"),
        ({"weight_decay": -1.0}, "optimizer.weight_decay must be a number >= 0"),
        ({"betas": [0.9]}, "optimizer.betas must be two numbers in [0, 1)"),
        ({"betas": [0.9, 1.0]}, "optimizer.betas must be two numbers in [0, 1)"),
        ({"name": "sgd", "betas": [0.9, 0.99]}, "optimizer.betas are Adam's"),
        ({"warmup_steps": 10}, "optimizer.warmup_steps must be from 0 to steps - 1"),
        ({"schedule": "linear"}, "optimizer.schedule must be one of constant, cosine"),
        ({"min_lr_ratio": 2.0}, "optimizer.min_lr_ratio must be in [0, 1]"),
    ],
)
def test_bad_values_are_one_line(options, message):
    overrides = {f"optimizer.{key}": value for key, value in options.items()}
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(")", r"\)")) as e:
        load_config("teacher_student", steps=10, eval_every=10, **overrides)
    assert "\n" not in str(e.value)


def test_an_old_autoencoder_config_names_where_lr_went(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("experiment: autoencoder\nlr: 1.0e-3\n")
    with pytest.raises(ConfigError, match="config key 'lr' is now 'optimizer.lr'"):
        load_config(path)
