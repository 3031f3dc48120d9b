"""The coordinator's cluster view: flow table, link loads, job progress, and policy driving.

Pure bookkeeping (no asyncio, no sockets, clock passed in). The service feeds it decoded
messages and, once per event-loop turn (or sooner: ``max_batch_delay``), calls
:meth:`ClusterState.flush` to run the policy on the flows touched since the last flush and
collect the level changes to send, per node.

Flow identity on the wire is ``(node, id)``; policies see cluster-unique ``Flow.flow_id`` values
that this table assigns. Which flows an event makes "dirty" (re-evaluated at the next flush):

* flow open: admitted at once (``policy.admit``), then dirty, with the flows the policy's
  optional ``linked_flows`` names (a request's flows whose MLU counts the new one's bytes;
  their timers are derived again);
* flow progress: that flow; with promotion timers and a policy that defines
  ``observe_progress`` (more bytes sent never brings its next change earlier), only the
  policy's measurements follow the bytes (``observe_progress``), and the flow is decided when
  its timer comes;
* flow close: the flows the policy's optional ``released_affects`` names (with per-flow
  decisions), else the remaining flows of the same job; the next flush calls the policy even
  when none is left;
* job progress: the flows of that job;
* NIC load: the flows crossing the reported links;
* the periodic timer tick (:meth:`ClusterState.start_sweep`), for the flows whose urgency
  changes with time alone: with ``promotion="timers"`` (default, for policies that define
  ``next_change``) only the flows whose promotion time has come, kept in a heap of
  ``(time, flow)``; with ``"sweep"`` (the baseline) every flow with a deadline.

Policies whose decisions depend on other flows (rank-based ones such as EDF) must see every
flow at once: unless the policy sets ``per_flow_decisions = True``, a flush re-evaluates all
flows whenever anything is dirty or a flow closed. A per-flow policy may also return decisions
for flows it was not passed (rmlq pruning a request moves its other flows): they are applied,
timers included.

A policy that raises on a flow does not take the others down with it: the flow is quarantined
(logged with its node and wire id, counted in ``Stats.policy_errors``, kept at its level) and
the rest of the batch is decided and sent. A quarantined flow is tried again after
:data:`QUARANTINE_RETRY_FIRST` seconds, twice as long after each further failure up to
:data:`QUARANTINE_RETRY_MAX`, and from the first again once it went that long without one
(NCCL's connections live as long as their job: a fault that passes must not pin one for that
long). These waits are pure delays, kept on the monotonic clock (``mono_clock``): a wall
clock stepped back must not hold a flow in quarantine for as long. Each node
may have at most ``max_flows_per_node`` flows open; opens beyond that are refused (counted in
``Stats.refused_opens``, returned by :meth:`ClusterState.open_flows`), so that one agent cannot
grow the table without bound. What its flows name is bounded too (:class:`NodeNames`): each
name is kept once per node however many of its flows repeat it, and a node's flows may name at
most ``max_link_names_per_node`` distinct links, :data:`LINKS_PER_FLOW` links per allowed flow
in all, and :data:`MAX_JOBS_PER_NODE` distinct jobs; an open beyond is refused likewise (also
counted in ``Stats.refused_for_names``). A real node's flows name their node's egress and
their peers' ingress links (1-3 each) and the few jobs it runs: only a hostile agent meets them.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from flowsched.coordinator.histogram import DeadlineSlack
from flowsched.lograte import RepeatLog
from flowsched.model import Context, Decision, Flow, FlowClass
from flowsched.policies.base import Policy
from flowsched.policies.common import MIN_BANDWIDTH
from flowsched.protocol import (
    RESYNC_FRAME_OPENS,
    FlowClose,
    FlowOpen,
    JobProgress,
    LevelUpdate,
    NicLoadEntry,
)

log = logging.getLogger("flowsched.coordinator")

#: Most flows of the timer sweep evaluated between two checks of its time budget (a step is
#: sized to what the budget left allows at the last step's cost per flow).
SWEEP_STEP = 32
#: open flows one node may have by default: a real node has tens (bench/coordinator_load.py
#: models 1,000 agents x 10-20 flows; the SDK caps one client at 4,096), so only a runaway or
#: hostile agent meets it (docs/security.md)
MAX_FLOWS_PER_NODE = 65536
#: distinct link names one node's flows may name by default: its egress and the ingress of
#: every other node a coordinator serves (CoordinatorConfig.max_connections, 16,384)
MAX_LINK_NAMES_PER_NODE = 16385
#: links a node's flows may name in all, per flow it may have open (a real flow names 1-3; one
#: flow may still name up to MAX_LINKS, 64, while its node has room)
LINKS_PER_FLOW = 4
#: job names one node may have reported at once (its agent keeps as many, see
#: flowsched.agent.flows.MAX_JOBS); beyond it the node's least recently updated is forgotten
#: (the service's job index). Also the distinct jobs one node's open flows may name.
MAX_JOBS_PER_NODE = 4096
#: seconds a quarantined flow waits before the policy is tried on it again; each further
#: failure of the same flow doubles the wait, up to QUARANTINE_RETRY_MAX
QUARANTINE_RETRY_FIRST = 1.0
QUARANTINE_RETRY_MAX = 300.0


def node_links(node: str) -> tuple[str, str]:
    """The links ``node``'s agent reports the load of: its egress ``<node>:tx`` and its
    ingress ``<node>:rx`` (flowsched.agent.nic)."""
    return f"{node}:tx", f"{node}:rx"


class SharedNames:
    """One copy of each name (link, job or request) some flows use, with how many use it: a
    name that every flow of a node repeats is kept once, not once per flow."""

    __slots__ = ("copies", "uses")

    def __init__(self) -> None:
        self.copies: dict[str, str] = {}
        self.uses: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.uses)

    def take(self, name: str) -> str:
        """The kept copy of ``name`` (``name`` itself if new), now used once more."""
        kept = self.copies.get(name)
        if kept is None:
            self.copies[name] = name
            self.uses[name] = 1
            return name
        self.uses[kept] += 1
        return kept

    def drop(self, name: str) -> None:
        """``name`` is used once less; forgotten when no flow uses it."""
        left = self.uses[name] - 1
        if left:
            self.uses[name] = left
        else:
            del self.uses[name]
            del self.copies[name]

    def new_among(self, names: Iterable[str]) -> int:
        """How many distinct names of ``names`` are not kept yet."""
        return len({name for name in names if name not in self.copies})


class NodeNames:
    """What one node's open flows name: its links, jobs and requests (each kept once), and
    how many links they name in all."""

    __slots__ = ("jobs", "link_uses", "links", "requests")

    def __init__(self) -> None:
        self.links = SharedNames()
        self.jobs = SharedNames()
        self.requests = SharedNames()
        self.link_uses = 0

    def __bool__(self) -> bool:
        return bool(self.links or self.jobs or self.requests)


@dataclass(slots=True)
class SplitResync:
    """A node's resync that may go on in ``flows`` frames (its ``resync`` frame was full)."""

    #: wire ids of the node's flows no frame of the resync named yet: kept, with their state,
    #: until the resync ends (:meth:`ClusterState.end_resync`), then dropped
    unnamed: set[int]
    #: whether the flows' re-evaluation waits for settle_resyncs() (see ClusterState.resync)
    defer: bool
    #: opens of new flows that found the node at ``max_flows_per_node`` while the unnamed
    #: flows still counted: admitted (or refused) once those are gone (end_resync). Refused at
    #: once, a live flow would stay unmanaged until the next resync (the agent never reports it
    #: again), kept out by a flow the agent closed while away. At most as many as there are
    #: unnamed flows (only their going makes room): the cap still bounds the memory
    held: list[FlowOpen]


