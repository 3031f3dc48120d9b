"""Helpers shared by the daemon subcommands (argument types, logging, the event loop)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable


def host_port(text: str) -> tuple[str, int]:
    """argparse type for ``HOST:PORT`` (``[v6addr]:PORT`` too; an empty host is 127.0.0.1)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def setup_logging(level: str) -> None:
    """Log to stderr with timestamps, as every daemon does."""
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def loop_factory(disabled: bool) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop factory unless disabled (flag or FLOWSCHED_NO_UVLOOP) or not installed.

    uvloop is chosen here, in the CLI runner only, so that tests run on the plain asyncio loop.
    """
    if disabled or os.environ.get("FLOWSCHED_NO_UVLOOP"):
        return None
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory
