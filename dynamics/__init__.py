"""dynamics: training-dynamics analysis for PyTorch Lightning and other training loops."""

from dynamics.exports import lazy_exports
from dynamics.store import Run, RunFileError, open_run

__version__ = "0.1.0"
# record() (a plain or accelerate loop's recorder) imports torch, watch() (a notebook's live
# widget) plotly and ipywidgets: loaded on first use only.
_lazy, __getattr__, _ = lazy_exports(
    __name__, {"record": "dynamics.integrations.plain", "watch": "dynamics.analysis.live.widget"}
)
__all__ = ["Run", "RunFileError", "open_run", "__version__", *_lazy]
