"""Helpers shared by several policies: bottleneck lookup, level banding, sparse decisions."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flowsched.model import EXPLICIT_DEADLINE, Context, Decision, Flow, FlowClass
from flowsched.policies.argcheck import Checker, boolean, list_of, one_of

#: the smallest link capacity a policy divides by (bytes/s): a reported capacity of 0, or one
#: so small that a product with it underflows to 0, reads as this (no real link is this slow,
#: so decisions on real capacities never change)
MIN_BANDWIDTH = 1.0


def bottleneck(flow: Flow, ctx: Context) -> float:
    """B of the flow's path: the smallest capacity on its links (``ctx.default_bandwidth``
    for a flow with no known links), at least :data:`MIN_BANDWIDTH`. The load of a path is the
    policy's own business (rmlq measures it with a :class:`TrafficMeter`)."""
    if not flow.links:
        found = ctx.default_bandwidth
    else:
        found = min(ctx.bandwidth(link) for link in flow.links)
    return found if found >= MIN_BANDWIDTH else MIN_BANDWIDTH  # (NaN too)


class BottleneckCache:
    """:func:`bottleneck` memoised per link tuple for one evaluation (flows share paths)."""

    __slots__ = ("_ctx", "_known")

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._known: dict[tuple[str, ...], float] = {}

    def __call__(self, flow: Flow) -> float:
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


class RankedLevels:
    """Rank-banded levels by a per-flow key (smaller = more urgent): ``edf`` and ``llf``.

    Flows with a key take the ranked levels by rank (:func:`rank_band`), the others the
    ``rest`` level. Without a late-dropping rule the ranked levels are 0..K-2 and the rest is
    K-1; with one (``late`` given) the ranked levels are 0..K-3, the rest K-2 and late flows
    the scavenger level K-1, below everything. :meth:`admit` ranks a new flow against the keys
    of the last evaluation (a sorted list; O(log N) plus the insert), :meth:`reevaluate` ranks
    every flow afresh.
    """

    __slots__ = ("_bands", "_key_of", "_late", "_sorted", "num_levels", "rest")

    def __init__(self, num_levels: int, late: LateDrop | None = None) -> None:
        self.num_levels = num_levels
        self._late = late if late is not None and late.enabled else None
        self.rest = num_levels - 1 if self._late is None else max(num_levels - 2, 0)
        self._bands = max(self.rest, 1)
        self._sorted: list[float] = []
        self._key_of: dict[int, float] = {}

    def describe(self, ranked: str, rest: str) -> list[str]:
        """``describe_levels`` lines: ``ranked`` bands, then ``rest``, then the late flows."""
        lines = []
        for level in range(self.num_levels):
            parts = [f"{ranked}, rank band {level}"] if level < self._bands else []
            parts += [rest] if level == self.rest else []
            if self._late is not None and level == self.num_levels - 1:
                parts.append(f"late {self._late.describe()} (drop_late)")
            lines.append("; ".join(parts) or "-")
        return lines

    def _dropped(self, flow: Flow, now: float) -> bool:
        return self._late is not None and self._late.dropped(flow, now)

    def admit(self, flow: Flow, key: float | None, now: float = 0.0) -> Decision:
        """The level of a new flow whose key is ``key`` (None: the rest level)."""
        if self._dropped(flow, now):
            return Decision(self.num_levels - 1)
        if key is None:
            return Decision(self.rest)
        rank = bisect.bisect_left(self._sorted, key)
        bisect.insort(self._sorted, key)
        self._key_of[flow.flow_id] = key
        return Decision(rank_band(rank, len(self._sorted), self._bands))

    def reevaluate(
        self, flows: Iterable[Flow], key: Callable[[Flow], float | None], now: float = 0.0
    ) -> dict[int, Decision]:
        """Rank ``flows`` by ``key``; the decisions that change a flow's level."""
        ranked: list[tuple[float, Flow]] = []
        changes: dict[int, Decision] = {}
        for flow in flows:
            value = None if self._dropped(flow, now) else key(flow)
            if value is not None:
                ranked.append((value, flow))
                continue
            level = self.num_levels - 1 if self._dropped(flow, now) else self.rest
            if flow.level != level:
                changes[flow.flow_id] = Decision(level)
        ranked.sort(key=lambda item: item[0])
        self._sorted = [value for value, _ in ranked]
        self._key_of = {flow.flow_id: value for value, flow in ranked}
        for rank, (_, flow) in enumerate(ranked):
            level = rank_band(rank, len(ranked), self._bands)
            if level != flow.level:
                changes[flow.flow_id] = Decision(level)
        return changes

    def release(self, flow: Flow) -> None:
        """Forget ``flow``'s key."""
        value = self._key_of.pop(flow.flow_id, None)
        if value is not None:
            index = bisect.bisect_left(self._sorted, value)
            if index < len(self._sorted) and self._sorted[index] == value:
                del self._sorted[index]