@dataclass(slots=True)
class Stats:
    """Counters kept on the hot paths as plain integers; exported at scrape time."""

    events: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    level_updates: int = 0
    promotions: int = 0
    flushes: int = 0
    evaluations: int = 0
    sweeps: int = 0
    #: flows re-evaluated because their promotion timer came due
    timer_fires: int = 0
    #: timer ticks that found the previous sweep unfinished (the effective period stretched)
    sweep_overruns: int = 0
    #: flow opens refused because their node had max_flows_per_node flows open, or because
    #: of what they named (refused_for_names)
    refused_opens: int = 0
    #: flow opens refused because their node's flows would name too many distinct links or
    #: jobs, or too many links in all (see NodeNames)
    refused_for_names: int = 0
    #: flows the policy raised on (each quarantined: see the module docstring)
    policy_errors: int = 0
    completed: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    slack: DeadlineSlack = field(default_factory=DeadlineSlack)

    @property
    def slack_counts(self) -> list[int]:
        """Closed deadline flows per lateness bucket, then per earliness bucket."""
        return self.slack.counts


class ClusterState:
    """All flows of the cluster, keyed internally by a cluster-unique id.

    Args:
        policy: the one policy object of the coordinator.
        default_bandwidth: B for links no agent has reported (bytes/s).
        per_flow: whether the policy decides each flow independently of the others (None:
            the policy's ``per_flow_decisions`` attribute, default False).
        clock: measures the timer sweep's time budget (see :meth:`flush`).
        mono_clock: CLOCK_MONOTONIC in nanoseconds, stamped with the wall-clock ``now`` on
            every level update as its decision time (``LevelUpdate.decided_ns`` /
            ``decided_at``); quarantine retries are timed on it.
        promotion: ``"timers"`` (re-evaluate a flow when the time the policy's
            ``next_change`` gave comes; "sweep" for policies without it) or ``"sweep"``
            (every timer tick queues every flow with a deadline).
        max_flows_per_node: open flows one node may have; its opens beyond are refused.
        max_link_names_per_node: distinct links one node's open flows may name; an open that
            would name more is refused (and one that would bring the node's link names in all
            past :data:`LINKS_PER_FLOW` per allowed flow).
    """

    def __init__(
        self,
        policy: Policy,
        default_bandwidth: float = 25e9,
        per_flow: bool | None = None,
        clock: Callable[[], float] = time.perf_counter,
        mono_clock: Callable[[], int] = time.monotonic_ns,
        promotion: str = "timers",
        max_flows_per_node: int = MAX_FLOWS_PER_NODE,
        max_link_names_per_node: int = MAX_LINK_NAMES_PER_NODE,
    ) -> None:
        if promotion not in ("timers", "sweep"):
            raise ValueError(f"promotion: expected 'timers' or 'sweep', got {promotion!r}")
        self.policy = policy
        self.max_flows_per_node = max_flows_per_node
        self.max_link_names_per_node = max_link_names_per_node
        self.max_link_uses_per_node = LINKS_PER_FLOW * max_flows_per_node
        #: what each node's open flows name (see NodeNames)
        self.node_names: dict[str, NodeNames] = {}
        next_change = getattr(policy, "next_change", None) if promotion == "timers" else None
        #: the policy's next_change, or None when promotions are swept
        self._next_change: Callable[[Flow, Context], float | None] | None = next_change
        self.promotion = "timers" if next_change is not None else "sweep"
        if per_flow is None:
            per_flow = bool(getattr(policy, "per_flow_decisions", False))
        self.per_flow = per_flow
        observe = getattr(policy, "observe_progress", None)
        #: the policy's observe_progress when progress reports need no decision (per-flow
        #: policy with timers), else None: a reported flow is re-evaluated
        self._observe: Callable[[Iterable[Flow], Context], Mapping[int, Decision]] | None = (
            observe if next_change is not None and per_flow else None
        )
        #: the policy's linked_flows (flows another flow's opening may promote), or None
        self._linked: Callable[[Flow], Iterable[int]] | None = getattr(policy, "linked_flows", None)
        #: the policy's released_affects (flows a flow's close may change), used with per-flow
        #: decisions (otherwise every flow is evaluated anyway), or None: the rest of the job
        self._released_affects: Callable[[Flow], Iterable[int] | None] | None = (
            getattr(policy, "released_affects", None) if per_flow else None
        )
        #: promotion timers: a heap of (due time, flow id); _due_at holds each flow's live entry
        #: (entries that no longer match it are skipped when they surface)
        self._timers: list[tuple[float, int]] = []
        self._due_at: dict[int, float] = {}
        self._clock = clock
        self._mono_clock = mono_clock
        #: (wall, monotonic ns) of the decision being made (stamped on queued level updates)
        self._decided: tuple[float, int] = (0.0, 0)
        self.flows: dict[int, Flow] = {}
        self.origin: dict[int, tuple[str, int]] = {}
        self.by_node: dict[str, dict[int, int]] = {}
        self.by_job: dict[str, set[int]] = defaultdict(set)
        self.by_link: dict[str, set[int]] = defaultdict(set)
        self.job_index: dict[str, int] = {}
        self.link_bandwidth: dict[str, float] = {}
        self.link_load: dict[str, float] = {}
        self.default_bandwidth = default_bandwidth
        self._context: Context | None = None  # the last context(), for its instant
        self.dirty: set[int] = set()
        #: a flow closed since the last flush: the next flush calls the policy even without a
        #: dirty flow, so that what a release decides unasked (rmlq's Algorithm 1 pruning
        #: another request) is not held until the next event, and a policy that ranks every
        #: flow (edf, llf) ranks them again without the closed one
        self._closed_since_flush = False
        #: flows with progress reports since the last flush (see ``_observe``)
        self.progressed: set[int] = set()
        #: resynced flows whose re-evaluation waits for settle_resyncs()
        self.resynced: set[int] = set()
        #: nodes whose resync may go on in further frames (see resync)
        self.split_resyncs: dict[str, SplitResync] = {}
        #: flows re-evaluated by the last flush
        self.last_batch = 0
        self.timed: set[int] = set()
        self._sweep: set[int] = set()
        self._sweep_cost = 0.0
        #: clock time per flow of the last sweep step (0 before the first): sizes the next step
        self._flow_cost = 0.0
        #: clock time the last complete timer sweep took (its steps added up)
        self.last_sweep_cost = 0.0
        self.outbox: dict[str, dict[int, LevelUpdate]] = {}
        self.rates: dict[int, float] = {}
        #: flows the policy ever gave a rate (pacing policies: karuna): a resync re-sends
        #: their rate, which the agent's resync does not report (see _refresh)
        self._rated: set[int] = set()
        self.stats = Stats()
        self._ids = itertools.count(1)
        #: flows the policy raised on: kept at their level until their retry (_retries)
        self.quarantined: set[int] = set()
        #: (monotonic ns, flow) at which a quarantined flow is tried again (a heap)
        self._retries: list[tuple[int, int]] = []
        #: how often the policy raised on a flow (its next retry waits 2**(n-1) times longer)
        self._strikes: dict[int, int] = {}
        #: quarantined flows the policy's admit raised on: admitted again at their retry
        self._unadmitted: set[int] = set()
        #: when each flow with strikes was last released from quarantine (monotonic ns): a
        #: flow that then went QUARANTINE_RETRY_MAX without raising starts its strikes afresh
        self._released_at: dict[int, int] = {}
        self._repeat_log = RepeatLog(log)

    def context(self, now: float) -> Context:
        """The policy's view of the cluster at ``now`` (shares the live dicts, no copies; the
        same object for the same instant: a frame's events and a flush's steps share one)."""
        ctx = self._context
        if ctx is None or ctx.now != now:
            ctx = self._context = Context(
                now, self.job_index, self.link_bandwidth, self.link_load, self.default_bandwidth
            )
        return ctx

    # -- events ------------------------------------------------------------------------------

    def open_flows(
        self,
        node: str,
        opens: Iterable[FlowOpen],
        now: float,
        kind: str = "open",
        held: list[FlowOpen] | None = None,
        hold_max: int = 0,
    ) -> int:
        """Admit newly opened flows of ``node`` (a re-sent open of a known flow is an update).

        Returns how many new flows were refused: ``node`` had ``max_flows_per_node`` open,
        or their names would pass its bounds (:class:`NodeNames`; counted in
        ``Stats.refused_for_names`` too). With ``held``, a new flow past the flow cap goes
        there instead, undecided and uncounted, while it holds fewer than ``hold_max`` (a split
        resync's, see :class:`SplitResync`).
        """
        self._stamp(now)
        ctx = self.context(now)
        table = self.by_node.setdefault(node, {})
        names = self.node_names.get(node)
        if names is None:
            names = self.node_names[node] = NodeNames()
        events = self.stats.events
        cap, refused, for_names = self.max_flows_per_node, 0, 0
        for op in opens:
            known = table.get(op.id)
            if known is None and held is not None and len(table) >= cap and len(held) < hold_max:
                held.append(op)
                continue
            events[kind] += 1
            if known is not None:
                self._refresh(known, op, resync=kind == "resync_flow")
            elif len(table) >= cap:
                refused += 1
            elif not self._names_fit(names, op):
                refused += 1
                for_names += 1
            else:
                self._admit(node, table, op, ctx, names)
        if refused:
            self.stats.refused_opens += refused
            self.stats.refused_for_names += for_names
        return refused

    def _names_fit(self, names: NodeNames, op: FlowOpen) -> bool:
        """Whether ``op``'s names stay within its node's bounds (see :class:`NodeNames`)."""
        if names.link_uses + len(op.links) > self.max_link_uses_per_node:
            return False
        if len(names.links) + names.links.new_among(op.links) > self.max_link_names_per_node:
            return False
        job = op.job
        return job is None or job in names.jobs.copies or len(names.jobs) < MAX_JOBS_PER_NODE

    def _admit(
        self, node: str, table: dict[int, int], op: FlowOpen, ctx: Context, names: NodeNames
    ) -> None:
        fid = next(self._ids)
        # the node's kept copy of each name: a name its flows repeat costs nothing more
        links = tuple([names.links.take(link) for link in op.links])
        names.link_uses += len(links)
        job = None if op.job is None else names.jobs.take(op.job)
        request = None if op.request is None else names.requests.take(op.request)
        flow = Flow(
            fid, op.cls, op.opened_at, op.size, op.sent, op.deadline, job,
            op.consumer_index, request, links, node,
        )  # fmt: skip
        table[op.id] = fid
        self.flows[fid] = flow
        self.origin[fid] = (node, op.id)
        if job is not None:
            self.by_job[job].add(fid)
        if op.deadline is not None:
            self.timed.add(fid)
        for link in links:
            self.by_link[link].add(fid)
        # the agent's current level (resync) is what it applies now: send only differences
        flow.level = -1 if op.level is None else op.level
        self._try_admit(flow, ctx)

    def _try_admit(self, flow: Flow, ctx: Context) -> None:
        """The policy's admit of ``flow``, applied; its linked flows re-evaluated. A flow the
        policy raises on keeps the agent's level, quarantined (see _release_quarantined)."""
        fid = flow.flow_id
        try:
            decision = self.policy.admit(flow, ctx)
            linked = self._linked(flow) if self._linked is not None else ()
        except Exception as exc:  # the agent keeps its own level for it
            self._quarantine(flow, "admit", exc)
            self._unadmitted.add(fid)
            return
        self._unadmitted.discard(fid)
        self._apply(fid, flow, decision, count_promotion=False)
        self.dirty.add(fid)  # evaluated (and its timer set) at the next flush
        for other in linked:
            if other in self.flows:
                self._due_at.pop(other, None)  # its timer may now come too late
                self.dirty.add(other)

    def _refresh(self, fid: int, op: FlowOpen, *, resync: bool = False) -> None:
        flow = self.flows[fid]
        self._due_at.pop(fid, None)  # re-derive its timer at the next evaluation
        flow.sent = max(flow.sent, op.sent)
        if (op.level != flow.level and flow.level >= 0) or (resync and fid in self._rated):
            # the agent applies something else, or no level at all (the update that carried
            # ours was lost with a previous connection): tell it ours again. A resync carries
            # no rate: a flow we ever gave one gets its rate again (the update may have been
            # lost likewise, or dropped while the agent was away), its level with it
            self._queue(fid, flow)
        self.dirty.add(fid)

    def progress(self, node: str, ids: Sequence[int], sent: Sequence[int]) -> None:
        """Record bytes sent: flow ``ids[i]`` of ``node`` has sent ``sent[i]`` bytes (a
        :class:`~flowsched.protocol.Flows` frame's ``progress_ids`` and ``progress_sent``).
        Unknown ids are ignored (the open may have been dropped).

        Raises:
            ValueError: ``ids`` and ``sent`` differ in length.
        """
        if len(ids) != len(sent):
            raise ValueError(f"progress: {len(ids)} ids but {len(sent)} byte counts")
        table = self.by_node.get(node, {})
        flows = self.flows
        dirty = self.dirty if self._observe is None else self.progressed
        for wire_id, sent_now in zip(ids, sent, strict=False):  # lengths checked above
            fid = table.get(wire_id)
            if fid is not None:
                flow = flows[fid]
                if sent_now > flow.sent:
                    flow.sent = sent_now
                dirty.add(fid)
        self.stats.events["progress"] += len(ids)

    def close_flows(self, node: str, closes: Iterable[FlowClose], now: float) -> None:
        """Forget closed flows, recording whether each met its deadline; the flows each close
        may change become dirty (the policy's ``released_affects``, else the rest of its job)."""
        table = self.by_node.get(node, {})
        ctx = self.context(now)
        jobs: set[str] = set()
        for close in closes:
            self.stats.events["close"] += 1
            fid = table.pop(close.id, None)
            if fid is not None:
                flow = self._remove(fid, ctx)
                flow.sent = max(flow.sent, close.sent)
                self._record_completion(flow, close.closed_at)
                self._mark_released(flow, jobs)
        # each job's remaining flows once per frame, not once per close (k closes of a job of
        # n flows would cost k * n)
        for job in jobs:
            self.dirty.update(self.by_job.get(job, ()))

    def _mark_released(self, flow: Flow, jobs: set[str]) -> None:
        """A flow gone (closed or dropped, removed already): the flows its going may change
        become dirty, those the policy names, else its job's (added to ``jobs``, for the
        caller to mark once for all its flows)."""
        self._closed_since_flush = True
        affected = self._affected_by_release(flow)
        if affected is not None:
            self.dirty.update(other for other in affected if other in self.flows)
        elif flow.job is not None:
            jobs.add(flow.job)

    def _affected_by_release(self, flow: Flow) -> Iterable[int] | None:
        """The policy's ``released_affects`` for ``flow`` (released already); None: the rest
        of its job (no such hook, or it raised: counted and logged like any policy error)."""
        if self._released_affects is None:
            return None
        try:
            return self._released_affects(flow)
        except Exception as exc:
            self.stats.policy_errors += 1
            self._repeat_log.log(
                "policy_error", logging.ERROR, "policy released_affects raised on flow %d of "
                "node %s: the rest of its job is re-evaluated", flow.flow_id, flow.node,
                exc_info=exc,
            )  # fmt: skip
            return None

    def job_progress(self, report: JobProgress) -> None:
        """Job ``report.job`` reached a step: its flows' RLI changes.

        ``job_index[job]`` holds the step; when a layer is given it is also published as
        ``job_index[f"{job}/layer"]`` for layer-indexed flows (``kv_reuse``). A ``done``
        report removes the job (what the simulator does when a batch's prefill ends: rmlq
        stops holding its P2D below the collectives).
        """
        self.stats.events["job_progress"] += 1
        if report.done:
            self.forget_job(report.job)
            return
        self.job_index[report.job] = report.step
        if report.layer is not None:
            self.job_index[f"{report.job}/layer"] = report.layer
        self.dirty.update(self.by_job.get(report.job, ()))

    def forget_job(self, job: str) -> None:
        """Drop ``job`` from the job index (it ended, or expired); its flows are re-evaluated."""
        self.job_index.pop(job, None)
        self.job_index.pop(f"{job}/layer", None)
        self.dirty.update(self.by_job.get(job, ()))

    def nic_load(self, entries: Iterable[NicLoadEntry]) -> None:
        """Update link capacities and loads (rho); flows on changed links become dirty.

        A capacity below :data:`~flowsched.policies.common.MIN_BANDWIDTH` (1 byte/s; the
        protocol allows 0) is stored as that floor. Which node may report which link is the
        service's check (:func:`node_links`)."""
        changed: set[str] = set()
        for entry in entries:
            self.stats.events["nic_load"] += 1
            old = self.link_load.get(entry.link)
            self.link_bandwidth[entry.link] = max(entry.bandwidth, MIN_BANDWIDTH)
            self.link_load[entry.link] = entry.load
            if old != entry.load:
                changed.add(entry.link)
        for link in changed:  # a link's flows once, however many entries name it
            self.dirty.update(self.by_link.get(link, ()))

    def resync(
        self, node: str, opens: tuple[FlowOpen, ...], now: float, *, defer: bool = False
    ) -> int:
        """Replace ``node``'s flow set by ``opens`` (its complete set after a (re)connect).

        Known flows keep their state; the agent is sent our level of each where the level it
        reports differs, and our rate of each flow the policy ever gave one (a resync reports
        no rates). New flows get their admission decision at once. With ``defer``, the policy's
        re-evaluation of these flows waits for :meth:`settle_resyncs`: a new leader absorbs
        the resyncs of every agent at once, and one re-evaluation of the whole burst costs far
        less than one per event-loop turn (``bench/takeover.py``). Returns how many flows were
        refused (see :meth:`open_flows`).

        A resync of :data:`~flowsched.protocol.RESYNC_FRAME_OPENS` opens or more may go on in
        ``flows`` frames of opens alone (an agent's flow set larger than one frame): then the
        node's flows it does not name stay until :meth:`end_resync`, and a flow that
        :meth:`continue_resync` names meanwhile keeps its state (id, strikes, rate, the
        policy's view) instead of being dropped and admitted anew. A new flow that finds the
        node at ``max_flows_per_node`` meanwhile waits for the end too (:class:`SplitResync`).
        """
        self.stats.events["resync"] += 1
        current = {op.id for op in opens}
        table = self.by_node.get(node, {})
        unnamed = [wire_id for wire_id in table if wire_id not in current]
        self.split_resyncs.pop(node, None)  # a new resync ends one still open (a reconnect)
        if len(opens) >= RESYNC_FRAME_OPENS:
            self.split_resyncs[node] = SplitResync(set(unnamed), defer, [])
        elif unnamed:
            self._drop([table.pop(wire_id) for wire_id in unnamed], self.context(now))
        self.outbox.pop(node, None)  # updates queued for the old connection are stale
        return self._resync_opens(node, opens, now, defer)

    def continue_resync(self, node: str, opens: tuple[FlowOpen, ...], now: float) -> int:
        """More of ``node``'s split resync (a ``flows`` frame of opens alone that follows it,
        see :meth:`resync`). Returns how many flows were refused.

        Raises:
            KeyError: ``node`` has no resync going on (:attr:`split_resyncs`).
        """
        split = self.split_resyncs[node]
        split.unnamed.difference_update(op.id for op in opens)
        return self._resync_opens(node, opens, now, split.defer)

    def end_resync(self, node: str, now: float) -> int:
        """``node``'s split resync is complete (a frame other than its continuation came):
        drop the flows none of its frames named, then admit the new flows they kept past the
        cap (:attr:`SplitResync.held`). Returns how many of those were refused all the same;
        0, and nothing done, when no resync is going on."""
        split = self.split_resyncs.pop(node, None)
        if split is None:
            return 0
        table = self.by_node.get(node, {})
        if split.unnamed:
            # (a flow closed meanwhile is gone from the table already)
            gone = [table.pop(wire_id, None) for wire_id in split.unnamed]
            self._drop([fid for fid in gone if fid is not None], self.context(now))
        if not split.held:
            return 0
        # not deferred: the settle of the resync burst may be over, and these are few
        return self.open_flows(node, split.held, now, kind="resync_flow")

    def _resync_opens(self, node: str, opens: tuple[FlowOpen, ...], now: float, defer: bool) -> int:
        split = self.split_resyncs.get(node)
        held, hold_max = (split.held, len(split.unnamed)) if split is not None else (None, 0)
        refused = self.open_flows(
            node, opens, now, kind="resync_flow", held=held, hold_max=hold_max
        )
        if defer:
            table = self.by_node[node]  # created by open_flows for a new node
            resynced = [fid for op in opens if (fid := table.get(op.id)) is not None]
            self.dirty.difference_update(resynced)
            self.resynced.update(resynced)
        return refused

    def settle_resyncs(self) -> None:
        """Queue the flows of deferred resyncs for the next flush (see :meth:`resync`)."""
        self.dirty.update(fid for fid in self.resynced if fid in self.flows)
        self.resynced.clear()

    def drop_node(self, node: str, now: float) -> None:
        """Forget every flow of ``node`` and the loads of its links (its agent stayed away past
        the grace period): a link nobody reports has the default bandwidth and no load, and the
        flows left on its links (other nodes' flows to it) are re-evaluated."""
        self._drop(list(self.by_node.pop(node, {}).values()), self.context(now))
        self.split_resyncs.pop(node, None)
        self.outbox.pop(node, None)
        self.node_names.pop(node, None)
        for link in node_links(node):
            bandwidth = self.link_bandwidth.pop(link, None)
            if self.link_load.pop(link, None) is not None or bandwidth is not None:
                self.dirty.update(self.by_link.get(link, ()))

    def start_sweep(self, now: float | None = None) -> bool:
        """The periodic timer tick: queue the flows due for re-evaluation.

        With promotion timers: the flows whose timer is at or before ``now`` (default: the
        wall clock), a heap peek when none is. With sweeps: every flow with a deadline.
        Either way the quarantined flows whose retry is due (monotonic clock) are released.
        Returns whether anything was queued; a sweep returns False, and changes nothing,
        while the previous one is unfinished (see :meth:`flush`): the effective period then
        stretches instead of starving flows.
        """
        now = time.time() if now is None else now
        released = self._release_quarantined(now)
        if self._next_change is not None:
            return self._take_due(now) or released
        if self._sweep:
            self.stats.sweep_overruns += 1
            return released
        self._sweep = set(self.flows if not self.per_flow else self.timed)
        self.stats.sweeps += 1
        return True

    def _take_due(self, now: float) -> bool:
        timers, due_at, sweep = self._timers, self._due_at, self._sweep
        before = len(sweep)
        while timers and timers[0][0] <= now:
            when, fid = heapq.heappop(timers)
            if due_at.get(fid) == when:
                del due_at[fid]
                sweep.add(fid)
        fired = len(sweep) - before
        if fired:
            self.stats.sweeps += 1
            self.stats.timer_fires += fired
        return fired > 0

    def _release_quarantined(self, now: float) -> bool:
        """Take the quarantined flows whose retry is due out of quarantine: dirty (admitted
        again first if their admit raised), so the next flush tries the policy on them again.
        Returns whether any was.

        A policy that decides all flows together is first tried on the flow alone: were it
        still to raise, the whole table's pass would raise and be isolated flow by flow (one
        call per flow) at every retry."""
        retries, released = self._retries, False
        if not retries or retries[0][0] > self._mono_clock():
            return False  # nothing due (the timer tick's usual case)
        self._stamp(now)  # an admit's level, and a new failure's retry, count from now
        ctx, mono = self.context(now), self._decided[1]
        while retries and retries[0][0] <= mono:
            _, fid = heapq.heappop(retries)
            flow = self.flows.get(fid)
            if flow is None or fid not in self.quarantined:
                continue  # closed meanwhile
            self.quarantined.discard(fid)
            released = True
            if fid in self._unadmitted:
                self._undo_admit(flow, ctx)
                self._try_admit(flow, ctx)
            elif not self.per_flow:
                try:
                    self.policy.reevaluate([flow], ctx)  # a probe: its decisions are not used
                except Exception as exc:
                    self._quarantine(flow, "reevaluate", exc)
            if fid not in self.quarantined:
                self.dirty.add(fid)
                self._released_at[fid] = mono
        return released

    def _undo_admit(self, flow: Flow, ctx: Context) -> None:
        """Release what a raising admit of ``flow`` may have registered in the policy before
        it raised, so that admitting it again counts it once (rmlq counts a request's flows)."""
        try:
            self.policy.release(flow, ctx)
        except Exception as exc:  # it raised on the partial state: admit it anyway
            self._repeat_log.log(
                "policy_error", logging.ERROR,
                "policy release raised on flow %d of node %s before its admit was retried",
                self.origin[flow.flow_id][1], flow.node, exc_info=exc,
            )  # fmt: skip

    def next_due(self) -> float | None:
        """The earliest promotion timer (the policy's clock: wall-clock time), or None."""
        while self._timers and self._due_at.get(self._timers[0][1]) != self._timers[0][0]:
            heapq.heappop(self._timers)  # stale
        return self._timers[0][0] if self._timers else None

    def next_retry(self) -> float | None:
        """The earliest quarantine retry (``mono_clock``'s time, in seconds), or None."""
        while self._retries and self._retries[0][1] not in self.quarantined:
            heapq.heappop(self._retries)  # its flow closed
        return self._retries[0][0] / 1e9 if self._retries else None

    @property
    def pending(self) -> bool:
        """Whether a flush has work: dirty or progressed flows, an unfinished timer sweep, a
        close since the last flush (see ``_closed_since_flush``)."""
        return bool(self.dirty or self.progressed or self._sweep or self._closed_since_flush)

    # -- decisions ---------------------------------------------------------------------------

    def flush(
        self, now: float, sweep_budget: float | None = None
    ) -> dict[str, dict[int, LevelUpdate]]:
        """Run the policy on the dirty flows and return the level changes to send, per node.

        Args:
            now: wall-clock time for the policy.
            sweep_budget: with a per-flow policy, also advance the timer's sweep
                (:meth:`start_sweep`) for about this many seconds of the injected clock, in
                steps of :data:`SWEEP_STEP` flows, so that a timer tick never delays
                event-driven decisions by a whole pass; None finishes the sweep, 0 skips it.
        """
        self.stats.flushes += 1
        self._stamp(now)
        self.last_batch = 0
        batch, self.dirty = self.dirty, set()
        if self.progressed:
            self._observe_progress(batch, now)
        if not self.per_flow:
            if batch or self._sweep or self._closed_since_flush:
                self._sweep = set()
                self._evaluate(self.flows.keys(), now)
            self._closed_since_flush = False
        else:
            if batch or self._closed_since_flush:
                self._sweep -= batch  # evaluated now anyway: the sweep need not visit them
                self._evaluate(batch, now)
            self._closed_since_flush = False
            if self._sweep and sweep_budget != 0:
                self._advance_sweep(now, sweep_budget)
        outbox, self.outbox = self.outbox, {}
        return outbox

    def _observe_progress(self, batch: set[int], now: float) -> None:
        """Fold the progressed flows' bytes into the policy's measurements; apply what that
        decides (normally nothing). ``batch`` is passed too: re-evaluated next at the same
        instant, its bytes are measured together with the others'."""
        assert self._observe is not None
        progressed, self.progressed = self.progressed, set()
        flows = self.flows
        if batch:
            progressed |= batch
        if self.quarantined:
            progressed -= self.quarantined
        active = [flows[fid] for fid in progressed if fid in flows]
        ctx = self.context(now)
        try:
            changed = self._observe(active, ctx)
        except Exception:  # one flow's fault (found alone) or several's: see _isolate
            changed = self._isolate(self._observe, active, ctx, "observe_progress")
        if changed:
            for fid, decision in changed.items():
                flow = flows.get(fid)
                if flow is not None:
                    self._apply(fid, flow, decision, count_promotion=True)
            assert self._next_change is not None
            moved = [flows[fid] for fid in changed if fid in flows]
            self._arm(moved, changed, ctx)

    def _advance_sweep(self, now: float, budget: float | None) -> None:
        # Steps of at most SWEEP_STEP flows, each no larger than the budget left allows at the
        # last step's cost per flow: at ~50 us per rmlq evaluation in the live coordinator, a
        # fixed step of 32 overran a 0.25 ms budget eightfold, and every frame read in that
        # loop turn waited for it.
        clock = self._clock
        started = step_started = clock()
        stop = None if budget is None else started + budget
        sweep, flows = self._sweep, self.flows
        while sweep:
            size = SWEEP_STEP
            if stop is not None and self._flow_cost > 0:
                size = max(1, min(size, int((stop - step_started) / self._flow_cost)))
            step = [sweep.pop() for _ in range(min(size, len(sweep)))]
            self._evaluate([fid for fid in step if fid in flows], now)
            ended = clock()
            self._flow_cost = (ended - step_started) / len(step)
            if stop is not None and ended >= stop:
                break
            step_started = ended
        self._sweep_cost += clock() - started
        if not sweep:
            self.last_sweep_cost, self._sweep_cost = self._sweep_cost, 0.0

    def _evaluate(self, batch: Iterable[int], now: float) -> None:
        flows = self.flows
        if self.quarantined:
            batch = [fid for fid in batch if fid not in self.quarantined]
        active = [flows[fid] for fid in batch]
        self.last_batch += len(active)
        self.stats.evaluations += len(active)
        ctx = self.context(now)
        try:
            changed = self.policy.reevaluate(active, ctx)
        except Exception:
            changed = self._isolate(self.policy.reevaluate, active, ctx, "reevaluate")
            active = [flow for flow in active if flow.flow_id not in self.quarantined]
        for fid, decision in changed.items():
            flow = flows.get(fid)
            if flow is not None:
                self._apply(fid, flow, decision, count_promotion=True)
        if self._next_change is not None:
            self._arm(active + self._moved(active, changed), changed, ctx)

    def _moved(self, active: list[Flow], changed: Mapping[int, Decision]) -> list[Flow]:
        """Flows the policy decided without being passed them (a pruned request's others,
        see policies/base.py): their timers are re-armed like the evaluated flows'."""
        if not changed:
            return []
        passed = {flow.flow_id for flow in active}
        flows = self.flows
        return [flows[fid] for fid in changed if fid not in passed and fid in flows]

    def _arm(self, active: list[Flow], changed: Mapping[int, Decision], ctx: Context) -> None:
        """Set the promotion timer of each evaluated flow that has none or changed level.

        A pending timer stays valid while the level holds: progress only pushes a promotion
        later, and the policy's answer already assumes the fastest rise of the load (an early
        timer only costs an evaluation that changes nothing, and re-arms)."""
        next_change, due_at, timers = self._next_change, self._due_at, self._timers
        assert next_change is not None
        for flow in active:
            fid = flow.flow_id
            if fid in due_at and fid not in changed:
                continue
            try:
                when = next_change(flow, ctx)
            except Exception as exc:
                self._quarantine(flow, "next_change", exc)
                continue
            if when is None:
                due_at.pop(fid, None)
            elif due_at.get(fid) != when:
                due_at[fid] = when
                heapq.heappush(timers, (when, fid))
        if len(timers) > 2 * len(due_at) + 1024:  # drop the stale entries now and then
            self._timers = [(when, fid) for fid, when in due_at.items()]
            heapq.heapify(self._timers)

    def _isolate(
        self,
        decide: Callable[[Iterable[Flow], Context], Mapping[int, Decision]],
        active: list[Flow],
        ctx: Context,
        hook: str,
    ) -> Mapping[int, Decision]:
        """``decide`` (the policy's ``hook``) raised on ``active``: find the flows it raises on
        (each alone), quarantine them, and decide the others: a per-flow policy's answers for
        them alone stand; another policy decides them again together (without the culprits)."""
        changed: dict[int, Decision] = {}
        for flow in active:
            try:
                changed.update(decide([flow], ctx))
            except Exception as exc:
                self._quarantine(flow, hook, exc)
        if self.per_flow:
            return changed
        rest = [flow for flow in active if flow.flow_id not in self.quarantined]
        try:
            return decide(rest, ctx)
        except Exception as exc:  # no one flow's fault: these keep their levels this time
            self.stats.policy_errors += 1
            self._repeat_log.log(
                "policy_error", logging.ERROR,
                "policy %s failed on %d flows together (none alone): their levels stay",
                hook, len(rest), exc_info=exc,
            )  # fmt: skip
            return {}

    def _quarantine(self, flow: Flow, hook: str, exc: Exception) -> None:
        """The policy raised on ``flow``: it keeps its level and is not evaluated until its
        retry, 2**(n-1) x QUARANTINE_RETRY_FIRST seconds after its n-th failure (its node's
        reports, closes and the rest of the batch go on)."""
        fid = flow.flow_id
        if fid in self.quarantined:
            return  # a second hook raised in the same pass: one failure
        self.quarantined.add(fid)
        self.dirty.discard(fid)
        self.progressed.discard(fid)
        self._due_at.pop(fid, None)
        self.stats.policy_errors += 1
        mono = self._decided[1]  # a pure delay: on the monotonic clock
        strikes = self._strikes.get(fid, 0)
        if mono - self._released_at.get(fid, mono) >= QUARANTINE_RETRY_MAX * 1e9:
            strikes = 0  # it went that long without a fault: this one is a new one
        strikes = self._strikes[fid] = strikes + 1
        wait = min(QUARANTINE_RETRY_FIRST * 2.0 ** (strikes - 1), QUARANTINE_RETRY_MAX)
        heapq.heappush(self._retries, (mono + round(wait * 1e9), fid))
        node, wire_id = self.origin.get(fid, (flow.node, -1))
        self._repeat_log.log(
            "policy_error", logging.ERROR,
            "policy %s raised on flow %d of node %s (%s, links %s): the flow keeps level %d "
            "and is tried again in %.0f s", hook, wire_id, node, flow.cls.label, flow.links,
            flow.level, wait, exc_info=exc,
        )  # fmt: skip

    def _apply(self, fid: int, flow: Flow, decision: Decision, count_promotion: bool) -> None:
        rate_changed = decision.rate != self.rates.get(fid)
        if decision.level == flow.level and not rate_changed:
            return
        if count_promotion and 0 <= decision.level < flow.level:
            self.stats.promotions += 1
        flow.level = decision.level
        if rate_changed:
            if decision.rate is None:
                self.rates.pop(fid, None)
            else:
                self.rates[fid] = decision.rate
                self._rated.add(fid)
        self._queue(fid, flow)

    def _queue(self, fid: int, flow: Flow) -> None:
        node, wire_id = self.origin[fid]
        box = self.outbox.get(node)
        if box is None:
            box = self.outbox[node] = {}
        wall, mono = self._decided
        box[wire_id] = LevelUpdate(wire_id, flow.level, self.rates.get(fid), wall, mono)
        self.stats.level_updates += 1

    def _stamp(self, now: float) -> None:
        """Decisions from here on are made at ``now`` (wall) / the monotonic clock's now."""
        self._decided = (now, self._mono_clock())

    # -- removal and completion --------------------------------------------------------------

    def _remove(self, fid: int, ctx: Context) -> Flow:
        flow = self.flows.pop(fid)
        node, wire_id = self.origin.pop(fid)
        self.rates.pop(fid, None)
        self._rated.discard(fid)
        self.dirty.discard(fid)
        self.progressed.discard(fid)
        self.timed.discard(fid)
        self._due_at.pop(fid, None)
        if flow.job is not None:
            self._discard(self.by_job, flow.job, fid)
        for link in flow.links:
            self._discard(self.by_link, link, fid)
        self._forget_names(node, flow)
        if fid in self._strikes:
            self.quarantined.discard(fid)
            self._unadmitted.discard(fid)
            del self._strikes[fid]  # its retry, if pending, finds it gone
            self._released_at.pop(fid, None)
        try:
            self.policy.release(flow, ctx)
        except Exception as exc:  # the flow is gone from the table anyway
            self.stats.policy_errors += 1
            self._repeat_log.log(
                "policy_error", logging.ERROR, "policy release raised on flow %d of node %s",
                wire_id, node, exc_info=exc,
            )  # fmt: skip
        return flow

    def _drop(self, fids: Iterable[int], ctx: Context) -> None:
        """Forget flows that closed without a close report (their agent stayed away, or its
        resync no longer names them): the flows their going may change become dirty and the
        next flush calls the policy, as after :meth:`close_flows` (a rank-based policy ranks
        the rest again; rmlq's pruning of another request comes unasked)."""
        jobs: set[str] = set()
        for fid in fids:
            self._mark_released(self._remove(fid, ctx), jobs)
        for job in jobs:
            self.dirty.update(self.by_job.get(job, ()))

    def _forget_names(self, node: str, flow: Flow) -> None:
        names = self.node_names.get(node)
        if names is None:
            return
        for link in flow.links:
            names.links.drop(link)
        names.link_uses -= len(flow.links)
        if flow.job is not None:
            names.jobs.drop(flow.job)
        if flow.request is not None:
            names.requests.drop(flow.request)
        if not names:
            del self.node_names[node]

    @staticmethod
    def _discard(index: dict[str, set[int]], key: str, fid: int) -> None:
        members = index.get(key)
        if members is not None:
            members.discard(fid)
            if not members:
                del index[key]

    def _record_completion(self, flow: Flow, closed_at: float) -> None:
        if flow.deadline is None:
            self.stats.completed[(flow.cls.label, "none")] += 1
            return
        slack = flow.deadline - closed_at
        self.stats.completed[(flow.cls.label, "met" if slack >= 0 else "missed")] += 1
        self.stats.slack.observe(slack)

    # -- views for metrics -------------------------------------------------------------------

    def active_by_class_level(self) -> dict[tuple[FlowClass, int], int]:
        """Number of active flows per (class, level)."""
        counts: dict[tuple[FlowClass, int], int] = defaultdict(int)
        for flow in self.flows.values():
            counts[(flow.cls, flow.level)] += 1
        return counts
