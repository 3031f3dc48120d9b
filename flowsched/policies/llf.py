"""``llf``: Least-Laxity-First with perfect knowledge, a reference oracle (never a competitor).

Laxity = deadline - now - remaining / B, where the deadline is the flow's true one
(``oracle_deadline``, which the simulator sets also for implicit deadlines; else ``deadline``),
remaining is the exact remaining size (0 if unknown) and B is the bandwidth of the flow's
bottleneck link. Flows with a deadline are ranked by laxity and banded by rank into levels
0..K-2 (each its own level while there are no more flows than levels, otherwise equal-count
groups); flows without any deadline share level K-1.

Ordering by laxity at one instant equals ordering by the latest start time
``deadline - remaining / B``, which does not depend on ``now``; ``admit`` bisects the new flow
into the latest-start times of the last reevaluation.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from flowsched.model import Context, Decision, Flow
from flowsched.policies.argcheck import check_fields
from flowsched.policies.common import BottleneckCache, RankedLevels, bottleneck

NAME = "llf"


@dataclass(frozen=True, slots=True)
class Args:
    """``llf`` takes no arguments."""


def validate(args: Mapping[str, Any], path: str) -> list[str]:
    """Field-path errors for ``args`` (empty when valid)."""
    return check_fields(args, path, {})


def true_deadline(flow: Flow) -> float | None:
    """The oracle's deadline of ``flow``: ``oracle_deadline`` if set, else ``deadline``."""
    return flow.oracle_deadline if flow.oracle_deadline is not None else flow.deadline


def latest_start(flow: Flow, ctx: Context, paths: BottleneckCache | None = None) -> float | None:
    """``deadline - remaining / B`` (the laxity plus ``now``), or None without a deadline."""
    deadline = true_deadline(flow)
    if deadline is None:
        return None
    bandwidth = paths(flow) if paths is not None else bottleneck(flow, ctx)
    remaining = flow.remaining or 0
    if remaining and bandwidth <= 0:
        return -math.inf  # cannot progress at all: as urgent as it gets
    return deadline - remaining / bandwidth if remaining else deadline


def laxity(flow: Flow, ctx: Context) -> float | None:
    """Laxity of ``flow`` at ``ctx.now`` (seconds), or None without a deadline."""
    start = latest_start(flow, ctx)
    return None if start is None else start - ctx.now


class LlfPolicy:
    """Rank-banded least laxity first over every flow that has a (true) deadline."""

    name: ClassVar[str] = NAME

    def __init__(self, args: Args, num_levels: int) -> None:
        self.num_levels = num_levels
        self._ranks = RankedLevels(num_levels)

    def describe_levels(self) -> list[str]:
        """What each level holds (for ``flowsched policy show``)."""
        ranked = [f"true deadlines, laxity rank band {i}" for i in range(self.num_levels - 1)]
        return [*ranked, "no deadline"][-self.num_levels :]

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        return self._ranks.admit(flow, latest_start(flow, ctx))

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        paths = BottleneckCache(ctx)
        return self._ranks.reevaluate(flows, lambda flow: latest_start(flow, ctx, paths))

    def release(self, flow: Flow, ctx: Context) -> None:
        self._ranks.release(flow)


def new(args: Mapping[str, Any], *, num_levels: int) -> LlfPolicy:
    """Build an :class:`LlfPolicy` from validated ``args``."""
    return LlfPolicy(Args(**args), num_levels)
