"""Event-driven fluid network simulator that drives a :class:`~flowsched.policies.base.Policy`.

Model
-----
* Flows cross a list of links (see :mod:`flowsched.sim.topology`). Rates are piecewise constant
  between events and follow :mod:`flowsched.sim.allocate`: strict priority across levels,
  max-min fairness within a level, ``Decision.rate`` as a per-flow cap.
* Rates are recomputed lazily, once per simulated instant, and only for the part of the network
  an event can change: the connected component (links <-> flows) of the touched links,
  restricted to flows at or below the most urgent touched level. More urgent levels cannot be
  affected by a change at a less urgent level, so their rates only reduce the residual capacity.
* The policy is called on the coordinator's hooks (:mod:`flowsched.coordinator.state`):
  ``admit`` when a flow opens, ``reevaluate`` (coalesced per instant) on job progress, flow
  completion and time, ``release`` when a flow closes. A policy with ``per_flow_decisions``
  sees only the flows an event touched (job progress: that job's flows; a completion: the flows
  its ``released_affects`` names, else the rest of its job, and the policy is called even with
  none; time: the flows whose time came; plus any flow it decides unasked, such as a pruned
  request's others), others see every active flow, also after each opening. Time: a policy
  with ``next_change`` gets each flow re-evaluated when its promotion time comes (the
  coordinator's promotion timers), and again when a flow its ``linked_flows`` names for a new
  flow opens; the others are swept every ``timer_period``. A decision waiting for its message
  boundary is the flow's level for the policy, its timer included (the coordinator's table
  holds what it sent, and the sender applies it at the boundary).
* Message boundaries: a decision change takes effect when the flow's sent bytes reach the next
  multiple of ``chunk_bytes`` (one message never spans two levels). ``chunk_bytes = 0`` models
  infinitesimal messages (changes apply at once).
* ``Context.link_load`` is an EWMA (time constant ``load_tau``) of each link's utilization.
* Hardware queues: ``SimConfig.level_queue`` maps each policy level to the switch queue that
  carries it (:mod:`flowsched.policies.hwqueues`); rates follow the queues, so levels that share
  a queue share it max-min fairly, as a switch serves them. The records keep the policy levels.
* Private paths: flows of the classes in ``SimConfig.private_classes`` each get a link of their
  own at their path's bottleneck rate (the ideal-network bound: they never contend).
* Headers: flows move at ``SimConfig.payload_share`` of each link's rate (default 1, a fluid
  model of the nominal rate); policies see the nominal rate.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from flowsched.metrics import FlowRecord, RunRecords
from flowsched.model import Context, Decision, Flow, FlowClass
from flowsched.policies.base import Policy
from flowsched.sim.allocate import allocate_levels

DoneCallback = Callable[[Flow], None]

_FLOW, _CALL, _TIMER, _REEVAL, _DUE = 0, 1, 2, 3, 4
#: the shortest wait before a promotion timer fires again (next_change answering "now" must
#: not spin the event loop at one instant), and the shortest sweep period
_MIN_DUE = 1e-6
#: bytes below which a flow counts as finished (absorbs float rounding)
_BYTE_EPS = 1e-3


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Engine knobs. ``timer_period`` <= 0 disables the periodic re-evaluation; a period
    below 1 us sweeps every microsecond."""

    chunk_bytes: int = 512 * 1024
    timer_period: float = 1e-3
    load_tau: float = 1e-3
    default_bandwidth: float = 25e9
    #: hardware queue of each level (empty: one queue per level)
    level_queue: tuple[int, ...] = ()
    #: classes whose flows travel on a private full-rate path (the ideal-network bound)
    private_classes: frozenset[FlowClass] = frozenset()
    #: share of every link's rate that carries payload (the rest: packet headers). Flows move at
    #: that share of the capacity; policies still see the nominal rate, as agents are told it.
    #: 1 = the fluid model of the nominal rate; the testbed's replays set TCP/IPv4's 1448 / 1514
    payload_share: float = 1.0
    #: "timers": as the coordinator, per-flow policies see only touched flows and policies
    #: with ``next_change`` get promotion timers; "sweep": every flow at every event and tick
    promotion: str = "timers"


