"""Hugging Face models built from a config (no download): GPT-2 with padded dict batches, and
transformers' activation modules recognised with their expected shift."""

import inspect
import math

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from scipy.integrate import quad
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dynamics import open_run
from dynamics.bias.activations import HF_ACTIVATIONS, expected_value, hf_activation_phi
from dynamics.callbacks import DynamicsRecorder, HiddenStateNorms
from dynamics.passes.isolation import in_extra_pass

transformers = pytest.importorskip("transformers")
activations = pytest.importorskip("transformers.activations")

VOCAB, LENGTH = 40, 12


class PaddedTokens(Dataset):
    """Sequences of 3 to 12 tokens, right-padded with 0, as a tokenizer hands them out."""

    def __init__(self, n: int = 16) -> None:
        generator = torch.Generator().manual_seed(0)
        self.lengths = torch.randint(3, LENGTH + 1, (n,), generator=generator)
        self.tokens = torch.randint(1, VOCAB, (n, LENGTH), generator=generator)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        mask = (torch.arange(LENGTH) < self.lengths[i]).long()
        ids = self.tokens[i] * mask
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100),
        }


class TinyGPT2(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        config = transformers.GPT2Config(
            vocab_size=VOCAB,
            n_positions=LENGTH,
            n_embd=16,
            n_layer=2,
            n_head=2,
            bos_token_id=1,
            eos_token_id=1,
        )
        self.model = transformers.GPT2LMHeadModel(config)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return DataLoader(PaddedTokens(), batch_size=8)


def _block_outputs(model: nn.Module, names: list[str]):
    seen = {n: [] for n in names}
    modules = dict(model.named_modules())

    def catch(name):
        def hook(module, args, output):
            if not in_extra_pass():
                out = output[0] if isinstance(output, tuple) else output
                seen[name].append(out.detach().clone())

        return hook

    return seen, [modules[n].register_forward_hook(catch(n)) for n in names]


def test_gpt2_norms_run_over_real_tokens_of_padded_dict_batches(tmp_path, quiet_trainer):
    torch.manual_seed(0)
    module = TinyGPT2()
    blocks = ["model.transformer.h.0", "model.transformer.h.1"]
    acts = ["model.transformer.h.0.mlp.act", "model.transformer.h.1.mlp.act"]
    seen, handles = _block_outputs(module, blocks + acts)
    path = tmp_path / "gpt2.h5"
    quiet_trainer(max_steps=2, callbacks=[DynamicsRecorder(path, [HiddenStateNorms()])]).fit(module)
    for handle in handles:
        handle.remove()
    run = open_run(path)
    norms, bias = run.series("hidden_norms"), run.series("activation_bias")
    # the default selection finds GPT-2's blocks, and NewGELUActivation without activation_types
    assert norms.columns["norm"] == tuple(blocks)
    assert bias.columns["mean"] == tuple(acts)
    (settings,) = [p["settings"] for p in run.attrs["probes"] if p["name"] == "hidden"]
    assert settings["mask"] == "batch['attention_mask']"
    assert set(settings["activation_bias"]["found"].values()) == {"NewGELUActivation"}
    assert "attention_mask" in norms.views["norm"].title

    data = PaddedTokens()
    for step in range(2):
        mask = torch.stack([data[i]["attention_mask"] for i in range(8 * step, 8 * step + 8)])
        real = mask.bool()
        assert 0.1 < 1 - real.float().mean() < 0.9  # padding to leave out
        for i, name in enumerate(blocks):
            per_token = seen[name][step].norm(dim=-1)
            expected = per_token[real].mean().item()
            assert norms["norm"][step][i] == pytest.approx(expected, rel=1e-5)
            assert abs(per_token.mean().item() - expected) > 1e-3  # all positions differ
        for i, name in enumerate(acts):
            expected = seen[name][step].mean(-1)[real].mean().item()
            assert bias["mean"][step][i] == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_a_callable_mask_and_mask_false_are_stored_and_used(tmp_path, quiet_trainer):
    def first_half(batch):
        mask = torch.zeros_like(batch["attention_mask"], dtype=torch.bool)
        mask[:, : LENGTH // 2] = True
        return mask

    torch.manual_seed(0)
    module = TinyGPT2()
    seen, handles = _block_outputs(module, ["model.transformer.h.1"])
    paths = {rule: tmp_path / f"{i}.h5" for i, rule in enumerate([first_half, False])}
    for rule, path in paths.items():
        probe = HiddenStateNorms(modules=["model.transformer.h.1"], mask=rule)
        quiet_trainer(max_steps=1, callbacks=[DynamicsRecorder(path, [probe])]).fit(module)
    for handle in handles:
        handle.remove()
    half, every = (open_run(p) for p in paths.values())
    expected_half = seen["model.transformer.h.1"][0].norm(dim=-1)[:, : LENGTH // 2].mean()
    assert half.series("hidden_norms")["norm"][0][0] == pytest.approx(expected_half.item(), 1e-5)
    expected_all = seen["model.transformer.h.1"][1].norm(dim=-1).mean()
    assert every.series("hidden_norms")["norm"][0][0] == pytest.approx(expected_all.item(), 1e-5)
    rules = [
        [p["settings"]["mask"] for p in run.attrs["probes"] if p["name"] == "hidden"][0]
        for run in (half, every)
    ]
    assert rules == [
        "mask=test_a_callable_mask_and_mask_false_are_stored_and_used.<locals>.first_half",
        "off",
    ]


def _instances():
    classes = {
        name: cls
        for name, cls in vars(activations).items()
        if inspect.isclass(cls)
        and issubclass(cls, nn.Module)
        and cls.__module__ == activations.__name__
    }
    # every activation module transformers defines is known, but the identity
    assert set(classes) - {"LinearActivation"} <= set(HF_ACTIVATIONS)
    made = {
        name: cls(-2.0, 3.0) if name == "ClippedGELUActivation" else cls()
        for name, cls in classes.items()
    }
    return {name: m for name, m in made.items() if name != "LinearActivation"}


def test_every_transformers_activation_is_recognised_with_its_expected_shift():
    for name, module in _instances().items():
        phi = hf_activation_phi(module)
        if name == "XIELUActivation":  # learned parameters: no fixed φ
            assert phi is None
            continue
        z = torch.linspace(-6, 6, 241, dtype=torch.float64)
        with torch.no_grad():  # our φ is transformers' function
            np.testing.assert_allclose(phi(z), module(z), rtol=1e-12, atol=1e-12, err_msg=name)

        def density(x, module=module):
            with torch.no_grad():
                value = module(torch.tensor([x], dtype=torch.float64)).item()
            return value * math.exp(-x * x / 2) / math.sqrt(2 * math.pi)

        reference = sum(quad(density, a, b, limit=200)[0] for a, b in [(-40, 0), (0, 40)])
        assert expected_value(phi) == pytest.approx(reference, abs=1e-9), name


def test_a_users_class_named_like_a_transformers_one_is_not_taken_for_it():
    class NewGELUActivation(nn.Module):
        def forward(self, x):
            return x

    assert hf_activation_phi(NewGELUActivation()) is None
