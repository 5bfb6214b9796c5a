"""The ``vit_digits`` experiment (the scale-up's vision transformer in miniature) from the command
line, as a user runs it, and the model: patches of the 8×8 image, a stratified split, shared θ0,
Eq. 9 on the MLP activations, the residual stream per block, held-out top-1 accuracy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from dynamics.experiments.vit_digits import LabelledDigitsData, ViTDigitsModule, labelled_digits
from dynamics.model.rebuild import rebuild_module
from dynamics.models import ViT
from dynamics.store import names, open_run
from tests.conftest import assert_one_line_error, run_dynamics
from tests.test_char_gpt_experiment import mlp_activation_means, residual_stream_norms, run_tiny

TINY = {
    "eval_every": 2,
    "model": {"width": 16, "depth": 2, "heads": 2},
    "data": {"batch_size": 8},
    "record": {"every_n_steps": 1, "hessian_every_n_steps": 2, "snapshot_budget_mb": 1},
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return run_tiny("vit_digits", TINY, tmp_path_factory.mktemp("vit_digits"))


def test_both_variants_train_from_one_theta0(tiny):
    result, runs, _ = tiny
    unshifted, adaptive = open_run(runs["unshifted"]), open_run(runs["adaptive"])
    assert unshifted.shares_theta0(adaptive) and "all variants share θ0" in result.stdout
    assert list(adaptive.series(names.LOSS).step) == [0, 1, 2]
    for run in (unshifted, adaptive):
        hessian = run.series(names.HESSIAN)
        assert list(hessian.step) == [0, 2]
        assert np.asarray(hessian[names.HESSIAN_EIGENVALUES]).shape == (2, 3)
        assert run.recorded(names.DISPLACEMENT) is not None


def test_heldout_accuracy_is_recorded_as_a_share_of_the_360_heldout_digits(tiny):
    _, runs, _ = tiny
    heldout = open_run(runs["adaptive"]).series(names.VALIDATION)
    assert list(heldout.step) == [2]
    hits = heldout["val_acc"][-1] * 360
    assert 0 <= hits <= 360 and hits == pytest.approx(round(hits), abs=1e-3)


def test_logged_accuracy_and_loss_are_those_of_direct_evaluation(quiet_trainer):
    module, data = ViTDigitsModule(width=16, depth=1, heads=2), LabelledDigitsData()
    metrics = quiet_trainer().validate(module, data, verbose=False)[0]
    images, labels = labelled_digits(True, 360)
    with torch.no_grad():
        logits = module(images)
    hits = (logits.argmax(1) == labels).sum().item()
    assert metrics["val_acc"] == pytest.approx(hits / 360)
    assert metrics["val_loss"] == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-5)


def test_the_adaptive_variant_has_zero_mean_mlp_activations(tiny):
    _, runs, _ = tiny
    images, _ = labelled_digits(True, 360)
    unshifted, adaptive = (rebuild_module(open_run(runs[v])) for v in ("unshifted", "adaptive"))
    assert mlp_activation_means(adaptive, images[:8].double()).abs().max() < 1e-15
    assert mlp_activation_means(unshifted, images[:8].double()).abs().mean() > 1e-3


def test_residual_stream_norms_per_block_match_direct_evaluation(tiny):
    _, runs, _ = tiny
    run = open_run(runs["unshifted"])
    norms = run.series(names.HIDDEN_NORMS)
    assert norms.columns[names.HIDDEN_NORM] == ("model.blocks.0", "model.blocks.1")
    data = LabelledDigitsData(batch_size=8)
    data.setup("fit")
    images, _ = next(iter(data.train_dataloader()))
    expected = residual_stream_norms(rebuild_module(run), images)
    np.testing.assert_allclose(norms[names.HIDDEN_NORM][0], expected, rtol=1e-5)


def test_the_report_shows_the_accuracy(tiny):
    _, _, report = tiny
    assert "Validation: val_acc" in report.read_text()


def test_patches_are_the_8x8_image_cut_in_row_major_squares():
    model = ViT(patch_size=4, width=8, depth=1, heads=2)
    image = torch.arange(64.0).view(1, 1, 8, 8)
    seen = []
    model.patches.register_forward_hook(lambda m, a, o: seen.append(a[0]))
    model(image)
    expected = torch.stack(
        [image[0, 0, r : r + 4, c : c + 4].flatten() for r in (0, 4) for c in (0, 4)]
    )
    torch.testing.assert_close(seen[0][0], expected)


def test_the_split_is_stratified_and_disjoint():
    train, heldout = labelled_digits(False, 360), labelled_digits(True, 360)
    assert len(train[1]) + len(heldout[1]) == 1797
    counts = torch.bincount(torch.cat([train[1], heldout[1]]), minlength=10)
    expected = counts * 360 / 1797  # each class in its overall proportion, to within one image
    assert (torch.bincount(heldout[1], minlength=10) - expected).abs().max() < 1
    rows = {tuple(x.flatten().tolist()) for x in train[0]}
    # load_digits has a few exact duplicate images; nearly all held-out images are unseen.
    assert sum(tuple(x.flatten().tolist()) in rows for x in heldout[0]) < 10


def test_module_applies_the_shift_by_surgery_keeping_theta0():
    plain, shifted = ViTDigitsModule(width=16), ViTDigitsModule(width=16, shift="adaptive")
    for (name, a), b in zip(plain.state_dict().items(), shifted.state_dict().values(), strict=True):
        assert a.equal(b), name


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model": {"patch_size": 3}}, "model.patch_size must tile the 8×8 digits"),
        ({"model": {"width": 10, "heads": 4}}, "model.heads (4) must divide model.width (10)"),
        ({"data": {"heldout_size": 5}}, "data.heldout_size must be from 10"),
    ],
)
def test_bad_config_values_are_one_line_errors(tmp_path, config, message):
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"experiment": "vit_digits", **config}))
    result = run_dynamics("run", tmp_path / "bad.yaml", "--out", tmp_path / "out")
    assert_one_line_error(result)
    assert message in result.stderr
    assert not (tmp_path / "out").exists()
