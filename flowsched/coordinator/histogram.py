"""The coordinator's hot-path histogram, and its deadline lateness / earliness pair.

The coordinator observes one decision latency per received frame and one deadline outcome
per closed flow, inside its event handling (about 3 us per event at saturation, see
README). ``prometheus_client.Histogram.observe`` takes a lock and walks the buckets:
``python bench/histogram_observe.py`` (14 buckets, both in one run) measured 0.26 us per
observe for this bisect-and-add against 1.82 us for prometheus_client (7.1x); four runs on
the shared 2-core machine gave 3.0x to 8.1x. Elsewhere (the agent) flowsched uses
prometheus_client's Histogram; both export the same cumulative form.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from flowsched.model import deadline_outcome

#: Buckets (seconds) of the lateness (completion after the deadline) and earliness
#: (completion before it) histograms. Both observe non-negative values only, so their
#: ``_sum`` never goes down (a signed "slack" histogram's would).
DEADLINE_BUCKETS = (0.001, 0.01, 0.1, 1.0, 10.0, 100.0)


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


class DeadlineSlack:
    """Closed deadline flows: how late the missed ones were, how early the met ones."""

    __slots__ = ("early", "late")

    def __init__(self, bounds: Sequence[float] = DEADLINE_BUCKETS) -> None:
        self.late = Histogram(bounds)
        self.early = Histogram(bounds)

    def observe(self, slack: float) -> None:
        """Record ``slack`` = deadline - completion time (negative: missed by ``-slack``),
        at most :data:`~flowsched.model.SLACK_CAP` either way."""
        outcome, amount = deadline_outcome(slack)
        (self.early if outcome == "met" else self.late).observe(amount)

    @property
    def counts(self) -> list[int]:
        """Per-bucket counts, lateness buckets first, then earliness buckets."""
        return self.late.counts + self.early.counts
