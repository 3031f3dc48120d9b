"""What the agent measures for its metrics (plain data; no I/O beyond reading the table).

* :class:`Telemetry`: closed flows (deadline met / missed, how late, how early), the local
  policy's decision latency, level updates received.
* :class:`SlotTelemetry`: from the plugin's words in the flow table, on every table scan:
  bytes sent per class and level in force, and the level-apply latency (the agent wrote a
  level into a slot, ``level_set_ns`` -> the plugin applied it to the connection's sockets at
  its next message, ``applied_ns``; one CLOCK_MONOTONIC clock, so exact).

Histograms are prometheus_client's; they are observed per closed flow or per level change,
not per message.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import Histogram
from prometheus_client.core import Metric

from flowsched.model import Flow, deadline_outcome
from flowsched.shm import layout

if TYPE_CHECKING:
    from flowsched.agent.flows import SlotConn

#: seconds spent in one local-policy call (admit batch or reevaluate)
LATENCY_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1)
#: seconds a missed deadline was missed by, or a met one met early
DEADLINE_BUCKETS = (0.001, 0.01, 0.1, 1.0, 10.0, 100.0)
#: seconds from a level written into a slot to the plugin applying it (its next message)
APPLY_BUCKETS = (1e-4, 1e-3, 1e-2, 0.1, 0.5, 1.0, 5.0, 30.0)

PREFIX = "flowsched_agent"


def _histogram(name: str, text: str, buckets: tuple[float, ...]) -> Histogram:
    return Histogram(f"{PREFIX}_{name}", text, buckets=buckets, registry=None)


@dataclass(slots=True)
class Telemetry:
    """Completions (deadline met / missed), lateness, earliness, local decision latency."""

    completions: Counter[tuple[str, str]] = field(default_factory=Counter)
    lateness: Histogram = field(
        default_factory=lambda: _histogram(
            "deadline_lateness_seconds",
            "Completion minus deadline of closed flows that missed it.",
            DEADLINE_BUCKETS,
        )
    )
    earliness: Histogram = field(
        default_factory=lambda: _histogram(
            "deadline_earliness_seconds",
            "Deadline minus completion of closed flows that met it.",
            DEADLINE_BUCKETS,
        )
    )
    decision_latency: Histogram = field(
        default_factory=lambda: _histogram(
            "local_decision_latency_seconds",
            "Time of one local-policy call (fallback mode).",
            LATENCY_BUCKETS,
        )
    )
    level_updates: int = 0

    def completed(self, flow: Flow, now: float) -> None:
        """Record a closed flow: deadline met / missed / none, and by how much."""
        if flow.deadline is None:
            self.completions[flow.cls.label, "none"] += 1
            return
        outcome, amount = deadline_outcome(flow.deadline - now)
        self.completions[flow.cls.label, outcome] += 1
        (self.earliness if outcome == "met" else self.lateness).observe(amount)

    def histograms(self) -> Iterator[Metric]:
        """The histogram families, for the collector."""
        for hist in (self.lateness, self.earliness, self.decision_latency):
            yield from hist.collect()


#: level label of the ``sent_bytes`` counter for each applied_level word value; any other value
#: (only a table writer's tampering makes one) is ``INVALID_LEVEL``, so the series stay bounded
_LEVEL_LABELS = {level: str(level) for level in range(layout.MAX_LEVELS)} | {
    layout.LEVEL_UNSET: "unset"
}
INVALID_LEVEL = "invalid"


class SlotTelemetry:
    """Bytes sent per (class, level) and level-apply latency, read from the plugins' slots.

    The agent calls :meth:`scan` after a table scan when :meth:`due` (every ``PERIOD``, not
    every scan: 1,000 busy slots cost about 1 ms per pass) with the busy slots' ``(index,
    state, claim_seq, bytes)``, the table's :data:`COLUMNS` and the connections it knows.
    Bytes that grew since the previous pass count for the level the plugin had applied at
    this pass, so bytes sent up to ``PERIOD`` before a level change may count for the new
    level. Every application is seen (``applied_ns`` stays in the slot); of two level writes
    applied within one period only the later is timed. The first pass only takes a
    baseline: bytes moved before this agent started are not its; nor are those a connection
    that moved into the table already open (``SlotConn.moved``) carried before it came.
    """

    COLUMNS = ("applied_level", "applied_ns", "level_set_ns")
    PERIOD = 0.05

    def __init__(self) -> None:
        self.sent: Counter[tuple[str, str]] = Counter()
        self.apply_latency = _histogram(
            "level_apply_latency_seconds",
            "From the agent writing a level into a connection's slot to the plugin applying "
            "it to the sockets (at the connection's next message).",
            APPLY_BUCKETS,
        )
        #: (index, claim_seq) -> (class label, bytes, applied_ns) at the previous pass
        self._seen: dict[tuple[int, int], tuple[str, int, int]] = {}
        self._primed = False
        self._next = 0.0

    def due(self, now: float) -> bool:
        """Whether a pass is due at monotonic time ``now`` (then the next one is PERIOD on)."""
        if now < self._next:
            return False
        self._next = now + self.PERIOD
        return True

    def scan(
        self,
        busy: Iterable[tuple[int, int, int, int]],
        columns: Mapping[str, list[int]],
        conns: Mapping[tuple[int, int], SlotConn],
    ) -> None:
        """Account one pass (``conns``: the connections the agent tracks, by ``(index,
        claim_seq)``; others are skipped until it does)."""
        applied_level, applied_ns = columns["applied_level"], columns["applied_ns"]
        level_set_ns = columns["level_set_ns"]
        old, seen, sent = self._seen, {}, self.sent
        for index, _state, seq, nbytes in busy:
            key = (index, seq)
            before = old.get(key)
            if before is None:
                conn = conns.get(key)
                if conn is None or conn.direction != layout.DIR_SEND:
                    continue
                baseline = nbytes if not self._primed or conn.moved else 0
                before = (conn.cls.label, baseline, 0)
            cls, was_bytes, was_applied = before
            if nbytes > was_bytes:
                level = applied_level[index]
                sent[cls, _LEVEL_LABELS.get(level, INVALID_LEVEL)] += nbytes - was_bytes
            else:
                nbytes = was_bytes  # counters only grow; a torn read never moves them back
            applied = applied_ns[index]
            # the first application of the slot's latest level write
            if applied != was_applied and was_applied < level_set_ns[index] <= applied:
                self.apply_latency.observe((applied - level_set_ns[index]) / 1e9)
            seen[key] = (cls, nbytes, applied)
        self._seen = seen
        self._primed = True
