"""BiasComponent: decodes of a layer's activation-bias component and remainder, against direct
evaluation; side-effect free; steps aside with a reason where it cannot measure."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dynamics.callbacks import BiasComponent, DynamicsRecorder, check_probe
from dynamics.callbacks.bias_component import image_steps
from dynamics.experiments.autoencoder.data import digit_images
from dynamics.experiments.autoencoder.module import AutoencoderModule
from dynamics.store import names, open_run
from tests.conftest import SmallCNN, make_quiet_trainer
from tests.test_real_projects import CharGPT, DigitsCNN, DigitsData


class Regressor(pl.LightningModule):
    """Linear → ReLU (the split layer, ``act``) → Linear, mean squared error."""

    def __init__(self, loss: str = "mse") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.act, self.out = nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3)
        self.loss = loss

    def forward(self, x):
        return self.out(self.act(self.inp(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.loss == "by hand":
            return ((self(x) - y) ** 2).mean()
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _regression_batch():
    generator = torch.Generator().manual_seed(3)
    return torch.randn(8, 5, generator=generator), torch.randn(8, 3, generator=generator)


def _cos(a, b):
    a, b = a.reshape(len(a), -1).double(), b.reshape(len(b), -1).double()
    return float((F.cosine_similarity(a, b, dim=1, eps=0)).mean())


def _relerr(a, r):
    return float((a.double() - r.double()).norm() / r.double().norm())


def test_rows_at_theta0_match_direct_evaluation_of_the_split():
    module, batch = Regressor(), _regression_batch()
    x, y = batch
    with torch.no_grad():
        h = module.act(module.inp(x))
        bias = h.mean(-1, keepdim=True).expand_as(h)
        full, decodes = module.out(h), {"bias": module.out(bias), "remainder": module.out(h - bias)}
    # The head is affine: the two decodes add up to the full output plus its bias once more.
    assert torch.allclose(decodes["bias"] + decodes["remainder"], full + module.out.bias, atol=1e-6)
    series = check_probe(BiasComponent(["act"]), module, batch)[names.BIAS_COMPONENT]
    row = {key: np.asarray(values)[0] for key, values in series.values.items()}
    assert series.step[0] == 0
    for part, decode in decodes.items():
        assert row[f"{part}_cos_full"][0] == pytest.approx(_cos(decode, full), abs=1e-6)
        assert row[f"{part}_relerr_full"][0] == pytest.approx(_relerr(decode, full), rel=1e-5)
        assert row[f"{part}_cos_target"][0] == pytest.approx(_cos(decode, y), abs=1e-6)
        assert row[f"{part}_relerr_target"][0] == pytest.approx(_relerr(decode, y), rel=1e-5)
        assert row[f"{part}_loss"][0] == pytest.approx(float(F.mse_loss(decode, y)), rel=1e-5)
        centred = [t - t.mean(1, keepdim=True) for t in (decode, y)]
        assert row[f"{part}_corr_target"][0] == pytest.approx(_cos(*centred), abs=1e-6)
    assert row["full_cos_target"] == pytest.approx(_cos(full, y), abs=1e-6)
    assert row["full_loss"] == pytest.approx(float(F.mse_loss(full, y)), rel=1e-5)
    share = float(bias.double().square().sum() / h.double().square().sum())
    assert row["bias_share"][0] == pytest.approx(share, rel=1e-5)
    # Not image-shaped: no decoded images are stored.
    assert names.BIAS_COMPONENT_IMAGES not in check_probe(BiasComponent(["act"]), module, batch)


def test_conv_features_are_the_channels_and_images_are_the_decodes():
    """The autoencoder: the bias part is the mean over channels at each position; the stored
    images are the first examples' decodes and targets."""
    module = AutoencoderModule(width=4)
    images = digit_images(False, 297)[:6]
    probe = BiasComponent(["encoder.3"], examples=2)
    recorded = check_probe(probe, module, (images,), steps=3)
    net = nn.Sequential(module.encoder, module.decoder)
    with torch.no_grad():
        h = module.encoder[:4](images)
        bias = h.mean(1, keepdim=True).expand_as(h)  # over the C channels, per (n, y, x)
        rest = nn.Sequential(*module.encoder[4:], module.decoder)
        expected = torch.stack([net(images), rest(bias), rest(h - bias)])[:, :2]
    decodes = recorded[names.BIAS_COMPONENT_IMAGES]
    assert decodes.step[0] == 0
    stored = np.asarray(decodes.values[names.BIAS_COMPONENT_DECODES])[0, 0]  # step 0, layer 0
    np.testing.assert_allclose(stored, expected.numpy(), atol=1e-5)
    cos = np.asarray(recorded[names.BIAS_COMPONENT].values["bias_cos_target"])[0, 0]
    assert cos == pytest.approx(_cos(rest(bias).detach(), images), abs=1e-5)
    with torch.no_grad():
        by_image = rest(h.mean((1, 2, 3), keepdim=True).expand_as(h))  # the other reading
    # The per-image mean (over C×H×W) decodes to other images than the ones stored.
    assert (by_image[:2] - expected[1]).abs().max() > 10 * 1e-5  # 10× the tolerance above


