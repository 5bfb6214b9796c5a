"""What this machine offers a job: the memory free (to refuse a job that cannot fit before it
starts) and the cores this process may run on."""

from __future__ import annotations

import os

from dynamics.errors import DynamicsError


def available_bytes() -> int:
    """The memory available to a new allocation: Linux's ``MemAvailable`` (free memory plus
    caches it can drop), else the physical memory.

    Example::

        available_bytes() // 2**20  # MiB this process may still allocate
    """
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(what: str, needed_bytes: float) -> None:
    """Refuse ``what`` when it needs more than the available memory.

    Example::

        check_fits("the 41×41 grid", 8 * 41 * 41 * n_parameters)  # DynamicsError if it cannot

    Args:
        what: what needs the memory, as the message's subject (e.g. ``"--grid 100000"``).
        needed_bytes: a lower bound of what it needs (a lower bound never refuses a job that
            would fit).

    Raises:
        DynamicsError: naming ``what``, what it needs and what is available.
    """
    available = available_bytes()
    if needed_bytes > available:
        raise DynamicsError(
            f"{what} needs at least {needed_bytes / 2**30:,.1f} GiB of memory; "
            f"{available / 2**30:,.1f} GiB are available"
        )


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, where the OS has one).

    Example::

        processes = min(jobs, available_cores())
    """
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
