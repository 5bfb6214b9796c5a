"""BlockHessian: each diagonal block H_bb of the Hessian against the dense Hessian's block, the
block traces against tr H, Hutchinson on shared probes against the block-diagonal part, the
probe contract, and recorded runs (teacher–student, an SDPA GPT-2) drawn by report and compare."""

from __future__ import annotations

import json
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

import dynamics
from dynamics import open_run
from dynamics.analysis import figures
from dynamics.analysis.pages.run_comparison import write_comparison
from dynamics.analysis.pages.run_report import write_report
from dynamics.callbacks import (
    BlockHessian,
    DynamicsRecorder,
    HessianSpectrum,
    TrainingLoss,
    check_probe,
)
from dynamics.callbacks.hessian_measurement import SpectrumRow
from dynamics.curvature import BlockOperator, hutchinson, layout_coordinates
from dynamics.errors import ParameterError
from dynamics.experiments.teacher_student.data import TeacherStudentData
from dynamics.experiments.teacher_student.module import TeacherStudentModule
from dynamics.params.layout import ParameterLayout
from dynamics.params.vectors import flatten
from tests import tiny_gpt2

ARCHITECTURE = dict(width=8, expansion=2, depth=2)


class Regressor(pl.LightningModule):
    """44 parameters in float64: two Linear layers around a tanh."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, _):
        return F.mse_loss(self(batch[0]), batch[1])


class Dense:
    """A matrix as a LinearOperator (the reference the blocks are checked against)."""

    def __init__(self, matrix: torch.Tensor) -> None:
        self.matrix, self.size = matrix, len(matrix)
        self.dtype, self.device = matrix.dtype, matrix.device

    def matvec(self, vector: torch.Tensor) -> torch.Tensor:
        return self.matrix @ vector


def _regressor() -> tuple[Regressor, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    module = Regressor()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=generator, dtype=torch.float64)
    return module, (x, torch.randn(32, 2, generator=generator, dtype=torch.float64))


def _dense_hessian(module: Regressor, batch) -> torch.Tensor:
    """torch.autograd.functional.hessian of the loss in the flat parameters (layout order)."""
    layout = ParameterLayout.of(module)
    x, y = batch

    def loss(theta: torch.Tensor) -> torch.Tensor:
        tensors = dict(zip(layout.names, layout.split(theta)))
        return F.mse_loss(torch.func.functional_call(module, tensors, (x,)), y)

    return torch.autograd.functional.hessian(loss, flatten(module.parameters()))


def _block_rows(measurement: BlockHessian, module, batch, fit=None) -> dict:
    probe = HessianSpectrum(k=2, tol=1e-10, batch=batch, measurements=[measurement])
    probe.setup(fit or SimpleNamespace(strategy=None), module, batch)
    probe.on_step_start(None, module, batch, 0)
    rows = probe.on_step_end(None, module, batch, None, 0)
    assert set(probe.series()["hessian_blocks"]) == set(rows["hessian_blocks"])
    return rows["hessian_blocks"]


def _index(coordinates) -> torch.Tensor:
    if isinstance(coordinates, slice):
        return torch.arange(coordinates.start, coordinates.stop)
    return coordinates


def test_block_operator_is_the_matrix_block_for_ranges_and_index_sets() -> None:
    torch.manual_seed(0)
    a = torch.randn(9, 9, dtype=torch.float64)
    matrix = a + a.T
    v = torch.randn(3, dtype=torch.float64)
    for coordinates in (slice(2, 5), torch.tensor([7, 0, 4])):
        block = BlockOperator(Dense(matrix), coordinates)
        index = _index(coordinates)
        assert block.size == 3
        torch.testing.assert_close(
            block.matvec(v), matrix[index][:, index] @ v, rtol=1e-14, atol=1e-14
        )
    for bad, message in [
        (slice(3, 3), "is empty"),
        (slice(0, 9, 2), "takes no step"),
        (slice(0, 10), "outside range"),
        (torch.tensor([1, 1]), "repeat"),
        (torch.tensor([9]), "outside range"),
    ]:
        with pytest.raises(ValueError, match=message):
            BlockOperator(Dense(matrix), bad)


def test_layout_coordinates_are_a_range_when_consecutive_else_indices() -> None:
    layout = ParameterLayout(("a", "b", "c"), ((2, 3), (4,), (5,)))
    assert layout_coordinates(layout, ["b", "a"]) == slice(0, 10)
    assert layout_coordinates(layout, ["c"]) == slice(10, 15)
    split = layout_coordinates(layout, ["a", "c"])
    assert split.tolist() == [*range(6), *range(10, 15)]
    with pytest.raises(ValueError, match="no parameter 'd'"):
        layout_coordinates(layout, ["d"])


@pytest.mark.parametrize(
    "blocks, expected",
    [
        (
            "layers",
            {"net.0": ["net.0.weight", "net.0.bias"], "net.2": ["net.2.weight", "net.2.bias"]},
        ),
        (  # index sets: each block is two pieces of the flat layout
            {"weights": ["net.*.weight"], "biases": ["net.*.bias"]},
            {"weights": ["net.0.weight", "net.2.weight"], "biases": ["net.0.bias", "net.2.bias"]},
        ),
    ],
)
def test_each_block_matches_the_dense_hessian_block_and_exact_traces_sum_to_tr_h(
    blocks, expected
) -> None:
    module, batch = _regressor()
    measurement = BlockHessian(blocks, k=3, trace_hvp="exact", tol=1e-10)
    row = _block_rows(measurement, module, batch)
    assert measurement.members == expected
    hessian = _dense_hessian(module, batch)
    layout = ParameterLayout.of(module)
    top_full = torch.linalg.eigvalsh(hessian).max().item()
    traces = []
    for b, members in enumerate(expected.values()):
        index = _index(layout_coordinates(layout, members))
        block = hessian[index][:, index]
        exact = torch.linalg.eigvalsh(block).flip(0)[:3].numpy()
        np.testing.assert_allclose(row["eigenvalues"][b], exact, rtol=1e-6, atol=1e-9)
        assert row["lambda_max"][b] == row["eigenvalues"][b, 0]
        assert row["converged"][b] == 1
        assert row["lambda_max"][b] < top_full  # a block, not the whole Hessian (interlacing)
        assert row["trace"][b] == pytest.approx(block.trace().item(), rel=1e-10)
        assert row["trace_stderr"][b] == 0 and row["n_hvp"][b] > len(index)
        traces.append(row["trace"][b])
    # The identity: the exact traces of blocks covering every parameter sum to tr H.
    assert sum(traces) == pytest.approx(hessian.trace().item(), rel=1e-10)
    assert all(p.grad is None for p in module.parameters())


def test_hutchinson_on_shared_probes_sums_to_hutchinson_of_the_block_diagonal_part() -> None:
    module, batch = _regressor()
    measurement = BlockHessian(
        {"weights": ["net.*.weight"], "biases": ["net.*.bias"]}, k=1, trace_hvp=8
    )
    row = _block_rows(measurement, module, batch)
    hessian = _dense_hessian(module, batch)
    layout = ParameterLayout.of(module)
    diagonal_part = torch.zeros_like(hessian)
    for members in measurement.members.values():  # index sets, two pieces each
        index = _index(layout_coordinates(layout, members))
        diagonal_part[index[:, None], index] = hessian[index][:, index]
    # The probe's seed is 0: the block estimates use the vectors hutchinson(seed=0) draws.
    shared = hutchinson(Dense(diagonal_part), 8, seed=0).trace
    assert row["trace"].sum() == pytest.approx(shared, rel=1e-12)
    # What the identity rules out: the whole Hessian's estimate on the same vectors (its
    # off-diagonal blocks count), another seed's vectors, and the exact trace all differ.
    gap = 1e-3 * abs(shared)
    assert abs(hutchinson(Dense(hessian), 8, seed=0).trace - shared) > gap
    assert abs(hutchinson(Dense(diagonal_part), 8, seed=1).trace - shared) > gap
    assert abs(hessian.trace().item() - shared) > gap
    assert (row["trace_stderr"] > 0).all()


def test_optimizer_groups_are_blocks_named_by_their_names() -> None:
    module, batch = _regressor()
    optimizer = torch.optim.SGD(
        [
            {"params": [module.net[0].weight, module.net[2].weight], "name": "matrices"},
            {"params": [module.net[0].bias]},
        ],
        lr=0.1,
    )
    measurement = BlockHessian("groups", trace_hvp=4)
    row = _block_rows(
        measurement, module, batch, SimpleNamespace(strategy=None, optimizers=[optimizer])
    )
    assert measurement.members == {
        "matrices": ["net.0.weight", "net.2.weight"],
        "group_1": ["net.0.bias"],
    }
    assert row["eigenvalues"].shape == (2, 2) and np.isfinite(row["eigenvalues"]).all()


def test_a_block_smaller_than_k_has_its_own_size_of_eigenvalues_then_nan() -> None:
    module, batch = _regressor()
    row = _block_rows(BlockHessian({"out_bias": ["net.2.bias"]}, k=3), module, batch)
    hessian = _dense_hessian(module, batch)
    exact = torch.linalg.eigvalsh(hessian[-2:, -2:]).flip(0).numpy()
    np.testing.assert_allclose(row["eigenvalues"][0, :2], exact, rtol=1e-6)
    assert np.isnan(row["eigenvalues"][0, 2]) and np.isnan(row["residuals"][0, 2])


def test_bad_blocks_are_refused_in_one_line() -> None:
    module, batch = _regressor()
    with pytest.raises(ParameterError, match="^blocks must be 'layers', 'groups' or"):
        BlockHessian("layer")
    with pytest.raises(ParameterError, match="^blocks block 'a': give a list of glob patterns"):
        BlockHessian({"a": "net.*"})
    with pytest.raises(ParameterError, match="^trace_hvp must be 0, at least 2 or 'exact'"):
        BlockHessian(trace_hvp=1)
    refused = [
        ({"a": ["net.0"]}, "^blocks block 'a': no trainable parameter matches \\['net.0'\\]"),
        ({"a": ["net.0.*"], "b": ["**.bias"]}, "^blocks 'a' and 'b' both hold 'net.0.bias'"),
        ("groups", "^blocks 'groups' needs the fit's optimizers"),
    ]
    for blocks, message in refused:
        with pytest.raises(ParameterError, match=message) as error:
            _block_rows(BlockHessian(blocks), module, batch)
        assert "\n" not in str(error.value)


def test_the_probe_contract_holds(small_cnn) -> None:
    generator = torch.Generator().manual_seed(0)
    batch = torch.randn(16, 1, 8, 8, generator=generator), torch.randint(0, 3, (16,))
    probe = HessianSpectrum(
        k=2, every_n_steps=1, measurements=[BlockHessian("layers", k=2, trace_hvp=2)]
    )
    series = check_probe(probe, small_cnn(), batch, steps=2)
    blocks = series["hessian_blocks"]
    assert np.isfinite(blocks["lambda_max"]).all() and np.isfinite(blocks["trace"]).all()


def _teacher_student_fit(path, quiet_trainer, with_blocks: bool) -> torch.Tensor:
    pl.seed_everything(0, verbose=False)
    module = TeacherStudentModule(**ARCHITECTURE)
    data = TeacherStudentData(**ARCHITECTURE, batch_size=16)
    callbacks = []
    if with_blocks:
        measurements = [BlockHessian("layers", k=2, trace_hvp=4)]
        probe = HessianSpectrum(k=2, every_n_steps=3, measurements=measurements)
        callbacks = [DynamicsRecorder(path, probes=[TrainingLoss(), probe])]
    quiet_trainer(max_steps=6, callbacks=callbacks).fit(module, data)
    return flatten(module.parameters())


def test_teacher_student_records_finite_rows_bit_identically_and_report_and_compare_draw_them(
    tmp_path, quiet_trainer
) -> None:
    runs = [tmp_path / "a.h5", tmp_path / "b.h5"]
    recorded = _teacher_student_fit(runs[0], quiet_trainer, with_blocks=True)
    assert torch.equal(recorded, _teacher_student_fit(None, quiet_trainer, with_blocks=False))
    _teacher_student_fit(runs[1], quiet_trainer, with_blocks=True)
    run = open_run(runs[0])
    series = run.series("hessian_blocks")
    assert list(series.step) == [0, 3]
    for name in ("lambda_max", "eigenvalues", "trace", "trace_stderr"):
        assert np.isfinite(series[name]).all(), name
    with h5py.File(runs[0], "r") as file:
        columns = json.loads(file["series/hessian_blocks/lambda_max"].attrs["columns"])
    layers = [f"student.blocks.{i}.{layer}" for i in range(2) for layer in ("norm", "up", "down")]
    assert columns == layers
    figure = figures.group(run, "hessian_blocks")
    lines = [t for t in figure.data if t.name]
    assert len(lines) >= 2 * series["lambda_max"].shape[1]  # λ1 and trace, one line per block
    report = write_report(runs, tmp_path / "report.html")
    comparison = write_comparison(runs, tmp_path / "compare.html", barrier_points=0)
    for page in (report.path, comparison.path):
        html = page.read_text()
        assert "Top eigenvalue of each Hessian block" in html
        assert "Trace of each Hessian block" in html


def test_an_sdpa_gpt2_records_finite_block_rows(tmp_path) -> None:
    net = tiny_gpt2.model()
    optimizer = tiny_gpt2.optimizer(net)
    blocks = {"attention": ["**.attn.**"], "mlp": ["**.mlp.**"], "embeddings": ["transformer.w*.*"]}
    probe = HessianSpectrum(
        k=2, every_n_steps=2, measurements=[BlockHessian(blocks, k=2, trace_hvp=2)]
    )
    path = tmp_path / "gpt2.h5"
    with dynamics.record(path, net, optimizer, loss_fn=tiny_gpt2.loss, probes=[probe]) as rec:
        for batch in list(tiny_gpt2.loader(count=12))[:3]:
            with rec.batch(batch) as b:
                loss = tiny_gpt2.loss(net, batch)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                b.loss(loss)
    series = open_run(path).series("hessian_blocks")
    assert list(series.step) == [0, 2]
    assert np.isfinite(series["eigenvalues"]).all() and np.isfinite(series["trace"]).all()
    assert (series["lambda_max"] > 0).all()


def test_a_block_with_values_not_finite_fails_the_row_by_name() -> None:
    module, batch = _regressor()
    measurement = BlockHessian("layers", k=2, trace_hvp=2)
    _block_rows(measurement, module, batch)  # set up on the module: blocks net.0 and net.2
    matrix = torch.eye(44, dtype=torch.float64)
    matrix[40, 40] = float("nan")  # in net.2's weight
    row = SpectrumRow(Dense(matrix), None, None, step=3, seed=0)
    with pytest.raises(
        FloatingPointError, match="^BlockHessian at step 3, block 'net.2': a Hessian-vector"
    ):
        measurement.measure(row)

    # Products Lanczos never saw: an operator that fails only on ±1 vectors (the trace's).
    class FailsOnSigns(Dense):
        def matvec(self, vector):
            product = super().matvec(vector)
            signs = ((vector == 0) | (vector.abs() == 1)).all()
            return product * float("nan") if signs else product

    row = SpectrumRow(FailsOnSigns(torch.eye(44, dtype=torch.float64)), None, None, 4, 0)
    with pytest.raises(FloatingPointError, match="^BlockHessian at step 4, block 'net.0': the"):
        measurement.measure(row)


def test_the_probes_blocks_keyword_is_the_measurement_with_the_probes_k():
    probe = HessianSpectrum(k=3, blocks="layers")
    assert [type(m) for m in probe.measurements] == [BlockHessian]
    assert probe.measurements[0].blocks == "layers"
    with pytest.raises(ParameterError, match="more than once"):
        HessianSpectrum(blocks="layers", measurements=[BlockHessian("groups")])
