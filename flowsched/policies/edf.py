"""``edf``: explicit-deadline flows first, earliest deadline first; everything else fair.

As the MFS paper runs its EDF baseline: flows of the explicit-deadline classes (``param_sync``,
``kv``) that carry a deadline are ordered by absolute deadline and banded by rank into the top
levels 0..K-2 (with no more such flows than levels each gets its own level; otherwise equal-count
groups of consecutive ranks). All other flows share level K-1 fairly. Deadline flows may move
down when an earlier deadline arrives: EDF is a ranking, not a promotion scheme.

``admit`` ranks the new flow among the deadlines it has seen (a sorted list, bisect), so a tight
flow is not parked at the bottom until the next reevaluation.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from flowsched.model import EXPLICIT_DEADLINE, Context, Decision, Flow
from flowsched.policies.argcheck import check_fields
from flowsched.policies.common import rank_band

NAME = "edf"


@dataclass(frozen=True, slots=True)
class Args:
    """``edf`` takes no arguments."""


def validate(args: Mapping[str, Any], path: str) -> list[str]:
    """Field-path errors for ``args`` (empty when valid)."""
    return check_fields(args, path, {})


def has_explicit_deadline(flow: Flow) -> bool:
    """True for flows of an explicit-deadline class that carry a deadline."""
    return flow.cls in EXPLICIT_DEADLINE and flow.deadline is not None


class EdfPolicy:
    """Rank-banded earliest deadline first for explicit deadlines, fair for the rest."""

    name: ClassVar[str] = NAME

    def __init__(self, args: Args, num_levels: int) -> None:
        self.num_levels = num_levels
        self._deadline_levels = max(num_levels - 1, 1)
        self._sorted: list[float] = []
        self._deadline_of: dict[int, float] = {}

    def describe_levels(self) -> list[str]:
        """What each level holds (for ``flowsched policy show``)."""
        ranked = [f"explicit deadlines, rank band {i}" for i in range(self.num_levels - 1)]
        return [*ranked, "everything else (fair)"][-self.num_levels :]

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        if not has_explicit_deadline(flow):
            return Decision(self.num_levels - 1)
        assert flow.deadline is not None
        rank = bisect.bisect_left(self._sorted, flow.deadline)
        bisect.insort(self._sorted, flow.deadline)
        self._deadline_of[flow.flow_id] = flow.deadline
        return Decision(rank_band(rank, len(self._sorted), self._deadline_levels))

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        ranked: list[tuple[float, Flow]] = []
        changes: dict[int, Decision] = {}
        for flow in flows:
            if has_explicit_deadline(flow):
                assert flow.deadline is not None
                ranked.append((flow.deadline, flow))
            elif flow.level != self.num_levels - 1:
                changes[flow.flow_id] = Decision(self.num_levels - 1)
        ranked.sort(key=lambda item: item[0])
        self._sorted = [deadline for deadline, _ in ranked]
        self._deadline_of = {flow.flow_id: deadline for deadline, flow in ranked}
        for rank, (_, flow) in enumerate(ranked):
            level = rank_band(rank, len(ranked), self._deadline_levels)
            if level != flow.level:
                changes[flow.flow_id] = Decision(level)
        return changes

    def release(self, flow: Flow, ctx: Context) -> None:
        deadline = self._deadline_of.pop(flow.flow_id, None)
        if deadline is not None:
            index = bisect.bisect_left(self._sorted, deadline)
            if index < len(self._sorted) and self._sorted[index] == deadline:
                del self._sorted[index]


def new(args: Mapping[str, Any], *, num_levels: int) -> EdfPolicy:
    """Build an :class:`EdfPolicy` from validated ``args``."""
    return EdfPolicy(Args(**args), num_levels)
