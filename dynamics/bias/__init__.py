"""Bias tools for any PyTorch model: activation shifting, bias audit, bias initialization."""

from dynamics.bias.audit import Activation, BiasAudit, Layer, Origin, ParameterCount, audit
from dynamics.bias.init import BiasSet, init_biases
from dynamics.bias.shift import ShiftRow, ShiftTable, shift_activations

__all__ = [
    "Activation",
    "BiasAudit",
    "BiasSet",
    "Layer",
    "Origin",
    "ParameterCount",
    "ShiftRow",
    "ShiftTable",
    "audit",
    "init_biases",
    "shift_activations",
]
