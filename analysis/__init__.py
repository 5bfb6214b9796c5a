"""Offline analysis of run files: never imports Lightning.

The figures of the report and comparison pages, one call per view of a run, are in
:mod:`dynamics.analysis.figures` (``from dynamics.analysis import figures``).
"""

from dynamics.analysis.measures.overshoot import OvershootReport, detect_overshoot

__all__ = ["OvershootReport", "detect_overshoot"]