def test_target_images_are_stored_once(tmp_path):
    module = AutoencoderModule(width=4)
    images = digit_images(False, 297)[:8]
    loader = DataLoader(TensorDataset(images), batch_size=8)
    recorder = DynamicsRecorder(tmp_path / "ae.h5", [BiasComponent(["decoder.4"], examples=3)])
    make_quiet_trainer(max_steps=4, callbacks=[recorder]).fit(module, loader)
    run = open_run(tmp_path / "ae.h5")
    np.testing.assert_array_equal(run.vector(names.BIAS_COMPONENT_TARGET), images[:3].numpy())
    steps = run.series(names.BIAS_COMPONENT_IMAGES).step
    assert list(steps) == sorted(image_steps(4, 1, 16)) == [0, 1, 2, 3]


def test_image_steps_are_due_dense_early_and_end_at_the_last_due_step():
    steps = sorted(image_steps(1500, 10, 16))
    assert steps[0] == 0 and steps[-1] == 1490 and len(steps) <= 16
    assert all(s % 10 == 0 for s in steps)
    gaps = np.diff(steps)
    assert gaps[0] < gaps[-1]


def _params_and_buffers(module):
    return [t.detach().clone() for t in (*module.parameters(), *module.buffers())]


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_training_is_bit_identical_with_and_without_the_probe(tmp_path, mode):
    """SmallCNN: BatchNorm running statistics and dropout draws (train mode) are untouched."""
    results = []
    for probes in ([], [BiasComponent(["features.2", "features.5"], mode=mode)]):
        torch.manual_seed(0)
        module = SmallCNN()
        callbacks = [DynamicsRecorder(tmp_path / f"{mode}{len(probes)}.h5", probes)]
        make_quiet_trainer(max_steps=5, callbacks=callbacks).fit(module)
        results.append(_params_and_buffers(module))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    run = open_run(tmp_path / f"{mode}1.h5")
    assert len(run.series(names.BIAS_COMPONENT).step) == 5
    assert not [e for e in run.events() if e.probe == "bias_component"]


def test_dict_batches_and_batchnorm_cnn_classification(tmp_path):
    """Logits against class indices: no cosine to the target, the decode's loss instead."""
    module = DigitsCNN()
    module0 = copy.deepcopy(module).eval()
    recorder = DynamicsRecorder(tmp_path / "cnn.h5", [BiasComponent(["features.6"])])
    make_quiet_trainer(max_steps=3, callbacks=[recorder]).fit(module, datamodule=DigitsData())
    run = open_run(tmp_path / "cnn.h5")
    series = run.series(names.BIAS_COMPONENT)
    assert "bias_cos_target" not in series.values and "bias_loss" in series.values
    (settings,) = [
        p["settings"] for p in run.attrs[names.ATTR_PROBES] if p["name"] == "bias_component"
    ]
    assert settings["layers"]["features.6"]["feature_dim"] == 1
    assert "not defined" in settings["target_similarity"]
    # The full decode's loss at step 0 is the module's eval-mode loss on the probe batch.
    data = DigitsData()
    data.setup("fit")
    torch.manual_seed(0)  # not needed by eval mode; the probe batch is the first training batch
    first = next(iter(data.train_dataloader()))
    with torch.no_grad():
        expected = F.cross_entropy(module0(first["x"]), first["y"])
    assert np.asarray(series.values["full_loss"])[0] == pytest.approx(float(expected), rel=1e-5)


