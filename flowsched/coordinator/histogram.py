"""The one fixed-bucket histogram of flowsched's metrics (coordinator and agent).

Observing is one bisect and two adds, cheap enough for the hot paths; Prometheus gets the
cumulative form at scrape time.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

#: Buckets (seconds) of the slack-at-completion histograms: deadline - completion time
#: (negative = missed).
SLACK_BUCKETS = (-10.0, -1.0, -0.1, -0.01, 0.0, 0.01, 0.1, 1.0, 10.0, 100.0)


class Histogram:
    """A bucket array (``le`` upper ``bounds``, +Inf implied) with cumulative export."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Add one observation."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, float]]:
        """``[(le, cumulative count), ...]`` ending with ``+Inf``, as Prometheus wants."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding quantile ``q`` (an over-estimate; inf if beyond)."""
        target = q * self.count
        running = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            if running >= target and running:
                return bound
        return float("inf")
