"""The ``flowsched`` command: one module per subcommand under ``flowsched.cli``.

Each module exports ``register(subparsers)``, which adds its parser and sets ``func`` to a
callable taking the parsed arguments and returning the exit status (0 ok, 1 failure at run
time, 2 bad input: see :mod:`flowsched.cli._common`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from flowsched.cli._common import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_STATUS_HELP,
    Parser,
    add_version,
    fail,
)

#: subcommand modules, in the order they appear in ``flowsched --help``
_SUBCOMMANDS = ("up", "coordinator", "agent", "flows", "sim", "bench", "policy", "plugin", "qos")


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (exposed for tests and for documentation)."""
    parser = Parser(
        prog="flowsched",
        description="Network flow scheduler for large-model GPU clusters.",
        epilog=EXIT_STATUS_HELP,
    )
    add_version(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _SUBCOMMANDS:
        importlib.import_module(f"flowsched.cli.{name}").register(sub)
    _add_version_and_exit_statuses(parser)
    return parser


def _add_version_and_exit_statuses(parser: argparse.ArgumentParser) -> None:
    """--version and the exit codes on every subcommand and every action of one
    (``flowsched bench serving``), but not where ``--version`` is a flag of its own."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        for command in action.choices.values():
            if "--version" not in command._option_string_actions:
                add_version(command)
            command.epilog = command.epilog or EXIT_STATUS_HELP
            _add_version_and_exit_statuses(command)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``flowsched`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status: int = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at interpreter exit
    except KeyboardInterrupt:
        return fail("flowsched", "interrupted", EXIT_INTERRUPTED)
    except BrokenPipeError:
        # the reader went away (``flowsched policy show F | head``): no traceback, and no
        # second error when the interpreter flushes stdout at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE
    return status
