"""``rmlq``: the Reverse Multi-Level Queue of MFS (arXiv 2603.17456), extended to our classes.

Defer-and-Promote: a flow enters at the level its urgency earns now and is only ever promoted
(``reevaluate`` never returns a less urgent level than ``flow.level``, except pruning to the
scavenger level). Levels, 0 = most urgent (K = 8 defaults in brackets):

=====================  ====================================================================
0..T-1 urgent  [0-1]   explicit deadlines past their promotion point (MLU >= top threshold),
                       in deadline order: time left <= ``urgent_slack`` x ratio^i -> level i
T..T+R-1 early [2-4]   ``tp`` alone (``collectives_first``), then the other RLI levels
T+R..K-2 bands [5-6]   deferred explicit deadlines (MLU below the top threshold), by time
                       left: <= ``deferred_slack`` x ratio^i -> band i (``deferred_order``;
                       ``"mlu"``: by MLU, Q_i = U x E^-i)
K-1 scavenger  [7]     ``bulk`` and pruned requests
=====================  ====================================================================

MLU = remaining / (time left x B x (1 - rho)), rho = the windowed load of the traffic more
urgent than the flow (``rho_source = "above"``, the paper's Alg. 1 semantics). P2D of a job
still in prefill (its job in ``Context.job_index``) stays below the job's collectives. Pruning
(``feasibility``): past-deadline requests at once, MFS Algorithm 1 over the requests in RED
order (``feasibility_check = "alg1"``, :mod:`flowsched.policies.feasibility`), and a request
whose layer pace says its last layer comes too late (``pace_layers``).
``next_change`` gives the coordinator each flow's next promotion time. The reasoning behind
each rule and argument, and the measurements, are in docs/rmlq.md.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from flowsched.model import EXPLICIT_DEADLINE, LAYER_CLASSES, Context, Decision, Flow, FlowClass
from flowsched.policies.argcheck import (
    boolean,
    check_fields,
    integer,
    list_of,
    number,
    one_of,
    optional,
)
from flowsched.policies.common import (
    MIN_BANDWIDTH,
    BottleneckCache,
    TrafficMeter,
    bottleneck,
    ewma_step,
    is_late,
    late_at,
)
from flowsched.policies.feasibility import Demand, inter_scheduling, robust_effective_deadline

NAME = "rmlq"
#: largest ratio between two MLU band thresholds (E) and largest MLU scale (U) accepted; also
#: the largest ``urgent_ratio`` (its powers bound the time bands: 1024^62 is still a float)
MAX_BAND_RATIO = 1024.0
MAX_BAND_SCALE = 1024.0
#: a ``consumer_index`` at or above this is not a layer: it never deepens the learned model
#: depth (one absurd index would make the pace check prune every later request of its scope)
MAX_DEPTH = 1 << 20
#: scopes whose model depth is remembered (the least recently deepened is forgotten beyond)
MAX_DEPTH_SCOPES = 4096

__all__ = ["NAME", "Args", "RmlqPolicy", "mlu", "new", "robust_effective_deadline", "validate"]


@dataclass(frozen=True, slots=True)
class Args:
    """Arguments of ``rmlq`` (docs/rmlq.md explains each)."""

    E: float = 4.0
    U: float = 0.5
    top_threshold: float | None = None
    urgent_levels: int = 2
    urgent_slack: float = 0.025
    urgent_ratio: float = 2.0
    urgent_order: str = "deadline"
    early_levels: int = 3
    red_tiers: int = 1
    collectives_first: bool = True
    unknown_level: int | None = None
    rho_source: str = "above"
    rho_window: float = 0.05
    max_load: float = 0.9
    feasibility: bool = True
    feasibility_check: str = "alg1"
    pace_layers: int = 4
    volume_check: bool = False
    volume_lag: float = 0.0
    drop_budget: int = 1
    alg1_interval: float = 0.01
    feasibility_grace: float = 0.0
    feasibility_load: str = "rho"
    prune_classes: tuple[str, ...] = ("kv",)
    request_memory: float = 1.0
    promotion_lead: float = 0.0
    mlu_scope: str = "flow"
    deferred_order: str = "deadline"
    deferred_slack: float = 0.025


_FIELDS = {
    # sane bounds (issue 12): E = 1e308 or U = 1e308 passed and made every band threshold
    # overflow or underflow; the paper's values are E = 4, U = 0.5
    "E": number(1.0, MAX_BAND_RATIO, open_low=True),
    "U": number(0.0, MAX_BAND_SCALE, open_low=True),
    "top_threshold": optional(number(0.0, open_low=True)),
    "urgent_levels": integer(1, 62),
    "urgent_slack": number(0.0),
    # bounded like E: urgent_ratio = 1e200 passed, then urgent_ratio**i overflowed in
    # describe_levels and next_change (OverflowError: policy show crashed, the flow quarantined)
    "urgent_ratio": number(1.0, MAX_BAND_RATIO, open_low=True),
    "urgent_order": one_of("deadline", "slack"),
    "early_levels": integer(1, 62),
    "red_tiers": integer(1, 62),
    "collectives_first": boolean,
    "unknown_level": optional(integer(0, 63)),
    "rho_source": one_of("above", "others", "link", "none"),
    "rho_window": number(0.0, open_low=True),
    "max_load": number(0.0, 0.99),
    "feasibility": boolean,
    "feasibility_check": one_of("alg1", "mlu"),
    "pace_layers": integer(0, 1 << 20),
    "volume_check": boolean,
    "volume_lag": number(0.0),
    "drop_budget": integer(0),
    "alg1_interval": number(0.0),
    "feasibility_grace": number(0.0),
    "feasibility_load": one_of("rho", "none"),
    "prune_classes": list_of(one_of(*sorted(cls.label for cls in EXPLICIT_DEADLINE))),
    "request_memory": number(0.0),
    "promotion_lead": number(0.0),
    "mlu_scope": one_of("request", "flow"),
    "deferred_order": one_of("mlu", "deadline"),
    "deferred_slack": number(0.0),
}


def validate(args: Mapping[str, Any], path: str) -> list[str]:
    """Field-path errors for ``args`` (empty when valid)."""
    return check_fields(args, path, _FIELDS)


def mlu(remaining: float, time_left: float, bandwidth: float, load: float) -> float:
    """Minimal Link Utilization; ``inf`` when the deadline has passed with bytes left."""
    if remaining <= 0:
        return 0.0
    residual = time_left * bandwidth * (1.0 - load)
    if time_left <= 0 or residual <= 0:
        return math.inf
    return remaining / residual


class _Urgency:
    """An explicit flow's urgency at one instant: MLU, and the inputs it came from (a plain
    class: a dataclass's generated ``__init__`` stays interpreted when mypyc compiles this)."""

    __slots__ = ("bandwidth", "remaining", "rho", "time_left", "value")

    def __init__(
        self, value: float, remaining: float, time_left: float, bandwidth: float, rho: float
    ) -> None:
        self.value = value
        self.remaining = remaining
        self.time_left = time_left
        self.bandwidth = bandwidth
        self.rho = rho


