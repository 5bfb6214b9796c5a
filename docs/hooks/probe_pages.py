"""mkdocs hook: every page in docs/probes/ goes into the nav under "Probes".

The nav names `probes/` as a folder; this fills in its pages (the catalogue `index.md` first, the
others by title), so a probe's page is listed the moment it is written, with no second edit of
mkdocs.yml.
"""

from __future__ import annotations

from pathlib import Path

FOLDER = "probes/"


def on_config(config):
    config["nav"] = [_expanded(item, Path(config["docs_dir"])) for item in config["nav"]]
    return config


def _expanded(item, docs: Path):
    if not isinstance(item, dict):
        return item
    ((title, target),) = item.items()
    if target != FOLDER:
        return item
    pages = sorted(
        (docs / FOLDER).glob("*.md"), key=lambda page: (page.name != "index.md", _title(page))
    )
    return {title: [{_title(page): f"{FOLDER}{page.name}"} for page in pages]}


def _title(page: Path) -> str:
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip().strip("`")
    return page.stem.replace("_", " ")
