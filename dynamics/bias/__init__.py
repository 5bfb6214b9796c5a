"""Bias tools for any PyTorch model: activation shifting, bias audit, bias initialization."""

from dynamics.bias.init import BiasSet, init_biases

__all__ = ["BiasSet", "init_biases"]