class _RequestFlows:
    """One request's open explicit-deadline flows (``mlu_scope = "request"``) by path, and
    the deepest ``consumer_index`` among them. ``linked_flows`` and a flow's request bytes
    read the flows of its path only, the deepest index comes from a heap (pruned lazily):
    each of a request's n opens scanned all its open flows, O(n^2) in all (a plain class, as
    :class:`_Urgency`)."""

    __slots__ = ("by_path", "depths", "index_count", "path_of")

    def __init__(self) -> None:
        #: path (a flow's ``links``) -> {flow id: flow}, in opening order
        self.by_path: dict[tuple[str, ...], dict[int, Flow]] = {}
        #: flow id -> the path it is kept under (a flow re-admitted on another path moves)
        self.path_of: dict[int, tuple[str, ...]] = {}
        #: max-heap (negated) of the open flows' indices; an index no open flow has any more
        #: (``index_count``) is dropped when it reaches the top
        self.depths: list[int] = []
        self.index_count: dict[int, int] = {}

    def add(self, flow: Flow) -> None:
        """Count ``flow`` in. A flow already in is replaced, not counted twice: in its place
        on the same path (the order ``linked_flows`` answers in), or moved to its new one."""
        fid = flow.flow_id
        path = self.path_of.get(fid)
        if path is not None and path != flow.links:
            self.remove(flow)
            path = None
        group = self.by_path.get(flow.links)
        if group is None:
            group = self.by_path[flow.links] = {}
        if path is not None:
            self._count_index(group[fid].consumer_index, -1)
        group[fid] = flow
        self.path_of[fid] = flow.links
        self._count_index(flow.consumer_index, 1)

    def remove(self, flow: Flow) -> bool:
        """Count the flow of ``flow``'s id out; True when no flow is left."""
        path = self.path_of.pop(flow.flow_id, None)
        if path is not None:
            group = self.by_path[path]
            gone = group.pop(flow.flow_id)
            if not group:
                del self.by_path[path]
            self._count_index(gone.consumer_index, -1)
        return not self.path_of

    def _count_index(self, index: int | None, change: int) -> None:
        if index is None:
            return
        count = self.index_count.get(index, 0) + change
        if count > 0:
            if count == 1 and change > 0:
                heapq.heappush(self.depths, -index)
            self.index_count[index] = count
        else:
            self.index_count.pop(index, None)

    def deepest(self) -> int | None:
        """The largest ``consumer_index`` of the open flows (None: none has one)."""
        depths, counts = self.depths, self.index_count
        while depths and -depths[0] not in counts:
            heapq.heappop(depths)
        return -depths[0] if depths else None


