"""Prometheus metrics of one node agent, computed at scrape time from the agent's state.

Served over HTTP on the agent's own event loop (the coordinator's exposition handler), so a
scrape never races the loops that change the state.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from flowsched.coordinator.exposition import start_metrics_server
from flowsched.model import FlowClass

if TYPE_CHECKING:
    from flowsched.agent.service import Agent


class AgentCollector(Collector):
    """Yields the agent's metrics (labels: node, plus class/level/link where it applies)."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Metric]:
        agent, node = self.agent, self.agent.config.node
        yield from self._flows(node)
        yield _gauge(
            "flowsched_agent_coordinator_connected",
            "1 while connected",
            node,
            float(agent.connected),
        )
        yield _gauge(
            "flowsched_agent_fallback_active",
            "1 while the local policy runs",
            node,
            float(agent.fallback is not None),
        )
        yield _gauge(
            "flowsched_agent_last_fallback_switch_seconds",
            "coordinator silence before the last switch to the local policy",
            node,
            agent.stats["last_switch_delay"],
        )
        yield _gauge(
            "flowsched_agent_last_fallback_switch_timestamp_seconds",
            "wall-clock time of the last switch to the local policy",
            node,
            agent.stats["last_switch_wall"],
        )
        for name, key, text in _COUNTERS:
            counter = CounterMetricFamily(name, text, labels=["node"])
            counter.add_metric([node], agent.stats[key])
            yield counter
        if agent.table is not None:
            yield _gauge(
                "flowsched_agent_table_generation",
                "table generation",
                node,
                float(agent.table.generation),
            )
        if agent.sdk is not None:
            yield _gauge(
                "flowsched_agent_sdk_clients",
                "connected SDK clients",
                node,
                float(agent.sdk.clients),
            )
        yield _gauge(
            "flowsched_agent_rdma_devices",
            "RDMA devices found through pyverbs",
            node,
            float(len(agent.rdma_devices)),
        )
        yield from self._telemetry(node)
        util = GaugeMetricFamily(
            "flowsched_agent_link_utilization",
            "load of each node link (<node>:tx egress, <node>:rx ingress; 0..1)",
            labels=["node", "link"],
        )
        for sample in list(agent.nic.samples.values()):
            util.add_metric([node, sample.link], sample.load)
        yield util

    def _telemetry(self, node: str) -> Iterator[Metric]:
        tel = self.agent.telemetry
        done = CounterMetricFamily(
            "flowsched_agent_completed_flows",
            "closed flows by class and deadline outcome",
            labels=["node", "class", "deadline"],
        )
        for (cls, outcome), n in sorted(tel.completions.items()):
            done.add_metric([node, cls, outcome], n)
        yield done
        for name, text, hist in (
            (
                "flowsched_agent_completion_slack_seconds",
                "deadline minus completion time",
                tel.slack,
            ),
            (
                "flowsched_agent_local_decision_latency_seconds",
                "time of one local-policy call (fallback mode)",
                tel.decision_latency,
            ),
        ):
            family = HistogramMetricFamily(name, text, labels=["node"])
            family.add_metric([node], hist.cumulative(), sum_value=hist.sum)
            yield family
        updates = CounterMetricFamily(
            "flowsched_agent_level_updates",
            "level updates received from the coordinator",
            labels=["node"],
        )
        updates.add_metric([node], tel.level_updates)
        yield updates
        if self.agent.sdk is not None:
            requests = CounterMetricFamily(
                "flowsched_agent_sdk_requests", "SDK requests by type", labels=["node", "type"]
            )
            for kind, n in sorted(self.agent.sdk.requests.items()):
                requests.add_metric([node, kind], n)
            yield requests
            bad = CounterMetricFamily(
                "flowsched_agent_sdk_bad_frames",
                "SDK clients dropped for a bad frame",
                labels=["node"],
            )
            bad.add_metric([node], self.agent.sdk.errors_total)
            yield bad

    def _flows(self, node: str) -> Iterator[Metric]:
        registry = self.agent.registry
        active = GaugeMetricFamily(
            "flowsched_agent_active_flows",
            "open flows by class and level",
            labels=["node", "class", "level", "source"],
        )
        totals = CounterMetricFamily(
            "flowsched_agent_flows", "flows opened / closed", labels=["node", "event"]
        )
        if registry is not None:
            counts = Counter(
                (f.cls, f.level, "sdk" if fid in registry.sdk else "plugin")
                for fid, f in list(registry.flows.items())
            )
            for (cls, level, source), n in sorted(counts.items()):
                active.add_metric([node, FlowClass(cls).label, str(level), source], n)
            totals.add_metric([node, "opened"], registry.opened_total)
            totals.add_metric([node, "closed"], registry.closed_total)
        yield active
        yield totals


_COUNTERS = (
    ("flowsched_agent_levels_written", "levels_written", "level words written into slots"),
    ("flowsched_agent_promotions", "promotions", "level decreases applied"),
    ("flowsched_agent_batches_sent", "batches_sent", "flow batches sent to the coordinator"),
    ("flowsched_agent_fallback_switches", "fallback_switches", "switches to the local policy"),
    ("flowsched_agent_resyncs", "resyncs_sent", "resyncs sent after (re)connecting"),
    ("flowsched_agent_slots_reaped", "reaped", "slots of dead processes freed"),
    ("flowsched_agent_coordinator_connects", "connects", "successful coordinator handshakes"),
)


def _gauge(name: str, text: str, node: str, value: float) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(name, text, labels=["node"])
    gauge.add_metric([node], value)
    return gauge


async def start_http(
    agent: Agent, host: str, port: int
) -> tuple[asyncio.AbstractServer, tuple[str, int]]:
    """Serve ``GET /metrics`` for ``agent`` on ``host:port`` (0 = any free port)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(agent))
    server = await start_metrics_server(registry, host, port)
    bound = server.sockets[0].getsockname()
    return server, (str(bound[0]), int(bound[1]))
