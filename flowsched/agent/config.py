"""Configuration of the node agent (the CLI builds one from its flags)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from flowsched import rundir
from flowsched.protocol import is_name
from flowsched.protocol.sdk import MAX_NODE
from flowsched.shm import layout
from flowsched.tls import TlsConfigError, check_pair

#: the most slots a flow table may have (FlowTable.create_or_attach refuses more)
MAX_NUM_SLOTS = 1 << 24


def default_nic_interval() -> float:
    """``$FLOWSCHED_NIC_INTERVAL`` seconds (a positive number), else 1 s."""
    try:
        value = float(os.environ.get("FLOWSCHED_NIC_INTERVAL", "1.0"))
    except ValueError:
        return 1.0
    return value if _positive(value) else 1.0


def default_link_capacity() -> float | None:
    """``$FLOWSCHED_LINK_CAPACITY`` bytes/s (a positive number), else None (sysfs speed)."""
    try:
        value = float(os.environ.get("FLOWSCHED_LINK_CAPACITY", "0"))
    except ValueError:
        return None
    return value if _positive(value) else None


def default_table_path() -> str:
    """``$FLOWSCHED_TABLE``, else ``table`` in the agent's runtime directory
    (``/run/flowsched`` for root, see :mod:`flowsched.rundir`): a path no other user can
    create first, unlike a fixed name in the world-writable ``/dev/shm``."""
    return rundir.agent_path(rundir.TABLE_NAME, "FLOWSCHED_TABLE")


def default_socket_path() -> str:
    """``$FLOWSCHED_SOCKET``, else ``agent.sock`` in the agent's runtime directory."""
    return rundir.agent_path(rundir.SOCKET_NAME, "FLOWSCHED_SOCKET")


def _positive(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return math.isfinite(value) and value > 0


class AgentConfigError(ValueError):
    """An invalid :class:`AgentConfig` field (``field`` names it)."""

    def __init__(self, field_name: str, problem: str) -> None:
        super().__init__(f"{field_name}: {problem}")
        self.field = field_name
        self.problem = problem


#: fields that must be finite numbers > 0 (a zero bandwidth divides by zero in the NIC loop,
#: an infinite or NaN interval spins or never wakes)
_POSITIVE_FIELDS = (
    "fallback_after",
    "default_bandwidth",
    "poll_interval",
    "report_interval",
    "progress_interval",
    "nic_interval",
    "reconnect_interval",
    "connect_timeout",
    "qos_check_interval",
)


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
    embedded default). ``interfaces`` empty = the hardware NICs that are up
    (:func:`flowsched.agent.nic.default_interfaces`).
    """

    node: str
    socket_path: str
    table_path: str = field(default_factory=default_table_path)
    coordinator: tuple[str, int] | None = None
    #: further coordinators of a high-availability group (``--coordinator a,b,c``): the agent
    #: follows whichever of them is the elected leader (docs/ha.md)
    coordinators: tuple[tuple[str, int], ...] = ()
    token_file: str | None = None
    #: connect to the coordinator over TLS, verifying it against ``tls_ca`` (None: the
    #: system's CAs) and the name ``tls_server_name`` (None: the host dialled); any TLS
    #: setting turns it on. ``tls_cert``/``tls_key``: the client certificate a coordinator
    #: with ``--tls-client-ca`` asks for. Files are re-read when they change (flowsched.tls).
    tls: bool = False
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None
    #: accept a coordinator that cannot prove it holds the token (one below protocol version
    #: 3, i.e. of an older release) without TLS that verifies it: only for a rolling upgrade
    #: that upgrades agents before coordinators (docs/protocol.md)
    allow_unproven_coordinator: bool = False
    policy_text: str | None = None
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = 0
    fallback_after: float = 1.0
    #: how long an SDK open waits for the coordinator's first level (seconds); 0 = answer at
    #: once with the level the agent's own copy of the policy admits the flow at, and let the
    #: coordinator's level follow as a push. A flow that waits sends nothing meanwhile: on
    #: pd-serving a 2 ms wait per KV flow costs rmlq 29 of its 66 points (docs/results.md)
    first_level_wait: float = 0.0
    num_slots: int = layout.DEFAULT_NUM_SLOTS
    group: str | None = None
    interfaces: tuple[str, ...] = ()
    default_bandwidth: float = 25e9
    #: capacity (bytes/s) of every monitored interface, overriding the sysfs speed: for links
    #: shaped below their line rate (the testbed's htb at 200 Mbit/s on veth pairs, which
    #: report 10 Gbit/s); None = sysfs speed, else ``default_bandwidth``
    link_capacity: float | None = field(default_factory=default_link_capacity)
    poll_interval: float = 0.005
    report_interval: float = 0.02
    #: byte counts of open flows are reported at most this often (opens/closes every batch)
    progress_interval: float = 0.1
    #: how often NIC counters are sampled and the link loads reported (the coordinator's rho
    #: is at most this old; the testbed sets it through ``FLOWSCHED_NIC_INTERVAL``)
    nic_interval: float = field(default_factory=default_nic_interval)
    reconnect_interval: float = 0.1
    connect_timeout: float = 2.0
    #: interface whose egress gets the policy's strict-priority classes at start and on every
    #: policy change (``flowsched qos apply``); None = leave the host's qdiscs alone
    qos_dev: str | None = None
    #: rate (bit/s) those classes shape at; None = the interface's speed from sysfs
    qos_rate: int | None = None
    #: how often the agent checks that the classes are still in place and restores them (s)
    qos_check_interval: float = 30.0
    on_ready: Callable[[ReadyInfo], None] | None = None

    @property
    def coordinator_addresses(self) -> tuple[tuple[str, int], ...]:
        """Every coordinator address given, ``coordinator`` first; () for a standalone node."""
        if self.coordinator is None:
            return ()
        return (self.coordinator, *self.coordinators)

    def __post_init__(self) -> None:
        """Refuse values that would fail later, far from their cause.

        Raises:
            AgentConfigError: naming the bad field.
        """
        if not is_name(self.node, MAX_NODE) or self.node != self.node.strip():
            raise AgentConfigError(
                "node",
                f"expected a printable name of 1..{MAX_NODE} characters without surrounding "
                f"blanks (the coordinator's link ids are built from it), got {self.node!r}",
            )
        for name in _POSITIVE_FIELDS:
            _check_positive(name, getattr(self, name))
        if self.link_capacity is not None:
            _check_positive("link_capacity", self.link_capacity)
        if self.first_level_wait != 0 and not _positive(self.first_level_wait):
            raise AgentConfigError(
                "first_level_wait",
                f"expected 0 or a finite number > 0, got {self.first_level_wait!r}",
            )
        if self.tls_ca or self.tls_cert or self.tls_key or self.tls_server_name:
            self.tls = True
        try:
            check_pair(self.tls_cert, self.tls_key)
        except TlsConfigError as exc:
            raise AgentConfigError(exc.field, exc.problem) from None
        if not 1 <= self.num_slots <= MAX_NUM_SLOTS:
            raise AgentConfigError(
                "num_slots", f"expected 1..{MAX_NUM_SLOTS} slots, got {self.num_slots!r}"
            )


def _check_positive(name: str, value: object) -> None:
    if not _positive(value):
        raise AgentConfigError(name, f"expected a finite number > 0, got {value!r}")