class Engine(Protocol):
    """What a workload drives: the simulator here, the testbed's live engine
    (:class:`flowsched.testbed.live.LiveEngine`) with real flows in real time."""

    now: float
    records: RunRecords
    job_index: dict[str, int]

    def at(self, when: float, callback: Callable[[], None]) -> None: ...

    def after(self, delay: float, callback: Callable[[], None]) -> None: ...

    def open_flow(
        self,
        cls: FlowClass,
        size: int,
        links: tuple[str, ...],
        on_done: DoneCallback | None = None,
        **fields: object,
    ) -> Flow: ...

    def set_job_index(self, job: str, index: int) -> None: ...

    def end_job(self, job: str) -> None: ...


@dataclass(slots=True, eq=False)
class ActiveFlow:
    """Engine state of one open flow (rates in bytes/s, ``remaining`` valid at ``t_mark``)."""

    flow: Flow
    links: tuple[int, ...]
    level: int
    cap: float | None
    remaining: float
    t_mark: float
    on_done: DoneCallback | None
    rate: float = 0.0
    version: int = 0
    target: float = 0.0
    pending: Decision | None = None
    first_level: int = -1
    #: the hardware queue carrying ``level`` (what the allocator ranks by)
    queue: int = 0
    #: sent-byte offsets at which a level/cap change was applied (for invariant checks)
    changes_at: list[float] = field(default_factory=list)
    #: version of the flow's promotion timer (a newer timer makes older events stale)
    due_version: int = 0


