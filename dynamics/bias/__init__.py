"""Bias tools for any PyTorch model: activation shifting, bias audit, bias initialization."""

from dynamics.bias.shift import ShiftRow, ShiftTable, shift_activations

__all__ = ["ShiftRow", "ShiftTable", "shift_activations"]
