"""Dotted module names matched against glob patterns, segment by segment.

``*`` (and any :mod:`fnmatch` glob) matches within one segment; ``**`` matches any number of
segments. Shared by the hidden-state probe and activation shifting, so both read a pattern the
same way.
"""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase


def glob_match(name: str, pattern: str) -> bool:
    """Whether a dotted module name matches a pattern segment by segment (``**``: any depth).

    Example::

        glob_match("blocks.0", "blocks.*")  # True
        glob_match("blocks.0.fc", "blocks.*")  # False: * is one segment
        glob_match("blocks.0.fc", "blocks.**")  # True
    """
    parts = name.split(".")
    # The name prefixes (by segment count) the pattern's segments so far can match.
    reachable = {0}
    for glob in pattern.split("."):
        if glob == "**":
            reachable = set(range(min(reachable), len(parts) + 1)) if reachable else set()
        else:
            reachable = {i + 1 for i in reachable if i < len(parts) and fnmatchcase(parts[i], glob)}
    return len(parts) in reachable


def glob_any(name: str, patterns: Iterable[str]) -> bool:
    """Whether ``name`` matches any of ``patterns``."""
    return any(glob_match(name, p) for p in patterns)


def matched(pattern: str, names: Iterable[str]) -> bool:
    """Whether ``pattern`` matches any of ``names``."""
    return any(glob_match(n, pattern) for n in names)
