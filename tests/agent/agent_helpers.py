"""TEST SUPPORT for the agent tests."""

from __future__ import annotations

import grp
from pathlib import Path

from polling import wait_until

from flowsched.agent import AgentConfig

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


def shareable_group() -> grp.struct_group | None:
    """A group other than root's that a test can hand the SDK socket to (``--group``), or
    None when the machine has none of users/nogroup/daemon/staff."""
    for name in ("users", "nogroup", "daemon", "staff"):
        try:
            return grp.getgrnam(name)
        except KeyError:
            continue
    return None