class Simulator:
    """The event loop. Workloads open flows, schedule callbacks and report job progress."""

    def __init__(
        self,
        capacity: Mapping[str, float],
        policy: Policy,
        config: SimConfig | None = None,
        *,
        record_changes: bool = False,
    ) -> None:
        self.config = config or SimConfig()
        self.policy = policy
        self.now = 0.0
        self.records = RunRecords()
        self.link_names = list(capacity)
        self._link_index = {name: i for i, name in enumerate(self.link_names)}
        if not 0 < self.config.payload_share <= 1:
            raise ValueError(f"payload_share: {self.config.payload_share} is outside (0, 1]")
        share = self.config.payload_share
        self.capacity = [float(capacity[name]) * share for name in self.link_names]
        self._bandwidth = dict(capacity)
        self._on_link: list[dict[int, ActiveFlow]] = [{} for _ in self.link_names]
        self._link_rate = [0.0] * len(self.link_names)
        self._ewma = [0.0] * len(self.link_names)
        self._ewma_t = [0.0] * len(self.link_names)
        self.active: dict[int, ActiveFlow] = {}
        self.job_index: dict[str, int] = {}
        self._events: list[tuple[float, int, int, object, int]] = []
        self._seq = itertools.count()
        self._ids = itertools.count(1)
        self._dirty: set[int] = set()
        self._dirty_level = math.inf
        self._reeval_queued = False
        self._timer_armed = False
        self._record_changes = record_changes
        #: flows touched since the last re-evaluation (per-flow policies only)
        timers = self.config.promotion == "timers"
        self._per_flow = timers and bool(getattr(policy, "per_flow_decisions", False))
        self._touched: set[int] = set()
        #: a flow closed since the last re-evaluation: the next one calls the policy
        self._closed_since = False
        self._job_flows: dict[str, set[int]] = {}
        self._next_change: Callable[[Flow, Context], float | None] | None = (
            getattr(policy, "next_change", None) if timers else None
        )
        #: the policy's linked_flows (flows another flow's opening may promote), with timers
        self._linked: Callable[[Flow], Iterable[int]] | None = (
            getattr(policy, "linked_flows", None) if self._next_change is not None else None
        )
        #: the policy's released_affects (flows a flow's close may change), with per-flow
        #: decisions (otherwise every flow is evaluated anyway), or None: the rest of the job
        self._released_affects: Callable[[Flow], Iterable[int] | None] | None = (
            getattr(policy, "released_affects", None) if self._per_flow else None
        )
        self.events_processed = 0
        self.observer: Callable[[Simulator], None] | None = None

    # ----------------------------------------------------------------- workload API
    def at(self, when: float, callback: Callable[[], None]) -> None:
        """Run ``callback()`` at simulated time ``when`` (not before now)."""
        self._push(max(when, self.now), _CALL, callback, 0)

    def after(self, delay: float, callback: Callable[[], None]) -> None:
        """Run ``callback()`` ``delay`` seconds from now."""
        self.at(self.now + delay, callback)

    def open_flow(
        self,
        cls: FlowClass,
        size: int,
        links: tuple[str, ...],
        on_done: DoneCallback | None = None,
        **fields: object,
    ) -> Flow:
        """Open a flow of ``size`` bytes across ``links``; ``on_done(flow)`` runs at completion.

        Extra keyword ``fields`` set attributes of :class:`~flowsched.model.Flow` (``job``,
        ``deadline``, ``consumer_index``, ``request``, ``oracle_deadline``, ``node``). A flow
        with no links (intra-node) completes at once.
        """
        flow = Flow(next(self._ids), cls, self.now, size=int(size), links=links, **fields)  # type: ignore[arg-type]
        link_ids = tuple(self._link_index[name] for name in links)
        if cls in self.config.private_classes and link_ids:
            link_ids = (self._private_link(flow.flow_id, link_ids),)
        state = ActiveFlow(flow, link_ids, 0, None, float(size), self.now, on_done)
        decision = self.policy.admit(flow, self._context())
        self._check_level(decision)
        state.level, state.cap, state.first_level = decision.level, decision.rate, decision.level
        state.queue = self._queue(decision.level)
        flow.level = decision.level
        if not link_ids or size <= 0:
            self._finish(state)
            return flow
        self.active[flow.flow_id] = state
        for link in link_ids:
            self._on_link[link][flow.flow_id] = state
        if flow.job is not None:
            self._job_flows.setdefault(flow.job, set()).add(flow.flow_id)
        self._touch(link_ids, state.queue)
        if self._next_change is not None:
            self._arm_due(state, self._context())
            self._touch_linked(flow)
        else:
            self._arm_timer()
        if not self._per_flow:
            # a rank policy (edf, llf) re-ranks every flow when one opens, as the coordinator's
            # flush does: an earlier deadline moves the others down at once
            self._request_reevaluate()
        return flow

    def _touch_linked(self, flow: Flow) -> None:
        """Re-evaluate (and re-time) the flows whose promotion ``flow``'s opening may bring
        forward (the policy's ``linked_flows``: a request's flows under request-scope MLU)."""
        if self._linked is None:
            return
        linked = [fid for fid in self._linked(flow) if fid in self.active]
        if linked:
            self._touched.update(linked)
            self._request_reevaluate()

    def _private_link(self, flow_id: int, links: tuple[int, ...]) -> int:
        """A new link for one flow, at the bottleneck rate of ``links``."""
        name = f"private{flow_id}"
        self._link_index[name] = len(self.link_names)
        self.link_names.append(name)
        self.capacity.append(min(self.capacity[link] for link in links))
        self._bandwidth[name] = min(self._bandwidth[self.link_names[link]] for link in links)
        for column in (self._link_rate, self._ewma, self._ewma_t):
            column.append(0.0)
        self._on_link.append({})
        return self._link_index[name]

    def _queue(self, level: int) -> int:
        table = self.config.level_queue
        return table[level] if level < len(table) else level

    def set_job_index(self, job: str, index: int) -> None:
        """Report job progress (the ``L_curr`` of RLI); triggers a re-evaluation."""
        if self.job_index.get(job) != index:
            self.job_index[job] = index
            self._touched.update(self._job_flows.get(job, ()))
            self._request_reevaluate()

    def end_job(self, job: str) -> None:
        """The job ended (a batch's prefill): policies no longer see it in the job index, and
        its flows are re-evaluated, as the coordinator does on a ``done`` report."""
        if self.job_index.pop(job, None) is not None:
            self._touched.update(self._job_flows.get(job, ()))
            self._request_reevaluate()

    def run(self, until: float = math.inf) -> None:
        """Process events until none are left or the clock would pass ``until``."""
        while True:
            if self._events and self._events[0][2] == _FLOW:
                head = self._events[0]
                if self._stale(head[3], head[4]):
                    heapq.heappop(self._events)
                    continue
            if not self._events or self._events[0][0] > self.now:
                self._flush()  # rates for the coming interval; may schedule flow events
                if not self._events:
                    break
                if self._events[0][0] > self.now:
                    if self._events[0][0] > until:
                        break
                    self.now = self._events[0][0]
                continue
            _, _, kind, payload, version = heapq.heappop(self._events)
            self.events_processed += 1
            self._dispatch(kind, payload, version)
        self._flush()
        self.records.end_time = self.now

    # ----------------------------------------------------------------- events
    def _push(self, when: float, kind: int, payload: object, version: int) -> None:
        heapq.heappush(self._events, (when, next(self._seq), kind, payload, version))

    def _stale(self, payload: object, version: int) -> bool:
        assert isinstance(payload, ActiveFlow)
        return payload.version != version or payload.flow.flow_id not in self.active

    def _dispatch(self, kind: int, payload: object, version: int) -> None:
        if kind == _FLOW:
            assert isinstance(payload, ActiveFlow)
            if not self._stale(payload, version):
                self._reach_target(payload)
        elif kind == _CALL:
            payload()  # type: ignore[operator]
        elif kind == _TIMER:
            self._timer_armed = False
            if self.active:
                self._touched.update(self.active)
                self._request_reevaluate()
                self._arm_timer()
        elif kind == _DUE:
            assert isinstance(payload, ActiveFlow)
            if payload.due_version == version and payload.flow.flow_id in self.active:
                self._touched.add(payload.flow.flow_id)
                self._request_reevaluate()
        else:
            self._reeval_queued = False
            self._reevaluate()

    def _reach_target(self, state: ActiveFlow) -> None:
        self._materialize(state)
        state.remaining = min(state.remaining, state.target) if state.target > 0 else 0.0
        if state.remaining <= _BYTE_EPS:
            self._close(state)
        elif state.pending is not None:
            self._apply(state, state.pending)

    def _close(self, state: ActiveFlow) -> None:
        del self.active[state.flow.flow_id]
        for link in state.links:
            del self._on_link[link][state.flow.flow_id]
        siblings = self._leave_job(state.flow)
        self._touch(state.links, state.queue)
        state.rate = 0.0
        if self._released_affects is None:
            self._touched.update(siblings)
        self._finish(state)
        if self._released_affects is not None:
            # asked after the release, as the coordinator does; None: the rest of the job
            affected = self._released_affects(state.flow)
            if affected is None:
                affected = siblings
            self._touched.update(fid for fid in affected if fid in self.active)
        # the policy is called even with no flow named, as the coordinator's next flush is:
        # what a release decides unasked (rmlq pruning another request) comes then
        self._closed_since = True
        self._request_reevaluate()

    def _leave_job(self, flow: Flow) -> set[int]:
        """Remove ``flow`` from its job's open flows; return the job's remaining ones."""
        if flow.job is None:
            return set()
        siblings = self._job_flows.get(flow.job)
        if siblings is None:
            return set()
        siblings.discard(flow.flow_id)
        if not siblings:
            del self._job_flows[flow.job]
        return siblings

    def _finish(self, state: ActiveFlow) -> None:
        flow = state.flow
        flow.sent = flow.size or 0
        self.records.flows.append(
            FlowRecord(
                flow.flow_id,
                flow.cls.label,
                flow.size or 0,
                flow.opened_at,
                self.now,
                flow.deadline,
                flow.job,
                flow.request,
                state.first_level,
                state.level,
            )
        )
        self.policy.release(flow, self._context())
        if state.on_done is not None:
            state.on_done(flow)

    # ----------------------------------------------------------------- policy
    def _context(self) -> Context:
        return Context(
            now=self.now,
            job_index=self.job_index,
            link_bandwidth=self._bandwidth,
            link_load=_LoadView(self),
            default_bandwidth=self.config.default_bandwidth,
        )

    def _request_reevaluate(self) -> None:
        if not self._reeval_queued:
            self._reeval_queued = True
            self._push(self.now, _REEVAL, None, 0)

    def _arm_timer(self) -> None:
        period = self.config.timer_period
        if period > 0 and not self._timer_armed:
            self._timer_armed = True
            # at least _MIN_DUE: a period below the clock's resolution (a policy file's 1e-300)
            # re-armed the sweep at the same instant for ever
            self._push(self.now + max(period, _MIN_DUE), _TIMER, None, 0)

    def _arm_due(self, state: ActiveFlow, ctx: Context) -> None:
        """Schedule ``state``'s promotion timer from the policy's ``next_change``."""
        assert self._next_change is not None
        state.due_version += 1
        when = self._next_change(state.flow, ctx)
        if when is None or not math.isfinite(when):
            return
        if when <= self.now:
            # a time already past (the flow was just evaluated at it): the coordinator would see
            # it again at its next tick, not at once
            when = self.now + max(self.config.timer_period, _MIN_DUE)
        self._push(when, _DUE, state, state.due_version)

    def _reevaluate(self) -> None:
        touched, self._touched = self._touched, set()
        closed, self._closed_since = self._closed_since, False
        if not self.active:
            return
        now = self.now
        if self._per_flow:
            states = [s for fid in touched if (s := self.active.get(fid)) is not None]
            if not states and not closed:
                return
        else:
            states = list(self.active.values())
        # every flow's bytes, passed or not: the coordinator's table follows the agents'
        # progress reports, and a policy may read flows it was not passed (rmlq's Algorithm 1
        # judges every tracked request: stale bytes there pruned 91% vs 96% SLO attainment)
        for state in self.active.values():
            self._mark_progress(state, now)
        ctx = self._context()
        changed = self.policy.reevaluate([s.flow for s in states], ctx)
        # a per-flow policy may decide flows it was not passed (a pruned request's others)
        passed = {s.flow.flow_id for s in states} if self._per_flow and changed else None
        for flow_id, decision in changed.items():
            target = self.active.get(flow_id)
            if target is not None:
                self._check_level(decision)
                if passed is not None and flow_id not in passed:
                    states.append(target)  # its timer is re-armed below
                self._decide(target, decision)
        if self._next_change is not None:
            ctx = self._context()
            for state in states:
                if state.flow.flow_id in self.active:
                    self._arm_due(state, ctx)

    @staticmethod
    def _mark_progress(state: ActiveFlow, now: float) -> None:
        remaining = state.remaining - state.rate * (now - state.t_mark)
        state.remaining, state.t_mark = (remaining if remaining > 0 else 0.0), now
        state.flow.sent = int(state.flow.size or 0) - math.ceil(state.remaining)

    def _check_level(self, decision: Decision) -> None:
        if not 0 <= decision.level < self.policy.num_levels:
            raise ValueError(
                f"policy {self.policy.name!r} returned level {decision.level} outside "
                f"0..{self.policy.num_levels - 1}"
            )

    def _decide(self, state: ActiveFlow, decision: Decision) -> None:
        """Apply ``decision`` now if at a message boundary, else at the next one."""
        if decision.level == state.level and decision.rate == state.cap:
            if state.pending is not None:  # withdrawn: the flow stays where it is
                state.pending, state.target = None, 0.0
                state.flow.level = state.level
                self._reschedule(state)
            return
        chunk = self.config.chunk_bytes
        size = float(state.flow.size or 0)
        sent = size - state.remaining
        boundary = math.ceil((sent - _BYTE_EPS) / chunk) * chunk if chunk > 0 else sent
        if boundary <= sent + _BYTE_EPS:
            self._apply(state, decision)
            return
        state.pending = decision
        state.target = max(size - boundary, 0.0)
        # the decided level, as the coordinator records it when it sends the change: the policy
        # then sees a withdrawal (back to the applied level) as a change, which clears the
        # pending decision above instead of leaving it to apply at the boundary
        state.flow.level = decision.level
        self._reschedule(state)

    def _apply(self, state: ActiveFlow, decision: Decision) -> None:
        old_queue = state.queue
        if self._record_changes:
            state.changes_at.append(float(state.flow.size or 0) - state.remaining)
        state.pending = None
        state.target = 0.0
        state.level, state.cap = decision.level, decision.rate
        state.queue = self._queue(decision.level)
        state.flow.level = decision.level
        self._touch(state.links, min(old_queue, state.queue))
        self._reschedule(state)
        if self._next_change is not None and state.flow.flow_id in self.active:
            self._arm_due(state, self._context())

    # ----------------------------------------------------------------- rates
    def _touch(self, links: tuple[int, ...], queue: int) -> None:
        self._dirty.update(links)
        self._dirty_level = min(self._dirty_level, queue)

    def _materialize(self, state: ActiveFlow) -> None:
        if state.t_mark != self.now:
            state.remaining = max(state.remaining - state.rate * (self.now - state.t_mark), 0.0)
            state.t_mark = self.now

    def _reschedule(self, state: ActiveFlow) -> None:
        state.version += 1
        if state.rate > 0:
            when = self.now + max(state.remaining - state.target, 0.0) / state.rate
            self._push(when, _FLOW, state, state.version)

    def _component(self) -> tuple[list[ActiveFlow], set[int]]:
        """Flows at queue >= the dirty queue connected to the dirty links, and their links."""
        level = self._dirty_level
        links, flows = set(self._dirty), {}
        stack = list(self._dirty)
        while stack:
            for flow_id, state in self._on_link[stack.pop()].items():
                if state.queue >= level and flow_id not in flows:
                    flows[flow_id] = state
                    for other in state.links:
                        if other not in links:
                            links.add(other)
                            stack.append(other)
        return list(flows.values()), links

    def _flush(self) -> None:
        """Recompute the rates that the events of this instant may have changed."""
        if not self._dirty:
            return
        level = self._dirty_level
        flows, links = self._component()
        self._dirty.clear()
        self._dirty_level = math.inf
        residual = self._residual(links, level)
        old = [s.rate for s in flows]
        allocate_levels(flows, [s.queue for s in flows], residual)
        now = self.now
        for state, rate in zip(flows, old, strict=True):
            if state.rate != rate:
                # progress up to now happened at the old rate
                if state.t_mark != now:
                    state.remaining = max(state.remaining - rate * (now - state.t_mark), 0.0)
                    state.t_mark = now
                self._reschedule(state)
        self._update_link_rates(links)
        if self.observer is not None:
            self.observer(self)

    def _residual(self, links: set[int], level: float) -> dict[int, float]:
        residual = {}
        for link in links:
            used = sum(s.rate for s in self._on_link[link].values() if s.queue < level)
            residual[link] = max(self.capacity[link] - used, 0.0)
        return residual

    def _update_link_rates(self, links: set[int]) -> None:
        for link in links:
            self._fold_ewma(link)
            self._link_rate[link] = sum(s.rate for s in self._on_link[link].values())

    def _fold_ewma(self, link: int) -> None:
        self._ewma[link] = self._ewma_value(link)
        self._ewma_t[link] = self.now

    def _ewma_value(self, link: int) -> float:
        dt = self.now - self._ewma_t[link]
        util = self._link_rate[link] / self.capacity[link] if self.capacity[link] > 0 else 0.0
        keep = math.exp(-dt / self.config.load_tau) if self.config.load_tau > 0 else 0.0
        return self._ewma[link] * keep + util * (1.0 - keep)

    # ----------------------------------------------------------------- inspection
    def link_utilization(self, name: str) -> float:
        """Current utilization (0..1) of link ``name``."""
        link = self._link_index[name]
        return self._link_rate[link] / self.capacity[link]

    def link_load(self, name: str) -> float:
        """EWMA utilization of link ``name`` (what ``Context.link_load`` reports)."""
        return self._ewma_value(self._link_index[name])

    def link_id(self, name: str) -> int:
        """Internal index of link ``name``."""
        return self._link_index[name]

    def flows_on(self, name: str) -> list[ActiveFlow]:
        """Active flows crossing link ``name``."""
        return list(self._on_link[self._link_index[name]].values())


class _LoadView(Mapping[str, float]):
    """Lazy ``link name -> EWMA utilization`` mapping handed to policies in ``Context``."""

    def __init__(self, sim: Simulator) -> None:
        self._sim = sim
        self._cache: dict[str, float] = {}  # one view lives for one instant

    def __getitem__(self, name: str) -> float:
        value = self._cache.get(name)
        if value is None:
            value = self._sim._ewma_value(self._sim._link_index[name])
            self._cache[name] = value
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._sim.link_names)

    def __len__(self) -> int:
        return len(self._sim.link_names)
