"""Bias tools for any PyTorch model: activation shifting, bias audit, bias initialization.

The names load on first use: the audit's result (:mod:`dynamics.bias.audit_result`) is
torch-free, so that a report of a recorded audit never imports torch.
"""

from dynamics.exports import lazy_exports

_HOMES = {
    "audit": "dynamics.bias.auditing",
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
__all__, __getattr__, __dir__ = lazy_exports(__name__, _HOMES)
