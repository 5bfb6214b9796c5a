"""Weight spectra against closed forms (known singular values, a known power law), a
brute-force Kolmogorov–Smirnov search, WeightWatcher itself (when installed), a convolution's
output, and a recorded teacher–student fit's θt − θ0 by hand; the command, report and compare."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from dynamics.analysis.measures.weight_spectra import (
    fit_power_law,
    matrix_spectrum,
    weight_matrix,
    weight_spectra,
)
from dynamics.callbacks import DynamicsRecorder, ParameterDisplacement, TrainingLoss
from dynamics.experiments.teacher_student.data import TeacherStudentData
from dynamics.experiments.teacher_student.module import TeacherStudentModule
from dynamics.store import open_run
from tests.conftest import make_quiet_trainer

ARCH = dict(width=16, expansion=2, depth=2)


def _orthogonal(rng: np.random.Generator, n: int) -> np.ndarray:
    q, r = np.linalg.qr(rng.normal(size=(n, n)))
    return q * np.sign(np.diag(r))


def _with_singular_values(rng: np.random.Generator, s: np.ndarray, rows: int) -> np.ndarray:
    """U diag(s) Vᵀ, U (rows × k) and V (k × k) orthonormal."""
    u = _orthogonal(rng, rows)[:, : len(s)]
    return (u * s) @ _orthogonal(rng, len(s)).T


def test_norms_and_stable_rank_of_known_singular_values() -> None:
    rng = np.random.default_rng(0)
    s = np.array([5.0, 3.0, 2.0, 1.0, 0.5, 0.25, 0.1, 0.05, 0.01])
    spectrum = matrix_spectrum(_with_singular_values(rng, s, rows=20))
    assert spectrum.spectral_norm == pytest.approx(5.0, rel=1e-12)
    assert spectrum.frobenius_norm == pytest.approx(np.sqrt(np.sum(s**2)), rel=1e-12)
    assert spectrum.stable_rank == pytest.approx(np.sum(s**2) / 25.0, rel=1e-12)


def _power_law_eigenvalues(rng: np.random.Generator, tail: int, alpha: float) -> np.ndarray:
    """λ ~ Pareto with density ∝ λ^−α above 1 (inverse CDF), under a uniform body in
    [0.05, 1) half as large: the power law starts at 1."""
    pareto = (1 - rng.random(tail)) ** (-1 / (alpha - 1))
    return np.concatenate([rng.uniform(0.05, 1.0, tail // 2), pareto])


def test_alpha_of_a_matrix_drawn_from_a_known_power_law() -> None:
    rng = np.random.default_rng(0)
    eigenvalues = _power_law_eigenvalues(rng, tail=400, alpha=3.0)
    w = _with_singular_values(rng, np.sqrt(eigenvalues), rows=len(eigenvalues) + 50)
    fit = matrix_spectrum(w).fit
    # The MLE's standard error is (α − 1)/√n ≈ 0.1 on 400 points: 3 of them.
    assert fit.alpha == pytest.approx(3.0, abs=0.3)
    assert 0.9 <= fit.xmin <= 1.5  # where the power law starts, not inside the uniform body
    assert fit.tail == np.sum(eigenvalues >= fit.xmin * (1 - 1e-9)) and not fit.reason


def _brute_force(x: np.ndarray) -> tuple[float, float, float]:
    """The same fit, one candidate and one eigenvalue at a time (as the paper states it)."""
    x = sorted(v for v in x if v > 1e-5)
    best = (np.inf, np.nan, np.nan)
    for i, xmin in enumerate(x[:-1]):
        tail = x[i:]
        alpha = 1 + len(tail) / sum(np.log(v / xmin) for v in tail)
        if not alpha > 1:
            continue
        d = max(abs((1 - (v / xmin) ** (1 - alpha)) - k / len(tail)) for k, v in enumerate(tail))
        if d < best[0]:
            best = (d, alpha, xmin)
    return best[1], best[2], best[0]


def test_ks_minimizing_xmin_equals_a_brute_force_search() -> None:
    rng = np.random.default_rng(1)
    for x in (_power_law_eigenvalues(rng, 40, 2.5), rng.exponential(size=30), rng.random(9)):
        fit = fit_power_law(x)
        alpha, xmin, d = _brute_force(x)
        assert (fit.alpha, fit.xmin, fit.ks_distance) == pytest.approx((alpha, xmin, d), rel=1e-12)


def test_too_few_eigenvalues_get_no_alpha() -> None:
    fit = matrix_spectrum(np.random.default_rng(0).normal(size=(50, 7))).fit
    assert np.isnan(fit.alpha) and "fewer than 8" in fit.reason
    assert matrix_spectrum(np.zeros((10, 10))).fit.reason == "zero matrix"


def test_a_convolution_is_its_output_channels_against_its_receptive_field() -> None:
    conv = torch.nn.Conv2d(3, 4, kernel_size=(2, 3), bias=False)
    patch = torch.randn(1, 3, 2, 3)  # one receptive field: a 1×1 output
    expected = conv(patch).detach().numpy().reshape(4)
    matrix = weight_matrix(conv.weight.detach().numpy())
    assert matrix.shape == (4, 18)
    np.testing.assert_allclose(matrix @ patch.numpy().reshape(18), expected, rtol=1e-5)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
def test_alpha_matches_weightwatcher_on_the_same_matrices() -> None:
    weightwatcher = pytest.importorskip("weightwatcher")
    logging.getLogger("weightwatcher").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(120, 80), torch.nn.Linear(80, 40))
    with torch.no_grad():  # a heavy-tailed layer besides a Gaussian one
        heavy = np.random.default_rng(1).standard_t(2.5, size=(40, 80))
        model[1].weight.copy_(torch.from_numpy(heavy))
    found = weightwatcher.WeightWatcher(model=model).analyze()
    for (_, row), layer in zip(found.iterrows(), model):
        fit = matrix_spectrum(layer.weight.detach().double().numpy()).fit
        assert (fit.alpha, fit.xmin, fit.ks_distance) == pytest.approx(
            (row["alpha"], row["xmin"], row["D"]), rel=1e-9
        )


def _record(path: Path, seed: int) -> Path:
    recorder = DynamicsRecorder(
        path, [TrainingLoss(), ParameterDisplacement(snapshot_every_n_steps=1)]
    )
    module = TeacherStudentModule(**ARCH, seed=seed, lr=1e-2)
    data = TeacherStudentData(**ARCH, batch_size=16, heldout_size=32)
    make_quiet_trainer(max_steps=3, callbacks=[recorder]).fit(module, data)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("spectra")
    return _record(folder / "a.h5", 0), _record(folder / "b.h5", 1)


def test_recorded_displacement_equals_the_hand_computation(runs) -> None:
    run = open_run(runs[0])
    spectra = weight_spectra(run)
    theta = {state.step: state.theta for state in run.stored_states()}  # θ0 and a snapshot at 0
    np.testing.assert_array_equal(spectra.steps, [0, 1, 2, 3])
    module = TeacherStudentModule(**ARCH)
    weights = [n for n, p in module.named_parameters() if p.ndim >= 2 and p.requires_grad]
    assert spectra.layers == tuple(weights)
    split0 = dict(zip(run.layout.names, run.layout.split(torch.from_numpy(theta[0]))))
    for s, step in enumerate(spectra.steps):
        split = dict(zip(run.layout.names, run.layout.split(torch.from_numpy(theta[step]))))
        for i, name in enumerate(spectra.layers):
            w, w0 = split[name].double(), split0[name].double()
            for kind, m in (("weights", w), ("displacement", w - w0)):
                measures = getattr(spectra, kind)
                two = torch.linalg.matrix_norm(m, ord=2).item()
                fro = torch.linalg.matrix_norm(m).item()
                assert measures["spectral_norm"][s, i] == pytest.approx(two, rel=1e-10, abs=0)
                assert measures["frobenius_norm"][s, i] == pytest.approx(fro, rel=1e-10, abs=0)
    assert set(spectra.reasons["displacement"][0]) == {"zero matrix"}  # θ0 − θ0
    assert np.isfinite(spectra.weights["alpha"]).all()  # 16 × 32 and 32 × 16: 16 eigenvalues
    fewer = weight_spectra(run, max_states=3)  # evenly spread, θ0 and θT kept
    np.testing.assert_array_equal(fewer.steps, [0, 2, 3])
    np.testing.assert_array_equal(fewer.weights["alpha"], spectra.weights["alpha"][[0, 2, 3]])


def test_spectra_command_prints_a_table_json_and_a_page(runs, dynamics, tmp_path) -> None:
    table = dynamics("spectra", runs[0])
    assert table.returncode == 0, table.stderr
    assert "step 3" in table.stdout and "stable rank" in table.stdout
    assert all(layer in table.stdout for layer in weight_spectra(open_run(runs[0])).layers)
    out = tmp_path / "spectra.html"
    as_json = dynamics("spectra", runs[0], "--json", "-o", out)
    assert as_json.returncode == 0, as_json.stderr
    document = json.loads(as_json.stdout)
    assert document["step"] == 3 and len(document["matrices"]) == 4
    assert document["matrices"][0]["displacement"]["spectral_norm"] > 0
    page = out.read_text()
    assert "Stable rank" in page and "Power-law exponent" in page


def test_spectra_command_bad_input_is_one_line(runs, dynamics, one_line_error, tmp_path) -> None:
    (tmp_path / "not_a_run.h5").write_text("plain text")
    one_line_error(dynamics("spectra", tmp_path / "not_a_run.h5"))
    one_line_error(dynamics("spectra", runs[0], "-o", tmp_path / "missing" / "x.html"))
    existing = tmp_path / "taken.html"
    existing.write_text("mine")
    one_line_error(dynamics("spectra", runs[0], "-o", existing))
    assert existing.read_text() == "mine"
    no_states = tmp_path / "loss_only.h5"
    make_quiet_trainer(max_steps=1, callbacks=[DynamicsRecorder(no_states, [TrainingLoss()])]).fit(
        TeacherStudentModule(**ARCH), TeacherStudentData(**ARCH, batch_size=16, heldout_size=32)
    )
    result = dynamics("spectra", no_states)
    one_line_error(result)
    assert "θ0" in result.stderr


def test_report_has_the_section_and_compare_overlays(runs, dynamics, tmp_path) -> None:
    report = tmp_path / "report.html"
    assert dynamics("report", runs[0], "-o", report).returncode == 0
    page = report.read_text()
    assert "<h3>Weight spectra</h3>" in page and "Spectral norm" in page
    compare = tmp_path / "compare.html"
    result = dynamics("compare", *runs, "-o", compare, "--barrier-points", "0")
    assert result.returncode == 0, result.stderr
    page = compare.read_text()
    assert "Spectral norm" in page
    for label in ("a", "b"):  # both runs' lines, overlaid (as plotly's JSON spells them)
        assert json.dumps(f"{label} · student.blocks.0.up.weight (θt)")[1:-1] in page
