"""The paper's controlled experiment (seed 002, §2.2): students regress a teacher's outputs.

``model`` (the residual MLP), ``streams`` (its random streams), ``module`` (the student),
``data`` (the teacher's data), ``config`` (its config) and ``experiment`` (its variants and
probes).
"""
