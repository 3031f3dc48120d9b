"""Run an agent on a background thread (embedding in tools, tests and the testbed).

>>> with AgentThread(AgentConfig(node="n1", socket_path=..., table_path=...)) as running:
...     running.ready.socket
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

from flowsched.agent.config import AgentConfig, ReadyInfo
from flowsched.agent.service import Agent


class AgentThread:
    """An :class:`Agent` on its own event loop in a daemon thread."""

    def __init__(self, config: AgentConfig) -> None:
        self.agent = Agent(config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="flowsched-agent", daemon=True
        )
        self.ready: ReadyInfo | None = None

    def start(self, timeout: float = 10.0) -> ReadyInfo:
        """Start the thread and the agent; returns where it listens.

        A start that fails is undone before the error is raised (as :func:`serve` does): the
        agent stops, so that nothing of it goes on serving the SDK socket or owning the table
        (``with AgentThread(...)`` never reaches :meth:`stop` when this raises), and the
        thread ends.
        """
        self._thread.start()
        try:
            self.ready = self.run(self.agent.start, timeout)
        except BaseException:
            with contextlib.suppress(Exception):  # the start's error is the one to raise
                self.stop()
            raise
        return self.ready

    def run(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run ``fn()`` on the agent's loop (awaiting it if it returns an awaitable)."""

        async def call() -> Any:
            result = fn()
            if asyncio.iscoroutine(result):
                result = await result
            return result

        future: concurrent.futures.Future[Any] = asyncio.run_coroutine_threadsafe(
            call(), self._loop
        )
        return future.result(timeout)

    def stop(self) -> None:
        """Stop the agent and the thread."""
        if self._thread.is_alive():
            try:
                self.run(self.agent.stop)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> AgentThread:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
