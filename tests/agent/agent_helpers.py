"""TEST SUPPORT for the agent tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from flowsched.agent import AgentConfig


def wait_until(predicate: Callable[[], object], timeout: float = 5.0) -> None:
    """Poll ``predicate`` every 10 ms until it is true (AssertionError after ``timeout`` s)."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def agent_config(tmp_path: Path, **overrides: object) -> AgentConfig:
    """An in-process agent's config under ``tmp_path`` (socket in run/, 32 slots, metrics on a
    free port, local fallback after 0.2 s on lo); ``overrides`` replace any field."""
    settings: dict[str, object] = dict(
        node="n1",
        socket_path=str(tmp_path / "run" / "agent.sock"),
        table_path=str(tmp_path / "table"),
        num_slots=32,
        metrics_port=0,
        fallback_after=0.2,
        interfaces=("lo",),
    )
    settings.update(overrides)
    return AgentConfig(**settings)  # type: ignore[arg-type]
