"""Counters and histograms the agent keeps for its metrics (plain data, no I/O)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from flowsched.coordinator.histogram import SLACK_BUCKETS, Histogram
from flowsched.model import Flow

#: seconds spent in one local-policy call (admit batch or reevaluate)
LATENCY_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1)


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
