"""Counters and histograms the agent keeps for its metrics (plain data, no I/O)."""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

from flowsched.model import Flow

#: seconds; slack at completion = deadline - completion time (negative = missed)
SLACK_BUCKETS = (-10.0, -1.0, -0.1, -0.01, 0.0, 0.01, 0.1, 1.0, 10.0, 100.0)
#: seconds spent in one local-policy call (admit batch or reevaluate)
LATENCY_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1)


@dataclass(slots=True)
class Histogram:
    """Fixed-bucket histogram (``le`` upper bounds; +Inf implied)."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        """Count one observation."""
        index = bisect.bisect_left(self.buckets, value)
        if index < len(self.counts):
            self.counts[index] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, float]]:
        """``[(le, cumulative count), ..., ("+Inf", count)]`` as Prometheus wants them."""
        out, running = [], 0
        for bound, n in zip(self.buckets, self.counts, strict=True):
            running += n
            out.append((repr(bound), float(running)))
        out.append(("+Inf", float(self.count)))
        return out


@dataclass(slots=True)
class Telemetry:
    """Completions (deadline met / missed), slack, local decision latency, level updates."""

    completions: Counter[tuple[str, str]] = field(default_factory=Counter)
    slack: Histogram = field(default_factory=lambda: Histogram(SLACK_BUCKETS))
    decision_latency: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    level_updates: int = 0

    def completed(self, flow: Flow, now: float) -> None:
        """Record a closed flow: deadline met / missed / none, and its slack."""
        if flow.deadline is None:
            self.completions[flow.cls.label, "none"] += 1
            return
        slack = flow.deadline - now
        self.completions[flow.cls.label, "met" if slack >= 0 else "missed"] += 1
        self.slack.observe(slack)
