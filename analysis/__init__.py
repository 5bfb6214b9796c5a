"""Offline analysis of run files: never imports Lightning.

Three roles, each a folder, one module name per measure in each: the numbers
(:mod:`dynamics.analysis.measures`), their plotly figures (:mod:`dynamics.analysis.figures`,
one call per view of a run: ``from dynamics.analysis import figures``) and the HTML pages
(:mod:`dynamics.analysis.pages`). ``docs/architecture.md`` says which goes where.

Example::

    from dynamics.analysis import detect_overshoot, figures

    figures.hidden_norms("runs/demo/shifted.h5").show()
"""

from dynamics.analysis.measures.overshoot import OvershootReport, detect_overshoot

__all__ = ["OvershootReport", "detect_overshoot"]
