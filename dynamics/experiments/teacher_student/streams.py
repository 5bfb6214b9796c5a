"""The controlled experiment's random streams: the student's and teacher's initializations and
the training and held-out data each draw from their own spawn of the seed they are given."""

from __future__ import annotations

import numpy as np
import torch

from dynamics.experiments.teacher_student.model import ResidualMLP

#: The random streams of the experiment. Each draws from its own spawn of the seed it is given,
#: so equal seed numbers never give equal streams (a student seeded like the teacher would be
#: the teacher: zero loss, zero gradient).
STREAMS = ("student", "teacher", "training data", "held-out data")


def stream_seed(seed: int, stream: str, *extra: int) -> int:
    """A 63-bit torch seed for ``stream``, independent of every other stream's for any seeds.

    Args:
        seed: the user's seed number for that stream.
        stream: one of :data:`STREAMS`.
        extra: further spawn keys (e.g. the DDP rank of a data stream).
    """
    sequence = np.random.SeedSequence(seed, spawn_key=(STREAMS.index(stream), *extra))
    return int(sequence.generate_state(1, np.uint64)[0] >> np.uint64(1))


def seeded_residual_mlp(seed: int, stream: str, **architecture) -> ResidualMLP:
    """A :class:`~dynamics.experiments.teacher_student.model.ResidualMLP` initialized from
    ``stream``'s seed, the global RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stream_seed(seed, stream))
        return ResidualMLP(**architecture)
