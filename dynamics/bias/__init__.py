"""Bias tools for any PyTorch model: activation shifting, bias audit, bias initialization."""

from dynamics.bias.init import BiasSet, init_biases
from dynamics.bias.shift import ShiftRow, ShiftTable, shift_activations

__all__ = ["BiasSet", "ShiftRow", "ShiftTable", "init_biases", "shift_activations"]
