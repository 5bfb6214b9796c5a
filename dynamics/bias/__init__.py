"""Bias tools for any PyTorch model: activation shifting, bias audit, bias initialization."""
