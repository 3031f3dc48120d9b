"""``rmlq``: the Reverse Multi-Level Queue of MFS (arXiv 2603.17456), extended to our classes.

Defer-and-Promote: a flow enters at the level its current urgency earns (low while it has
slack) and is only ever promoted as its laxity shrinks; ``reevaluate`` never returns a level
number above ``flow.level``. The caller applies new levels at message boundaries, so one message
never spans two queues. Urgency metrics (reference/mfs-rmlq.md sections 2.2-2.5):

* implicit deadlines (``tp``, ``experience``, ``kv_reuse``): RLI = consumer index - the job's
  current index (``Context.job_index[flow.job]``); ``tp`` is always RLI 0. Smaller = sooner.
* explicit deadlines (``param_sync``, ``kv``): MLU = remaining bytes / (time to deadline x B x
  (1 - rho)), B and rho of the flow's bottleneck link (smallest capacity, highest load over
  ``flow.links``). Larger = more urgent; past the deadline MLU is infinite.
* ``bulk``: no deadline, the scavenger level.

Level layout (K levels, 0 = most urgent) -- the paper leaves it open; ours, in this order:

====================  =============================================================
level 0               explicit-deadline flows with MLU >= ``top_threshold`` (default U)
                      and flows past their deadline: the reserved top level (paper 2.1.1)
levels 1..R           early stage (R = ``early_levels``, default 3): by RLI, then RED
levels R+1..K-2       the remaining MLU bands, geometric thresholds Q_i = U * E^-i:
                      band i holds MLU in [Q_i, Q_{i-1}) with Q_0 = the top threshold;
                      the last band also holds everything below
level K-1             scavenger: ``bulk`` and requests pruned by the feasibility check
====================  =============================================================

With the defaults (K=8, R=3, E=4, U=0.5): 0 = MLU >= 0.5; 1/2/3 = RLI 0/1/>=2; 4 = MLU in
[0.125, 0.5); 5 = [0.031, 0.125); 6 = below 0.031; 7 = scavenger. Why this split: K=8 is what
switches offer, three RLI levels cover a collective plus a two-layer KV-reuse lookahead, and
three MLU bands below the early levels reach the paper's thresholds down to Q_2.

RED tie-break (paper 2.5): flows sharing ``flow.request`` form a request (or batch); its RED is
computed from the distinct deadlines of its flows (largest-gap split into a tight and a loose
set, RED = f x min(tight) + (1-f) x min(loose)). With ``red_tiers`` T > 1 the requests are
ranked by RED and cut into T equal-count tiers; an early flow's slot inside the early range is
``RLI x T + tier`` (capped at R-1), i.e. strict RLI first and RED order among equal RLI, using
spare early levels. Flows with no request, or whose request has no deadline, are in tier 0
(nothing says they can wait). Default T = 1 (no spare levels at K = 8); pd-serving.toml uses
K = 12 with T = 2.

rho source (``rho_source``; the paper does not say how rho is measured): B(1 - rho) must be
the bandwidth left *for this flow* until its deadline, so the default ``"others"`` takes, on each
link of the flow, the utilization by the other scheduled flows, and uses the highest. It is an
EWMA over ``rho_window`` seconds computed from the flows' byte counters
(:class:`~flowsched.policies.common.TrafficMeter`): at each evaluation the bytes every active
flow sent since the previous one are added to its links; the link's utilization and the flow's
own rate are averaged with the same weights, so their difference is exactly the others'
traffic. Why: MLU predicts the residual over the time left, hundreds of ms for a param sync,
while ``Context.link_load`` follows ~1 ms bursts. The first version subtracted the flow's rate
since the previous evaluation (< 1 ms) from that burst-following load: a flow briefly starved
by a TP burst read "own share 0, link full", i.e. rho at ``max_load`` and MLU up to 10x too
high, and never-demote made the promotion permanent; a flow opened right after a collective
read the collective's burst as rho 0.92. Averaging ``Context.link_load`` itself over a longer
window is no cure: it is read at event times, which cluster at bursts (a flow completes, the
next one opens), so it oversamples busy instants. The window should span several periods of
the periodic collective traffic so that rho reads its duty-cycle mean, not its phase. Not
chosen: rho = the load of strictly more urgent levels (the other reading of the paper), which
would need per-level loads. Caveats: traffic the policy does not schedule is not counted; the
flow's siblings (flows of the same request on the same link) count as others. ``"link"``
uses the windowed utilization including the flow's own traffic, ``"none"`` uses rho = 0
(plain bandwidth, as the unofficial reproductions do). rho is capped at ``max_load`` so the
residual never drops below (1 - max_load) x B.

Feasibility check (Alg. 1 at request granularity; ``feasibility``, default off): the paper
judges a whole request (batch) against its deadline when it arrives and prunes the hopeless
ones to a scavenger class so that they stop soaking up bandwidth (the Black Hole effect). Ours
runs whenever a flow of a class in ``prune_classes`` (default ``kv``) is admitted or
re-evaluated, and judges its *request*: a request whose deadline has passed is pruned at once
(nothing is estimated there); one whose flow has MLU > 1 (it cannot finish in time even with the
whole residual bandwidth) is pruned once that has held for ``feasibility_grace`` seconds, timed
per request, so the grace spans the request's successive per-layer flows. A re-evaluation that
finds every evaluated flow of the request feasible resets its timer. Pruning is final for the
request: every flow of it in ``prune_classes``, present and future, goes to the scavenger level
K-1 -- the one allowed demotion. Flows of other classes of a pruned request keep their level:
other requests of the same batch wait on them. Request state outlives the request's last flow
by ``request_memory`` seconds (per-layer flows of one request come and go), then is dropped.
The MLU judged is the level's own (``feasibility_load = "rho"``, default: residual B(1 - rho)
with rho = the other flows' load) or MLU on the whole bottleneck bandwidth
(``"none"``). At an incast port the other flows are largely the deferred transfers that this
one would preempt once promoted, so ``"rho"`` reads requests that would finish at the top level
as hopeless; in the contention benchmark's simulator replay ``"none"`` kept 0.78-0.83 of the
requests in time against 0.47-0.54 with ``"rho"`` (seeds 1-3, 30 s). The paper's Alg. 1
counts only the load of higher-priority batches, which lies between the two.
Off by default in the code because pruning sacrifices requests on the strength of B/rho
estimates; the policy files turn it on for serving (see their comments). ``param_sync`` is not
in the default ``prune_classes``: generation waits for a late sync, so starving it only adds
delay. Without pruning, past-deadline flows sit at the top level (MLU infinite).

Collectives first (``collectives_first``, default off = the paper's order): MFS ranks early
flows by RLI only, so a ``tp`` collective and another RLI-0 transfer (KV reuse for the layer
being computed, experience for the step the trainer waits on) share a level and split the link.
With the option on, ``tp`` keeps level 1 alone and every other early flow moves down one slot.
Why one may want it: a collective is a barrier for every GPU of its group and is short (one
layer's or phase's exchange), so serving it first delays the other RLI-0 flow by that short
time once, while delaying the collective stalls the whole group -- and, when that group is the
producer of a pipeline (the rollout generating experience), everything downstream of it.

Promotion lead (``promotion_lead``, seconds, default 0): a level change takes effect on the
wire only after the decision reaches the sender and the flow's packets already queued in the
old class have drained, which the fluid model of the paper treats as instant. MLU counts the
time left to the deadline minus this lead, so a flow is promoted that much earlier, and a flow
within the lead of its deadline takes the top level. Set it to the measured decision -> wire
latency of the deployment (``flowsched bench contention`` reports it); the feasibility check's
past-deadline rule still uses the deadline itself.

Explicit flows with an unknown size or no deadline are placed as implicit flows at
``unknown_level`` (default R, the lowest early level); implicit flows whose job index or
consumer index is unknown likewise.

Cost: ``reevaluate`` is O(N) over the flows (plus O(G log G) over the G requests when
``red_tiers`` > 1); flows already at the most urgent level their class can reach are skipped,
since never-demote means nothing can change them, but every evaluation counts the bytes of
all flows for rho (O(N x path length)). Per-flow state (byte counter, rate EWMA) lives in dicts
keyed by ``flow_id`` and is dropped in ``release``; per-request state (infeasibility
timer, pruned mark) ``request_memory`` seconds after the request's last flow is released;
per-link state (utilization EWMA) for every link seen, bounded by the topology.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from flowsched.model import EXPLICIT_DEADLINE, Context, Decision, Flow, FlowClass
from flowsched.policies.argcheck import (
    boolean,
    check_fields,
    integer,
    list_of,
    number,
    one_of,
    optional,
)
from flowsched.policies.common import BottleneckCache, TrafficMeter, bottleneck

NAME = "rmlq"
#: largest ratio between two MLU band thresholds (E) and largest MLU scale (U) accepted
MAX_BAND_RATIO = 1024.0
MAX_BAND_SCALE = 1024.0


@dataclass(frozen=True, slots=True)
class Args:
    """Arguments of ``rmlq`` (see the module docstring for their meaning)."""

    E: float = 4.0
    U: float = 0.5
    top_threshold: float | None = None
    early_levels: int = 3
    red_tiers: int = 1
    collectives_first: bool = False
    unknown_level: int | None = None
    rho_source: str = "others"
    rho_window: float = 0.05
    max_load: float = 0.9
    feasibility: bool = False
    feasibility_grace: float = 0.0
    prune_classes: tuple[str, ...] = ("kv",)
    request_memory: float = 1.0
    promotion_lead: float = 0.0
    feasibility_load: str = "rho"


_FIELDS = {
    # sane bounds (issue 12): E = 1e308 or U = 1e308 passed and made every band threshold
    # overflow or underflow; the paper's values are E = 4, U = 0.5
    "E": number(1.0, MAX_BAND_RATIO, open_low=True),
    "U": number(0.0, MAX_BAND_SCALE, open_low=True),
    "top_threshold": optional(number(0.0, open_low=True)),
    "early_levels": integer(1, 62),
    "red_tiers": integer(1, 62),
    "collectives_first": boolean,
    "unknown_level": optional(integer(0, 63)),
    "rho_source": one_of("others", "link", "none"),
    "rho_window": number(0.0, open_low=True),
    "max_load": number(0.0, 0.99),
    "feasibility": boolean,
    "feasibility_grace": number(0.0),
    "prune_classes": list_of(one_of(*sorted(cls.label for cls in EXPLICIT_DEADLINE))),
    "request_memory": number(0.0),
    "promotion_lead": number(0.0),
    "feasibility_load": one_of("rho", "none"),
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


def robust_effective_deadline(deadlines: Iterable[float]) -> float:
    """RED of a batch: split the sorted distinct deadlines at the largest gap, then weight.

    ``RED = f * min(tight) + (1 - f) * min(loose)``, f = the tight fraction; one deadline -> it.
    """
    ordered = sorted(set(deadlines))
    n = len(ordered)
    if n == 1:
        return ordered[0]
    split = max(range(1, n), key=lambda k: ordered[k] - ordered[k - 1])  # tight = first `split`
    fraction = split / n
    return fraction * ordered[0] + (1.0 - fraction) * ordered[split]


class RmlqPolicy:
    """Reverse Multi-Level Queue: enter by current urgency, promote only (see module doc)."""

    name: ClassVar[str] = NAME

    def __init__(self, args: Args, num_levels: int) -> None:
        self.num_levels = num_levels
        self.args = args
        self.early_levels = args.early_levels
        self.mlu_bands = num_levels - 2 - args.early_levels
        if self.mlu_bands < 1:
            raise ValueError(
                f"policy.args.early_levels: {args.early_levels} early levels leave no MLU band "
                f"with K={num_levels} (need K >= early_levels + 3)"
            )
        self.scavenger = num_levels - 1
        self.top_threshold = args.U if args.top_threshold is None else args.top_threshold
        #: thresholds Q_1..Q_{bands-1}: band i (level R+i) holds MLU >= Q_i
        self.band_thresholds = [args.U * args.E**-i for i in range(1, self.mlu_bands)]
        self.unknown_level = args.early_levels if args.unknown_level is None else args.unknown_level
        if not 0 <= self.unknown_level < num_levels:
            raise ValueError(
                f"policy.args.unknown_level: {self.unknown_level} is outside 0..{num_levels - 1}"
            )
        #: the most urgent level each class can ever reach: a flow already there cannot change
        #: (never demote), so reevaluate skips it unless pruning may move it
        #: early slots taken by the collectives ahead of the other RLI-0 flows
        self._shift = 1 if args.collectives_first else 0
        first_other = 1 + min(self._shift, args.early_levels - 1)
        self._floor = {cls: min(first_other, self.unknown_level) for cls in FlowClass}
        self._floor.update({cls: 0 for cls in EXPLICIT_DEADLINE})
        self._floor[FlowClass.TP] = 1
        self._floor[FlowClass.BULK] = self.scavenger
        self.prune_classes = frozenset(FlowClass.parse(label) for label in args.prune_classes)
        self._tier_of_request: dict[str, int] = {}
        #: request -> when it was first found infeasible (cleared when found feasible again)
        self._infeasible_since: dict[str, float] = {}
        self._pruned: set[str] = set()
        self._request_flows: dict[str, int] = {}
        #: requests with no active flow -> when their last flow left (insertion = time order)
        self._idle_requests: dict[str, float] = {}
        self._meter = TrafficMeter(args.rho_window)

    @property
    def per_flow_decisions(self) -> bool:
        """True unless RED tiers or the feasibility check make decisions depend on other flows.

        rho is measured from the flows' byte counters, which tolerates being given a subset:
        a flow's bytes are counted whenever it is next evaluated or released.
        """
        return self.args.red_tiers <= 1 and not self.args.feasibility

    def describe_levels(self) -> list[str]:
        """What each level 0..K-1 holds (for ``flowsched policy show``)."""
        late = "past deadline"
        if self.args.feasibility:
            pruned = ", ".join(sorted(cls.label for cls in self.prune_classes)) or "none"
            late += f" (pruned instead: {pruned})"
        names = [f"top: explicit deadline, MLU >= {self.top_threshold:g} or {late}"]
        for slot in range(self.early_levels):
            if slot < self._shift:
                names.append("early: tp collectives (RLI 0, collectives_first)")
                continue
            rli, tier = divmod(slot - self._shift, self.args.red_tiers)
            red = f", RED tier {tier}" if self.args.red_tiers > 1 else ""
            if slot == self.early_levels - 1:
                names.append(f"early: RLI {rli}{red} and every later RLI/tier")
            else:
                names.append(f"early: RLI {rli}{red}")
        upper = self.top_threshold
        for threshold in self.band_thresholds:
            names.append(f"MLU in [{threshold:.4g}, {upper:.4g})")
            upper = threshold
        names.append(f"MLU below {upper:.4g}")
        names.append("scavenger: bulk, pruned requests")
        return names

    # -- urgency -> level ----------------------------------------------------------------------

    def mlu_level(self, value: float) -> int:
        """Level of an explicit-deadline flow with MLU ``value``."""
        if value >= self.top_threshold:
            return 0
        for band, threshold in enumerate(self.band_thresholds, start=1):
            if value >= threshold:
                return self.early_levels + band
        return self.early_levels + self.mlu_bands

    def rli_level(self, rli: int, tier: int = 0, shift: int = 0) -> int:
        """Level of an early-stage flow with relative index ``rli`` in RED tier ``tier``.

        ``shift`` early slots are skipped (the collectives' own slot with ``collectives_first``).
        """
        slot = max(rli, 0) * self.args.red_tiers + tier + shift
        return 1 + min(slot, self.early_levels - 1)

    def flow_mlu(
        self, flow: Flow, ctx: Context, paths: BottleneckCache | None = None, *, rho: bool = True
    ) -> float | None:
        """MLU of an explicit-deadline flow, or None when its size or deadline is unknown.

        ``rho=False`` divides by the whole bottleneck bandwidth (the feasibility check's
        ``feasibility_load = "none"``)."""
        remaining = flow.remaining
        if remaining is None or flow.deadline is None:
            return None
        bandwidth = paths(flow) if paths is not None else bottleneck(flow, ctx)
        time_left = flow.deadline - ctx.now - self.args.promotion_lead
        return mlu(remaining, time_left, bandwidth, self._rho(flow, ctx) if rho else 0.0)

    def _feasibility_value(
        self, flow: Flow, ctx: Context, value: float | None, paths: BottleneckCache | None = None
    ) -> float | None:
        """The MLU the feasibility check judges: ``value`` itself, or MLU on the whole link."""
        if not self.args.feasibility or self.args.feasibility_load == "rho":
            return value
        return self.flow_mlu(flow, ctx, paths, rho=False)

    def _rho(self, flow: Flow, ctx: Context) -> float:
        """rho of the flow's path: the windowed load of its busiest link (see module doc)."""
        source = self.args.rho_source
        if source == "none":
            return 0.0
        if source == "others":
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
        return max(flow.consumer_index - ctx.job_index[flow.job], 0)

    def target_level(self, flow: Flow, ctx: Context, value: float | None, tier: int) -> int:
        """The level ``flow``'s urgency earns now, before the never-demote rule."""
        if flow.cls is FlowClass.BULK:
            return self.scavenger
        if flow.cls in EXPLICIT_DEADLINE:
            return self.unknown_level if value is None else self.mlu_level(value)
        rli = self.flow_rli(flow, ctx)
        if rli is None:
            return self.unknown_level
        shift = 0 if flow.cls is FlowClass.TP else self._shift
        return self.rli_level(rli, tier, shift)

    # -- feasibility and RED --------------------------------------------------------------------

    def _request_key(self, flow: Flow) -> str:
        return flow.request if flow.request is not None else f"#flow-{flow.flow_id}"

    def _infeasible(self, flow: Flow, value: float | None, now: float) -> bool | None:
        """Whether the request of ``flow`` looks hopeless now (None: not judged)."""
        if not self.args.feasibility or value is None or flow.cls not in self.prune_classes:
            return None
        key = self._request_key(flow)
        if key in self._pruned:
            return True
        if flow.deadline is not None and flow.deadline <= now and (flow.remaining or 0) > 0:
            self._pruned.add(key)  # certain, not estimated: no grace
            return True
        if value <= 1.0:
            return False
        since = self._infeasible_since.setdefault(key, now)
        if now - since >= self.args.feasibility_grace:
            self._pruned.add(key)
        return True

    def is_pruned(self, flow: Flow) -> bool:
        """True when ``flow`` (of a class in ``prune_classes``) belongs to a pruned request."""
        if not self._pruned or flow.cls not in self.prune_classes:
            return False
        return self._request_key(flow) in self._pruned

    def _forget_idle_requests(self, now: float) -> None:
        """Drop the state of requests that have had no flow for ``request_memory`` seconds."""
        idle = self._idle_requests
        while idle:
            request, since = next(iter(idle.items()))
            if now - since < self.args.request_memory:
                return
            del idle[request]
            self._pruned.discard(request)
            self._infeasible_since.pop(request, None)

    def _red_tiers(self, deadlines: Mapping[str, list[float]]) -> dict[str, int]:
        tiers = self.args.red_tiers
        if tiers <= 1 or not deadlines:
            return {}
        reds = sorted(deadlines, key=lambda req: robust_effective_deadline(deadlines[req]))
        return {req: rank * tiers // len(reds) for rank, req in enumerate(reds)}

    # -- the Policy protocol --------------------------------------------------------------------

    def _decide(self, flow: Flow, ctx: Context, value: float | None) -> int:
        if self.is_pruned(flow):
            return self.scavenger
        tier = self._tier_of_request.get(flow.request, 0) if flow.request is not None else 0
        target = self.target_level(flow, ctx, value, tier)
        return target if flow.level < 0 else min(target, flow.level)

    def _settled(self, flow: Flow) -> bool:
        """True when no evaluation can change ``flow``: at its class's floor, nothing to prune."""
        level = flow.level
        if level < 0 or level > self._floor[flow.cls]:
            return False
        return not (self.args.feasibility and flow.cls in self.prune_classes)

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        if flow.request is not None:
            self._idle_requests.pop(flow.request, None)
            self._request_flows[flow.request] = self._request_flows.get(flow.request, 0) + 1
        if self.args.rho_source != "none":
            self._meter.open(flow, ctx.now)
        value = self.flow_mlu(flow, ctx) if flow.cls in EXPLICIT_DEADLINE else None
        self._infeasible(flow, self._feasibility_value(flow, ctx, value), ctx.now)
        return Decision(self._decide(flow, ctx, value))

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        active = flows if isinstance(flows, list | tuple) else list(flows)
        self._forget_idle_requests(ctx.now)
        if self.args.rho_source != "none":
            self._meter.update(active, ctx)
        values: dict[int, float | None] = {}
        deadlines: dict[str, list[float]] = {}
        verdicts: dict[str, bool] = {}
        want_red = self.args.red_tiers > 1
        paths = BottleneckCache(ctx)
        for flow in active:
            if want_red and flow.request is not None and flow.deadline is not None:
                deadlines.setdefault(flow.request, []).append(flow.deadline)
            if self._settled(flow):
                continue
            if flow.cls in EXPLICIT_DEADLINE:
                value = values[flow.flow_id] = self.flow_mlu(flow, ctx, paths)
                judged = self._feasibility_value(flow, ctx, value, paths)
                verdict = self._infeasible(flow, judged, ctx.now)
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
            level = self._decide(flow, ctx, values.get(flow.flow_id))
            if level != flow.level:
                changes[flow.flow_id] = Decision(level)
        return changes

    def release(self, flow: Flow, ctx: Context) -> None:
        self._meter.close(flow)
        if flow.request is None:
            key = self._request_key(flow)
            self._pruned.discard(key)
            self._infeasible_since.pop(key, None)
            return
        left = self._request_flows.pop(flow.request, 1) - 1
        if left > 0:
            self._request_flows[flow.request] = left
        elif flow.request in self._pruned or flow.request in self._infeasible_since:
            self._idle_requests[flow.request] = ctx.now


def new(args: Mapping[str, Any], *, num_levels: int) -> RmlqPolicy:
    """Build an :class:`RmlqPolicy` from validated ``args``."""
    fields = dict(args)
    if "prune_classes" in fields:
        fields["prune_classes"] = tuple(fields["prune_classes"])
    return RmlqPolicy(Args(**fields), num_levels)
