"""dynamics: training-dynamics analysis for PyTorch Lightning."""

from dynamics.store import Run, RunFileError, open_run

__version__ = "0.1.0"
__all__ = ["Run", "RunFileError", "open_run", "__version__"]
