"""Recorded series as pandas tables and labelled xarray arrays, for notebooks.

pandas and xarray are optional (``pip install 'dynamics-for-pytorch[notebook]'``): they are
imported when a table or an array is asked for, never by the rest of the toolkit, so ``dynamics
info`` and the reports start without them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import numpy as np

from dynamics.errors import DynamicsError
from dynamics.store import names

if TYPE_CHECKING:
    import pandas as pd
    import xarray as xr

    from dynamics.store.reader import Run, Series

#: Names of the axes of one row of the standard series (after ``step``). A user's series names
#: its last axis ``<series>_column`` and any axis before it ``<series>_axis<i>``.
STANDARD_AXES: dict[tuple[str, str], tuple[str, ...]] = {
    (names.HIDDEN_NORMS, names.HIDDEN_NORM): ("layer",),
    (names.ACTIVATION_BIAS, names.ACTIVATION_MEAN): ("layer",),
    (names.DISPLACEMENT, names.DISPLACEMENT_PER_TENSOR): ("tensor",),
    (names.SNAPSHOTS, names.SNAPSHOT_THETA): ("parameter",),
    (names.HESSIAN, names.HESSIAN_EIGENVALUES): ("eigen_index",),
    (names.HESSIAN, names.HESSIAN_RESIDUALS): ("eigen_index",),
    (names.HESSIAN, names.HESSIAN_ERROR_BOUNDS): ("eigen_index",),
    # One stochastic Lanczos quadrature per density run, one node per Lanczos step.
    (names.HESSIAN, names.HESSIAN_DENSITY_NODES): ("density_run", "node"),
    (names.HESSIAN, names.HESSIAN_DENSITY_WEIGHTS): ("density_run", "node"),
}

#: Groups :meth:`Run.to_xarray` leaves out unless named: parameter snapshots can hold gigabytes.
UNREAD_BY_DEFAULT = (names.SNAPSHOTS,)

_INSTALL = "pip install 'dynamics-for-pytorch[notebook]'"


def default_columns(name: str, width: int) -> tuple[str, ...]:
    """Names of the last axis of a series that recorded none: ``<name>_0``, ``<name>_1``, ..."""
    return tuple(f"{name}_{j}" for j in range(width))


def series_frame(series: Series, long: bool = False) -> pd.DataFrame:
    """The group's rows as a DataFrame; see :meth:`Series.to_pandas`."""
    pd = _require("pandas")
    data = {}
    for name, values in series.values.items():
        labels = _column_labels(name, values.shape[1:], series.columns.get(name))
        entries = values.reshape(len(values), len(labels))  # -1 cannot size an empty group
        for label, column in zip(labels, entries.T):
            data[(name, label)] = column
    wide = pd.DataFrame(data, index=pd.Index(series.step, name="step"))
    wide.columns.names = ["series", "column"]
    if not long:
        return wide
    return wide.melt(ignore_index=False, value_name="value").reset_index()


def series_dataset(series: Series) -> xr.Dataset:
    """The group's rows as an xarray Dataset; see :meth:`Series.to_xarray`."""
    xr = _require("xarray")
    variables, coords = {}, {"step": series.step}
    for name, values in series.values.items():
        dims = ("step", *_axes(series.group, name, values.ndim - 1))
        view = series.views.get(name)
        attrs = {"long_name": view.y_label or view.title} if view else {}
        if view and view.units:
            attrs["units"] = view.units
        variables[name] = xr.Variable(dims, values, attrs=attrs)
        if name in series.columns:  # the file names the last axis: its labels are coordinates
            coords[dims[-1]] = list(series.columns[name])
    return xr.Dataset(variables, coords=coords, attrs={"group": series.group})


def run_tree(run: Run, groups: list[str] | None = None) -> xr.DataTree:
    """Every group of the run as one node of a DataTree; see :meth:`Run.to_xarray`."""
    xr = _require("xarray")
    if groups is None:
        groups = [g for g in run.groups if g not in UNREAD_BY_DEFAULT]
    nodes = {f"/{group}": _tree_safe(run.series(group).to_xarray()) for group in groups}
    tree = xr.DataTree.from_dict(nodes, name=run.name)
    tree.attrs = {"run_name": run.name, "path": str(run.path)}
    return tree


def _tree_safe(dataset: xr.Dataset) -> xr.Dataset:
    """A DataTree refuses variables named with "/" (Lightning's ``val_loss/dataloader_idx_0``):
    those take their dataset's safe name (:func:`names.series_name`), the name as logged kept
    in the variable's ``declared_name`` attribute."""
    renamed = {n: names.series_name(n) for n in dataset.data_vars if "/" in str(n)}
    dataset = dataset.rename(renamed)
    for original, safe in renamed.items():
        dataset[safe].attrs[names.ATTR_NAME] = original
    return dataset


def _column_labels(
    name: str, row_shape: tuple[int, ...], columns: tuple[str, ...] | None
) -> list[str]:
    """One label per entry of a row: "" for a scalar, the column's name along the last axis,
    prefixed by the leading axes' indices (``0/node_3``) for rows of several axes."""
    if not row_shape:
        return [""]
    last = columns or default_columns(name, row_shape[-1])
    return ["/".join([*map(str, index), c]) for index in np.ndindex(row_shape[:-1]) for c in last]


def _axes(group: str, name: str, count: int) -> tuple[str, ...]:
    axes = STANDARD_AXES.get((group, name))
    if axes is not None and len(axes) == count:
        return axes
    if not count:
        return ()
    return (*(f"{name}_axis{i}" for i in range(count - 1)), f"{name}_column")


def _require(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise DynamicsError(f"{module} is not installed; {_INSTALL}") from error
