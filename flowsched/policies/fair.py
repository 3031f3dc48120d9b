"""``fair``: every flow on one level, so the network shares bandwidth max-min fairly.

This is what a network without a scheduler does today (DCTCP/DCQCN-style fair sharing).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from flowsched.model import Context, Decision, Flow
from flowsched.policies.argcheck import check_fields, integer, optional
from flowsched.policies.base import FlowLocalDecisions

NAME = "fair"


@dataclass(frozen=True, slots=True)
class Args:
    """Arguments of the ``fair`` policy.

    ``level``: the single level every flow uses (default: the least urgent level, K-1, so that
    fair traffic never outranks a strict-priority class sharing the fabric).
    """

    level: int | None = None


def validate(args: Mapping[str, Any], path: str) -> list[str]:
    """Field-path errors for ``args`` (empty when valid)."""
    return check_fields(args, path, {"level": optional(integer(0))})


class FairPolicy(FlowLocalDecisions):
    """One level for everything; decisions never change."""

    name: ClassVar[str] = NAME
    #: each decision depends on one flow and the Context only (see policies.base)
    per_flow_decisions: ClassVar[bool] = True

    def __init__(self, args: Args, num_levels: int) -> None:
        self.num_levels = num_levels
        level = num_levels - 1 if args.level is None else args.level
        if not 0 <= level < num_levels:
            raise ValueError(f"policy.args.level: {level} is outside 0..{num_levels - 1}")
        self._decision = Decision(level)

    def describe_levels(self) -> list[str]:
        """What each level holds (for ``flowsched policy show``)."""
        used = self._decision.level
        return ["every flow (fair)" if lvl == used else "-" for lvl in range(self.num_levels)]

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        return self._decision

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        return {f.flow_id: self._decision for f in flows if f.level != self._decision.level}

    def release(self, flow: Flow, ctx: Context) -> None:
        return None


def new(args: Mapping[str, Any], *, num_levels: int) -> FairPolicy:
    """Build a :class:`FairPolicy` from validated ``args``."""
    return FairPolicy(Args(**args), num_levels)
