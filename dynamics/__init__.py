"""dynamics: training-dynamics analysis for PyTorch Lightning."""

__version__ = "0.1.0"
