"""Bias tools for any PyTorch model: activation shifting, bias audit, bias initialization.

The names load on first use: the audit's result (:mod:`dynamics.bias.audit_result`) is
torch-free, so that a report of a recorded audit never imports torch.
"""

import importlib
from typing import Any

_HOMES = {
    "audit": "dynamics.bias.audit",
    "BiasSet": "dynamics.bias.init",
    "init_biases": "dynamics.bias.init",
    "ShiftRow": "dynamics.bias.shift",
    "ShiftTable": "dynamics.bias.shift",
    "shift_activations": "dynamics.bias.shift",
    "Activation": "dynamics.bias.audit_result",
    "AuditResult": "dynamics.bias.audit_result",
    "Layer": "dynamics.bias.audit_result",
    "Origin": "dynamics.bias.audit_result",
    "ParameterCount": "dynamics.bias.audit_result",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'dynamics.bias' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)


def __dir__() -> list[str]:
    return __all__
