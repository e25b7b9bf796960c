"""The help text of `memopd` and of every subcommand, one file per command path under tests/data/cli_help/.

`python tests/cli_help.py` writes the files; tests/test_cli.py compares the parser with them byte for byte.
argparse wraps help at the terminal width (it reads COLUMNS), so both run with COLUMNS=100.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HELP_DIR = Path(__file__).parent / "data" / "cli_help"
COLUMNS = "100"


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(path, parser) of the parser and of every subcommand below it, depth first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, path + (name,))


def file_name(path: tuple[str, ...]) -> str:
    return ("_".join(path) or "memopd") + ".txt"


def help_texts() -> dict[str, str]:
    """{file name: help text} of every command of memopd.cli.build_parser(), at COLUMNS wide."""
    from memopd.cli import build_parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = COLUMNS
    try:
        return {file_name(path): p.format_help() for path, p in commands(build_parser())}
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parents[1] / "src"))
    HELP_DIR.mkdir(parents=True, exist_ok=True)
    texts = help_texts()
    for name, text in texts.items():
        (HELP_DIR / name).write_text(text)
    print(f"{len(texts)} help texts -> {HELP_DIR}")
