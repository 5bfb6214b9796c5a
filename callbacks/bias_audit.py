"""A probe that records the bias audit of the module at the fit's first batch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dynamics.bias.audit_result import SETTINGS_KEY
from dynamics.bias.auditing import DEFAULT_DRAWS, audit_batch
from dynamics.callbacks.fit import Fit
from dynamics.callbacks.probe import Probe, ProbeUnavailable, parameter_shards
from dynamics.callbacks.probe_loss import uncompiled
from dynamics.errors import DynamicsError, one_line
from dynamics.sharding import unsharded_copy

if TYPE_CHECKING:
    import pytorch_lightning as pl


class BiasAudit(Probe):
    """:func:`dynamics.bias.auditing` of the module at θ0, stored with the probe's settings.

    At the first training batch, the input the loss rule's pass on that batch gives the
    module's network is the example input (:func:`dynamics.bias.auditing.audit_batch`): the audit
    traces the data flow on it, measures the activations' mean output and checks the origin.
    Where the batch gives no such input (a forward with several arguments, a network split in
    parts), the audit counts parameters in registration order and the run file says why.

    It records no series: the audit is stored with the probe's settings, and ``dynamics
    report`` shows it as a section. Side-effect free: every pass restores flags, buffers and
    the random state, and the origin check runs on a copy with its own generator. A compiled
    module is audited uncompiled (its parameters are the same); an audit that fails all the
    same steps aside with the error's first line. Under FSDP the audit reads a plain copy of
    the module holding every parameter whole (:func:`dynamics.sharding.unsharded_copy`), so it
    equals the unsharded run's.

    Example::

        DynamicsRecorder("run.h5", probes=[BiasAudit(draws=5)])

    Args:
        draws: random weight draws of the origin check.
        seed: seed of the origin check's generator.
    """

    name = "bias_audit"

    def __init__(self, draws: int = DEFAULT_DRAWS, seed: int = 0) -> None:
        super().__init__(every_n_steps=1)
        if draws < 1:
            raise DynamicsError(f"draws must be at least 1, got {draws}")
        self.draws = draws
        self.seed = seed
        self._audit: dict[str, Any] = {}

    def setup(self, fit: Fit, pl_module: pl.LightningModule, batch: Any) -> None:
        source = "the fit's first training batch"
        # Under sharding the audit reads a plain copy holding every parameter whole (FSDP's
        # views would count a rank's shard, and its hooks would gather inside the traced pass).
        trainable = parameter_shards(fit, pl_module)
        frozen = parameter_shards(fit, pl_module, "frozen")
        try:
            with (
                unsharded_copy(pl_module, trainable, frozen) as module,
                uncompiled(),  # dynamo cannot trace the audit's hooks and copies
            ):
                result = audit_batch(
                    module,
                    batch,
                    draws=self.draws,
                    seed=self.seed,
                    source=source,
                    rule=fit.loss_rule,
                )
        except DynamicsError:
            raise
        except Exception as error:  # a failure deep in user or compiler code: one line
            raise ProbeUnavailable(f"BiasAudit: {one_line(error)}") from None
        self._audit = result.to_dict()

    def is_due(self, step: int) -> bool:
        return False  # everything is measured at setup

    def settings(self) -> dict[str, Any]:
        return {"draws": self.draws, "seed": self.seed, SETTINGS_KEY: self._audit}
