"""Prometheus metrics of one node agent, computed at scrape time from the agent's state.

Served over HTTP on the agent's own event loop (the coordinator's exposition handler, with
``/healthz`` and ``/readyz``), so a scrape never races the loops that change the state. No
metric carries a ``node`` label: the scrape target already names the node. Names follow the
Prometheus conventions; the list is in docs/deploy.md.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from flowsched.coordinator.exposition import start_metrics_server
from flowsched.coordinator.metrics import register_standard_collectors
from flowsched.model import FlowClass

if TYPE_CHECKING:
    from flowsched.agent.service import Agent

PREFIX = "flowsched_agent"


class AgentCollector(Collector):
    """Yields the agent's metrics (labels: class, level, link, ... where they apply)."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Metric]:
        agent = self.agent
        yield from self._flows()
        yield _gauge(
            "coordinator_connected", "1 while connected to a coordinator.", agent.connected
        )
        yield _gauge(
            "fallback_active", "1 while the local policy runs.", agent.fallback is not None
        )
        yield _gauge(
            "coordinators_configured",
            "Coordinator addresses the agent was given (0: standalone, the local policy only).",
            len(agent.config.coordinator_addresses),
        )
        if agent.stats["fallback_switches"]:  # absent until the first switch
            yield _gauge(
                "last_fallback_switch_seconds",
                "Coordinator silence before the last switch to the local policy.",
                agent.stats["last_switch_delay"],
            )
            yield _gauge(
                "last_fallback_switch_timestamp_seconds",
                "Wall-clock time of the last switch to the local policy.",
                agent.stats["last_switch_wall"],
            )
        for name, key, text in _COUNTERS:
            yield CounterMetricFamily(f"{PREFIX}_{name}", text, value=agent.stats[key])
        yield from self._table()
        if agent.sdk is not None:
            yield _gauge("sdk_clients", "Connected SDK clients.", agent.sdk.clients)
        yield _gauge("rdma_devices", "RDMA devices found through pyverbs.", len(agent.rdma_devices))
        yield from self._telemetry()
        yield from self._links()

    def _table(self) -> Iterator[Metric]:
        table = self.agent.table
        if table is None:
            return
        yield _gauge("table_generation", "Generation of the flow table.", table.generation)
        yield _gauge("table_slots", "Slots of the flow table.", table.num_slots)
        used = self.agent.slots_used
        yield _gauge("table_slots_used", "Slots holding a connection (not FREE).", used)
        yield _gauge(
            "table_slots_unplaced",
            "Slots of processes in another pid namespace that /proc does not let the agent "
            "place (kept until closed; docs/deploy.md).",
            len(table.last_reap.unplaced),
        )

    def _links(self) -> Iterator[Metric]:
        util = GaugeMetricFamily(
            f"{PREFIX}_link_utilization_ratio",
            "Load of each node link (<node>:tx egress, <node>:rx ingress; 0..1).",
            labels=["link"],
        )
        capacity = GaugeMetricFamily(
            f"{PREFIX}_link_bandwidth_bytes_per_second",
            "Capacity of each node link used by the policy.",
            labels=["link"],
        )
        for sample in list(self.agent.nic.samples.values()):
            util.add_metric([sample.link], sample.load)
            capacity.add_metric([sample.link], sample.bandwidth)
        yield util
        yield capacity

    def _telemetry(self) -> Iterator[Metric]:
        tel, slots = self.agent.telemetry, self.agent.slot_telemetry
        done = CounterMetricFamily(
            f"{PREFIX}_completed_flows",
            "Closed flows by class and deadline outcome (met, missed, none).",
            labels=["class", "deadline"],
        )
        for (cls, outcome), n in sorted(tel.completions.items()):
            done.add_metric([cls, outcome], n)
        yield done
        yield from tel.histograms()
        yield from slots.apply_latency.collect()
        sent = CounterMetricFamily(
            f"{PREFIX}_sent_bytes",
            "Bytes the plugin's connections sent, by class and the level they were sent at "
            "(level=unset: before the plugin applied any).",
            labels=["class", "level"],
        )
        for (cls, level), n in sorted(slots.sent.items()):
            sent.add_metric([cls, level], n)
        yield sent
        yield CounterMetricFamily(
            f"{PREFIX}_level_updates",
            "Level updates received from the coordinator.",
            value=tel.level_updates,
        )
        sdk = self.agent.sdk
        if sdk is not None:
            requests = CounterMetricFamily(
                f"{PREFIX}_sdk_requests", "SDK requests by type.", labels=["type"]
            )
            for kind, n in sorted(sdk.requests.items()):
                requests.add_metric([kind], n)
            yield requests
            yield CounterMetricFamily(
                f"{PREFIX}_sdk_bad_frames",
                "SDK clients dropped for a bad frame.",
                value=sdk.errors_total,
            )

    def _flows(self) -> Iterator[Metric]:
        registry = self.agent.registry
        active = GaugeMetricFamily(
            f"{PREFIX}_active_flows",
            "Open flows by class, level and source (plugin connection or SDK).",
            labels=["class", "level", "source"],
        )
        if registry is None:
            yield active
            return
        counts = Counter(
            (f.cls, f.level, "sdk" if fid in registry.sdk else "plugin")
            for fid, f in list(registry.flows.items())
        )
        for (cls, level, source), n in sorted(counts.items()):
            active.add_metric([FlowClass(cls).label, str(level), source], n)
        yield active
        yield CounterMetricFamily(
            f"{PREFIX}_flows_opened", "Flows opened.", value=registry.opened_total
        )
        yield CounterMetricFamily(
            f"{PREFIX}_flows_closed", "Flows closed.", value=registry.closed_total
        )


#: (name without prefix and _total, Agent.stats key, help)
_COUNTERS = (
    ("levels_written", "levels_written", "Level words written into slots."),
    ("promotions", "promotions", "Level decreases applied."),
    ("batches_sent", "batches_sent", "Flow batches sent to the coordinator."),
    ("fallback_switches", "fallback_switches", "Switches to the local policy."),
    ("resyncs", "resyncs_sent", "Resyncs sent after (re)connecting."),
    ("slots_reaped", "reaped", "Slots of dead processes freed."),
    ("coordinator_connects", "connects", "Successful coordinator handshakes."),
    (
        "qos_repairs",
        "qos_repairs",
        "Checks that found the --qos-dev classes changed and restored them.",
    ),
)


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", text, value=float(value))


async def start_http(
    agent: Agent, host: str, port: int
) -> tuple[asyncio.AbstractServer, tuple[str, int]]:
    """Serve ``/metrics``, ``/healthz`` and ``/readyz`` for ``agent`` on ``host:port``
    (0 = any free port)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(agent))
    register_standard_collectors(registry)
    server = await start_metrics_server(registry, host, port, ready=agent.readiness)
    bound = server.sockets[0].getsockname()
    return server, (str(bound[0]), int(bound[1]))
