"""The numbers of the offline analysis: what pages print and figures draw, without plotly or
HTML (overshoot verdicts, comparisons of runs and of seed groups, loss barriers, the plane
grid). Each module is named after what it measures; its figure, where it has one, has the same
name in :mod:`dynamics.analysis.figures`, its page section in :mod:`dynamics.analysis.pages`.
"""
