"""The scale-up in miniature, language (seed 002, §4): a character transformer on the standard
library's source, with and without adaptive shifting of its MLP activations.

``model`` (the transformer), ``module`` (next-byte prediction), ``data`` (the text), ``config``
and ``experiment``.
"""
