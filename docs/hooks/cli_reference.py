"""mkdocs hook: the CLI reference, rendered from the parser at build time.

`docs/cli.md` holds the marker below; each build replaces it with one section per subcommand of
`dynamics.cli.build_parser()` (usage, what it does, every argument with its help and default),
so the reference cannot drift from the command a user runs.
"""

from __future__ import annotations

import argparse
import os

MARKER = "<!-- cli-reference -->"
PAGE = "cli.md"
# argparse wraps the usage line to the terminal's width; the page must not depend on it.
WIDTH = "100"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE} lost its marker {MARKER}")
    from dynamics.cli import build_parser

    return markdown.replace(MARKER, render(build_parser()))


def render(parser: argparse.ArgumentParser) -> str:
    """Markdown for every subcommand of ``parser``, in the order the parser declares them."""
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        return "\n".join(_command(name, sub, summary) for name, sub, summary in _commands(parser))
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous


def _commands(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            summaries = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, sub, summaries.get(name) or ""


def _command(name: str, parser: argparse.ArgumentParser, summary: str) -> str:
    lines = [f"## dynamics {name}", ""]
    if summary:
        lines += [_sentence(summary), ""]
    if parser.description and parser.description != summary:
        lines += [parser.description, ""]
    usage = parser.format_usage().removeprefix("usage: ").rstrip().replace("\n       ", "\n")
    lines += ["```text", usage, "```", ""]
    rows = [_row(parser, action) for action in parser._actions if _documented(action)]
    if rows:
        lines += ["| argument | meaning | default |", "|---|---|---|", *rows, ""]
    return "\n".join(lines)


def _documented(action: argparse.Action) -> bool:
    return not isinstance(action, argparse._HelpAction) and action.help != argparse.SUPPRESS


def _row(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if action.option_strings:
        names = ", ".join(action.option_strings)
        if action.nargs != 0:
            names += " " + parser._get_formatter()._format_args(action, action.dest.upper())
    else:
        names = action.metavar or action.dest
    meaning = parser._get_formatter()._expand_help(action) if action.help else ""
    if action.required and action.option_strings:
        meaning = f"required; {meaning}"
    default = action.default
    shown = "" if default in (None, False, argparse.SUPPRESS) else f"`{default}`"
    names = names.replace("|", "\\|")  # a table cell ends at a bare bar, code span or not
    return f"| `{names}` | {_cell(meaning)} | {shown} |"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")
