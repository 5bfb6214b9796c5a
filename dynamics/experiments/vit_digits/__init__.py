"""The scale-up in miniature, vision (seed 002, §4.1): a small vision transformer on
scikit-learn's 8×8 digits, with and without adaptive shifting of its MLP activations.

``model`` (the transformer), ``module`` (classification), ``data`` (the digits), ``config`` and
``experiment``.
"""
