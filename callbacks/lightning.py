"""The recorder and the model-editing callbacks (bias initialization, activation shifting) for
``lightning.pytorch`` (``import lightning as L``).

Its Trainer and LightningCLI accept only their own namespace's callbacks, so these subclasses are
``lightning.pytorch`` ``Callback``s; probes come from :mod:`dynamics.callbacks` and work under
either namespace::

    from dynamics.callbacks import HiddenStateNorms, TrainingLoss
    from dynamics.callbacks.lightning import DynamicsRecorder

    L.Trainer(callbacks=[DynamicsRecorder("runs/run.h5", [TrainingLoss(), HiddenStateNorms()])])
"""

import lightning
from lightning.pytorch.callbacks import Callback

from dynamics.callbacks.init_biases import InitBiasesBase
from dynamics.callbacks.recorder import RecorderBase
from dynamics.callbacks.shift_activations import ShiftActivationsBase


class DynamicsRecorder(RecorderBase, Callback):
    """The recorder for ``lightning.pytorch``; what it records and its arguments are in
    :class:`~dynamics.callbacks.recorder.RecorderBase`.

    Example::

        import lightning as L
        from dynamics.callbacks.lightning import DynamicsRecorder

        L.Trainer(callbacks=[DynamicsRecorder("runs/run.h5")])
    """

    _lightning = lightning


class InitBiases(InitBiasesBase, Callback):
    """The bias initialization callback for ``lightning.pytorch``; see
    :class:`~dynamics.callbacks.init_biases.InitBiasesBase`.

    Example::

        L.Trainer(callbacks=[InitBiases("zeros"), DynamicsRecorder("runs/run.h5")])
    """


class ShiftActivations(ShiftActivationsBase, Callback):
    """The activation-shifting callback for ``lightning.pytorch``; see
    :class:`~dynamics.callbacks.shift_activations.ShiftActivationsBase`.

    Example::

        L.Trainer(callbacks=[ShiftActivations("expected"), DynamicsRecorder("runs/run.h5")])
    """