class RmlqPolicy:
    """Reverse Multi-Level Queue: enter by current urgency, promote only (see module doc)."""

    name: ClassVar[str] = NAME

    def __init__(self, args: Args, num_levels: int) -> None:
        self.num_levels = num_levels
        self.args = args
        self.urgent_levels = args.urgent_levels
        self.early_levels = args.early_levels
        self.first_early = args.urgent_levels
        self.first_band = args.urgent_levels + args.early_levels
        self.mlu_bands = num_levels - 1 - self.first_band
        if self.mlu_bands < 1:
            raise ValueError(
                f"policy.args.early_levels: {args.early_levels} early levels leave no MLU band "
                f"with K={num_levels} and {args.urgent_levels} urgent levels "
                f"(need K >= urgent_levels + early_levels + 2)"
            )
        self.scavenger = num_levels - 1
        self.top_threshold = args.U if args.top_threshold is None else args.top_threshold
        #: thresholds Q_1..Q_{bands-1}: band i (level first_band + i) holds MLU >= Q_{i+1}
        self.band_thresholds = [args.U * args.E**-i for i in range(1, self.mlu_bands)]
        self.unknown_level = (
            self.first_band - 1 if args.unknown_level is None else args.unknown_level
        )
        if not 0 <= self.unknown_level < num_levels:
            raise ValueError(
                f"policy.args.unknown_level: {self.unknown_level} is outside 0..{num_levels - 1}"
            )
        self._shift = 1 if args.collectives_first else 0
        first_other = self.first_early + min(self._shift, args.early_levels - 1)
        #: the most urgent level each class can reach (never demote: a flow there is settled)
        self._floor = {cls: min(first_other, self.unknown_level) for cls in FlowClass}
        self._floor.update({cls: 0 for cls in EXPLICIT_DEADLINE})
        self._floor[FlowClass.TP] = self.first_early
        self._floor[FlowClass.BULK] = self.scavenger
        self.prune_classes = frozenset(FlowClass.parse(label) for label in args.prune_classes)
        self._tier_of_request: dict[str, int] = {}
        self._infeasible_since: dict[str, float] = {}
        self._pruned: set[str] = set()
        #: prunable flows by request, and the requests pruned since the last reevaluate (their
        #: flows not passed to it are moved there: per-flow callers do not pass them all)
        self._members: dict[str, dict[int, Flow]] = {}
        self._newly_pruned: list[str] = []
        self._request_flows: dict[str, int] = {}
        self._idle_requests: dict[str, float] = {}
        self._meter = TrafficMeter(args.rho_window, flow_rates=args.rho_source == "others")
        self._alg1 = args.feasibility and args.feasibility_check == "alg1"
        #: prunable flows; those in the urgent tier (the ones Algorithm 1 judges); whether a
        #: request arrived, left or turned urgent since its last run
        self._tracked: dict[int, Flow] = {}
        self._urgent: dict[int, Flow] = {}
        self._alg1_due = False
        self._alg1_last = -math.inf
        #: the latest time the policy was called at (a clock stepping back is a reset: _rebase)
        self._latest = -math.inf
        #: job -> (index, when it was reached), EWMA seconds per index step, for the jobs in
        #: ``Context.job_index`` (forgotten once a job leaves it: _watch_jobs); the deepest index
        #: seen per scope (see _depth_scope: one user's flows never deepen another's model)
        self._job_seen: dict[str, tuple[int, float]] = {}
        self._job_pace: dict[str, float] = {}
        self._depths: dict[str, int] = {}
        #: request -> (first layer index, latest layer index, when the latest opened, the
        #: shortest time per layer between two of its layers so far), for ``pace_layers``
        self._layer_pace: dict[str, tuple[int, int, float, float]] = {}
        self._pace_check = args.feasibility and args.pace_layers > 0
        self._volume_check = args.feasibility and args.volume_check
        #: open explicit-deadline flows by request and path, for the request's remaining
        #: bytes (MLU) and linked_flows
        self._siblings: dict[str, _RequestFlows] = {}
        self._request_scope = args.mlu_scope == "request"
        self._deferred_by_time = args.deferred_order == "deadline"
        #: the urgencies (and volume_check's instants) the last reevaluate computed, with the
        #: (now, level, sent) they hold for: next_change, called right after it for the same
        #: flows, reuses them
        self._found: dict[int, tuple[float, int, int, _Urgency | None, float]] = {}
        #: levels at which bytes sent never move a flow (observe_progress skips them cheaply)
        self._inert_levels = frozenset(
            level for level in range(num_levels) if self._progress_moves_level(level) is False
        )

    @property
    def per_flow_decisions(self) -> bool:
        """True unless RED tiers (a request's tier ranks it among all requests) or the
        ``"mlu"`` check (a request is hopeless when any of its flows is, judged as each is
        evaluated) make a flow's decision depend on flows not passed.

        Algorithm 1 does not: it judges the requests it tracks whatever is passed, and when
        it prunes one, ``reevaluate`` also returns the scavenger level for the request's
        flows not passed (the Policy contract's decisions for flows not passed; the
        ``"mlu"`` check does the same, for callers passing part of the table anyway).
        """
        mlu_check = self.args.feasibility and self.args.feasibility_check == "mlu"
        return self.args.red_tiers <= 1 and not mlu_check

    def linked_flows(self, flow: Flow) -> tuple[int, ...]:
        """With ``mlu_scope = "request"``: the request's other open flows on ``flow``'s path,
        whose MLU now counts ``flow``'s bytes too (the Policy contract's ``linked_flows``).
        Elsewhere a flow's arrival changes no other flow's promotion time. Not covered: the
        model depth learnt from a deeper layer raises every request's estimate of its layers
        to come, once, while the first requests run."""
        if not self._request_scope or flow.request is None:
            return ()
        siblings = self._siblings.get(flow.request)
        group = siblings.by_path.get(flow.links) if siblings is not None else None
        if not group:
            return ()
        fid = flow.flow_id
        return tuple(other for other in group if other != fid)

    def released_affects(self, flow: Flow) -> tuple[int, ...] | None:
        """The flows whose decision or ``next_change`` the release of ``flow`` (just done)
        may change (the Policy contract's ``released_affects``; docs/rmlq.md, "Closes"): with
        ``mlu_scope = "request"`` its request's open flows (their MLU counted its bytes, and
        its layer index may have been the request's deepest, which sets the layers still to
        come on every path). Nothing else reads another flow: the hold below the collectives
        reads the job index, the pruned set only grows, and what Algorithm 1 prunes after a
        request left it returns unasked. None (the whole job) unless decisions are per flow,
        and with ``volume_check`` (off by default): naming the request's flows, the
        coordinator's replays pruned at other flushes than with the whole job."""
        if not self.per_flow_decisions or self._volume_check:
            return None
        siblings = self._siblings.get(flow.request or "") if self._request_scope else None
        return () if siblings is None else tuple(siblings.path_of)

    def describe_levels(self) -> list[str]:
        """What each level 0..K-1 holds (for ``flowsched policy show``)."""
        names = []
        order = "time left" if self.args.urgent_order == "deadline" else "slack"
        for level in range(self.urgent_levels):
            bound = self.args.urgent_slack * self.args.urgent_ratio**level
            rank = "the rest" if level == self.urgent_levels - 1 else f"{order} <= {bound:g} s"
            names.append(f"urgent: MLU >= {self.top_threshold:g} or late, {rank}")
        for slot in range(self.early_levels):
            if slot < self._shift:
                names.append("early: tp collectives (RLI 0, collectives_first)")
                continue
            rli, tier = divmod(slot - self._shift, self.args.red_tiers)
            red = f", RED tier {tier}" if self.args.red_tiers > 1 else ""
            last = slot == self.early_levels - 1
            names.append(f"early: RLI {rli}{red}" + (" and every later RLI/tier" if last else ""))
        if self._deferred_by_time:
            bound = self.args.deferred_slack
            for band in range(self.mlu_bands):
                last = band == self.mlu_bands - 1
                rank = "the rest" if last else f"{order} <= {bound:g} s"
                names.append(f"deferred: MLU < {self.top_threshold:g}, {rank}")
                bound *= self.args.urgent_ratio
            return self._describe_scavenger(names)
        upper = self.top_threshold
        for threshold in self.band_thresholds:
            names.append(f"deferred: MLU in [{threshold:.4g}, {upper:.4g})")
            upper = threshold
        names.append(f"deferred: MLU below {upper:.4g}")
        return self._describe_scavenger(names)

    def _describe_scavenger(self, names: list[str]) -> list[str]:
        pruned = ", ".join(sorted(c.label for c in self.prune_classes)) or "none"
        names.append(
            "scavenger: bulk" + (f", pruned requests ({pruned})" if self.args.feasibility else "")
        )
        return names

    # -- urgency -> level ----------------------------------------------------------------------

    def mlu_level(self, value: float, slack: float = math.inf) -> int:
        """Level of an explicit-deadline flow with MLU ``value`` and ``slack`` seconds of laxity."""
        if value >= self.top_threshold:
            return self.urgent_level(slack)
        if self._deferred_by_time and value > 0:  # nothing left to send: the lowest band
            bound = self.args.deferred_slack
            for band in range(self.mlu_bands - 1):
                if slack <= bound:
                    return self.first_band + band
                bound *= self.args.urgent_ratio
            return self.first_band + self.mlu_bands - 1
        for band, threshold in enumerate(self.band_thresholds):
            if value >= threshold:
                return self.first_band + band
        return self.first_band + self.mlu_bands - 1

    def urgent_level(self, slack: float) -> int:
        """Level inside the urgent tier of a flow with ``slack`` seconds before its latest start."""
        bound = self.args.urgent_slack
        for level in range(self.urgent_levels - 1):
            if slack <= bound:
                return level
            bound *= self.args.urgent_ratio
        return self.urgent_levels - 1

    def rli_level(self, rli: int, tier: int = 0, shift: int = 0) -> int:
        """Level of an early-stage flow with relative index ``rli`` in RED tier ``tier``."""
        slot = max(rli, 0) * self.args.red_tiers + tier + shift
        return self.first_early + min(slot, self.early_levels - 1)

    def urgency(
        self, flow: Flow, ctx: Context, paths: BottleneckCache | None = None, *, rho: bool = True
    ) -> _Urgency | None:
        """MLU of an explicit-deadline flow and its inputs; None when size or deadline unknown."""
        remaining = flow.remaining
        if remaining is None or flow.deadline is None:
            return None
        if self._request_scope and flow.request is not None:
            remaining = self._request_remaining(flow, remaining, ctx)
        bandwidth = paths(flow) if paths is not None else bottleneck(flow, ctx)
        time_left = flow.deadline - ctx.now - self.args.promotion_lead
        load = self._rho(flow, ctx) if rho else 0.0
        return _Urgency(
            mlu(remaining, time_left, bandwidth, load), remaining, time_left, bandwidth, load
        )

    def _request_remaining(self, flow: Flow, remaining: int, ctx: Context) -> int:
        """Bytes ``flow``'s request still has to move on ``flow``'s path: its open flows there
        and, while its job is in prefill, the layers not opened yet (each of ``flow``'s size;
        the model depth is the deepest ``consumer_index`` seen in its scope, :meth:`_depth`).
        Its layers share its deadline, so one layer's bytes understate its urgency by the layer
        count (docs/rmlq.md)."""
        siblings = self._siblings.get(flow.request or "")
        last = flow.consumer_index
        if siblings is not None:
            fid = flow.flow_id
            for other in siblings.by_path.get(flow.links, {}).values():
                if other.flow_id != fid:
                    remaining += other.remaining or 0
            deepest = siblings.deepest()
            if deepest is not None and (last is None or deepest > last):
                last = deepest
        return remaining + self._unopened_layers(flow, last, ctx) * (flow.size or 0)

    def _unopened_layers(self, flow: Flow, last: int | None, ctx: Context) -> int:
        """Layers of ``flow``'s request after ``last`` (the deepest one opened) while its job
        is in prefill; the model depth is :meth:`_depth`'s. 0 once the prefill has ended."""
        if last is None or flow.job not in ctx.job_index:
            return 0
        return max(self._depth(flow) - 1 - last, 0)

    def flow_mlu(
        self, flow: Flow, ctx: Context, paths: BottleneckCache | None = None, *, rho: bool = True
    ) -> float | None:
        """MLU of an explicit-deadline flow, or None when its size or deadline is unknown."""
        found = self.urgency(flow, ctx, paths, rho=rho)
        return None if found is None else found.value

    def _rho(self, flow: Flow, ctx: Context) -> float:
        """rho of the flow's path: the windowed load of its busiest link (docs/rmlq.md)."""
        source = self.args.rho_source
        if source == "none":
            return 0.0
        if source == "above":
            level = flow.level if flow.level >= 0 else self.first_band
            links = flow.links
            if len(links) == 1:  # the common case, without a generator
                load = self._meter.load_above(links[0], level)
            else:
                load = max((self._meter.load_above(link, level) for link in links), default=0.0)
        elif source == "others":
            load = self._meter.others_load(flow, ctx)
        else:
            load = max((self._meter.link_load(link) for link in flow.links), default=0.0)
        return min(max(load, 0.0), self.args.max_load)

    def flow_rli(self, flow: Flow, ctx: Context) -> int | None:
        """RLI of an implicit-deadline flow (``tp``: 0), or None when unknown."""
        if flow.cls is FlowClass.TP:
            return 0
        if flow.job is None or flow.consumer_index is None or flow.job not in ctx.job_index:
            return None
        layered = flow.cls in LAYER_CLASSES
        current = _layer_of(flow.job, ctx) if layered else ctx.job_index[flow.job]
        return max(flow.consumer_index - current, 0)

    def _held_below_collectives(self, flow: Flow, ctx: Context) -> bool:
        """P2D of a job still in prefill: its collectives carry the job's requests first."""
        return flow.cls is FlowClass.KV and flow.job is not None and flow.job in ctx.job_index

    def target_level(self, flow: Flow, ctx: Context, found: _Urgency | None, tier: int) -> int:
        """The level ``flow``'s urgency earns now, before the never-demote rule."""
        if flow.cls is FlowClass.BULK:
            return self.scavenger
        if flow.cls in EXPLICIT_DEADLINE:
            if found is None:
                return self.unknown_level
            key = found.time_left if self.args.urgent_order == "deadline" else _slack(found)
            level = self.mlu_level(found.value, key)
            if level < self.first_band and self._held_below_collectives(flow, ctx):
                return self.first_band
            return level
        rli = self.flow_rli(flow, ctx)
        if rli is None:
            return self.unknown_level
        shift = 0 if flow.cls is FlowClass.TP else self._shift
        return self.rli_level(rli, tier, shift)

    # -- pruning and RED ------------------------------------------------------------------------

    def _request_key(self, flow: Flow) -> str:
        return flow.request if flow.request is not None else f"#flow-{flow.flow_id}"

    def _depth(self, flow: Flow) -> int:
        """The model depth (deepest ``consumer_index`` + 1) learned in ``flow``'s scope."""
        return self._depths.get(_depth_scope(flow), 0)

    def _learn_depth(self, flow: Flow, index: int) -> None:
        """Deepen ``flow``'s scope's model depth to ``index`` + 1; an index of
        :data:`MAX_DEPTH` or more is not a layer and is ignored."""
        if index >= MAX_DEPTH:
            return
        scope = _depth_scope(flow)
        depths = self._depths
        known = depths.get(scope)
        if known is not None and known > index:
            return
        if known is None and len(depths) >= MAX_DEPTH_SCOPES:
            del depths[next(iter(depths))]
        depths.pop(scope, None)  # most recently deepened last
        depths[scope] = index + 1

    def _prunable(self, flow: Flow) -> bool:
        return self.args.feasibility and flow.cls in self.prune_classes

    def _judge(self, flow: Flow, ctx: Context, found: _Urgency | None) -> bool | None:
        """The ``"mlu"`` check: prune a request hopeless (MLU > 1) for the grace period."""
        if self._alg1 or not self._prunable(flow) or found is None:
            return None
        key = self._request_key(flow)
        if key in self._pruned or is_late(flow, ctx.now):  # late: pruned at once
            return True
        value = found.value
        if self.args.feasibility_load == "none":
            value = mlu(found.remaining, found.time_left, found.bandwidth, 0.0)
        if value <= 1.0:
            return False
        since = self._infeasible_since.setdefault(key, ctx.now)
        if ctx.now - since >= self.args.feasibility_grace:
            self._prune(key)
        return True

    def _check_pace(self, flow: Flow, ctx: Context) -> None:
        """``pace_layers``: prune ``flow``'s request when its last layer, released at the
        fastest pace its layers have opened so far, comes too late for that layer's bytes to
        cross at line rate before the deadline. Judged once ``pace_layers`` layers have opened
        since its first (a request's first layers can open more slowly than its later ones);
        the model depth is the deepest ``consumer_index`` seen in the request's scope
        (:meth:`_depth`). Optimistic on purpose: no queueing, no other layer's bytes, no layer
        faster than the fastest seen (docs/rmlq.md).
        """
        index, request, deadline = flow.consumer_index, flow.request, flow.deadline
        if index is None or request is None or deadline is None:
            return
        self._learn_depth(flow, index)
        seen = self._layer_pace.get(request)
        if seen is None:
            self._layer_pace[request] = (index, index, ctx.now, math.inf)
            return
        first, last, when, step = seen
        if index <= last:
            return
        step = min(step, (ctx.now - when) / (index - last))
        self._layer_pace[request] = (first, index, ctx.now, step)
        if index - first < self.args.pace_layers:
            return
        last_release = ctx.now + (self._depth(flow) - 1 - index) * step
        if deadline < last_release + (flow.size or 0) / bottleneck(flow, ctx):
            self._prune(request)

    def _volume_lost_at(self, flow: Flow, ctx: Context) -> float:
        """The instant after which ``flow``'s request can no longer move, at full line rate,
        the bytes it has left on ``flow``'s links: its open flows on each link and, while its
        prefill runs, its layers not opened yet (each of ``flow``'s size). ``volume_check``
        prunes the request once this is past; it assumes no other traffic and no compute, so
        a request it gives up could not have met its deadline (docs/rmlq.md). Byte counts
        reported up to ``volume_lag`` seconds ago may be short by what the link carried since,
        so the instant is that much later."""
        deadline = flow.deadline
        members = self._members.get(self._request_key(flow))
        if deadline is None or not members:
            return math.inf
        opened = [m.consumer_index for m in members.values() if m.consumer_index is not None]
        seen = self._layer_pace.get(flow.request or "")
        if seen is not None:
            opened.append(seen[1])
        last = max(opened, default=None)
        to_come = self._unopened_layers(flow, last, ctx) * (flow.size or 0)
        capacity = self._capacity(ctx)
        lost_at = math.inf
        for link in flow.links or ("",):
            on_link = sum(m.remaining or 0 for m in members.values() if _crosses(m, link))
            lost_at = min(lost_at, deadline - (on_link + to_come) / capacity(link))
        return lost_at + self.args.volume_lag

    def _check_volume(self, flow: Flow, ctx: Context) -> float:
        """``volume_check``: prune ``flow``'s request once :meth:`_volume_lost_at` is past;
        that instant (inf for a request already pruned)."""
        key = self._request_key(flow)
        if key in self._pruned:
            return math.inf
        lost_at = self._volume_lost_at(flow, ctx)
        if lost_at < ctx.now:
            self._prune(key)
        return lost_at

    def _prune(self, key: str) -> None:
        if key not in self._pruned:
            self._pruned.add(key)
            self._newly_pruned.append(key)

    def dropped(self, flow: Flow, now: float) -> bool:
        """True when ``flow`` goes to the scavenger level: late, or its request was pruned."""
        if not self._prunable(flow):
            return False
        return is_late(flow, now) or self._request_key(flow) in self._pruned

    def _forget_idle_requests(self, now: float) -> None:
        """Drop the state of requests that have had no flow for ``request_memory`` seconds."""
        idle = self._idle_requests
        while idle:
            request, since = next(iter(idle.items()))
            if now - since < self.args.request_memory:
                return
            del idle[request]
            self._layer_pace.pop(request, None)
            self._pruned.discard(request)
            self._infeasible_since.pop(request, None)

    def _red_tiers(self, deadlines: Mapping[str, list[float]]) -> dict[str, int]:
        tiers = self.args.red_tiers
        if tiers <= 1 or not deadlines:
            return {}
        reds = sorted(deadlines, key=lambda req: robust_effective_deadline(deadlines[req]))
        return {req: rank * tiers // len(reds) for rank, req in enumerate(reds)}

    def _watch_jobs(self, ctx: Context) -> None:
        """Follow the pace (seconds per index step) of the jobs whose requests are tracked, and
        forget the jobs gone from ``ctx.job_index`` (their pace is read only while they are in
        it; in serving a job is a batch: one entry per batch, kept for good, grew without bound)."""
        index_of = ctx.job_index
        for gone in [job for job in self._job_seen if job not in index_of]:
            del self._job_seen[gone]
            self._job_pace.pop(gone, None)
        for job in {f.job for f in self._urgent.values() if f.job is not None}:
            if job not in index_of:
                continue
            index = _layer_of(job, ctx)
            seen = self._job_seen.get(job)
            if seen is None or index < seen[0]:
                self._job_seen[job] = (index, ctx.now)
            elif index > seen[0]:
                step = (ctx.now - seen[1]) / (index - seen[0])
                pace = self._job_pace.get(job)
                self._job_pace[job] = step if pace is None else ewma_step(pace, step, 1.0, 4.0)
                self._job_seen[job] = (index, ctx.now)

    def _run_alg1(self, ctx: Context) -> None:
        """MFS Algorithm 1 over the tracked requests; prune what it picks (docs/rmlq.md)."""
        self._alg1_due, self._alg1_last = False, ctx.now
        self._watch_jobs(ctx)
        demands: dict[str, Demand] = {}
        compute: dict[str, float] = {}
        last_layer: dict[str, int] = {}
        layer_bytes: dict[str, int] = {}
        depth: dict[str, int] = {}
        for flow in self._urgent.values():
            key = self._request_key(flow)
            remaining, deadline = flow.remaining or 0, flow.deadline
            if key in self._pruned or not remaining or deadline is None or deadline <= ctx.now:
                continue
            batch = flow.job if flow.job is not None else key
            demand = demands.get(key)
            if demand is None:
                demand = demands[key] = Demand(key, batch, deadline)
            demand.deadline = min(demand.deadline, deadline)
            for link in flow.links or ("",):
                demand.load[link] = demand.load.get(link, 0.0) + remaining
            depth[key] = self._depth(flow)
            if flow.consumer_index is not None:
                last_layer[key] = max(last_layer.get(key, -1), flow.consumer_index)
                layer_bytes[key] = max(layer_bytes.get(key, 0), flow.size or remaining)
            if flow.job in ctx.job_index and flow.job in self._job_pace:
                left = max(depth[key] - 1 - _layer_of(flow.job, ctx), 0)
                compute[batch] = left * self._job_pace[flow.job]
        for key, demand in demands.items():  # the layers whose P2D has not opened yet
            if key in last_layer and demand.batch in compute:
                more = max(depth[key] - 1 - last_layer[key], 0) * layer_bytes[key]
                for link in demand.load:  # one layer's bytes each, however many are open
                    demand.load[link] += more
        capacity = self._capacity(ctx)
        for key in inter_scheduling(
            demands.values(), capacity, ctx.now, self.args.drop_budget, compute
        ):
            self._prune(key)

    @staticmethod
    def _capacity(ctx: Context) -> Callable[[str], float]:
        """Bandwidth the requests may use per link: all of it, since the urgent tier preempts
        the collectives (docs/rmlq.md: counting their load pruned requests that finish); at
        least MIN_BANDWIDTH."""

        def capacity(link: str) -> float:
            found = ctx.bandwidth(link) if link else ctx.default_bandwidth
            return found if found >= MIN_BANDWIDTH else MIN_BANDWIDTH

        return capacity

    # -- the Policy protocol --------------------------------------------------------------------

    def _decide(self, flow: Flow, ctx: Context, found: _Urgency | None) -> int:
        if self.dropped(flow, ctx.now):
            return self.scavenger
        # a request not ranked yet starts in the loosest RED tier: never demoted, it would keep
        # the tightest one for good
        loosest = self.args.red_tiers - 1
        tier = self._tier_of_request.get(flow.request, loosest) if flow.request is not None else 0
        target = self.target_level(flow, ctx, found, tier)
        return target if flow.level < 0 else min(target, flow.level)

    def _follow_clock(self, now: float) -> None:
        """Note the time of a call; a clock that went back (an NTP step of the wall clock the
        coordinator and the agent read) re-bases the stored times (:meth:`_rebase`)."""
        if now >= self._latest:
            self._latest = now
        else:
            self._rebase(now - self._latest)

    def _rebase(self, step: float) -> None:
        """Move every stored time by ``step`` (< 0), as if no time had passed since the latest
        call: Algorithm 1 keeps its interval, a request its memory and grace, a job its pace,
        instead of all waiting until the clock passes their times again. (The meter re-bases
        its own times the same way.) Deadlines are the flows' own: they are not moved."""
        self._latest += step
        self._alg1_last += step
        self._found.clear()
        for request, since in self._infeasible_since.items():
            self._infeasible_since[request] = since + step
        for request, since in self._idle_requests.items():
            self._idle_requests[request] = since + step
        for request, (first, last, when, pace) in self._layer_pace.items():
            self._layer_pace[request] = (first, last, when + step, pace)
        for job, (index, when) in self._job_seen.items():
            self._job_seen[job] = (index, when + step)

    def _settled(self, flow: Flow) -> bool:
        """True when no evaluation can change ``flow``: at its class's floor, nothing to prune."""
        level = flow.level
        if level < 0 or level > self._floor[flow.cls]:
            return False
        return not self._prunable(flow)

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        self._follow_clock(ctx.now)
        if flow.request is not None:
            self._idle_requests.pop(flow.request, None)
            self._request_flows[flow.request] = self._request_flows.get(flow.request, 0) + 1
        if self.args.rho_source != "none":
            self._meter.open(flow, ctx.now)
        if self._prunable(flow):
            self._members.setdefault(self._request_key(flow), {})[flow.flow_id] = flow
        if self._request_scope and flow.request is not None and flow.cls in EXPLICIT_DEADLINE:
            siblings = self._siblings.get(flow.request)
            if siblings is None:
                siblings = self._siblings[flow.request] = _RequestFlows()
            siblings.add(flow)
            if flow.consumer_index is not None:
                self._learn_depth(flow, flow.consumer_index)
        found = self.urgency(flow, ctx) if flow.cls in EXPLICIT_DEADLINE else None
        if self._alg1 and self._prunable(flow) and found is not None:
            arrives = flow.request is None or self._request_flows.get(flow.request) == 1
            self._alg1_due = self._alg1_due or arrives
            self._tracked[flow.flow_id] = flow
            if flow.consumer_index is not None:
                self._learn_depth(flow, flow.consumer_index)
        if self._pace_check and self._prunable(flow):
            self._check_pace(flow, ctx)
        if self._volume_check and self._prunable(flow):
            self._check_volume(flow, ctx)
        self._judge(flow, ctx, found)
        level = self._decide(flow, ctx, found)
        self._watch_urgent(flow, level, found)
        return Decision(level)

    def _watch_urgent(self, flow: Flow, level: int, found: _Urgency | None) -> None:
        """Note a tracked flow that reached its promotion point (urgent tier, or held below
        its job's collectives at that point): Algorithm 1 judges those requests only."""
        fid = flow.flow_id
        if level == self.scavenger and fid in self._tracked:
            self._urgent.pop(fid, None)  # pruned or late: nothing left to judge
            return
        urgent = level < self.first_band or (
            found is not None and found.value >= self.top_threshold
        )
        if urgent and fid in self._tracked and fid not in self._urgent:
            self._urgent[fid] = flow
            self._alg1_due = True

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        active = flows if isinstance(flows, list | tuple) else list(flows)
        self._follow_clock(ctx.now)
        self._forget_idle_requests(ctx.now)
        if self.args.rho_source != "none":
            self._meter.update(active, ctx)
        if self._alg1_due and ctx.now - self._alg1_last >= self.args.alg1_interval:
            self._run_alg1(ctx)
        # each evaluated flow's urgency, with the (now, level, sent) it holds for (see _found)
        found: dict[int, tuple[float, int, int, _Urgency | None, float]] = {}
        self._found = found
        deadlines: dict[str, list[float]] = {}
        verdicts: dict[str, bool] = {}
        want_red = self.args.red_tiers > 1
        paths = BottleneckCache(ctx)
        for flow in active:
            if want_red and flow.request is not None and flow.deadline is not None:
                deadlines.setdefault(flow.request, []).append(flow.deadline)
            if self._settled(flow) or flow.cls not in EXPLICIT_DEADLINE:
                continue
            urgency = self.urgency(flow, ctx, paths)
            lost_at = math.inf
            if self._volume_check and self._prunable(flow):
                lost_at = self._check_volume(flow, ctx)
            found[flow.flow_id] = (ctx.now, flow.level, flow.sent, urgency, lost_at)
            verdict = self._judge(flow, ctx, urgency)
            if verdict is not None:
                key = self._request_key(flow)
                verdicts[key] = verdicts.get(key, False) or verdict
        for key, infeasible in verdicts.items():
            if not infeasible:
                self._infeasible_since.pop(key, None)
        self._tier_of_request = self._red_tiers(deadlines)
        changes: dict[int, Decision] = {}
        for flow in active:
            if self._settled(flow):
                continue
            entry = found.get(flow.flow_id)
            urgency = None if entry is None else entry[3]
            level = self._decide(flow, ctx, urgency)
            self._watch_urgent(flow, level, urgency)
            if level != flow.level:
                changes[flow.flow_id] = Decision(level)
        self._move_pruned(changes)
        return changes

    def observe_progress(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        """Fold the bytes ``flows`` sent into rho; decide only the flows progress can move.

        More bytes sent only lowers a flow's MLU and raises its slack, so a promotion never
        comes earlier than ``next_change`` said: a caller with promotion timers calls this
        instead of ``reevaluate`` on progress reports. Decided here all the same: a late flow
        that has sent its last byte (late no more), a flow held below its job's collectives
        (its MLU reaching the top threshold brings it to Algorithm 1) and, in slack order, an
        urgent flow (its timer assumes today's rho). Algorithm 1 runs when due, as in
        ``reevaluate``.
        """
        active = flows if isinstance(flows, list | tuple) else list(flows)
        self._follow_clock(ctx.now)
        if self.args.rho_source != "none":
            self._meter.update(active, ctx)  # reevaluate's own update at this instant is a no-op
        explicit, inert = EXPLICIT_DEADLINE, self._inert_levels
        moved = [
            f
            for f in active
            if f.cls in explicit and f.level not in inert and self._moved_by_progress(f, ctx)
        ]
        if moved or (self._alg1_due and ctx.now - self._alg1_last >= self.args.alg1_interval):
            return self.reevaluate(moved, ctx)
        self._forget_idle_requests(ctx.now)  # all that reevaluate([]) would do
        return {}

    def _moved_by_progress(self, flow: Flow, ctx: Context) -> bool:
        """Whether bytes can move explicit-deadline ``flow`` (see :meth:`observe_progress`)."""
        moves = self._progress_moves_level(flow.level)
        if moves is not None:
            return moves
        if flow.level == self.scavenger:
            return flow.remaining == 0
        return (
            flow.flow_id in self._tracked
            and flow.flow_id not in self._urgent
            and self._held_below_collectives(flow, ctx)
        )

    def _progress_moves_level(self, level: int) -> bool | None:
        """Whether bytes can move an explicit-deadline flow at ``level``; None: that depends
        on the flow (the scavenger: once it has sent its last byte; the first band with
        Algorithm 1: a flow held below its job's collectives)."""
        if level < 0:
            return True
        if level == self.scavenger:
            return None
        if level < self.urgent_levels:
            return self.args.urgent_order == "slack" and level > 0
        if self._alg1 and level == self.first_band:
            return None
        return False

    def _move_pruned(self, changes: dict[int, Decision]) -> None:
        """Send the flows of newly pruned requests that were not evaluated to the scavenger."""
        pruned, self._newly_pruned = self._newly_pruned, []
        for key in pruned:
            for fid, flow in self._members.get(key, {}).items():
                if fid not in changes and flow.level != self.scavenger:
                    changes[fid] = Decision(self.scavenger)
                    self._urgent.pop(fid, None)

    def release(self, flow: Flow, ctx: Context) -> None:
        self._follow_clock(ctx.now)
        self._meter.close(flow)
        self._urgent.pop(flow.flow_id, None)
        siblings = self._siblings.get(flow.request or "")
        if siblings is not None and siblings.remove(flow):
            del self._siblings[flow.request or ""]
        members = self._members.get(self._request_key(flow))
        if members is not None:
            members.pop(flow.flow_id, None)
            if not members:
                del self._members[self._request_key(flow)]
        if self._tracked.pop(flow.flow_id, None) is not None and flow.request is None:
            self._alg1_due = True  # a one-flow request left
        if flow.request is None:
            key = self._request_key(flow)
            self._pruned.discard(key)
            self._infeasible_since.pop(key, None)
            return
        left = self._request_flows.pop(flow.request, 1) - 1
        if left > 0:
            self._request_flows[flow.request] = left
            return
        self._alg1_due = self._alg1_due or self._alg1
        request = flow.request
        if (
            request in self._pruned
            or request in self._infeasible_since
            or request in self._layer_pace
        ):
            self._idle_requests[request] = ctx.now

    # -- promotion timers -----------------------------------------------------------------------

    def next_change(self, flow: Flow, ctx: Context) -> float | None:
        """The earliest time ``flow``'s level may change with no new report (docs/rmlq.md).

        An explicit flow is promoted when its MLU reaches the next threshold above its level.
        With ``remaining`` fixed, that time follows from MLU's formula; rho is taken to rise
        as fast as its EWMA can (towards 1, capped at ``max_load``), so the answer is never
        later than the true crossing. Also the deadline itself (pruning; the only time of a
        flow of unknown size, which has no MLU), with ``volume_check`` the instant its
        request's bytes can no longer cross in time, and, for a request judged hopeless by
        the ``"mlu"`` check, the end of its grace. None: only reports can change the flow
        (implicit classes: job progress).
        """
        memo = self._found.pop(flow.flow_id, None)
        if flow.cls not in EXPLICIT_DEADLINE or flow.level < 0 or self.dropped(flow, ctx.now):
            return None
        if memo is not None and memo[:3] == (ctx.now, flow.level, flow.sent):
            found, lost_at = memo[3:]  # the same inputs as reevaluate's a moment ago (_found)
        else:
            found, lost_at = self.urgency(flow, ctx), None
        pruned_at = self._pruned_at(flow, ctx.now)
        if found is None or found.remaining <= 0:
            # no MLU (an unknown size: unknown_level), or nothing left of the request: at
            # most the deadline, where an unknown size counts as late (bytes left)
            return pruned_at
        times = [] if pruned_at is None else [pruned_at]
        if self._prunable(flow) and flow.deadline is not None:
            since = self._infeasible_since.get(self._request_key(flow))
            if since is not None:
                times.append(since + self.args.feasibility_grace)
            if self._volume_check:
                if lost_at is None:
                    lost_at = self._volume_lost_at(flow, ctx)
                if ctx.now < lost_at < flow.deadline:
                    times.append(lost_at)
        threshold = self._next_threshold(flow, ctx)
        if threshold is not None:
            times.append(ctx.now + self._time_to_reach(found, threshold))
        step = self._urgent_step(flow, found, ctx)
        if step is None:
            step = self._deferred_step(flow, found)
        if step is not None:
            times.append(ctx.now + max(step, _MIN_STEP))
        return min(times) if times else None

    def _pruned_at(self, flow: Flow, now: float) -> float | None:
        """``flow``'s deadline while it would prune the flow there (:func:`late_at`, an
        unknown size counting as bytes left); None for a flow that is not prunable. With
        ``mlu_scope = "request"`` a flow whose own bytes are sent still sees its request's
        bytes, which is why this asks the flow's own."""
        return late_at(flow, now) if self._prunable(flow) else None

    def _next_threshold(self, flow: Flow, ctx: Context) -> float | None:
        """The MLU at which a deferred ``flow`` moves up a level (None: urgent, or held)."""
        level = flow.level
        if level < self.first_band:
            return None
        if self._held_below_collectives(flow, ctx) and level == self.first_band:
            return None  # until the job's prefill ends (a job report)
        band = level - self.first_band
        if band == 0 or self._deferred_by_time:
            return self.top_threshold
        band_up = self.band_thresholds[min(band, len(self.band_thresholds)) - 1]
        # a top_threshold below the next band's lifts the flow into the urgent tier first
        return min(self.top_threshold, band_up)

    def _urgent_step(self, flow: Flow, found: _Urgency, ctx: Context) -> float | None:
        """Seconds until an urgent ``flow`` reaches the next urgent level (None: at the top,
        or held below its job's collectives: never demoted, it keeps its urgent level, and
        time alone cannot move it up; its job's report can).

        In deadline order that is exact; in slack order it assumes rho stays as measured (an
        urgent flow sends, so its own reports re-evaluate it often)."""
        level = flow.level
        if not 0 < level < self.urgent_levels or self._held_below_collectives(flow, ctx):
            return None
        bound = self.args.urgent_slack * self.args.urgent_ratio ** (level - 1)
        key = found.time_left if self.args.urgent_order == "deadline" else _slack(found)
        return max(key - bound, 0.0)

    def _deferred_step(self, flow: Flow, found: _Urgency) -> float | None:
        """Seconds until a deferred ``flow`` reaches the next band up, with deferred bands in
        deadline order (None: MLU bands, or the first band)."""
        band = flow.level - self.first_band
        if not self._deferred_by_time or not 0 < band < self.mlu_bands:
            return None
        bound = self.args.deferred_slack * self.args.urgent_ratio ** (band - 1)
        key = found.time_left if self.args.urgent_order == "deadline" else _slack(found)
        return max(key - bound, 0.0)

    def _time_to_reach(self, found: _Urgency, threshold: float) -> float:
        """Seconds until MLU may reach ``threshold``, rho rising as fast as its EWMA can."""
        if not found.bandwidth * threshold > 0:  # (a product that underflows, or NaN)
            return _MIN_STEP
        need = found.remaining / (threshold * found.bandwidth)  # (time left) x (1 - rho) at it
        floor = 1.0 - self.args.max_load
        if self.args.rho_source == "none":
            return max(found.time_left - need, _MIN_STEP)
        start = 1.0 - found.rho
        window = self.args.rho_window
        capped = window * math.log(start / floor) if start > floor else 0.0

        def residual(delta: float) -> float:  # (time left) x (1 - worst rho) after delta
            return (found.time_left - delta) * max(start * math.exp(-delta / window), floor)

        if residual(capped) > need:  # crossed only once rho sits at its cap
            return max(capped, found.time_left - need / floor)
        low, high = 0.0, capped
        for _ in range(12):  # keep the lower end: never later than the crossing
            middle = (low + high) / 2
            low, high = (middle, high) if residual(middle) > need else (low, middle)
        # Near the crossing the worst case shrinks towards 0 (Zeno): wait at least until the
        # crossing at today's rho or _NEAR_STEP, whichever is sooner
        at_current = found.time_left - need / start
        return max(low, min(at_current, _NEAR_STEP), _MIN_STEP)


#: the shortest wait next_change returns (a crossing computed in floating point may be read
#: as not reached yet at that very instant); and the wait near a worst-case crossing
_MIN_STEP = 1e-6
_NEAR_STEP = 1e-3


def _crosses(flow: Flow, link: str) -> bool:
    """Whether ``flow`` crosses ``link`` (``""``: the default link of a flow without links)."""
    return link in flow.links if flow.links else link == ""


def _layer_of(job: str, ctx: Context) -> int:
    """The layer job ``job`` (in ``ctx.job_index``) reached: its reported layer
    (``"<job>/layer"``), else its step (an engine, like the simulator, that reports a
    serving batch's layer as the batch job's step)."""
    layer = ctx.job_index.get(f"{job}/layer")
    return ctx.job_index[job] if layer is None else layer


def _depth_scope(flow: Flow) -> str:
    """Whose model depth ``flow`` informs and uses: the owner in front of the first ``/`` of its
    request name (or of its job's, without a request). The agent scopes SDK names to the
    client's uid (``"1000/r7"``), so one user's absurd layer index cannot make the pace check
    prune every other user's requests; unscoped names (the simulator's) share ``""``."""
    name = flow.request if flow.request is not None else flow.job
    if name is None or "/" not in name:
        return ""
    return name.split("/", 1)[0]


def _slack(found: _Urgency) -> float:
    """Seconds before the latest start at the residual bandwidth (-inf when late)."""
    residual = found.bandwidth * (1.0 - found.rho)
    if found.time_left <= 0 or residual <= 0:
        return -math.inf
    return found.time_left - found.remaining / residual


def new(args: Mapping[str, Any], *, num_levels: int) -> RmlqPolicy:
    """Build an :class:`RmlqPolicy` from validated ``args``."""
    fields = dict(args)
    if "prune_classes" in fields:
        fields["prune_classes"] = tuple(fields["prune_classes"])
    return RmlqPolicy(Args(**fields), num_levels)
