"""``karuna``: deadline flows at the minimum rate that meets the deadline, the rest PIAS/SJF.

After Karuna (SIGCOMM'16), the strongest baseline of the MFS paper: flows of the
explicit-deadline classes with a known size and a deadline go to the top level (0) with a rate
cap ``Decision.rate = remaining / time to deadline x (1 + headroom)``, the minimum rate that
still meets the deadline (Karuna's MCP), leaving the rest of the link to other flows. A deadline
flow already past its deadline is uncapped (``rate = None``): it finishes as fast as it can.

Every other flow shares levels 1..K-1 through one set of K-2 thresholds (PIAS's, derived as in
:mod:`flowsched.policies.pias` from the size distribution and load, or given): flows of known
size are placed by their *remaining* size against the thresholds (SJF), flows of unknown size
by their bytes sent (PIAS's MLFQ), as Karuna splits its type-2 and type-3 flows.

A rate is re-issued only when it moves by more than ``rate_tolerance`` (relative), so that a
reevaluation returns sparse changes.

The rate caps are applied by the simulator only. Live, the coordinator ships them but the agent
applies levels only (nothing paces a flow): live karuna is "deadline flows strictly first" at
level 0, not Karuna's minimum rate. ``flowsched policy check`` warns about it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from flowsched.model import EXPLICIT_DEADLINE, Context, Decision, Flow
from flowsched.policies import pias
from flowsched.policies.argcheck import number
from flowsched.policies.base import FlowLocalDecisions

NAME = "karuna"


@dataclass(frozen=True, slots=True)
class Args:
    """Arguments of ``karuna``: pacing headroom and tolerance, plus the PIAS arguments."""

    headroom: float = 0.05
    rate_tolerance: float = 0.05
    thresholds: Sequence[float] | None = None
    size_samples: Sequence[float] | None = None
    size_cdf: Sequence[Sequence[float]] | None = None
    load: float = 0.7


def validate(args: Mapping[str, Any], path: str) -> list[str]:
    """Field-path errors for ``args`` (empty when valid)."""
    own = {"headroom": number(0.0, 10.0), "rate_tolerance": number(0.0, 1.0)}
    return pias.validate(args, path, extra=own)


def minimum_rate(flow: Flow, now: float, headroom: float) -> float | None:
    """Bytes/s that finish ``flow`` exactly at its deadline, plus headroom.

    None (uncapped) when the deadline has passed or nothing is left to send.
    """
    assert flow.deadline is not None and flow.remaining is not None
    time_left = flow.deadline - now
    if time_left <= 0 or flow.remaining == 0:
        return None  # late: as fast as possible; done: nothing to pace (a 0 cap would stall it)
    return flow.remaining / time_left * (1.0 + headroom)


def is_deadline_flow(flow: Flow) -> bool:
    """Karuna's type-1 flows: explicit-deadline class, known size and a deadline."""
    return flow.cls in EXPLICIT_DEADLINE and flow.deadline is not None and flow.size is not None


class KarunaPolicy(FlowLocalDecisions):
    """Paced deadline flows on top; SJF (known size) / PIAS (unknown size) below."""

    name: ClassVar[str] = NAME
    #: each decision depends on one flow and the Context only (see policies.base)
    per_flow_decisions: ClassVar[bool] = True

    def __init__(self, args: Args, num_levels: int) -> None:
        self.num_levels = num_levels
        self._args = args
        lower = max(num_levels - 1, 1)
        if args.thresholds is not None and len(args.thresholds) != lower - 1:
            # worded here: pias's own message would name the K of its levels, K-1
            raise ValueError(
                f"policy.args.thresholds: expected {lower - 1} thresholds for K={num_levels} "
                f"(level 0 holds the deadline flows), got {len(args.thresholds)}"
            )
        pias_args = pias.Args(args.thresholds, args.size_samples, args.size_cdf, args.load)
        self.thresholds = pias.resolve_thresholds(pias_args, lower)
        self._offset = 1 if num_levels > 1 else 0
        self._rate: dict[int, float | None] = {}

    def decide(self, flow: Flow, now: float) -> Decision:
        """The decision for ``flow`` at ``now`` (no sparseness applied)."""
        if is_deadline_flow(flow):
            return Decision(0, minimum_rate(flow, now, self._args.headroom))
        return Decision(self._lower_level(flow))

    def _lower_level(self, flow: Flow) -> int:
        """SJF by remaining size when known, else PIAS by bytes sent, on levels 1..K-1."""
        remaining = flow.remaining
        progress = remaining if remaining is not None else flow.sent
        return self._offset + pias.sent_level(progress, self.thresholds)

    def describe_levels(self) -> list[str]:
        """What each level holds (for ``flowsched policy show``)."""
        bounds = [0.0, *self.thresholds, float("inf")]
        lower = [
            f"size left (or bytes sent) in [{lo:.4g}, {hi:.4g})"
            for lo, hi in itertools.pairwise(bounds)
        ]
        return ["deadline flows, paced at the minimum rate", *lower][: self.num_levels]

    def _rate_changed(self, flow_id: int, rate: float | None) -> bool:
        old = self._rate.get(flow_id)
        if old is None or rate is None:
            return old is not rate
        return abs(rate - old) > self._args.rate_tolerance * old

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        decision = self.decide(flow, ctx.now)
        self._rate[flow.flow_id] = decision.rate
        return decision

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        changes: dict[int, Decision] = {}
        for flow in flows:
            if not is_deadline_flow(flow):
                level = self._lower_level(flow)
                if level != flow.level or self._rate.get(flow.flow_id) is not None:
                    self._rate[flow.flow_id] = None
                    changes[flow.flow_id] = Decision(level)
                continue
            decision = self.decide(flow, ctx.now)
            if decision.level != flow.level or self._rate_changed(flow.flow_id, decision.rate):
                self._rate[flow.flow_id] = decision.rate
                changes[flow.flow_id] = decision
        return changes

    def release(self, flow: Flow, ctx: Context) -> None:
        self._rate.pop(flow.flow_id, None)


def new(args: Mapping[str, Any], *, num_levels: int) -> KarunaPolicy:
    """Build a :class:`KarunaPolicy` from validated ``args``."""
    return KarunaPolicy(Args(**args), num_levels)
