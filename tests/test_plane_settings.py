"""The plane's settings are checked once, in the library, before any run is read: a bad value
raises ParameterError naming the parameter (the CLI spells it as its flag)."""

import os

import pytest

from dynamics.analysis.measures.plane_grid import MAX_MARGIN, check_plane_settings
from dynamics.analysis.pages.plane import write_plane
from dynamics.errors import ParameterError

CORES = os.cpu_count() or 1


@pytest.mark.parametrize(
    ("settings", "parameter", "problem"),
    [
        ({"grid_side": 1}, "grid_side", "must be at least 2, got 1"),
        ({"grid_side": 10**7}, "grid_side", "10000000 needs at least"),
        ({"grid_side": 5, "coarse": 9}, "coarse", "between 2 and the grid side (5), got 9"),
        ({"coarse": 1}, "coarse", "got 1"),
        ({"processes": 0}, "processes", "must be at least 1"),
        ({"processes": CORES + 1}, "processes", f"at most this machine's {CORES} cores"),
        ({"margin": -0.5}, "margin", f"must be a number from 0 to {MAX_MARGIN}"),
        ({"margin": float("nan")}, "margin", "got nan"),
        ({"plane": "diagonal"}, "plane", "must be one of auto, gradients"),
    ],
)
def test_bad_settings_name_their_parameter_before_any_run_is_read(
    tmp_path, settings, parameter, problem
):
    with pytest.raises(ParameterError) as refused:
        check_plane_settings(**settings)
    assert refused.value.parameter == parameter and problem in refused.value.problem
    assert "--" not in str(refused.value)  # a library message names no CLI flag
    # write_plane refuses them first: the runs named here do not exist
    missing = [tmp_path / "a.h5", tmp_path / "b.h5"]
    kind = settings.pop("plane", "auto")
    with pytest.raises(ParameterError) as again:
        write_plane(*missing, tmp_path / "p.html", plane=kind, **settings)
    assert again.value.parameter == parameter
    assert not list(tmp_path.iterdir())  # nothing written


def test_good_settings_pass():
    check_plane_settings("pca", grid_side=41, margin=0.25, coarse=9, processes=1)
    check_plane_settings(grid_side=2, coarse=2, margin=MAX_MARGIN)
