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

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from flowsched.model import EXPLICIT_DEADLINE, Context, Decision, Flow
from flowsched.policies.argcheck import check_fields
from flowsched.policies.common import RankedLevels

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
        self._ranks = RankedLevels(num_levels)

    def describe_levels(self) -> list[str]:
        """What each level holds (for ``flowsched policy show``)."""
        ranked = [f"explicit deadlines, rank band {i}" for i in range(self.num_levels - 1)]
        return [*ranked, "everything else (fair)"][-self.num_levels :]

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        return self._ranks.admit(flow, _deadline(flow))

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        return self._ranks.reevaluate(flows, _deadline)

    def release(self, flow: Flow, ctx: Context) -> None:
        self._ranks.release(flow)


def _deadline(flow: Flow) -> float | None:
    return flow.deadline if has_explicit_deadline(flow) else None


def new(args: Mapping[str, Any], *, num_levels: int) -> EdfPolicy:
    """Build an :class:`EdfPolicy` from validated ``args``."""
    return EdfPolicy(Args(**args), num_levels)
