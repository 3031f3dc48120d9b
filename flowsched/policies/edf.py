"""``edf``: explicit-deadline flows first, earliest deadline first; everything else fair.

As the MFS paper runs its EDF baseline: flows of the explicit-deadline classes (``param_sync``,
``kv``) that carry a deadline are ordered by absolute deadline and banded by rank into the top
levels 0..K-2 (with no more such flows than levels each gets its own level; otherwise equal-count
groups of consecutive ranks). All other flows share level K-1 fairly. Deadline flows may move
down when an earlier deadline arrives: EDF is a ranking, not a promotion scheme.

``admit`` ranks the new flow among the deadlines it has seen (a sorted list, bisect), so a tight
flow is not parked at the bottom until the next reevaluation.

``drop_late = true`` adds the late-dropping rule (:class:`~flowsched.policies.common.LateDrop`):
a flow of ``drop_classes`` (default ``["kv"]``) past its deadline goes to the scavenger level
K-1, the ranks take 0..K-3 and everything else K-2.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from flowsched.model import EXPLICIT_DEADLINE, Context, Decision, Flow
from flowsched.policies.argcheck import check_fields
from flowsched.policies.common import (
    DROP_CLASSES,
    LATE_DROP_FIELDS,
    LateDrop,
    RankedLevels,
    late_drop_fields,
)

NAME = "edf"


@dataclass(frozen=True, slots=True)
class Args:
    """Arguments of ``edf``: the late-dropping rule only (module docstring)."""

    drop_late: bool = False
    drop_classes: tuple[str, ...] = DROP_CLASSES


def validate(args: Mapping[str, Any], path: str) -> list[str]:
    """Field-path errors for ``args`` (empty when valid)."""
    return check_fields(args, path, LATE_DROP_FIELDS)


def has_explicit_deadline(flow: Flow) -> bool:
    """True for flows of an explicit-deadline class that carry a deadline."""
    return flow.cls in EXPLICIT_DEADLINE and flow.deadline is not None


class EdfPolicy:
    """Rank-banded earliest deadline first for explicit deadlines, fair for the rest."""

    name: ClassVar[str] = NAME

    def __init__(self, args: Args, num_levels: int) -> None:
        self.num_levels = num_levels
        self._late = LateDrop(args.drop_late, args.drop_classes)
        self._ranks = RankedLevels(num_levels, self._late)

    def describe_levels(self) -> list[str]:
        """What each level holds (for ``flowsched policy show``)."""
        return self._ranks.describe("explicit deadlines", "everything else (fair)")

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        return self._ranks.admit(flow, _deadline(flow), ctx.now)

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        return self._ranks.reevaluate(flows, _deadline, ctx.now)

    def release(self, flow: Flow, ctx: Context) -> None:
        self._ranks.release(flow)

    def next_change(self, flow: Flow, ctx: Context) -> float | None:
        """When time alone changes ``flow``'s own decision: its deadline with ``drop_late``
        (ranks also move when other flows change; the caller re-ranks every flow then)."""
        return self._late.next_change(flow, ctx.now)


def _deadline(flow: Flow) -> float | None:
    return flow.deadline if has_explicit_deadline(flow) else None


def new(args: Mapping[str, Any], *, num_levels: int) -> EdfPolicy:
    """Build an :class:`EdfPolicy` from validated ``args``."""
    return EdfPolicy(Args(**late_drop_fields(args)), num_levels)
