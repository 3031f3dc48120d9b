"""Helpers shared by several policies: bottleneck lookup, level banding, sparse decisions."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from flowsched.model import Context, Decision, Flow


def bottleneck(flow: Flow, ctx: Context) -> tuple[float, float]:
    """``(B, rho)`` of the flow's path: the smallest capacity and the highest load on its links.

    A flow with no known links uses ``ctx.default_bandwidth`` and a load of 0.
    """
    if not flow.links:
        return ctx.default_bandwidth, 0.0
    bandwidth = min(ctx.bandwidth(link) for link in flow.links)
    load = max(ctx.load(link) for link in flow.links)
    return bandwidth, load


class BottleneckCache:
    """:func:`bottleneck` memoised per link tuple for one evaluation (flows share paths)."""

    __slots__ = ("_ctx", "_known")

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._known: dict[tuple[str, ...], tuple[float, float]] = {}

    def __call__(self, flow: Flow) -> tuple[float, float]:
        found = self._known.get(flow.links)
        if found is None:
            found = self._known[flow.links] = bottleneck(flow, self._ctx)
        return found


def rank_band(rank: int, count: int, levels: int) -> int:
    """Level ``0..levels-1`` for the ``rank``-th of ``count`` ordered items.

    With no more items than levels each item gets its own level (rank); otherwise the ranks are
    cut into ``levels`` contiguous groups of (nearly) equal size. Monotone in ``rank``.
    """
    if count <= levels:
        return rank
    return rank * levels // count


def level_changes(flows: Iterable[Flow], decide: Callable[[Flow], int]) -> dict[int, Decision]:
    """``{flow_id: Decision(level)}`` for the flows whose decided level differs from ``level``."""
    changes: dict[int, Decision] = {}
    for flow in flows:
        level = decide(flow)
        if level != flow.level:
            changes[flow.flow_id] = Decision(level)
    return changes
