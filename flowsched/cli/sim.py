"""`flowsched sim` (placeholder until its owner lands it)."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    """Add the `sim` subcommand."""
    parser = sub.add_parser("sim", help="(not built yet)")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    raise SystemExit("flowsched sim: not built yet")
