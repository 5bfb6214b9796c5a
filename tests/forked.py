"""Two forked CPU processes as the ranks of one job, for loops that start their own process
group (a plain DDP loop, accelerate's ``Accelerator``): the environment ``torchrun`` would set
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...), one free port, and fork, which keeps pytest's
process (nothing re-runs the test file)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def run_ranks(main: Callable[..., None], *args: Any, size: int = 2) -> None:
    """``main(rank, *args)`` in ``size`` forked processes with torchrun's environment; raises
    if any of them fails."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(size, port, main, args), nprocs=size, start_method="fork")


def _rank(rank: int, size: int, port: int, main: Callable[..., None], args: tuple) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(size),
        LOCAL_WORLD_SIZE=str(size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    main(rank, *args)
