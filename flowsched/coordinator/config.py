"""Coordinator configuration: typed attributes with defaults, built by the CLI or by tests."""

from __future__ import annotations

import importlib.resources
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flowsched import tls
from flowsched.policies.base import Policy
from flowsched.protocol import (
    DEFAULT_MAX_FRAME_SIZE,
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    U64_MAX,
    Welcome,
    encode_body,
)
from flowsched.protocol._codec import MAC_SIZE

SECONDS = 1.0
MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Addresses:
    """Where a started coordinator listens (ports resolved when 0 was asked for)."""

    host: str
    port: int
    metrics_host: str | None
    metrics_port: int | None

    def listen_text(self) -> str:
        """``host:port`` as ``--coordinator`` takes it (an IPv6 host in brackets)."""
        return host_port_text(self.host, self.port)

    def metrics_text(self) -> str:
        """Where the metrics are served (``host:port``, as above), or ``off``."""
        if self.metrics_port is None:
            return "off"
        return host_port_text(self.metrics_host or "", self.metrics_port)


def host_port_text(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets (``[::1]:7711``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(slots=True)
class CoordinatorConfig:
    """Everything :func:`flowsched.coordinator.serve` needs.

    ``policy_factory`` builds the one policy object; ``policy_text`` is the policy file sent to
    agents in ``welcome`` (they run the same policy when they fall back). ``batching=False``
    runs the policy after every message instead of once per batch (an event-loop turn, or
    ``max_batch_delay`` of one; the baseline of ``bench/coordinator_load.py``).
    ``metrics_port=None`` disables the metrics endpoint.
    """

    token: bytes
    policy_factory: Callable[[], Policy]
    policy_text: str = ""
    timer_period: float = 0.05 * SECONDS
    host: str = "127.0.0.1"
    port: int = 0
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = 0
    heartbeat_interval: float = 0.2 * SECONDS
    #: a connection silent (not even a heartbeat) for this long is closed
    idle_timeout: float = 2.0 * SECONDS
    handshake_timeout: float = 5.0 * SECONDS
    #: a disconnected agent's flows are kept this long, so that a quick reconnect keeps state
    grace_period: float = 5.0 * SECONDS
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    #: bytes queued for one agent before it is considered stuck and disconnected
    send_buffer_limit: int = 8 * MIB
    #: agent connections served at once (handshakes included); the open-file limit may lower
    #: it (see flowsched.coordinator.service)
    max_connections: int = 16384
    #: connections still in their handshake; at the cap the oldest one makes room. Sized for
    #: every agent of a large cluster reconnecting at once (a coordinator takeover).
    max_unauthenticated: int = 2048
    #: open flows one node (agent) may have; opens beyond are refused, logged and counted
    #: (flowsched_coordinator_refused_flows_total). Real nodes have tens (the SDK caps a
    #: client at 4,096): this bounds what one runaway or hostile agent costs (~0.7 KB a flow)
    max_flows_per_node: int = 65536
    batching: bool = True
    #: a batch of events is flushed (policy run, level updates queued) once it has been
    #: collecting for this long since its first frame was handled, even in the middle of an
    #: event-loop turn; ``math.inf``: once per turn only (the baseline of
    #: bench/coordinator_load.py)
    max_batch_delay: float = 1e-3 * SECONDS
    #: resyncs (a new leader's rebuild) are re-evaluated once per burst, not per loop turn;
    #: False is the baseline of bench/takeover.py
    rebuild_batching: bool = True
    #: whether the policy decides each flow on its own (then events re-evaluate only the flows
    #: they touch); None asks the policy's ``per_flow_decisions`` attribute (default False:
    #: every flush re-evaluates every flow, which is always correct but O(all flows))
    per_flow_decisions: bool | None = None
    #: how time-driven promotions are found: "timers" (each flow's next promotion time from
    #: the policy's next_change, kept in a heap) or "sweep" (every deadline flow each period)
    promotion: str = "timers"
    #: time per event-loop turn given to the timer sweep (per-flow policies): the sweep
    #: advances in small steps within this budget, so it never delays events by a whole pass
    sweep_budget: float = 0.25e-3 * SECONDS
    #: largest share of the time spent in timer sweeps; when one pass over the deadline flows
    #: costs more than timer_period allows, the effective period stretches to respect it
    sweep_duty: float = 0.5
    #: etcd client URL for leader election among several coordinators (None: this one leads
    #: alone, no etcd); see flowsched.coordinator.election and docs/ha.md
    etcd: str | None = None
    #: TLS to an https etcd (PEM files): the CA bundle verifying etcd (None: the system trust
    #: store), the client certificate and its key (etcd's --client-cert-auth)
    etcd_cacert: str | None = None
    etcd_cert: str | None = None
    etcd_key: str | None = None
    #: coordinators sharing this name (and etcd) elect one leader
    election_name: str = "flowsched"
    #: leader lease TTL, whole seconds: a crashed leader's host going silent is replaced
    #: after about this long (a crashed process on a live host within ~0.3 s); None: 2 with
    #: one etcd URL, 10 with several (:func:`flowsched.coordinator.election.lease_ttl`)
    lease_ttl: int | None = None
    #: HOST:PORT agents and standbys use to reach this coordinator (None: the bound address,
    #: or this host's name when listening on a wildcard address)
    advertise: str | None = None
    #: PEM certificate (chain) and unencrypted key: agents connect over TLS (None: plain TCP);
    #: re-read when the files change (flowsched.tls)
    tls_cert: str | None = None
    tls_key: str | None = None
    #: PEM CA bundle: every agent must present a client certificate it signed (mutual TLS)
    tls_client_ca: str | None = None
    #: with ``tls_client_ca``: "node", the client certificate must name the node the agent
    #: logs in as (a subjectAltName DNS entry or the subject's CN); "any", any certificate
    #: the CA signed may log in as any node
    tls_client_names: str = "node"
    #: agents offering a lower protocol version are refused (5: every session sealed, once
    #: every agent is of this release; 1 admits every release)
    min_agent_version: int = MIN_PROTOCOL_VERSION
    on_ready: Callable[[Addresses], None] | None = None

    def __post_init__(self) -> None:
        """Refuse timeouts that would drop healthy agents or never fire, and TLS settings
        that lack their other half (the files themselves are read when the service starts).

        Raises:
            ValueError: naming the bad field.
        """
        for name in ("heartbeat_interval", "idle_timeout", "handshake_timeout", "grace_period"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: expected a finite number of seconds > 0, got {value!r}")
        delay = self.max_batch_delay
        if not (isinstance(delay, int | float) and delay >= 0 and not math.isnan(delay)):
            raise ValueError(f"max_batch_delay: expected seconds >= 0 or inf, got {delay!r}")
        if self.idle_timeout <= self.heartbeat_interval:
            raise ValueError(
                f"idle_timeout: {self.idle_timeout:g} s must exceed the heartbeat interval "
                f"({self.heartbeat_interval:g} s) at which agents send heartbeats"
            )
        etcd_tls = {"etcd_cacert": self.etcd_cacert, "etcd_cert": self.etcd_cert}
        for name, value in {**etcd_tls, "etcd_key": self.etcd_key}.items():
            if value is not None and self.etcd is None:
                raise ValueError(f"{name}: TLS to etcd, only used with --etcd https://...")
        for name in ("max_unauthenticated", "max_flows_per_node"):
            cap = getattr(self, name)
            if not (isinstance(cap, int) and not isinstance(cap, bool) and cap >= 1):
                raise ValueError(f"{name}: expected a whole number >= 1, got {cap!r}")
        tls.check_pair(self.tls_cert, self.tls_key)
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise tls.TlsConfigError(
                "tls_client_ca",
                "client certificates are checked only over TLS: give a certificate and key",
            )
        if not MIN_PROTOCOL_VERSION <= self.min_agent_version <= PROTOCOL_VERSION:
            raise ValueError(
                f"min_agent_version: expected {MIN_PROTOCOL_VERSION}..{PROTOCOL_VERSION},"
                f" got {self.min_agent_version!r}"
            )
        if self.tls_client_names not in ("node", "any"):
            raise ValueError(
                f"tls_client_names: expected 'node' or 'any', got {self.tls_client_names!r}"
            )

    @classmethod
    def from_policy_file(
        cls, path: str | Path | None, token: bytes, **kwargs: object
    ) -> CoordinatorConfig:
        """Build a config from a policy file (the packaged default when ``path`` is None).

        Raises:
            flowsched.policyfile.PolicyFileError: the file is unreadable or invalid.
        """
        from flowsched import policyfile

        if path is None:
            resource = importlib.resources.files("flowsched") / "data" / "policies" / "default.toml"
            text, source = resource.read_text(encoding="utf-8"), "<embedded default.toml>"
        else:
            text, source = policyfile.read_text(path), str(path)
        policy = policyfile.loads(text, source=source)
        # the largest welcome this file makes: with its MAC, an epoch and a fencing scope
        widest = Welcome(text, policy.timer_period, 0.0, epoch=U64_MAX, cluster=U64_MAX,
                         mac=bytes(MAC_SIZE))  # fmt: skip
        if len(encode_body(widest)) > DEFAULT_MAX_FRAME_SIZE:  # no handshake could complete
            raise policyfile.PolicyFileError(
                [
                    "the coordinator sends the policy file to every agent, and this "
                    f"one ({len(text.encode())} bytes) does not fit in a protocol frame "
                    f"({DEFAULT_MAX_FRAME_SIZE} bytes)"
                ]
            )
        return cls(
            token=token,
            policy_factory=policy.make_policy,
            policy_text=text,
            timer_period=policy.timer_period,
            **kwargs,  # type: ignore[arg-type]
        )
