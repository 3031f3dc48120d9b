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
the bandwidth left *for this flow*, so the default ``"others"`` takes the bottleneck's measured
load from ``Context.link_load`` minus the flow's own share, estimated from its progress
(``sent``) between two evaluations; counting the flow's own traffic would make a flow that
sends alone on a link look overloaded and promote it at once. ``"link"`` uses the link's load
as measured, ``"none"`` uses rho = 0 (plain bandwidth, as the unofficial reproductions do).
rho is capped at ``max_load`` so the residual never drops below (1 - max_load) x B.

Feasibility check (Alg. 1, simplified; ``feasibility``, default off): an explicit flow whose MLU
stays above 1 for ``feasibility_grace`` seconds cannot finish in time even with all residual
bandwidth; its request is pruned and every explicit-deadline flow of that request moves to the
scavenger level K-1 -- the one allowed demotion, and final. Implicit flows of a pruned request
keep their level: other requests of the same batch wait on them. Off by default because
pruning knowingly sacrifices requests on the strength of noisy B/rho estimates, and the paper
treats it as a safeguard for pathological overload only. With it off, past-deadline flows stay
at the top level (MLU infinite).

Explicit flows with an unknown size or no deadline are placed as implicit flows at
``unknown_level`` (default R, the lowest early level); implicit flows whose job index or
consumer index is unknown likewise.

Cost: ``reevaluate`` is O(N) over the flows (plus O(G log G) over the G requests when
``red_tiers`` > 1); flows already at the most urgent level their class can reach are skipped,
since never-demote means nothing can change them. Per-flow state (progress samples for
``rho_source = "others"``, infeasibility timers) lives in dicts keyed by ``flow_id`` and is
dropped in ``release``; per-request state when the request's last flow is released.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from flowsched.model import EXPLICIT_DEADLINE, Context, Decision, Flow, FlowClass
from flowsched.policies.argcheck import boolean, check_fields, integer, number, one_of, optional
from flowsched.policies.common import BottleneckCache, bottleneck

NAME = "rmlq"


@dataclass(frozen=True, slots=True)
class Args:
    """Arguments of ``rmlq`` (see the module docstring for their meaning)."""

    E: float = 4.0
    U: float = 0.5
    top_threshold: float | None = None
    early_levels: int = 3
    red_tiers: int = 1
    unknown_level: int | None = None
    rho_source: str = "others"
    max_load: float = 0.9
    feasibility: bool = False
    feasibility_grace: float = 0.0


