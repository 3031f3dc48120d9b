"""Prometheus metrics of the coordinator, computed at scrape time from its live state.

Nothing here runs on the hot paths: the service keeps plain integer counters and a bucket
array (:class:`Histogram`), and :class:`CoordinatorCollector` turns them, and the flow table,
into metric families when Prometheus scrapes. Names follow the Prometheus conventions (base
units, ``_total`` counters, ``_ratio`` for 0..1); the list is in docs/deploy.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Info, PlatformCollector, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from flowsched import __version__
from flowsched.compiled import is_compiled
from flowsched.coordinator.histogram import Histogram
from flowsched.coordinator.state import ClusterState, node_links

#: Buckets (seconds) of the decision-latency histogram: 50 us .. 1 s.
LATENCY_BUCKETS = (
    50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 20e-3, 50e-3, 0.1, 0.2, 0.5, 1.0,
)  # fmt: skip

PREFIX = "flowsched_coordinator"
#: close reasons exported from the start (at 0), so that the alerts on them watch a series
#: (deploy/prometheus/flowsched-rules.yml)
ALERTED_CLOSE_REASONS = ("auth_failed", "bad_mac")


def register_standard_collectors(registry: CollectorRegistry) -> None:
    """Add ``flowsched_build_info`` and prometheus_client's process and platform collectors
    (``process_*``, ``python_info``) to a daemon's own registry."""
    Info(
        "flowsched_build",
        "flowsched version of this daemon; compiled: whether its flow table, policy and"
        " protocol codec run as mypyc-compiled modules (a wheel) or as Python (an editable"
        " install).",
        registry=registry,
    ).info({"version": __version__, "compiled": "true" if is_compiled() else "false"})
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)


@dataclass(slots=True)
class LiveCounters:
    """Service-level counters that are not part of the cluster state."""

    decision_latency: Histogram
    flush_duration: Histogram
    frames_received: int = 0
    rejected: dict[str, int] | None = None


