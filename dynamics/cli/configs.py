"""``dynamics configs``: the experiment configs shipped with the package, by name."""

from __future__ import annotations

import argparse

from dynamics.cli.common import print_table


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``configs`` to ``commands``."""
    configs = commands.add_parser("configs", help="list the shipped configs dynamics run names")
    configs.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    """Print each shipped config's name, experiment and one line of what it is."""
    from dynamics.experiments.config_files import configs_folder, shipped_configs

    rows = [(c.name, c.experiment, c.description) for c in shipped_configs().values()]
    print_table(("name", "experiment", "what it is"), rows)
    print(f"files in {configs_folder()}: copy one to change it, or run one by name")
    return 0