def is_late(flow: Flow, now: float) -> bool:
    """True when ``flow``'s explicit deadline has passed with bytes (or an unknown size) left.

    Flows of one request carry the request's deadline, so this is also "its request is late".
    """
    deadline = flow.deadline
    return deadline is not None and deadline <= now and flow.remaining != 0


def late_at(flow: Flow, now: float) -> float | None:
    """When :func:`is_late` turns true by time alone: ``flow``'s deadline while it is ahead and
    bytes (or an unknown size) are left. None otherwise (a past deadline would only re-arm a
    promotion timer at every tick)."""
    deadline = flow.deadline
    if deadline is None or deadline <= now or flow.remaining == 0:
        return None
    return deadline


#: the classes late-dropping applies to by default: P2D transfers (a late param sync still
#: gates the next generation, so dropping it would only add delay)
DROP_CLASSES = ("kv",)
#: ``drop_classes`` values a policy file may name
DROP_CLASS_LABELS = tuple(sorted(cls.label for cls in EXPLICIT_DEADLINE))


#: validators of the late-dropping arguments, for the ``validate`` of the policies that offer it
LATE_DROP_FIELDS: dict[str, Checker] = {
    "drop_late": boolean,
    "drop_classes": list_of(one_of(*DROP_CLASS_LABELS)),
}


