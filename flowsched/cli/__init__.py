"""The ``flowsched`` command: one module per subcommand under ``flowsched.cli``.

Each module exports ``register(subparsers)``, which adds its parser and sets ``func`` to a
callable taking the parsed arguments and returning the exit status.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

#: subcommand modules, in the order they appear in ``flowsched --help``
_SUBCOMMANDS = ("up", "coordinator", "agent", "sim", "bench", "policy", "plugin")


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (exposed for tests and for documentation)."""
    parser = argparse.ArgumentParser(
        prog="flowsched",
        description="Network flow scheduler for large-model GPU clusters.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _SUBCOMMANDS:
        importlib.import_module(f"flowsched.cli.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``flowsched`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status: int = args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return status
