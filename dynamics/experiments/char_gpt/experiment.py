"""The character transformer with and without adaptive shifting, as the ``dynamics run``
experiment ``char_gpt`` (seed 002, §4's GPT-2 on OpenWebText, in miniature).

Every variant is built from the config's seed, so all share θ0; they differ only in the shift of
their MLP activations. The text is the running Python's standard library (see
:func:`~dynamics.experiments.char_gpt.data.stdlib_text`); held-out loss and bits per character are
logged at every evaluation.
"""

from __future__ import annotations

from dynamics.experiments.char_gpt.config import CharGPTConfig
from dynamics.experiments.char_gpt.data import StdlibTextData
from dynamics.experiments.char_gpt.module import CharGPTModule
from dynamics.experiments.scaleup import ScaleupExperiment
from dynamics.store import names

#: The bits-per-character key :class:`CharGPTModule` logs.
VAL_BPC = "val_bpc"


class CharGPTExperiment(ScaleupExperiment[CharGPTConfig]):
    """Character transformers on the standard library's source, one per shift in
    ``config.variants``.

    Example::

        experiment, config = load_config("char_gpt", steps=100)
        run_experiment(experiment, config, "runs/char_gpt")
    """

    name = "char_gpt"
    config_class = CharGPTConfig
    metrics = (names.VAL_LOSS, VAL_BPC)

    def module(self, config: CharGPTConfig, shift: str | float) -> CharGPTModule:
        return CharGPTModule(
            **vars(config.model),
            shift=shift,
            seed=config.seed,
            **config.optimizer.module_kwargs(),
        )

    def data(self, config: CharGPTConfig) -> StdlibTextData:
        return StdlibTextData(context=config.model.context, **vars(config.data))
