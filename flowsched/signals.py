"""The default shutdown trigger of the daemons' ``serve(config, *, shutdown_trigger=None)``."""

from __future__ import annotations

import asyncio
import contextlib
import signal


async def wait_for_signal() -> None:
    """Return on the first SIGINT or SIGTERM (handlers are installed only when this runs)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
