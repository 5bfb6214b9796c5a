"""The recorder for ``lightning.pytorch`` (``import lightning as L``).

Its Trainer and LightningCLI accept only their own namespace's callbacks, so this subclass is a
``lightning.pytorch`` ``Callback``; probes come from :mod:`dynamics.callbacks` and work under
either namespace::

    from dynamics.callbacks import HiddenStateNorms, TrainingLoss
    from dynamics.callbacks.lightning import DynamicsRecorder

    L.Trainer(callbacks=[DynamicsRecorder("runs/run.h5", [TrainingLoss(), HiddenStateNorms()])])
"""

import lightning
from lightning.pytorch.callbacks import Callback

from dynamics.callbacks.recorder import RecorderBase


class DynamicsRecorder(RecorderBase, Callback):
    """The recorder for ``lightning.pytorch``; what it records and its arguments are in
    :class:`~dynamics.callbacks.recorder.RecorderBase`."""

    _lightning = lightning
