"""Notebook use: series as pandas tables and xarray arrays, named as the run file names them."""

import sys

import numpy as np
import pytest

from dynamics import open_run
from dynamics.errors import DynamicsError
from dynamics.store import RunWriter, SeriesSpec, names


@pytest.fixture(scope="module")
def run(recorded_runs):
    return open_run(recorded_runs[0])


def test_wide_table_is_indexed_by_step_with_the_recorded_column_names(run):
    norms = run.series(names.HIDDEN_NORMS)
    frame = norms.to_pandas()
    assert frame.index.name == "step"
    np.testing.assert_array_equal(frame.index, norms.step)
    layers = run.columns(names.HIDDEN_NORMS, names.HIDDEN_NORM)
    assert tuple(frame[names.HIDDEN_NORM].columns) == layers == norms.columns["norm"]
    np.testing.assert_array_equal(frame[names.HIDDEN_NORM].to_numpy(), norms[names.HIDDEN_NORM])
    # A scalar series is one column, read as a pandas Series by its name.
    loss = run.series(names.LOSS).to_pandas()[names.LOSS_TRAIN]
    np.testing.assert_array_equal(loss.to_numpy(), run.train_loss().values)


def test_wide_table_keeps_every_series_of_a_group_and_its_dtypes(run):
    hessian = run.series(names.HESSIAN)
    frame = hessian.to_pandas()
    assert tuple(frame[names.HESSIAN_EIGENVALUES].columns) == ("lambda_1", "lambda_2")
    np.testing.assert_array_equal(
        frame[names.HESSIAN_EIGENVALUES].to_numpy(), hessian[names.HESSIAN_EIGENVALUES]
    )
    assert frame[names.HESSIAN_N_HVP].dtype == hessian[names.HESSIAN_N_HVP].dtype
    # Rows of several axes: one column per entry, leading index first (2 runs × nodes).
    nodes = hessian[names.HESSIAN_DENSITY_NODES]
    density = frame[names.HESSIAN_DENSITY_NODES]
    assert density.shape == (len(hessian), nodes.shape[1] * nodes.shape[2])
    assert density.columns[nodes.shape[2]] == "1/density_nodes_0"
    np.testing.assert_array_equal(density["1/density_nodes_0"], nodes[:, 1, 0])
    assert set(frame.columns.get_level_values("series")) == set(hessian.values)


def test_long_table_holds_one_row_per_value(run):
    norms = run.series(names.HIDDEN_NORMS)
    long = norms.to_pandas(long=True)
    assert list(long.columns) == ["step", "series", "column", "value"]
    assert len(long) == norms[names.HIDDEN_NORM].size
    layer = run.columns(names.HIDDEN_NORMS, names.HIDDEN_NORM)[1]
    rows = long[long["column"] == layer]
    np.testing.assert_array_equal(rows["step"], norms.step)
    np.testing.assert_array_equal(rows["value"], norms[names.HIDDEN_NORM][:, 1])


def test_dataset_dimensions_are_named_after_what_they_index(run):
    norms = run.series(names.HIDDEN_NORMS).to_xarray()
    norm = norms[names.HIDDEN_NORM]
    assert norm.dims == ("step", "layer")
    assert tuple(norm["layer"].values) == run.columns(names.HIDDEN_NORMS, names.HIDDEN_NORM)
    assert norm.attrs["long_name"] == "mean ‖h‖"
    second = run.columns(names.HIDDEN_NORMS, names.HIDDEN_NORM)[1]
    np.testing.assert_array_equal(
        norm.sel(layer=second).values, run.series(names.HIDDEN_NORMS)["norm"][:, 1]
    )
    hessian = run.series(names.HESSIAN).to_xarray()
    assert hessian[names.HESSIAN_EIGENVALUES].dims == ("step", "eigen_index")
    assert hessian[names.HESSIAN_RESIDUALS].dims == ("step", "eigen_index")
    assert list(hessian["eigen_index"].values) == ["lambda_1", "lambda_2"]
    assert hessian[names.HESSIAN_DENSITY_NODES].dims == ("step", "density_run", "node")
    np.testing.assert_array_equal(hessian["step"], run.series(names.HESSIAN).step)
    # A user's probe: its columns name the last axis after the series.
    user = run.series("head_norms").to_xarray()["norm"]
    assert user.dims == ("step", "norm_column")
    assert list(user["norm_column"].values) == ["weight", "bias"]


def test_run_tree_has_one_node_per_group_and_leaves_snapshots_unless_named(run):
    tree = run.to_xarray()
    assert names.SNAPSHOTS in run.groups
    assert set(tree.children) == set(run.groups) - {names.SNAPSHOTS}
    assert tree.attrs["run_name"] == run.name
    np.testing.assert_array_equal(tree["loss"]["train"].values, run.train_loss().values)
    np.testing.assert_array_equal(tree["validation"]["step"], run.series(names.VALIDATION).step)
    snapshots = run.to_xarray([names.SNAPSHOTS])
    theta = snapshots[names.SNAPSHOTS][names.SNAPSHOT_THETA]
    assert theta.dims == ("step", "parameter") and theta.sizes["step"] > 0
    np.testing.assert_array_equal(theta.values, run.series(names.SNAPSHOTS)["theta"])


def test_a_group_without_rows_is_empty_with_its_columns_named(tmp_path):
    spec = SeriesSpec((2,), columns=("a", "b"))
    RunWriter.create(tmp_path / "empty.h5", {names.HIDDEN_NORMS: {"norm": spec}}, {}, {}).close()
    norms = open_run(tmp_path / "empty.h5").series(names.HIDDEN_NORMS)
    frame = norms.to_pandas()
    assert frame.empty and list(frame["norm"].columns) == ["a", "b"]
    assert norms.to_pandas(long=True).empty
    norm = norms.to_xarray()["norm"]
    assert norm.dims == ("step", "layer") and norm.shape == (0, 2)


@pytest.mark.parametrize(
    ("module", "call"),
    [
        ("pandas", lambda run: run.series(names.LOSS).to_pandas()),
        ("xarray", lambda run: run.series(names.LOSS).to_xarray()),
        ("xarray", lambda run: run.to_xarray()),
    ],
)
def test_a_missing_optional_package_says_how_to_install_it(run, monkeypatch, module, call):
    monkeypatch.setitem(sys.modules, module, None)  # what an uninstalled package raises
    with pytest.raises(
        DynamicsError,
        match=rf"^{module} is not installed; pip install 'dynamics-for-pytorch\[notebook\]'$",
    ):
        call(run)