def late_drop_fields(args: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` with ``drop_classes`` as a tuple (TOML gives a list), for an ``Args(**...)``."""
    fields = dict(args)
    if "drop_classes" in fields:
        fields["drop_classes"] = tuple(fields["drop_classes"])
    return fields


class LateDrop:
    """The late-dropping rule of the baselines (``drop_late``, ``drop_classes`` arguments).

    A flow of a class in ``drop_classes`` whose explicit deadline has passed goes to the
    scavenger level K-1 and stays there: its SLO is lost whatever the network does, and above
    the scavenger it would only delay the traffic still on time. This is the rule ``rmlq``
    applies to past-deadline requests (its feasibility pruning), available to any baseline in
    one line of a policy file (``drop_late = true``) so that comparisons isolate the ranking.
    """

    __slots__ = ("classes", "enabled")

    def __init__(self, enabled: bool, classes: Iterable[str] = DROP_CLASSES) -> None:
        self.enabled = enabled
        self.classes = frozenset(FlowClass.parse(label) for label in classes)

    def dropped(self, flow: Flow, now: float) -> bool:
        """True when ``flow`` belongs on the scavenger level at ``now``."""
        return self.enabled and flow.cls in self.classes and is_late(flow, now)

    def describe(self) -> str:
        """The classes dropped, for ``describe_levels`` (e.g. ``"kv"``)."""
        return ", ".join(sorted(cls.label for cls in self.classes)) or "none"

    def next_change(self, flow: Flow, now: float) -> float | None:
        """When :meth:`dropped` turns true by time alone (the deadline), or None (also once
        it has: a dropped flow stays dropped, so a past time would only re-arm its timer)."""
        if not self.enabled or flow.cls not in self.classes:
            return None
        return late_at(flow, now)


def level_changes(flows: Iterable[Flow], decide: Callable[[Flow], int]) -> dict[int, Decision]:
    """``{flow_id: Decision(level)}`` for the flows whose decided level differs from ``level``."""
    changes: dict[int, Decision] = {}
    for flow in flows:
        level = decide(flow)
        if level != flow.level:
            changes[flow.flow_id] = Decision(level)
    return changes


def ewma_step(value: float, sample: float, elapsed: float, window: float) -> float:
    """``value`` moved towards ``sample`` held for ``elapsed`` s, time constant ``window``."""
    if window <= 0:
        return sample
    if elapsed <= 0:
        return value
    return sample + (value - sample) * math.exp(-elapsed / window)


class TrafficMeter:
    """Windowed rates of the scheduled flows, per flow and per (link, level), from byte counters.

    The meter counts the bytes each flow sent between two :meth:`update` calls (exact, whatever
    the call times) on each link of the flow, under the level the flow held, and keeps EWMAs
    (time constant ``window`` seconds) of each flow's rate and of each (link, level)'s
    utilization. Both are updated at the same instants with the same weights, so a link's
    utilization minus a flow's share is exactly the EWMA of the *other* flows' traffic, and the
    sum over the levels above ``L`` is the load of the traffic more urgent than ``L``. Why a
    window: ``Context.link_load`` follows ~1 ms bursts and, read at event times, oversamples
    busy instants (see docs/rmlq.md). A flow starts at rate 0; a link first seen starts idle.
    Traffic the policy never sees (unscheduled flows) is not counted. With ``flow_rates``
    off, the per-flow rates are not kept (:meth:`flow_rate` and :meth:`others_load` read 0
    for the flows' own share); the link loads are the same.

    A sample that is not finite (bytes over a vanishing interval, or on a link reported with
    a capacity below :data:`MIN_BANDWIDTH`, which counts as unknown) is skipped. Every
    :data:`PRUNE_WINDOWS` windows, the (link, level) entries no open flow is counted under and
    that carried no byte for that long are forgotten (their utilization has decayed by
    ``exp(-PRUNE_WINDOWS)``, far below any float's resolution next to a live sample): link
    names of closed flows are not kept forever, and no decision changes.

    A time earlier than one already passed (a wall clock stepped back) re-bases the meter's
    times by the step, as if no time had passed since the latest: it keeps measuring (it
    skipped every update until the clock passed its old times again, rho frozen meanwhile).
    """

    __slots__ = (
        "_counted", "_flow_rate", "_flow_rates", "_latest", "_link_util", "_next_prune",
        "_pending", "_tallies", "_then", "_touched", "window",
    )  # fmt: skip

    def __init__(self, window: float, *, flow_rates: bool = True) -> None:
        if window <= 0:
            raise ValueError(f"TrafficMeter window must be > 0, got {window}")
        self.window = window
        self._flow_rates = flow_rates
        self._then: float | None = None
        #: the latest time passed to open or update (a time before it: _rebase)
        self._latest = -math.inf
        # Per flow, one record updated in place (_Counted). Not a (when, sent) tuple replaced
        # on every report: a tuple replaced per report is a new object tracked by the garbage
        # collector, and the one it replaces, freed, takes the young generation's count back
        # down, so that count never reaches its threshold while a young tuple per flow piles
        # up; the next generation-0 collection then traverses them all (2-4 ms with 10,000
        # flows, measured in the coordinator).
        self._counted: dict[int, _Counted] = {}
        self._flow_rate: dict[int, float] = {}
        #: (link, level) -> the bytes counted there since the last update; a record holds the
        #: tallies of its level, so a report adds its bytes without building or hashing a key
        self._tallies: dict[tuple[str, int], _Tally] = {}
        #: the tallies with bytes since the last update, in the order they got their first
        self._touched: list[_Tally] = []
        #: the tallies' bytes in that order (a float per tally, as the dict it replaces held)
        self._pending: list[float] = []
        #: link -> {level: [utilization, as of when]}, updated in place (see _counted);
        #: decayed lazily, so an update costs only the (link, level) pairs that carried bytes
        #: (no bytes: exp(-dt/w) composes)
        self._link_util: dict[str, dict[int, list[float]]] = {}
        #: meter time of the next pass over the tallies for idle ones (see _prune)
        self._next_prune = -math.inf

    def open(self, flow: Flow, now: float) -> None:
        """Start counting ``flow`` from its current ``sent`` (the meter's clock starts too)."""
        if now < self._latest:
            self._rebase(now - self._latest)
        self._latest = now
        if self._then is None:
            self._then = now
        if flow.flow_id not in self._counted:
            self._counted[flow.flow_id] = _Counted(now, flow.sent)
            if self._flow_rates:
                self._flow_rate[flow.flow_id] = 0.0

    def close(self, flow: Flow) -> None:
        """Count ``flow``'s last bytes (into the next update) and forget it."""
        record = self._counted.pop(flow.flow_id, None)
        if record is not None:
            self._add_link_bytes(flow, record, max(flow.sent - record.sent, 0))
            for tally in record.tallies:
                tally.refs -= 1
        self._flow_rate.pop(flow.flow_id, None)

    def _add_link_bytes(self, flow: Flow, record: _Counted, sent: int) -> None:
        if not sent:
            return
        level = flow.level if flow.level >= 0 else _UNPLACED
        if record.level != level:
            self._file_under(record, flow, level)
        for tally in record.tallies:
            self._tally(tally, sent)

    def _tally(self, tally: _Tally, sent: int) -> None:
        """Add ``sent`` bytes to ``tally`` (queued for the next update at its first bytes)."""
        slot = tally.slot
        if slot < 0:
            tally.slot = len(self._pending)
            self._touched.append(tally)
            self._pending.append(0.0 + sent)
        else:
            self._pending[slot] += sent

    def _file_under(self, record: _Counted, flow: Flow, level: int) -> None:
        """File ``flow``'s next bytes under ``level``: its record's level and the (link, level)
        tallies of that level (looked up once per level, not per report)."""
        tallies = self._tallies
        for old in record.tallies:
            old.refs -= 1
        found = []
        for link in flow.links:
            tally = tallies.get((link, level))
            if tally is None:
                tally = tallies[(link, level)] = _Tally(link, level)
            tally.refs += 1
            found.append(tally)
        record.level, record.tallies = level, tuple(found)

    def _count(self, flow: Flow, record: _Counted, now: float) -> None:
        """Fold ``flow``'s bytes since its last count (``record``: at ``then``, ``last`` bytes
        sent) into its rate and its links' bytes."""
        then, last = record.counted_at, record.sent
        sent = flow.sent - last
        if sent < 0:
            sent = 0
        record.counted_at, record.sent = now, last + sent
        self._add_link_bytes(flow, record, sent)
        if self._flow_rates:
            rate = self._flow_rate[flow.flow_id]
            sample = sent / (now - then)
            if math.isfinite(sample):  # else skipped (see the class docstring)
                self._flow_rate[flow.flow_id] = ewma_step(rate, sample, now - then, self.window)

    def update(self, flows: Iterable[Flow], ctx: Context) -> None:
        """Fold the bytes sent since the previous update into the averages.

        Pass every active flow for exact link loads. Given a subset (a caller that re-evaluates
        only the flows an event touched), the others' bytes are counted when they are next
        passed or closed, i.e. a little late, which a window much longer than a flow's
        lifetime or evaluation period absorbs.
        """
        now = ctx.now
        if now < self._latest:
            self._rebase(now - self._latest)
        self._latest = now
        then = self._then
        if then is not None and now <= then:
            return
        self._then = now
        elapsed = now - then if then is not None else 0.0
        counted, touched, pending = self._counted, self._touched, self._pending
        rates = self._flow_rates
        for flow in flows:  # _count() inlined without rates: this runs for every report
            record = counted.get(flow.flow_id)
            if record is None:
                self.open(flow, now)
            elif record.counted_at >= now:
                continue
            elif rates:
                self._count(flow, record, now)
            elif (sent := flow.sent - record.sent) > 0:
                record.counted_at, record.sent = now, flow.sent
                level = flow.level if flow.level >= 0 else _UNPLACED
                if record.level != level:  # _add_link_bytes inlined
                    self._file_under(record, flow, level)
                for tally in record.tallies:  # _tally inlined
                    slot = tally.slot
                    if slot < 0:
                        tally.slot = len(pending)
                        touched.append(tally)
                        pending.append(0.0 + sent)
                    else:
                        pending[slot] += sent
        start = then if then is not None else now
        window = self.window
        # ewma_step(util, sample, elapsed, window) with its factor computed once, and the decay
        # inlined (the same arithmetic: this runs for every (link, level) with bytes, about
        # one per report when each node has its own link)
        factor = math.exp(-elapsed / window) if elapsed > 0 else 1.0
        link_util, bandwidth, default = self._link_util, ctx.link_bandwidth, ctx.default_bandwidth
        exp, isfinite = math.exp, math.isfinite
        for tally, moved in zip(touched, pending, strict=True):
            tally.slot = -1
            capacity = bandwidth.get(tally.link, default)
            known = elapsed > 0 and capacity >= MIN_BANDWIDTH  # (below the floor, NaN: unknown)
            sample = moved / elapsed / capacity if known else 0.0
            entry = tally.entry
            if entry is None:
                util = 0.0
            else:
                util, since = entry
                if start - since > 0:  # the decay: ewma_step towards 0, the same product
                    util = util * exp(-(start - since) / window)
            if elapsed > 0 and isfinite(sample):  # a non-finite sample is skipped
                util = sample + (util - sample) * factor
            if entry is None:  # the (link, level)'s first bytes: its entry from now on
                tally.entry = link_util.setdefault(tally.link, {})[tally.level] = [util, now]
            else:
                entry[0], entry[1] = util, now
        touched.clear()
        pending.clear()
        if now >= self._next_prune:
            self._next_prune = now + PRUNE_WINDOWS * window
            self._prune(now - PRUNE_WINDOWS * window)

    def _rebase(self, step: float) -> None:
        """Move every stored time by ``step`` (< 0: the clock went back by that much since the
        latest time passed), so that the next update measures from the step on."""
        self._latest += step
        if self._then is not None:
            self._then += step
        self._next_prune += step
        for record in self._counted.values():
            record.counted_at += step
        for levels in self._link_util.values():
            for entry in levels.values():
                entry[1] += step

    def _prune(self, idle_since: float) -> None:
        """Forget the (link, level) tallies no open flow is filed under whose last bytes came
        at or before ``idle_since`` (none is pending: called at the end of an update)."""
        link_util = self._link_util
        idle = [
            key
            for key, tally in self._tallies.items()
            if tally.refs <= 0 and (tally.entry is None or tally.entry[1] <= idle_since)
        ]
        for key in idle:
            tally = self._tallies.pop(key)
            levels = link_util.get(tally.link)
            if levels is not None and levels.get(tally.level) is tally.entry:
                del levels[tally.level]
                if not levels:
                    del link_util[tally.link]

    def link_load(self, link: str) -> float:
        """Windowed utilization of ``link`` by the scheduled flows (0 when never seen)."""
        return self.load_above(link, _UNPLACED + 1)

    def load_above(self, link: str, level: int) -> float:
        """Windowed utilization of ``link`` by flows at levels more urgent than ``level``."""
        levels = self._link_util.get(link)
        if not levels or self._then is None:
            return 0.0
        now, window, exp = self._then, self.window, math.exp
        # each entry decayed to now, ewma_step(util, 0.0, now - since, window) inlined (the
        # same arithmetic): this runs for every urgency an rmlq flow gets
        return sum(
            [
                util * exp((since - now) / window) if now > since else util
                for lvl, (util, since) in levels.items()
                if lvl < level
            ]
        )

    def flow_rate(self, flow: Flow) -> float:
        """Windowed rate of ``flow`` in bytes/s (0 when not counted yet)."""
        return self._flow_rate.get(flow.flow_id, 0.0)

    def others_load(self, flow: Flow, ctx: Context) -> float:
        """Highest windowed utilization of ``flow``'s links by the *other* flows."""
        rate = self.flow_rate(flow)
        loads = [0.0]
        for link in flow.links:
            capacity = ctx.bandwidth(link)
            own = rate / capacity if capacity >= MIN_BANDWIDTH else 0.0
            loads.append(self.link_load(link) - own)
        return max(loads)


#: the level under which the meter files bytes of a flow not placed yet (below every level)
_UNPLACED = 1 << 20
#: windows without bytes after which the meter forgets a (link, level) no open flow is filed
#: under, and how often it looks for them (see TrafficMeter)
PRUNE_WINDOWS = 200


class _Counted:
    """A metered flow: when it was last counted, its bytes sent then, the level its bytes are
    filed under (None: not yet) and the (link, level) tallies of that level."""

    __slots__ = ("counted_at", "level", "sent", "tallies")

    def __init__(self, counted_at: float, sent: int) -> None:
        self.counted_at = counted_at
        self.sent = sent
        self.level: int | None = None
        self.tallies: tuple[_Tally, ...] = ()


class _Tally:
    """One (link, level): its slot in the meter's pending bytes until the next update (-1:
    none since the last), its utilization entry in the meter (None until its first bytes) and
    how many open flows' records are filed under it."""

    __slots__ = ("entry", "level", "link", "refs", "slot")

    def __init__(self, link: str, level: int) -> None:
        self.link = link
        self.level = level
        self.slot = -1
        self.entry: list[float] | None = None
        self.refs = 0
