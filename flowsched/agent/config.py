"""Configuration of the node agent (the CLI builds one from its flags)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from flowsched.shm import layout

DEFAULT_TABLE = "/dev/shm/flowsched-table"


def default_table_path() -> str:
    """``$FLOWSCHED_TABLE`` or ``/dev/shm/flowsched-table``."""
    return os.environ.get("FLOWSCHED_TABLE") or DEFAULT_TABLE


@dataclass(frozen=True, slots=True)
class ReadyInfo:
    """Where a started agent can be reached."""

    node: str
    table: str
    socket: str
    metrics: tuple[str, int] | None
    generation: int


@dataclass(slots=True)
class AgentConfig:
    """Everything :func:`flowsched.agent.serve` needs.

    ``coordinator`` None runs the local policy from the start (standalone node).
    ``policy_text`` is the policy used until the coordinator's welcome names one (None: the
    embedded default). ``interfaces`` empty = every interface that is up, loopback excluded.
    """

    node: str
    socket_path: str
    table_path: str = DEFAULT_TABLE
    coordinator: tuple[str, int] | None = None
    token_file: str | None = None
    policy_text: str | None = None
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = 0
    fallback_after: float = 1.0
    num_slots: int = layout.DEFAULT_NUM_SLOTS
    group: str | None = None
    interfaces: tuple[str, ...] = ()
    default_bandwidth: float = 25e9
    poll_interval: float = 0.005
    report_interval: float = 0.02
    #: byte counts of open flows are reported at most this often (opens/closes every batch)
    progress_interval: float = 0.1
    nic_interval: float = 1.0
    reconnect_interval: float = 0.1
    connect_timeout: float = 2.0
    on_ready: Callable[[ReadyInfo], None] | None = None
