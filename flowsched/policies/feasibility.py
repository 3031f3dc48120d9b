"""MFS Algorithm 1 (``InterScheduling``): worst-case feasibility of batches in RED order.

Pure functions over plain data, used by ``rmlq``'s ``feasibility_check = "alg1"``. Batches are
walked in ascending RED (:func:`robust_effective_deadline`); ``S`` accumulates, per link, the
bytes of the more urgent batches already walked; batch ``i`` is estimated to finish at
``now + compute_i + max_u (S(u) + L_i(u)) / B(u)`` (batches do not overlap, the paper's
pessimistic estimate). While that is later than the earliest deadline of the batch's loose set
and the drop budget allows, the request with the largest load on the bottleneck link ``u*``,
among the candidates of this batch and the more urgent ones, is pruned and its load removed
(from ``L_i`` or from ``S``). Then ``S += L_i``. See docs/rmlq.md for how flows map to it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(slots=True)
class Demand:
    """What one request still has to move: bytes per link, its deadline, its batch."""

    request: str
    batch: str
    deadline: float
    load: dict[str, float] = field(default_factory=dict)


def robust_effective_deadline(deadlines: Iterable[float]) -> float:
    """RED of a batch: split the sorted distinct deadlines at the largest gap, then weight.

    ``RED = f * min(tight) + (1 - f) * min(loose)``, f = the fraction of the requests (one
    deadline each, repeats counted) that are tight; one distinct deadline -> it.
    """
    every = sorted(deadlines)
    ordered = sorted(set(every))
    split = _largest_gap(ordered)
    if split == 0:
        return ordered[0]
    loose_from = ordered[split]
    fraction = bisect.bisect_left(every, loose_from) / len(every)
    return fraction * ordered[0] + (1.0 - fraction) * loose_from


def loose_deadline(deadlines: Iterable[float]) -> float:
    """``D^Lo_min``: the earliest deadline of the loose set (the only one with one deadline)."""
    ordered = sorted(set(deadlines))
    return ordered[_largest_gap(ordered)]


def _largest_gap(ordered: list[float]) -> int:
    """Index of the first loose deadline (0 when there are fewer than two)."""
    if len(ordered) < 2:
        return 0
    return max(range(1, len(ordered)), key=lambda k: ordered[k] - ordered[k - 1])


def inter_scheduling(
    demands: Iterable[Demand],
    capacity: Callable[[str], float],
    now: float,
    budget: int,
    compute: Mapping[str, float] | None = None,
) -> list[str]:
    """The requests Algorithm 1 prunes (at most ``budget``), in pruning order.

    ``capacity(link)`` is the bandwidth the batches may use on ``link`` (bytes/s);
    ``compute[batch]`` the estimated compute time the batch still needs (default 0).
    """
    batches: dict[str, list[Demand]] = {}
    for demand in demands:
        batches.setdefault(demand.batch, []).append(demand)
    order = sorted(
        batches.items(),
        key=lambda item: (robust_effective_deadline(d.deadline for d in item[1]), item[0]),
    )
    compute = compute or {}
    walked: dict[str, float] = {}
    pool: list[Demand] = []
    pruned: list[str] = []
    for batch, members in order:
        pool.extend(members)
        load: dict[str, float] = {}
        for demand in members:
            _add(load, demand.load, 1.0)
        due = loose_deadline(d.deadline for d in members)
        left = len(members)
        # once the batch judged here is gone, its deadline binds nothing: the batches walked
        # before it passed their own checks
        while len(pruned) < budget and left:
            link, busy = _bottleneck(walked, load, capacity)
            if now + compute.get(batch, 0.0) + busy <= due or link is None:
                break
            victim = max(
                (d for d in pool if d.load.get(link, 0.0) > 0),
                key=lambda d: d.load.get(link, 0.0),
                default=None,
            )
            if victim is None:
                break
            pool.remove(victim)
            pruned.append(victim.request)
            left -= victim.batch == batch
            _add(load if victim.batch == batch else walked, victim.load, -1.0)
        _add(walked, load, 1.0)
    return pruned


def _add(into: dict[str, float], load: Mapping[str, float], sign: float) -> None:
    for link, amount in load.items():
        into[link] = into.get(link, 0.0) + sign * amount


def _bottleneck(
    walked: Mapping[str, float], load: Mapping[str, float], capacity: Callable[[str], float]
) -> tuple[str | None, float]:
    """The link where the walked batches plus this one need the longest, and that time."""
    worst: str | None = None
    longest = 0.0
    for link, amount in load.items():
        total = walked.get(link, 0.0) + amount
        bandwidth = capacity(link)
        busy = total / bandwidth if bandwidth > 0 else float("inf")
        if busy > longest:
            worst, longest = link, busy
    return worst, longest
