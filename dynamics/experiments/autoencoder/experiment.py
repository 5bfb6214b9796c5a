"""The digits autoencoder with and without shifted activations, as the ``dynamics run``
experiment ``autoencoder`` (seed 002, §3.2, Fig. 5: the transient use of the bias component).

Every variant is built from the config's seed, so all share θ0; they differ only in the shift
:func:`dynamics.bias.shift_activations` applies to their ReLUs. Each records
:class:`~dynamics.callbacks.BiasComponent` at the ReLUs of ``record.layers`` on a fixed probe
batch (the same for every variant), the bias audit at θ0, the loss change of every
``record.split_every_n_steps``-th step split into biases, weights and normalization
(:class:`~dynamics.callbacks.LossChangeSplit`), and the usual probes.
"""

from __future__ import annotations

from collections.abc import Mapping

from dynamics.callbacks import (
    BiasAudit,
    BiasComponent,
    HiddenStateNorms,
    LoggedMetrics,
    LossChangeSplit,
    ParameterDisplacement,
    TrainingLoss,
)
from dynamics.experiments.autoencoder.config import AutoencoderConfig
from dynamics.experiments.autoencoder.data import DigitsData
from dynamics.experiments.autoencoder.module import AutoencoderModule
from dynamics.experiments.experiment import Built, Recording
from dynamics.experiments.shift_experiment import (
    ShiftExperiment,
    hessian_probes,
    shared_probe_batch,
)
from dynamics.store import names


class Autoencoder(ShiftExperiment[AutoencoderConfig]):
    """Digits autoencoders, one per activation shift in ``config.variants``.

    Example::

        experiment, config = load_config("autoencoder", steps=100)
        run_experiment(experiment, config, "runs/autoencoder")
    """

    name = "autoencoder"
    config_class = AutoencoderConfig

    def module(self, config: AutoencoderConfig, shift: str | float) -> AutoencoderModule:
        return AutoencoderModule(
            width=config.model.width,
            init=config.model.init,
            shift=shift,
            seed=config.seed,
            **config.optimizer.module_kwargs(),
        )

    def data(self, config: AutoencoderConfig) -> DigitsData:
        return DigitsData(**vars(config.data))

    def recordings(
        self, config: AutoencoderConfig, built: Mapping[str, Built]
    ) -> dict[str, Recording]:
        probe_batch = shared_probe_batch(built)
        record = config.record
        every = record.every_n_steps
        recordings = {}
        for variant in built:
            probes = [
                TrainingLoss(every),
                HiddenStateNorms(modules=record.layers, feature_dim=1, every_n_steps=every),
                ParameterDisplacement(every, snapshot_budget_mb=record.snapshot_budget_mb),
                LoggedMetrics([names.VAL_LOSS]),
                BiasAudit(),
                BiasComponent(
                    record.layers,
                    every_n_steps=record.bias_every_n_steps,
                    batch=probe_batch,
                    examples=record.examples,
                    image_rows=record.image_rows,
                ),
            ]
            if record.split_every_n_steps:
                probes.append(
                    LossChangeSplit(every_n_steps=record.split_every_n_steps, batch=probe_batch)
                )
            probes += hessian_probes(
                record.hessian_top_k, record.hessian_every_n_steps, probe_batch
            )
            recordings[variant] = Recording(probes, record.flush_interval_s)
        return recordings
