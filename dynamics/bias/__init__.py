"""Bias tools for any PyTorch model: activation shifting, bias audit, bias initialization."""

from dynamics.bias.audit import audit
from dynamics.bias.audit_result import Activation, AuditResult, Layer, Origin, ParameterCount
from dynamics.bias.init import BiasSet, init_biases
from dynamics.bias.shift import ShiftRow, ShiftTable, shift_activations

__all__ = [
    "Activation",
    "AuditResult",
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
