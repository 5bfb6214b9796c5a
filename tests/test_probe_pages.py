"""Every probe the package exports has its page in docs/probes/ and an Example:: in its
docstring, so the docs site's probe catalogue cannot miss one."""

import inspect
import re
from pathlib import Path

import dynamics.callbacks as callbacks
from dynamics.callbacks import Probe

PAGES = Path(__file__).resolve().parents[1] / "docs" / "probes"


def _page(cls: type) -> Path:
    return PAGES / (re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower() + ".md")


def test_every_exported_probe_has_a_page_and_an_example() -> None:
    probes = [
        getattr(callbacks, name)
        for name in callbacks.__all__
        if inspect.isclass(getattr(callbacks, name))
        and issubclass(getattr(callbacks, name), Probe)
        and getattr(callbacks, name) is not Probe
    ]
    assert len(probes) >= 12
    missing = [p.__name__ for p in probes if not _page(p).is_file()]
    assert not missing, f"write docs/probes/<probe>.md for {missing}"
    without = [p.__name__ for p in probes if "Example::" not in (p.__doc__ or "")]
    assert not without, f"add an Example:: to the docstrings of {without}"
