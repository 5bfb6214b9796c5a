"""Plotly figures of recorded runs: one call per view, for a notebook or a page.

Two levels, both public and stable, importable from here (``from dynamics.analysis import
figures``):

- **Views of runs** (:mod:`.runs`, :mod:`.plane`): :func:`loss`, :func:`hidden_norms`,
  :func:`eigenvalues`, :func:`displacement`, :func:`spectral_density`, :func:`plane_path`,
  :func:`plane_share`, :func:`group`. Each takes a run (a :class:`~dynamics.store.Run` or a
  path) or several and returns the figure ``dynamics report`` (one run) or ``dynamics compare``
  (several) draws of it.
- **Builders** (``*_figure``, :mod:`.lines`, :mod:`.series`): pure functions of arrays (or
  :class:`Curve` and :class:`SeriesView` bundles of them) that the views above and the pages
  are made of. :func:`view_figure` and :func:`compared_view_figure` draw any series as the
  :class:`~dynamics.store.View` it was recorded with says.

Which groups are drawn otherwise than from their views alone is one table,
:mod:`.dedicated_views`.

Example::

    from dynamics.analysis import figures

    figures.hidden_norms("runs/demo/shifted.h5").show()
    figures.loss(["runs/demo/unshifted.h5", "runs/demo/shifted.h5"]).show()
"""

from dynamics.analysis.figures.lines import (
    DISPLAY_BUDGET,
    Curve,
    Decimated,
    decimate,
    line_figure,
    run_colors,
)
from dynamics.analysis.figures.plane import (
    plane_figure,
    plane_path,
    plane_paths_figure,
    plane_share,
)
from dynamics.analysis.figures.runs import (
    displacement,
    eigenvalues,
    group,
    hidden_norms,
    loss,
    loss_figure,
    spectral_density,
)
from dynamics.analysis.figures.series import compared_view_figure, density_figure, view_figure
from dynamics.analysis.measures.run_series import Peak, RunLike, SeriesView

__all__ = [
    "DISPLAY_BUDGET",
    "Curve",
    "Decimated",
    "Peak",
    "RunLike",
    "SeriesView",
    "compared_view_figure",
    "decimate",
    "density_figure",
    "displacement",
    "eigenvalues",
    "group",
    "hidden_norms",
    "line_figure",
    "loss",
    "loss_figure",
    "plane_figure",
    "plane_path",
    "plane_paths_figure",
    "plane_share",
    "run_colors",
    "spectral_density",
    "view_figure",
]
