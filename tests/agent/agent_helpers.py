"""TEST SUPPORT for the agent tests."""

from __future__ import annotations

from pathlib import Path

from polling import wait_until

from flowsched.agent import AgentConfig
from flowsched.testbed.sdk_flood import shareable_group

__all__ = ["agent_config", "shareable_group", "wait_until"]


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
