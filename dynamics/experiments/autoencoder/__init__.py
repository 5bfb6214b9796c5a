"""The paper's autoencoder (seed 002, §3.2, Fig. 5): a convolutional autoencoder on
scikit-learn's 8×8 digits, with and without shifted ReLUs.

``model`` (the network), ``module`` (reconstruction), ``data`` (the digits), ``config`` and
``experiment``.
"""
