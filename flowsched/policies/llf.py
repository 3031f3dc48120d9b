"""``llf``: Least-Laxity-First with perfect knowledge, a reference oracle (never a competitor).

Laxity = deadline - now - remaining / B, where the deadline is the flow's true one, remaining
is the exact remaining size (0 if unknown) and B is the bandwidth of the flow's bottleneck link.
Flows with a deadline are ranked by laxity and banded by rank into levels 0..K-2 (each its own
level while there are no more flows than levels, otherwise equal-count groups); flows without
any deadline share level K-1.

True deadlines: ``oracle_deadline`` (which the simulator sets for implicit deadlines), else
``deadline``; for collectives (``tp``) ``opened_at + size / B``. A collective is a barrier: the
next layer or step starts the moment it completes, so every instant past its isolated transfer
time (what it takes alone on its path) is a GPU stall. Its consumer's start time is no
deadline (it waits for the collective, whenever it ends): with it as the deadline every
collective was late from its first byte, by its whole size, so collectives were ranked by
size against each other and not by how long each had already been held back.

``drop_late = true`` adds the late-dropping rule of the baselines
(:class:`~flowsched.policies.common.LateDrop`, on the explicit ``deadline``): a late flow of
``drop_classes`` goes to K-1, the ranks take 0..K-3 and flows without a deadline K-2.

Ordering by laxity at one instant equals ordering by the latest start time
``deadline - remaining / B``, which does not depend on ``now``; ``admit`` bisects the new flow
into the latest-start times of the last reevaluation.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from flowsched.model import Context, Decision, Flow, FlowClass
from flowsched.policies.argcheck import check_fields
from flowsched.policies.common import (
    DROP_CLASSES,
    LATE_DROP_FIELDS,
    BottleneckCache,
    LateDrop,
    RankedLevels,
    bottleneck,
    late_drop_fields,
)

NAME = "llf"


@dataclass(frozen=True, slots=True)
class Args:
    """Arguments of ``llf``: the late-dropping rule only (module docstring)."""

    drop_late: bool = False
    drop_classes: tuple[str, ...] = DROP_CLASSES


def validate(args: Mapping[str, Any], path: str) -> list[str]:
    """Field-path errors for ``args`` (empty when valid)."""
    return check_fields(args, path, LATE_DROP_FIELDS)


def true_deadline(flow: Flow, bandwidth: float) -> float | None:
    """The oracle's deadline of ``flow`` whose path has capacity ``bandwidth`` (module doc):
    a collective's isolated completion time, else ``oracle_deadline``, else ``deadline``."""
    if flow.cls is FlowClass.TP:
        if not flow.size:
            return flow.opened_at
        return flow.opened_at + flow.size / bandwidth if bandwidth > 0 else -math.inf
    return flow.oracle_deadline if flow.oracle_deadline is not None else flow.deadline


def latest_start(flow: Flow, ctx: Context, paths: BottleneckCache | None = None) -> float | None:
    """``deadline - remaining / B`` (the laxity plus ``now``), or None without a deadline."""
    bandwidth = paths(flow) if paths is not None else bottleneck(flow, ctx)
    deadline = true_deadline(flow, bandwidth)
    if deadline is None:
        return None
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
        self._late = LateDrop(args.drop_late, args.drop_classes)
        self._ranks = RankedLevels(num_levels, self._late)

    def describe_levels(self) -> list[str]:
        """What each level holds (for ``flowsched policy show``)."""
        return self._ranks.describe("true deadlines by laxity", "no deadline")

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        return self._ranks.admit(flow, latest_start(flow, ctx), ctx.now)

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        paths = BottleneckCache(ctx)
        return self._ranks.reevaluate(flows, lambda flow: latest_start(flow, ctx, paths), ctx.now)

    def release(self, flow: Flow, ctx: Context) -> None:
        self._ranks.release(flow)

    # No next_change: a flow's laxity moves as it and the others send, so the ranks change
    # with time alone and the caller must sweep (the simulator re-ranked only at opens and
    # closes, leaving a flow that had fallen behind below one that had gone ahead).


def new(args: Mapping[str, Any], *, num_levels: int) -> LlfPolicy:
    """Build an :class:`LlfPolicy` from validated ``args``."""
    return LlfPolicy(Args(**late_drop_fields(args)), num_levels)