_FIELDS = {
    "E": number(1.0, open_low=True),
    "U": number(0.0, open_low=True),
    "top_threshold": optional(number(0.0, open_low=True)),
    "early_levels": integer(1, 62),
    "red_tiers": integer(1, 62),
    "unknown_level": optional(integer(0, 63)),
    "rho_source": one_of("others", "link", "none"),
    "max_load": number(0.0, 0.99),
    "feasibility": boolean,
    "feasibility_grace": number(0.0),
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
        self._floor = {cls: min(1, self.unknown_level) for cls in FlowClass}
        self._floor.update({cls: 0 for cls in EXPLICIT_DEADLINE})
        self._floor[FlowClass.TP] = 1
        self._floor[FlowClass.BULK] = self.scavenger
        self._tier_of_request: dict[str, int] = {}
        self._infeasible_since: dict[int, float] = {}
        self._pruned: set[str] = set()
        self._request_flows: dict[str, int] = {}
        self._progress: dict[int, tuple[float, int]] = {}
        self._share: dict[int, float] = {}

    @property
    def per_flow_decisions(self) -> bool:
        """True unless RED tiers or the feasibility check make decisions depend on other flows."""
        return self.args.red_tiers <= 1 and not self.args.feasibility

    def describe_levels(self) -> list[str]:
        """What each level 0..K-1 holds (for ``flowsched policy show``)."""
        names = [f"top: explicit deadline, MLU >= {self.top_threshold:g} or past deadline"]
        for slot in range(self.early_levels):
            rli, tier = divmod(slot, self.args.red_tiers)
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

    def rli_level(self, rli: int, tier: int = 0) -> int:
        """Level of an early-stage flow with relative index ``rli`` in RED tier ``tier``."""
        slot = max(rli, 0) * self.args.red_tiers + tier
        return 1 + min(slot, self.early_levels - 1)

    def flow_mlu(
        self, flow: Flow, ctx: Context, paths: BottleneckCache | None = None
    ) -> float | None:
        """MLU of an explicit-deadline flow, or None when its size or deadline is unknown."""
        remaining = flow.remaining
        if remaining is None or flow.deadline is None:
            return None
        bandwidth, load = paths(flow) if paths is not None else bottleneck(flow, ctx)
        return mlu(
            remaining, flow.deadline - ctx.now, bandwidth, self._rho(flow, ctx, bandwidth, load)
        )

    def _rho(self, flow: Flow, ctx: Context, bandwidth: float, load: float) -> float:
        source = self.args.rho_source
        if source == "none":
            return 0.0
        if source == "others":
            load -= self._own_share(flow, ctx.now, bandwidth)
        return min(max(load, 0.0), self.args.max_load)

    def _own_share(self, flow: Flow, now: float, bandwidth: float) -> float:
        """The flow's own rate / B since its previous evaluation (0 on the first)."""
        previous = self._progress.get(flow.flow_id)
        self._progress[flow.flow_id] = (now, flow.sent)
        if previous is None or now <= previous[0] or bandwidth <= 0:
            return 0.0 if previous is None else self._share.get(flow.flow_id, 0.0)
        share = max(flow.sent - previous[1], 0) / (now - previous[0]) / bandwidth
        self._share[flow.flow_id] = share
        return share

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
        return self.unknown_level if rli is None else self.rli_level(rli, tier)

    # -- feasibility and RED --------------------------------------------------------------------

    def _request_key(self, flow: Flow) -> str:
        return flow.request if flow.request is not None else f"#flow-{flow.flow_id}"

    def _check_feasible(self, flow: Flow, value: float | None, now: float) -> None:
        if not self.args.feasibility or value is None:
            return
        if value <= 1.0:
            self._infeasible_since.pop(flow.flow_id, None)
            return
        since = self._infeasible_since.setdefault(flow.flow_id, now)
        if now - since >= self.args.feasibility_grace:
            self._pruned.add(self._request_key(flow))

    def is_pruned(self, flow: Flow) -> bool:
        """True when ``flow`` is an explicit-deadline flow of a pruned request."""
        if not self._pruned or flow.cls not in EXPLICIT_DEADLINE:
            return False
        return self._request_key(flow) in self._pruned

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
        return not (self.args.feasibility and flow.cls in EXPLICIT_DEADLINE)

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        if flow.request is not None:
            self._request_flows[flow.request] = self._request_flows.get(flow.request, 0) + 1
        value = self.flow_mlu(flow, ctx) if flow.cls in EXPLICIT_DEADLINE else None
        self._check_feasible(flow, value, ctx.now)
        return Decision(self._decide(flow, ctx, value))

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        active = flows if isinstance(flows, list | tuple) else list(flows)
        values: dict[int, float | None] = {}
        deadlines: dict[str, list[float]] = {}
        want_red = self.args.red_tiers > 1
        paths = BottleneckCache(ctx)
        for flow in active:
            if want_red and flow.request is not None and flow.deadline is not None:
                deadlines.setdefault(flow.request, []).append(flow.deadline)
            if self._settled(flow):
                continue
            if flow.cls in EXPLICIT_DEADLINE:
                value = values[flow.flow_id] = self.flow_mlu(flow, ctx, paths)
                self._check_feasible(flow, value, ctx.now)
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
        self._infeasible_since.pop(flow.flow_id, None)
        self._progress.pop(flow.flow_id, None)
        self._share.pop(flow.flow_id, None)
        if flow.request is None:
            self._pruned.discard(self._request_key(flow))
            return
        left = self._request_flows.pop(flow.request, 1) - 1
        if left > 0:
            self._request_flows[flow.request] = left
        else:
            self._pruned.discard(flow.request)


def new(args: Mapping[str, Any], *, num_levels: int) -> RmlqPolicy:
    """Build an :class:`RmlqPolicy` from validated ``args``."""
    return RmlqPolicy(Args(**args), num_levels)
