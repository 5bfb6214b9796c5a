"""side_effect_free: an extra pass leaves RNG, flags, buffers and .grad bit-identical."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dynamics.passes.isolation import in_extra_pass, side_effect_free


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 2)
    )


def _state(net: nn.Module) -> dict:
    return {
        "rng": torch.get_rng_state(),
        "flags": [m.training for m in net.modules()],
        "buffers": {n: b.clone() for n, b in net.named_buffers()},
        "grads": {n: p.grad.clone() for n, p in net.named_parameters()},
        "grad_ids": {n: id(p.grad) for n, p in net.named_parameters()},
    }


def _assert_same(before: dict, after: dict) -> None:
    assert torch.equal(before["rng"], after["rng"])
    assert before["flags"] == after["flags"]
    for name, value in before["buffers"].items():
        assert torch.equal(value, after["buffers"][name]), name
    for name, value in before["grads"].items():
        assert torch.equal(value, after["grads"][name]), name
    assert before["grad_ids"] == after["grad_ids"]


def test_extra_pass_in_train_mode_leaves_everything_bit_identical() -> None:
    net = _net()
    x, y = torch.randn(16, 6), torch.randn(16, 2)
    F.mse_loss(net(x), y).backward()  # .grad as a training step leaves it
    net[3].eval()  # a mixed flag pattern must survive, not just "all train"
    before = _state(net)
    with side_effect_free(net):
        assert in_extra_pass()
        loss = F.mse_loss(net(torch.randn(16, 6)), y)  # draws from the RNG, moves BN stats
        grads = torch.autograd.grad(loss, list(net.parameters()), create_graph=True)
        torch.autograd.grad(grads[0].sum(), list(net.parameters()), allow_unused=True)
        net.eval()
        net[1].running_mean = torch.zeros(8)  # rebinding a buffer is undone too
    assert not in_extra_pass()
    _assert_same(before, _state(net))
    assert net[1].num_batches_tracked.item() == 1


def test_the_next_training_step_is_unchanged() -> None:
    """The step after an extra pass equals the step without it: same dropout mask, BN stats."""
    x, y = torch.randn(16, 6), torch.randn(16, 2)
    results = []
    for extra in (False, True):
        net = _net()
        torch.manual_seed(1)
        if extra:
            with side_effect_free(net):
                net(torch.randn(16, 6)).sum()
        loss = F.mse_loss(net(x), y)
        loss.backward()
        results.append((loss.detach(), net[0].weight.grad.clone(), net[1].running_var.clone()))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_backward_inside_is_undone_including_in_place_accumulation() -> None:
    net = _net()
    x, y = torch.randn(16, 6), torch.randn(16, 2)
    F.mse_loss(net(x), y).backward()
    before = _state(net)
    with side_effect_free(net):
        F.mse_loss(net(x), y).backward()  # accumulates into the existing .grad in place
        net.zero_grad()
    _assert_same(before, _state(net))


def test_state_is_restored_when_the_pass_raises() -> None:
    net = _net()
    F.mse_loss(net(torch.randn(16, 6)), torch.randn(16, 2)).backward()
    before = _state(net)
    try:
        with side_effect_free(net):
            net(torch.randn(16, 6))
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    _assert_same(before, _state(net))


def test_eval_mode_runs_the_pass_in_eval_and_restores_each_flag() -> None:
    net = _net()
    F.mse_loss(net(torch.randn(16, 6)), torch.randn(16, 2)).backward()
    net[3].eval()
    x = torch.randn(16, 6)
    before = _state(net)
    with side_effect_free(net, mode="eval"):
        assert not any(m.training for m in net.modules())
        first, second = net(x), net(x)  # no dropout draw, running statistics: deterministic
    assert torch.equal(first, second)
    _assert_same(before, _state(net))
    assert net[1].num_batches_tracked.item() == 1
