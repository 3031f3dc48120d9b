"""``sjf``: strict priority to the flow with the least known remaining bytes (pFabric-style SRPT).

Remaining sizes are banded geometrically into levels 0..K-2: level 0 below ``base`` bytes,
level i below ``base * ratio**i``, the largest flows at K-2. Flows of unknown size go to the
lowest level, K-1. A flow climbs as it drains (its remaining size shrinks), never falls.
Banding is O(1) per flow (a logarithm), so a reevaluation is O(N).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from flowsched.model import Context, Decision, Flow
from flowsched.policies.argcheck import check_fields, number
from flowsched.policies.base import FlowLocalDecisions
from flowsched.policies.common import level_changes

NAME = "sjf"


@dataclass(frozen=True, slots=True)
class Args:
    """``base``: bytes below which a flow is at level 0; ``ratio``: growth of each band (> 1)."""

    base: float = 1 << 20
    ratio: float = 4.0


def validate(args: Mapping[str, Any], path: str) -> list[str]:
    """Field-path errors for ``args`` (empty when valid)."""
    return check_fields(
        args, path, {"base": number(0.0, open_low=True), "ratio": number(1.0, open_low=True)}
    )


def size_level(remaining: int | None, args: Args, levels: int) -> int:
    """Level ``0..levels-1`` for a flow with ``remaining`` bytes; unknown -> ``levels - 1``."""
    if levels == 1:
        return 0
    if remaining is None:
        return levels - 1
    return bisect.bisect_right(band_bounds(args, levels), remaining)


def band_bounds(args: Args, levels: int) -> list[float]:
    """Lower bounds of bands 1..levels-2: ``base * ratio**i`` (for a bisect instead of a log).

    Raises:
        ValueError: ``ratio**(levels - 3)`` overflows a float (the error names the field).
    """
    try:
        return [args.base * args.ratio**i for i in range(max(levels - 2, 0))]
    except OverflowError:
        raise ValueError(
            f"policy.args.ratio: {args.ratio!r} ** {levels - 3} overflows a float (K={levels}); "
            "use a smaller ratio or fewer levels"
        ) from None


class SjfPolicy(FlowLocalDecisions):
    """Shortest remaining size first, banded into K levels."""

    name: ClassVar[str] = NAME
    #: each decision depends on one flow and the Context only (see policies.base)
    per_flow_decisions: ClassVar[bool] = True

    def __init__(self, args: Args, num_levels: int) -> None:
        self.num_levels = num_levels
        self._args = args
        self._bounds = band_bounds(args, num_levels)

    def describe_levels(self) -> list[str]:
        """The remaining-size range of each level (for ``flowsched policy show``)."""
        bounds = [0.0, *self._bounds, float("inf")]
        names = [
            f"remaining in [{lo:.4g}, {hi:.4g}) bytes" for lo, hi in itertools.pairwise(bounds)
        ]
        return [*names[: self.num_levels - 1], "unknown size"][: self.num_levels]

    def _level(self, flow: Flow) -> int:
        remaining = flow.remaining
        if remaining is None or self.num_levels == 1:
            return self.num_levels - 1
        return bisect.bisect_right(self._bounds, remaining)  # same as size_level, no list built

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        return Decision(self._level(flow))

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        return level_changes(flows, self._level)

    def release(self, flow: Flow, ctx: Context) -> None:
        return None


def new(args: Mapping[str, Any], *, num_levels: int) -> SjfPolicy:
    """Build a :class:`SjfPolicy` from validated ``args``."""
    return SjfPolicy(Args(**args), num_levels)
