"""Fluid rate allocation: strict priority across levels, max-min fairness within a level.

The allocation is computed level by level, most urgent (0) first, on the capacity that the more
urgent levels left over (progressive filling on residual capacities). Within a level every flow
rises at the same pace until a link on its path saturates or it reaches its rate cap; flows
frozen by a saturated link keep that share and the others continue. The result is work
conserving: every flow that is neither capped nor starved has a saturated link on its path.

These functions are pure and know nothing about time; :mod:`flowsched.sim.engine` decides which
flows to (re)allocate.
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping, Sequence
from typing import Protocol

#: residual capacities below this many bytes/s count as exhausted (absorbs float rounding)
EPSILON_RATE = 1e-3


class Allocatable(Protocol):
    """What the allocator needs from a flow: its links, its cap and a slot for its rate."""

    links: tuple[int, ...]
    cap: float | None
    rate: float


def waterfill(flows: Sequence[Allocatable], residual: MutableMapping[int, float]) -> None:
    """Max-min fair rates for ``flows`` (one level) on ``residual`` capacities.

    Sets ``rate`` on every flow and subtracts the allocated rates from ``residual`` in place.
    Flows with no links get their cap (or 0 when uncapped, which the engine never asks for).
    """
    users: dict[int, list[int]] = {}
    for index, flow in enumerate(flows):
        for link in flow.links:
            users.setdefault(link, []).append(index)
    unfrozen = set(range(len(flows)))
    count = {link: len(members) for link, members in users.items()}
    capped = sorted((f.cap, i) for i, f in enumerate(flows) if f.cap is not None)
    cap_pos = 0
    for index, flow in enumerate(flows):
        if not flow.links:
            flow.rate = flow.cap or 0.0
            unfrozen.discard(index)
    while unfrozen:
        link, share = _bottleneck(count, residual)
        while cap_pos < len(capped) and capped[cap_pos][1] not in unfrozen:
            cap_pos += 1
        if cap_pos < len(capped) and capped[cap_pos][0] <= share:
            _freeze(flows, [capped[cap_pos][1]], capped[cap_pos][0], unfrozen, count, residual)
            continue
        if link < 0:  # only link-less flows remain (handled above); defensive stop
            break
        members = [i for i in users[link] if i in unfrozen]
        _freeze(flows, members, share, unfrozen, count, residual)


def _bottleneck(count: dict[int, int], residual: MutableMapping[int, float]) -> tuple[int, float]:
    """The link with the smallest fair share among links that still have unfrozen users."""
    best_link, best_share = -1, float("inf")
    for link, users in count.items():
        if users > 0:
            share = max(residual[link], 0.0) / users
            if share < best_share:
                best_link, best_share = link, share
    return best_link, best_share


def _freeze(
    flows: Sequence[Allocatable],
    members: Iterable[int],
    rate: float,
    unfrozen: set[int],
    count: dict[int, int],
    residual: MutableMapping[int, float],
) -> None:
    for index in members:
        flow = flows[index]
        flow.rate = rate
        unfrozen.discard(index)
        for link in flow.links:
            count[link] -= 1
            left = residual[link] - rate
            residual[link] = left if left > EPSILON_RATE else 0.0


def allocate_levels(
    flows: Iterable[Allocatable], levels: Iterable[int], residual: MutableMapping[int, float]
) -> None:
    """Strict priority across ``levels`` (parallel to ``flows``), max-min within each level."""
    by_level: dict[int, list[Allocatable]] = {}
    for flow, level in zip(flows, levels, strict=True):
        by_level.setdefault(level, []).append(flow)
    for level in sorted(by_level):
        waterfill(by_level[level], residual)