def test_gpt_layernorms_hide_the_residual_streams_bias_component(tmp_path):
    """A pre-norm GPT (SDPA attention, logits against token indices): every read of the
    residual stream goes through a LayerNorm, which removes each token's mean, so a block's
    bias component changes nothing downstream — the remainder decodes to the full logits. The
    MLP's post-activation is different: its mean reaches the stream through c_proj."""
    module = CharGPT()
    probe = BiasComponent(["blocks.*", "blocks.0.mlp.act"])
    recorder = DynamicsRecorder(tmp_path / "gpt.h5", [probe])
    make_quiet_trainer(max_steps=2, callbacks=[recorder]).fit(module)
    series = open_run(tmp_path / "gpt.h5").series(names.BIAS_COMPONENT)
    layers = series.columns["bias_cos_full"]
    assert layers == ("blocks.0", "blocks.0.mlp.act", "blocks.1")
    assert "bias_cos_target" not in series.values  # logits vs indices: the loss instead
    relerr = np.asarray(series.values["remainder_relerr_full"])
    loss = np.asarray(series.values["remainder_loss"])
    full = np.asarray(series.values["full_loss"])
    for j in (0, 2):
        np.testing.assert_allclose(relerr[:, j], 0, atol=1e-5)
        np.testing.assert_allclose(loss[:, j], full, rtol=1e-5)
    assert (relerr[:, 1] > 1e-3).all()


def _disabled(tmp_path, module, probe, loader=None) -> str:
    recorder = DynamicsRecorder(tmp_path / "x.h5", [probe])
    make_quiet_trainer(max_steps=2, callbacks=[recorder]).fit(module, loader)
    run = open_run(tmp_path / "x.h5")
    (event,) = [e for e in run.events() if e.probe == "bias_component"]
    assert event.kind == names.EVENT_DISABLED
    assert names.BIAS_COMPONENT not in run.groups
    return event.message


def _regression_loader():
    return DataLoader(TensorDataset(*_regression_batch()), batch_size=8)


def test_steps_aside_without_a_known_loss_function(tmp_path):
    message = _disabled(
        tmp_path, Regressor("by hand"), BiasComponent(["act"]), _regression_loader()
    )
    assert "calls none of the loss functions" in message and "mse_loss" in message


def test_steps_aside_when_a_pattern_matches_nothing(tmp_path):
    message = _disabled(tmp_path, Regressor(), BiasComponent(["missing.*"]), _regression_loader())
    assert "'missing.*' matched no module" in message and "inp, act, out" in message


class LSTMRegressor(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(5, 5, batch_first=True)
        self.unused = nn.Linear(5, 5)

    def forward(self, x):
        return super().forward(self.lstm(x.unsqueeze(1))[0].squeeze(1))


def test_steps_aside_for_an_output_that_is_no_tensor_or_a_layer_never_called(tmp_path):
    message = _disabled(
        tmp_path / "a", LSTMRegressor(), BiasComponent(["lstm"]), _regression_loader()
    )
    assert "lstm (LSTM) outputs a tuple, not a tensor" in message
    message = _disabled(
        tmp_path / "b", LSTMRegressor(), BiasComponent(["unused"]), _regression_loader()
    )
    assert "unused is not called" in message


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="non-empty list"):
        BiasComponent("act")
    with pytest.raises(ValueError, match="examples"):
        BiasComponent(["act"], examples=0)


class TwoLosses(Regressor):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y) + 0.1 * F.l1_loss(self(x), y)


def test_steps_aside_when_the_loss_calls_several_loss_functions(tmp_path):
    message = _disabled(tmp_path, TwoLosses(), BiasComponent(["act"]), _regression_loader())
    assert "calls mse_loss, l1_loss of the loss functions" in message


def test_an_image_budget_too_small_stores_no_images_and_says_so(tmp_path):
    module = AutoencoderModule(width=4)
    loader = DataLoader(TensorDataset(digit_images(False, 297)[:8]), batch_size=8)
    probe = BiasComponent(["decoder.4"], image_budget_mb=0)
    make_quiet_trainer(max_steps=2, callbacks=[DynamicsRecorder(tmp_path / "a.h5", [probe])]).fit(
        module, loader
    )
    run = open_run(tmp_path / "a.h5")
    assert names.BIAS_COMPONENT_IMAGES not in run.groups
    assert run.vector(names.BIAS_COMPONENT_TARGET) is None
    (warning,) = [e for e in run.events() if e.probe == "bias_component"]
    assert warning.kind == names.EVENT_WARNING and "stores no decoded images" in warning.message
    assert len(run.series(names.BIAS_COMPONENT).step) == 2  # the series are recorded all the same