class CoordinatorCollector:
    """Yields the coordinator's metric families from live state at every scrape.

    Args:
        state: the cluster state (flow table, link loads, counters).
        live: service counters (decision latency, frames, rejected connections).
        agents_connected: returns the number of authenticated agent connections now.
        leadership: returns (leading, epoch) now (see flowsched.coordinator.election); None:
            always the leader, epoch 0 (no election).
        etcd_failures: returns each etcd member URL's failed requests and watch streams so far
            (empty without an election).
        connected_nodes: returns the nodes with an authenticated connection now: link series
            are exported for their links only (None: for every link the state holds), so that
            the series are bounded by the agents, not by the names anyone ever reported.
        agents_cut_off: returns how many agents have kept knocking on this standby (refused)
            long enough to count as unable to reach the leader, 0 while leading, None without
            an election (no series; see flowsched.coordinator.reach).
    """

    def __init__(
        self,
        state: ClusterState,
        live: LiveCounters,
        agents_connected: Callable[[], int],
        leadership: Callable[[], tuple[bool, int]] | None = None,
        etcd_failures: Callable[[], Mapping[str, int]] | None = None,
        connected_nodes: Callable[[], Iterable[str]] | None = None,
        agents_cut_off: Callable[[], int | None] | None = None,
    ) -> None:
        self._state = state
        self._live = live
        self._agents = agents_connected
        self._leadership = leadership
        self._etcd_failures = etcd_failures
        self._connected_nodes = connected_nodes
        self._agents_cut_off = agents_cut_off

    def collect(self) -> Iterator[Metric]:
        """The metric families (called by the registry on each scrape)."""
        yield self._active_flows()
        yield from self._counters()
        yield self._completed()
        yield from self._slack()
        yield from self._latency()
        yield from self._links()
        agents = GaugeMetricFamily(f"{PREFIX}_agents_connected", "Authenticated agents.")
        agents.add_metric([], self._agents())
        yield agents
        yield from self._leader()

    def _leader(self) -> Iterator[Metric]:
        leading, epoch = self._leadership() if self._leadership is not None else (True, 0)
        leader = GaugeMetricFamily(
            f"{PREFIX}_leader", "1 while this coordinator is the elected leader (or runs alone)."
        )
        leader.add_metric([], 1.0 if leading else 0.0)
        yield leader
        token = GaugeMetricFamily(
            f"{PREFIX}_epoch",
            "Fencing token of this leadership: etcd create revision of the leader key (0: no "
            "election, or standing by).",
        )
        token.add_metric([], float(epoch))
        yield token
        failures = CounterMetricFamily(
            f"{PREFIX}_etcd_failures",
            "etcd requests and watch streams that failed, by member URL (each moves the next "
            "request on to the next member of --etcd).",
            labels=["member"],
        )
        for member, count in sorted((self._etcd_failures or dict)().items()):
            failures.add_metric([member], count)
        yield failures
        unreached = self._agents_cut_off() if self._agents_cut_off is not None else None
        if unreached is not None:
            cut_off = GaugeMetricFamily(
                f"{PREFIX}_agents_cut_off_from_leader",
                "On a standby: agents refused here for 5 s or more, which cannot reach the "
                "leader (it is deposed when they outnumber the agents it serves).",
            )
            cut_off.add_metric([], unreached)
            yield cut_off

    def _active_flows(self) -> Metric:
        family = GaugeMetricFamily(
            f"{PREFIX}_active_flows", "Active flows by class and level.", labels=["class", "level"]
        )
        for (cls, level), count in sorted(self._state.active_by_class_level().items()):
            family.add_metric([cls.label, str(level)], count)
        return family

    def _counters(self) -> Iterator[Metric]:
        stats = self._state.stats
        events = CounterMetricFamily(
            f"{PREFIX}_events", "Flow and job events received, by kind.", labels=["kind"]
        )
        for kind, count in sorted(stats.events.items()):
            events.add_metric([kind], count)
        yield events
        yield CounterMetricFamily(
            f"{PREFIX}_level_updates", "Level changes queued to agents.", value=stats.level_updates
        )
        yield CounterMetricFamily(
            f"{PREFIX}_promotions", "Decisions moving a flow to a more urgent level.",
            value=stats.promotions,
        )  # fmt: skip
        yield CounterMetricFamily(
            f"{PREFIX}_frames", "Frames received from agents.", value=self._live.frames_received
        )
        yield CounterMetricFamily(
            f"{PREFIX}_policy_evaluations", "Flows passed to policy.reevaluate.",
            value=stats.evaluations,
        )  # fmt: skip
        yield CounterMetricFamily(
            f"{PREFIX}_timer_sweeps", "Timer passes over the deadline flows.", value=stats.sweeps
        )
        yield CounterMetricFamily(
            f"{PREFIX}_timer_overruns", "Timer ticks skipped: previous sweep unfinished.",
            value=stats.sweep_overruns,
        )  # fmt: skip
        yield CounterMetricFamily(
            f"{PREFIX}_refused_flows",
            "Flow opens refused: their node had --max-flows-per-node flows open, or its flows "
            "would name too many distinct links or jobs, or links in all (docs/security.md).",
            value=stats.refused_opens,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_policy_errors",
            "Times the policy raised (each flow it raised on keeps its level until its retry; "
            "see the log).",
            value=stats.policy_errors,
        )
        rejected = CounterMetricFamily(
            f"{PREFIX}_closed_connections",
            "Agent connections closed, by reason (bad_mac: a frame failed its MAC, altered on "
            "the way; auth_failed: a wrong token or node certificate).",
            labels=["reason"],
        )
        counts = dict.fromkeys(ALERTED_CLOSE_REASONS, 0) | (self._live.rejected or {})
        for reason, count in sorted(counts.items()):
            rejected.add_metric([reason], count)
        yield rejected

    def _completed(self) -> Metric:
        family = CounterMetricFamily(
            f"{PREFIX}_completed_flows",
            "Closed flows by class and deadline outcome (met, missed, none).",
            labels=["class", "deadline"],
        )
        for (cls, outcome), count in sorted(self._state.stats.completed.items()):
            family.add_metric([cls, outcome], count)
        return family

    def _slack(self) -> Iterator[Metric]:
        slack = self._state.stats.slack
        for name, hist, text in (
            ("lateness", slack.late, "Completion minus deadline of flows that missed it."),
            ("earliness", slack.early, "Deadline minus completion of flows that met it."),
        ):
            family = HistogramMetricFamily(f"{PREFIX}_deadline_{name}_seconds", text)
            family.add_metric([], hist.cumulative(), hist.sum)
            yield family

    def _latency(self) -> Iterator[Metric]:
        hist = self._live.decision_latency
        family = HistogramMetricFamily(
            f"{PREFIX}_decision_latency_seconds",
            "Time from reading an event's frame to its level updates being queued (time the"
            " frame waited in the socket before the read is not included).",
        )
        family.add_metric([], hist.cumulative(), hist.sum)
        yield family
        flush = self._live.flush_duration
        family = HistogramMetricFamily(
            f"{PREFIX}_flush_seconds", "Duration of one policy run (flush) and its sends."
        )
        family.add_metric([], flush.cumulative(), flush.sum)
        yield family

    def _links(self) -> Iterator[Metric]:
        util = GaugeMetricFamily(
            f"{PREFIX}_link_utilization_ratio", "Reported link load rho (0..1).", labels=["link"]
        )
        bandwidth = GaugeMetricFamily(
            f"{PREFIX}_link_bandwidth_bytes_per_second",
            "Reported link capacity.",
            labels=["link"],
        )
        loads, capacities = self._state.link_load, self._state.link_bandwidth
        if self._connected_nodes is None:
            links = sorted(loads)
        else:
            links = sorted(link for node in self._connected_nodes() for link in node_links(node))
        for link in links:
            load = loads.get(link)
            if load is None:  # not reported yet
                continue
            util.add_metric([link], load)
            capacity = capacities.get(link)
            if capacity is not None:  # absent, not 0, while no agent has reported it
                bandwidth.add_metric([link], capacity)
        yield util
        yield bandwidth
