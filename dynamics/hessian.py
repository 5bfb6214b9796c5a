"""Alias of :mod:`dynamics.curvature`, the one curvature face (kept for code written earlier)."""

from dynamics.curvature import *  # noqa: F403
from dynamics.curvature import __all__  # noqa: F401
