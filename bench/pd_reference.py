"""pd-serving: where a policy loses against the ideal-network bound, and what is reachable.

Four commands (seeds pooled; every run uses the simulator and the bundled scenario as
``flowsched sim pd-serving`` does, K = 8 on 8 hardware queues):

``diagnose``: one policy against the bound, request by request (queue wait, prefill, the tail
after prefill) and at the decode NICs' ingress (the levels of the bytes that cross it, how
many requests share it at once, and, while a request that missed waits there after its
prefill, how much of the ingress goes to requests due earlier or later than it), and the
policy's own P2D release times replayed on each decode NIC alone (below)::

    .venv/bin/python bench/pd_reference.py diagnose --policy rmlq --load 0.6 --seeds 1
    .venv/bin/python bench/pd_reference.py diagnose --args '{"deferred_order": "mlu"}'

``reachable``: the bound; the bound with only the P2D on private paths (Stage-1 fetches on the
shared links, collectives first) and, on that run's prefill timeline, the ceiling of any
schedule that serves the collectives first on the prefill NICs (:func:`egress_ceiling`); each
decode NIC replayed offline as one preemptive server fed by the bound's own P2D release times
under processor sharing, EDF, EDF with Moore-Hodgson admission decided online (a drop keeps
the service the victim already got) and with retroactive drops (a victim is served last from
its first byte on: clairvoyant); and an EDF-rank reference scheduler on the real links
(collectives, then Stage-1 fetches, then the P2D by deadline rank over five levels, late
requests dropped), alone and with the retroactive replay's drops applied at their time::

    .venv/bin/python bench/pd_reference.py reachable --loads 0.5,0.6,0.7 --seeds 1,2,3

``orders``: the EDF-rank reference with the P2D ranked by deadline, by the request's KV bytes
still to send (shortest first) or by its slack (deadline minus those bytes at line rate)::

    .venv/bin/python bench/pd_reference.py orders --loads 0.6,0.7 --seeds 1,2,3

``offline``: the offline optimum (:func:`offline_optimum`, an integer program solved with
HiGHS through scipy) of every schedule that serves the collectives and the Stage-1 fetches as
one P2D-private run does, above every P2D (static's order, and rmlq's own): no such schedule
meets more; next to it rmlq, and the EDF-rank reference admitting only the requests the
optimum meets (the rest dropped from the start), each also with level changes applied at once
instead of at the next message::

    .venv/bin/python bench/pd_reference.py offline --loads 0.5,0.6,0.7 --seeds 1,2,3

``--router-load queued`` (before the command) runs them with the router that counts queued
tokens only. Each takes minutes per load and seed on one core; run them under
``flock -s /tmp/flowsched-measure.lock`` on a shared machine. docs/rmlq.md has the figures.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import itertools
import json
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, NamedTuple

from flowsched import scenario
from flowsched.cli.sim import specs
from flowsched.metrics import RunRecords
from flowsched.model import Context, Decision, Flow, FlowClass
from flowsched.policies import hwqueues
from flowsched.policies.common import is_late, rank_band
from flowsched.sim.engine import Simulator
from flowsched.sim.run import PolicySpec, build_topology, ideal_spec, run, sim_config
from flowsched.sim.serving import ServingWorkload

SCENARIO = "pd-serving"
#: the scenario's ``router_load``, unless ``--router-load`` names another
ROUTER_LOAD: str | None = None
LEVELS = 8
#: bytes below which a replayed request counts as done (float rounding)
_DONE = 1.0


# -- the EDF-rank reference scheduler -----------------------------------------------------------


class EdfRankReference:
    """Collectives (0), Stage-1 fetches (1), P2D by rank over levels 2-6, late P2D and
    everything else 7. Ranks move both ways (no Defer-and-Promote): a reference, not a policy.
    ``drops``: request -> when its P2D goes to level 7 (admission decided elsewhere).
    ``order``: what ranks the P2D (:data:`ORDERS`); ``layers`` and ``rate`` (bytes/s) estimate
    a request's KV still to send: its open P2D bytes plus its layers still to come, each the
    size of its last one."""

    name: ClassVar[str] = "edf-rank-reference"
    num_levels = LEVELS
    #: the deadline; the request's KV bytes still to send (shortest first); its slack, the
    #: deadline minus those bytes at ``rate`` (least first)
    ORDERS: ClassVar[tuple[str, ...]] = ("deadline", "remaining", "slack")

    def _dropped(self, flow: Flow, now: float) -> bool:
        return is_late(flow, now) or self.drops.get(flow.request or "", math.inf) <= now

    def _keys(self, ranked: list[Flow]) -> dict[int, float]:
        """Flow id -> its rank key (smaller = served first) for the P2D flows ``ranked``."""
        if self.order == "deadline":
            return {f.flow_id: f.deadline or 0.0 for f in ranked}
        open_bytes: dict[str, float] = defaultdict(float)
        last: dict[str, Flow] = {}
        for flow in ranked:
            request = flow.request or ""
            open_bytes[request] += flow.remaining or 0
            newest = last.get(request)
            if newest is None or (flow.consumer_index or 0) > (newest.consumer_index or 0):
                last[request] = flow
        keys = {}
        for request, flow in last.items():
            to_come = (self.layers - 1 - (flow.consumer_index or 0)) * (flow.size or 0)
            left = open_bytes[request] + to_come
            keys[request] = left if self.order == "remaining" else (
                (flow.deadline or 0.0) - left / self.rate)  # fmt: skip
        return {f.flow_id: keys[f.request or ""] for f in ranked}

    def _levels(self, flows: Iterable[Flow], now: float) -> dict[int, int]:
        flows = list(flows)
        ranked = [
            f for f in flows
            if f.cls is FlowClass.KV and f.deadline is not None and not self._dropped(f, now)
        ]  # fmt: skip
        keys = self._keys(ranked)
        order = sorted(set(keys.values()))
        rank = {key: i for i, key in enumerate(order)}
        levels = {}
        for flow in flows:
            if flow.cls is FlowClass.TP:
                levels[flow.flow_id] = 0
            elif flow.cls is FlowClass.KV_REUSE:
                levels[flow.flow_id] = 1
            elif flow.flow_id in keys:
                levels[flow.flow_id] = 2 + rank_band(rank[keys[flow.flow_id]], len(order), 5)
            else:
                levels[flow.flow_id] = 7
        return levels

    def __init__(
        self,
        drops: Mapping[str, float] | None = None,
        order: str = "deadline",
        layers: int = 32,
        rate: float = 100e9 / 8,
    ) -> None:
        if order not in self.ORDERS:
            raise ValueError(f"order: expected one of {', '.join(self.ORDERS)}, got {order!r}")
        self._open: dict[int, Flow] = {}
        self.drops = dict(drops or {})
        self.order, self.layers, self.rate = order, layers, rate

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        self._open[flow.flow_id] = flow
        return Decision(self._levels(self._open.values(), ctx.now)[flow.flow_id])

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        levels = self._levels(self._open.values(), ctx.now)
        return {
            f.flow_id: Decision(levels[f.flow_id]) for f in flows if levels[f.flow_id] != f.level
        }

    def release(self, flow: Flow, ctx: Context) -> None:
        self._open.pop(flow.flow_id, None)


# -- running ------------------------------------------------------------------------------------


def simulate(
    scen: scenario.Scenario,
    policy: Any,
    load: float,
    seed: int,
    observer: Callable[[Simulator, ServingWorkload], None] | None = None,
) -> RunRecords:
    """The records of :func:`simulate_on` with the default simulator, no class private."""
    return simulate_on(scen, policy, load, seed, observer).records


def simulate_on(
    scen: scenario.Scenario,
    policy: Any,
    load: float,
    seed: int,
    observer: Callable[[Simulator, ServingWorkload], None] | None = None,
    *,
    private: frozenset[FlowClass] = frozenset(),
    simulator: type[Simulator] = Simulator,
) -> Simulator:
    """One run of ``policy`` (a Policy object) with the CLI's engine settings, the ``private``
    classes on private full-rate paths, on a ``simulator`` (a Simulator subclass): the
    simulator after the run."""
    assert scen.serving is not None
    base = PolicySpec(
        "static", {}, LEVELS, level_queue=hwqueues.table(LEVELS, LEVELS), private_classes=private
    )
    topo = build_topology(scen)
    sim = simulator(topo.capacity, policy, sim_config(scen, base))
    trace = scenario.serving_trace(scen.serving, load, seed)
    workload = ServingWorkload(sim, topo, scen.serving, trace)
    if observer is not None:
        sim.observer = lambda s: observer(s, workload)
    workload.start()
    sim.run()
    workload.finish()
    return sim


def measured(records: RunRecords) -> list[Any]:
    return [r for r in records.requests if not r.warmup]


def met(records: RunRecords) -> int:
    return sum(r.met for r in measured(records))


def egress_ceiling(records: RunRecords, cfg: Any, trace: Iterable[Any]) -> int:
    """Measured requests that a schedule serving the collectives first on the prefill NICs
    could still meet, on ``records``' prefill timeline (a lower bound on each one's TTFT).

    A request's KV leaves its GPU's NIC at no more than the line rate B, and only while that
    NIC does not carry its own batch's all-to-all (the batch's cross-server bytes spread over
    the instance's NICs): its last byte arrives no earlier than
    ``max(prefill end - a2a_layer / B + kv_layer / B, start + layers (kv_layer + a2a_layer) / B)``
    with kv_layer its KV per layer and a2a_layer the all-to-all bytes per layer on its NIC. The
    other requests on the NIC and the decode ingress are ignored, so no such schedule meets more.
    """
    rate = cfg.nic_gbps * 1e9 / 8
    nics = cfg.servers_per_instance * cfg.nics_per_server
    prompts = {r.request_id: (r.prompt_tokens, r.new_tokens) for r in trace}
    batch_tokens: dict[tuple[float | None, float | None], int] = defaultdict(int)
    for record in records.requests:
        batch_tokens[record.started, record.prefill_done] += prompts[record.request][1]
    count = 0
    for record in measured(records):
        assert record.started is not None and record.prefill_done is not None
        kv = prompts[record.request][0] * cfg.kv_bytes_per_token_layer / rate
        tokens = batch_tokens[record.started, record.prefill_done]
        a2a = scenario.a2a_cross_bytes(cfg, tokens) / nics / rate
        earliest = max(record.prefill_done - a2a + kv, record.started + cfg.layers * (kv + a2a))
        count += earliest <= record.arrival + record.slo
    return count


# -- offline replay of the decode ingress -------------------------------------------------------

Jobs = dict[str, tuple[float, list[tuple[float, float]]]]


def ingress_jobs(records: RunRecords, decode_servers: int) -> dict[int, Jobs]:
    """Per decode server: request -> (deadline, [(release time, bytes)]) of its P2D flows."""
    requests = {r.request: r for r in records.requests}
    chunks: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for flow in records.flows:
        if flow.cls == "kv" and flow.request is not None:
            chunks[flow.request].append((flow.opened, float(flow.size)))
    jobs: dict[int, Jobs] = defaultdict(dict)
    for request, parts in chunks.items():
        record = requests[request]
        server = int(request[1:]) % decode_servers  # as ServingWorkload places them
        jobs[server][request] = (record.arrival + record.slo, sorted(parts))
    return jobs


#: called by :func:`serve` after releasing bytes at ``now``: (now, the events released then,
#: the events still to come, bytes ready, bytes left, finish times so far)
ReleaseHook = Callable[
    [float, list[tuple[float, str, float]], list[tuple[float, str, float]],
     dict[str, float], dict[str, float], dict[str, float]],
    None,
]  # fmt: skip


def serve(
    jobs: Jobs,
    rate: float,
    key: Callable[[str], Any] | None,
    on_release: ReleaseHook | None = None,
) -> dict[str, float]:
    """Finish times on one preemptive server: ``key`` orders the requests (smallest first),
    None shares the server equally among the requests with bytes released. ``on_release``
    sees the server's state each time bytes are released (online admission decides there)."""
    events = sorted((t, r, b) for r, (_, parts) in jobs.items() for t, b in parts)
    ready: dict[str, float] = defaultdict(float)
    left = {r: sum(b for _, b in parts) for r, (_, parts) in jobs.items()}
    finish: dict[str, float] = {}
    now, i = (events[0][0] if events else 0.0), 0
    while i < len(events) or ready:
        start = i
        while i < len(events) and events[i][0] <= now:
            ready[events[i][1]] += events[i][2]
            i += 1
        if on_release is not None and i > start:
            on_release(now, events[start:i], events[i:], ready, left, finish)
        upcoming = events[i][0] if i < len(events) else math.inf
        if not ready:
            now = upcoming
            continue
        served = list(ready) if key is None else [min(ready, key=key)]
        share = rate / len(served)
        step = min(min(ready[r] for r in served) / share, upcoming - now)
        now += step
        for r in served:
            ready[r] -= share * step
            left[r] -= share * step
            _settle(r, now, ready, left, finish)
    return finish


def _settle(
    request: str,
    now: float,
    ready: dict[str, float],
    left: dict[str, float],
    finish: dict[str, float],
) -> None:
    """After serving ``request``: a released remnant under ``_DONE`` bytes counts as sent
    (from what it has left too, or a later release would leave it a byte short forever), and
    a request with nothing left finishes ``now``."""
    if ready[request] <= _DONE:
        left[request] -= ready.pop(request)
    if left[request] <= _DONE and request not in finish:
        finish[request] = now


def serve_with_admission(jobs: Jobs, rate: float) -> dict[str, float]:
    """EDF with clairvoyant, retroactive admission: at each request's first release, admit it
    and, while the admitted set misses a deadline under EDF, drop the admitted request with the
    most bytes among those due no later than the first miss (Moore-Hodgson). Dropped requests
    are served last, by deadline, *from their first byte on* (the bandwidth a victim used
    before the drop goes back to the others), and count if they still finish in time."""
    dropped = retroactive_drops(jobs, rate)
    return serve(jobs, rate, lambda r: (r in dropped, jobs[r][0], r))


def retroactive_drops(jobs: Jobs, rate: float) -> dict[str, float]:
    """The requests :func:`serve_with_admission` drops, and when: the first release of the
    request whose arrival made the admitted set infeasible."""
    admitted: list[str] = []
    dropped: dict[str, float] = {}
    for request in sorted(jobs, key=lambda r: jobs[r][1][0][0]):
        admitted.append(request)
        while True:
            subset = {r: jobs[r] for r in admitted}
            finish = serve(subset, rate, lambda r: (jobs[r][0], r))
            late = [r for r in admitted if finish[r] > jobs[r][0]]
            if not late:
                break
            first = min(late, key=lambda r: jobs[r][0])
            now = jobs[request][1][0][0]
            victim = max(  # among those not done by now: the past stays as it was
                (r for r in admitted if jobs[r][0] <= jobs[first][0] and finish[r] > now),
                key=lambda r: sum(b for _, b in jobs[r][1]),
            )
            admitted.remove(victim)
            dropped[victim] = now
    return dropped


def serve_online_admission(jobs: Jobs, rate: float) -> dict[str, float]:
    """EDF with admission decided online: at each request's first release, forecast the
    admitted requests under EDF from the server's state at that instant (their future releases
    known) and, while one misses, drop the one with the most bytes left among those due no
    later than the first miss. A dropped request keeps the service it got before and goes on
    at the lowest priority (by deadline); it counts if it still finishes in time. Unlike
    :func:`serve_with_admission`, a drop never gives back the bandwidth the victim used before
    it was dropped."""
    first = {r: min(t for t, _ in parts) for r, (_, parts) in jobs.items() if parts}
    dropped: set[str] = set()

    def admit(
        now: float,
        released: list[tuple[float, str, float]],
        future: list[tuple[float, str, float]],
        ready: dict[str, float],
        left: dict[str, float],
        finish: dict[str, float],
    ) -> None:
        if any(first[r] == t for t, r, _ in released):  # a request's first bytes
            present = {r for r, t in first.items() if t <= now}
            _admit(jobs, rate, now, future, ready, left, present - finish.keys(), dropped)

    return serve(jobs, rate, lambda r: (r in dropped, jobs[r][0], r), admit)


def _admit(
    jobs: Jobs,
    rate: float,
    now: float,
    future: list[tuple[float, str, float]],
    ready: Mapping[str, float],
    left: Mapping[str, float],
    present: set[str],
    dropped: set[str],
) -> None:
    """Moore-Hodgson from the server's state at ``now`` over the ``present`` requests (arrived,
    not finished): see serve_online_admission."""
    while True:
        live = [r for r in present if r not in dropped and left[r] > _DONE]
        forecast: Jobs = {r: (jobs[r][0], []) for r in live}
        for r in live:
            if ready.get(r, 0.0) > 0:
                forecast[r][1].append((now, ready[r]))
        for t, r, b in future:
            if r in forecast:
                forecast[r][1].append((t, b))
        forecast = {r: job for r, job in forecast.items() if job[1]}
        done = serve(forecast, rate, lambda r: (jobs[r][0], r))
        late = [r for r in forecast if done.get(r, math.inf) > jobs[r][0]]
        if not late:
            return
        due = jobs[min(late, key=lambda r: jobs[r][0])][0]
        # the most bytes left; on a tie the later deadline, then the name: ``present`` is a
        # set of strings, whose order changes from process to process with the hash seed
        candidates = (r for r in forecast if jobs[r][0] <= due)
        dropped.add(max(candidates, key=lambda r: (left[r], jobs[r][0], r)))


def ingress_replays(records: RunRecords, cfg: Any) -> dict[str, int]:
    """Measured requests meeting their deadline under each offline ingress schedule."""
    rate = cfg.nic_gbps * 1e9 / 8
    warm = {r.request for r in records.requests if r.warmup}
    counts: Counter[str] = Counter()
    for jobs in ingress_jobs(records, cfg.decode_servers).values():
        schedules = {
            "PS": serve(jobs, rate, None),
            "EDF": serve(jobs, rate, lambda r, j=jobs: (j[r][0], r)),  # type: ignore[misc]
            "EDF+online admission": serve_online_admission(jobs, rate),
            "EDF+retroactive admission": serve_with_admission(jobs, rate),
        }
        for name, finish in schedules.items():
            counts[name] += sum(
                1 for r in jobs if r not in warm and finish.get(r, math.inf) <= jobs[r][0]
            )
    return dict(counts)


# -- the offline optimum on a collectives-first timeline ----------------------------------------


class P2dDemand(NamedTuple):
    """One request's P2D transfers: due at ``deadline``, across ``links`` (every layer of a
    request takes the same path), each released as ``(time, bytes)``."""

    deadline: float
    links: tuple[str, ...]
    releases: tuple[tuple[float, float], ...]


#: (link, t0, t1) -> the bytes that link can carry for the P2D between t0 and t1
FreeBytes = Callable[[str, float, float], float]
#: bytes per unit inside the program (the solver works best on numbers near 1)
_MB = 1e6


def offline_optimum(
    demands: Mapping[str, P2dDemand], free: FreeBytes, slot: float, *, integer: bool = True
) -> tuple[int, set[str]]:
    """No fewer of ``demands`` than any schedule can meet when the P2D get ``free`` bytes of
    each link, and the requests met by the optimum of the time-indexed program below.

    Over slots of ``slot`` seconds: x_r = 1 when request r is met (0..1 with ``integer``
    False), z_rk = the bytes r has sent by the end of slot k. A slot's bytes of r
    (z_rk - z_r,k-1 >= 0) count against every link of r's path in that slot, since a flow
    crosses its links at one rate, and no link carries more than its free bytes in a slot;
    z_rk <= x_r times r's bytes released before the end of slot k; a met request has sent
    everything by the end of the last slot that starts before its deadline. Relaxed in the
    requests' favour: a release counts from the start of its slot and a deadline from the
    end of its slot, a slot's bytes need no order, and a request that misses costs nothing (it
    can go after the others), so no schedule on the same ``free`` meets more than the optimum.
    The count is the solver's proven bound (within its gap), rounded down.
    """
    import numpy as np
    from scipy import optimize

    names = sorted(demands)
    rows = _ProgramRows()
    upper = [1.0] * len(names)  # x_r's upper bounds; z's follow
    on_link: dict[tuple[str, int], list[tuple[int, int]]] = defaultdict(list)
    for r, name in enumerate(names):
        demand = demands[name]
        releases = sorted(demand.releases)
        first = math.floor(releases[0][0] / slot)
        last = math.ceil(demand.deadline / slot) - 1
        if last < first:
            upper[r] = 0.0
            continue
        total = sum(size for _, size in releases) / _MB
        before, released = None, 0.0
        for k in range(first, last + 1):
            z = len(upper)
            upper.append(math.inf)
            while releases and releases[0][0] < (k + 1) * slot:
                released += releases.pop(0)[1] / _MB
            if released < total:
                rows.at_most({z: 1.0, r: -released}, 0.0)
            if before is not None:
                rows.at_most({before: 1.0, z: -1.0}, 0.0)
            for link in demand.links:
                on_link[link, k].append((z, -1 if before is None else before))
            before = z
        assert before is not None
        rows.equal({before: 1.0, r: -total})
    for (link, k), columns in on_link.items():
        terms: dict[int, float] = defaultdict(float)
        for z, previous in columns:
            terms[z] += 1.0
            if previous >= 0:
                terms[previous] -= 1.0
        rows.at_most(terms, max(free(link, k * slot, (k + 1) * slot), 0.0) / _MB)
    width = len(upper)
    objective = np.zeros(width)
    objective[: len(names)] = -1.0
    kinds = np.zeros(width)
    if integer:
        kinds[: len(names)] = 1
    result = optimize.milp(
        objective,
        constraints=rows.constraints(width),
        integrality=kinds,
        bounds=optimize.Bounds(np.zeros(width), np.array(upper)),
    )
    if result.x is None:
        raise RuntimeError(f"offline_optimum: the solver found no schedule ({result.message})")
    proven = -getattr(result, "mip_dual_bound", result.fun) if integer else -result.fun
    chosen = {name for name, x in zip(names, result.x, strict=False) if x > 0.5}
    return math.floor(proven + 1e-6), chosen


class _ProgramRows:
    """Sparse rows of a linear program: ``<= bound`` and ``= 0`` rows, kept apart."""

    def __init__(self) -> None:
        self._ub: tuple[list[int], list[int], list[float]] = ([], [], [])
        self._bounds: list[float] = []
        self._eq: tuple[list[int], list[int], list[float]] = ([], [], [])
        self._equals = 0

    def at_most(self, terms: Mapping[int, float], bound: float) -> None:
        self._add(self._ub, len(self._bounds), terms)
        self._bounds.append(bound)

    def equal(self, terms: Mapping[int, float]) -> None:
        self._add(self._eq, self._equals, terms)
        self._equals += 1

    @staticmethod
    def _add(
        into: tuple[list[int], list[int], list[float]], row: int, terms: Mapping[int, float]
    ) -> None:
        for column, value in terms.items():
            into[0].append(row)
            into[1].append(column)
            into[2].append(value)

    def constraints(self, width: int) -> list[Any]:
        """The rows as scipy LinearConstraints over ``width`` columns (empty blocks left out)."""
        from scipy import optimize, sparse

        blocks: list[tuple[tuple[list[int], list[int], list[float]], int, Any, Any]] = [
            (self._ub, len(self._bounds), -math.inf, self._bounds),
            (self._eq, self._equals, 0.0, 0.0),
        ]
        return [
            optimize.LinearConstraint(
                sparse.csr_array((values, (rows, columns)), shape=(count, width)), low, high
            )
            for (rows, columns, values), count, low, high in blocks
            if count
        ]


class LinkRates:
    """Observer: the rate (bytes/s) each of ``links`` carries over a run, as change points,
    and the bytes it carried between two instants (:meth:`sent`)."""

    def __init__(self, capacity: Mapping[str, float], links: Iterable[str]) -> None:
        self.capacity = capacity
        self.changes: dict[str, list[tuple[float, float]]] = {link: [(0.0, 0.0)] for link in links}
        self._cumulative: dict[str, list[float]] = {}

    def __call__(self, sim: Simulator, _workload: Any = None) -> None:
        for link in self.changes:
            self.record(sim.now, link, sim.link_utilization(link) * self.capacity[link])

    def record(self, now: float, link: str, rate: float) -> None:
        """``link`` carries ``rate`` from ``now`` on (times never go back)."""
        changes = self.changes[link]
        if changes[-1][1] == rate:
            return
        if changes[-1][0] == now:
            changes[-1] = (now, rate)
        else:
            changes.append((now, rate))
        self._cumulative.pop(link, None)

    def sent(self, link: str, start: float, end: float) -> float:
        """Bytes ``link`` carried between ``start`` and ``end``."""
        return self._carried(link, end) - self._carried(link, start)

    def _carried(self, link: str, when: float) -> float:
        changes = self.changes[link]
        cumulative = self._cumulative.get(link)
        if cumulative is None:
            cumulative = [0.0]
            for (t0, rate), (t1, _) in itertools.pairwise(changes):
                cumulative.append(cumulative[-1] + rate * (t1 - t0))
            self._cumulative[link] = cumulative
        i = max(bisect.bisect_right(changes, (when, math.inf)) - 1, 0)
        t0, rate = changes[i]
        return cumulative[i] + rate * max(when - t0, 0.0)


class P2dPaths(Simulator):
    """A Simulator that remembers the links of every P2D flow (flow id -> link names)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.p2d_links: dict[int, tuple[str, ...]] = {}

    def open_flow(
        self, cls: FlowClass, size: int, links: tuple[str, ...], *args: Any, **kw: Any
    ) -> Flow:
        flow = super().open_flow(cls, size, links, *args, **kw)
        if cls is FlowClass.KV:
            self.p2d_links[flow.flow_id] = links
        return flow


def collectives_first(
    scen: scenario.Scenario, policy: Any, load: float, seed: int
) -> tuple[RunRecords, dict[str, P2dDemand], FreeBytes]:
    """``policy``'s run with every P2D on a private full-rate path: its records, its measured
    requests' P2D demands, and the bytes its collectives and Stage-1 fetches leave the P2D on
    each link. Any schedule that serves those two as this run does, above every P2D, gets
    the same free bytes: their timeline does not depend on the P2D. Warm-up requests are left
    out: like a request that misses, they can wait until the others are done."""
    assert scen.serving is not None
    topo = build_topology(scen)
    rates = LinkRates(topo.capacity, list(topo.capacity))
    sim = simulate_on(
        scen, policy, load, seed, rates, private=frozenset({FlowClass.KV}), simulator=P2dPaths
    )
    assert isinstance(sim, P2dPaths)
    requests = {r.request: r for r in measured(sim.records)}
    releases: dict[str, list[tuple[float, float]]] = defaultdict(list)
    paths: dict[str, tuple[str, ...]] = {}
    for flow in sim.records.flows:
        if flow.cls == "kv" and flow.request is not None and flow.request in requests:
            releases[flow.request].append((flow.opened, float(flow.size)))
            paths[flow.request] = sim.p2d_links[flow.flow_id]
    demands = {
        request: P2dDemand(
            requests[request].arrival + requests[request].slo, paths[request], tuple(parts)
        )
        for request, parts in releases.items()
    }

    def free(link: str, start: float, end: float) -> float:
        return topo.capacity[link] * (end - start) - rates.sent(link, start, end)

    return sim.records, demands, free


# -- commands -----------------------------------------------------------------------------------


def load_scenario() -> scenario.Scenario:
    """The bundled scenario, with ``--router-load`` applied when given."""
    scen = scenario.load(SCENARIO)
    assert scen.serving is not None
    if ROUTER_LOAD is None:
        return scen
    return dataclasses.replace(
        scen, serving=dataclasses.replace(scen.serving, router_load=ROUTER_LOAD)
    )


def against_the_bound(
    loads: list[float],
    seeds: list[int],
    add: Callable[[scenario.Scenario, float, int, RunRecords, Counter[str]], None],
    width: int,
) -> None:
    """Per load: the bound on each seed, then ``add(scenario, load, seed, the bound's records,
    counts)`` counts the measured requests each other row meets on that seed; print every row
    (names ``width`` wide) against the bound."""
    scen = load_scenario()
    assert scen.serving is not None
    for load in loads:
        counts: Counter[str] = Counter()
        total = 0
        for seed in seeds:
            bound = run(scen, ideal_spec(LEVELS), load, seed).records
            total += len(measured(bound))
            counts["bound"] += met(bound)
            add(scen, load, seed, bound, counts)
        print(f"load {load:g}, seeds {seeds}, {total} measured requests:")
        for name, value in counts.items():
            share, of_bound = value / total, value / counts["bound"]
            print(f"  {name:{width}s} {share:6.1%}  {of_bound:.2f}x the bound")


def reachable(loads: list[float], seeds: list[int]) -> None:
    """Print the reachability table (see the module docstring)."""
    queues = hwqueues.table(LEVELS, LEVELS)
    partial = {
        "P2D private, Stage-1 shared": {},
        "P2D private, Stage-1 at the collectives' level": {"levels": {"kv_reuse": 0}},
    }

    def add(
        scen: scenario.Scenario, load: float, seed: int, bound: RunRecords, counts: Counter[str]
    ) -> None:
        assert scen.serving is not None
        for name, value in ingress_replays(bound, scen.serving).items():
            counts[f"ingress {name} (bound's timeline)"] += value
        for label, args in partial.items():
            spec = PolicySpec(
                "static",
                args,
                LEVELS,
                label=label,
                level_queue=queues,
                private_classes=frozenset({FlowClass.KV}),
            )
            records = run(scen, spec, load, seed).records
            counts[label] += met(records)
            if label == "P2D private, Stage-1 shared":
                trace = scenario.serving_trace(scen.serving, load, seed)
                counts["  its timeline, collectives first on the prefill NICs: ceiling"] += (
                    egress_ceiling(records, scen.serving, trace)
                )
        edf_rank = simulate(scen, EdfRankReference(), load, seed)
        counts["EDF-rank reference, all shared"] += met(edf_rank)
        drops: dict[str, float] = {}
        for jobs in ingress_jobs(edf_rank, scen.serving.decode_servers).values():
            drops.update(retroactive_drops(jobs, scen.serving.nic_gbps * 1e9 / 8))
        counts["  + the retroactive replay's drops, at their time"] += met(
            simulate(scen, EdfRankReference(drops), load, seed)
        )

    against_the_bound(loads, seeds, add, 48)


def compare_orders(loads: list[float], seeds: list[int], orders: list[str]) -> None:
    """Print the EDF-rank reference's attainment under each P2D order, against the bound."""

    def add(
        scen: scenario.Scenario, load: float, seed: int, bound: RunRecords, counts: Counter[str]
    ) -> None:
        assert scen.serving is not None
        rate = scen.serving.nic_gbps * 1e9 / 8
        for order in orders:
            reference = EdfRankReference(order=order, layers=scen.serving.layers, rate=rate)
            counts[order] += met(simulate(scen, reference, load, seed))

    against_the_bound(loads, seeds, add, 10)


class IngressProbe:
    """Observer: per decode ingress link, byte shares by level, concurrency, and for each
    request waiting there after its prefill, where the ingress bandwidth went."""

    def __init__(self, links: list[str], capacity: Mapping[str, float]) -> None:
        self.links, self.capacity = links, capacity
        self.last = 0.0
        self.snapshot: dict[str, list[tuple[str, float, int, float]]] = {}
        self.level_bytes: dict[int, float] = defaultdict(float)
        self.busy: dict[str, float] = defaultdict(float)
        self.sharing: dict[str, float] = defaultdict(float)
        self.waiting: dict[str, float] = defaultdict(float)
        self.by_request: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def __call__(self, sim: Simulator, workload: ServingWorkload) -> None:
        step = sim.now - self.last
        if step > 0:
            for link, flows in self.snapshot.items():
                self._account(link, flows, step, workload)
        self.snapshot = {
            link: [
                (s.flow.request or "", s.flow.deadline or math.inf, s.level, s.rate)
                for s in sim.flows_on(link)
            ]
            for link in self.links
        }
        self.last = sim.now

    def _account(
        self,
        link: str,
        flows: list[tuple[str, float, int, float]],
        step: float,
        workload: ServingWorkload,
    ) -> None:
        rate: dict[str, float] = defaultdict(float)
        due: dict[str, float] = {}
        for request, deadline, level, r in flows:
            rate[request] += r
            due[request] = deadline
            self.level_bytes[level] += r * step
        total = sum(rate.values())
        self.waiting[link] += len(rate) * step
        if total > 0:
            self.busy[link] += step * total / self.capacity[link]
            self.sharing[link] += step * sum(1 for r in rate.values() if r > 0)
        for request in rate:
            record = workload.records[request]
            if record.prefill_done is None or record.warmup:
                continue
            seen = self.by_request[request]
            seen["time"] += step
            for other, r in rate.items():
                kind = (
                    "own"
                    if other == request
                    else "earlier"
                    if due[other] < due[request]
                    else "later"
                )
                seen[kind] += r * step


def diagnose(policy: str, load: float, seeds: list[int], args: dict[str, Any]) -> None:
    """Print where ``policy`` (with ``args``) loses against the bound (module docstring)."""
    scen = load_scenario()
    assert scen.serving is not None
    plain = specs([policy], None, LEVELS)[0]
    built = PolicySpec(plain.name, {**plain.args, **args}, LEVELS, level_queue=plain.level_queue)
    lost_parts: list[tuple[float, float, float]] = []
    probe_totals: dict[str, float] = defaultdict(float)
    levels: dict[int, float] = defaultdict(float)
    replays: Counter[str] = Counter()
    for seed in seeds:
        bound = {r.request: r for r in measured(run(scen, ideal_spec(LEVELS), load, seed).records)}
        topo = build_topology(scen)
        rx = [link for link in topo.capacity if link.startswith(scen.serving.decode_prefix)]
        rx = [link for link in rx if link.endswith(".rx")]
        probe = IngressProbe(rx, topo.capacity)
        records = simulate(scen, built.build(), load, seed, probe)
        ours = {r.request: r for r in measured(records)}
        replays[policy] += met(records)
        replays.update(ingress_replays(records, scen.serving))
        for level, sent in probe.level_bytes.items():
            levels[level] += sent
        end = records.end_time or 1.0
        for link in rx:
            print(
                f"seed {seed} {link}: {probe.busy[link] / end:.0%} busy, "
                f"{probe.sharing[link] / max(probe.busy[link], 1e-12):.2f} requests served at "
                f"once while busy, {probe.waiting[link] / end:.2f} with P2D open on average"
            )
        for request, ideal in bound.items():
            mine = ours[request]
            if not ideal.met or mine.met:
                continue
            a, b = _phases(mine), _phases(ideal)
            lost_parts.append((a[0] - b[0], a[1] - b[1], a[2] - b[2]))
            for kind, value in probe.by_request.get(request, {}).items():
                probe_totals[kind] += value
    print(
        f"requests met: {policy} {replays.pop(policy)}; its own P2D release times replayed on "
        "each decode NIC alone: " + ", ".join(f"{name} {count}" for name, count in replays.items())
    )
    total = sum(levels.values()) or 1.0
    print(
        "bytes into the decode ingress by level: "
        + ", ".join(f"{level}: {b / total:.1%}" for level, b in sorted(levels.items()))
    )
    if not lost_parts:
        print("no request met under the bound was missed")
        return
    wait, prefill, tail = (statistics.mean(p[i] for p in lost_parts) * 1e3 for i in range(3))
    dominant = Counter(p.index(max(p)) for p in lost_parts)
    print(
        f"{len(lost_parts)} requests met under the bound, missed under {policy}: "
        f"+{wait:.1f} ms queue wait, +{prefill:.1f} ms prefill, +{tail:.1f} ms after prefill "
        f"(dominant: wait {dominant[0]}, prefill {dominant[1]}, tail {dominant[2]})"
    )
    served = probe_totals["own"] + probe_totals["earlier"] + probe_totals["later"]
    if served:
        print(
            "while they waited at the ingress after prefill, its bytes went to: "
            f"themselves {probe_totals['own'] / served:.0%}, requests due earlier "
            f"{probe_totals['earlier'] / served:.0%}, "
            f"due later {probe_totals['later'] / served:.0%}"
        )


def offline(loads: list[float], seeds: list[int], slot: float) -> None:
    """Print the offline optimum on two collectives-first timelines, with rmlq and the
    EDF-rank reference given the optimum's admissions (each also with level changes applied
    at once instead of at the next message), against the bound."""
    rmlq = specs(["rmlq"], None, LEVELS)[0]
    static = PolicySpec("static", {}, LEVELS, level_queue=hwqueues.table(LEVELS, LEVELS))

    def add(
        scen: scenario.Scenario, load: float, seed: int, bound: RunRecords, counts: Counter[str]
    ) -> None:
        at_once = dataclasses.replace(scen, sim=dataclasses.replace(scen.sim, chunk_kib=0))
        counts["rmlq"] += met(run(scen, rmlq, load, seed).records)
        counts["  level changes at once"] += met(run(at_once, rmlq, load, seed).records)
        for label, spec in (("static", static), ("rmlq", rmlq)):
            records, demands, free = collectives_first(scen, spec.build(), load, seed)
            most, chosen = offline_optimum(demands, free, slot)
            counts[f"offline optimum, collectives and fetches as {label}: at most"] += most
            if spec is not static:
                continue
            # the EDF-rank reference serves the collectives and fetches as static does (and
            # static never changes a level, so the message boundary does not move them)
            drops = {r.request: 0.0 for r in records.requests if r.request not in chosen}
            for name, where in (("", scen), (", level changes at once", at_once)):
                counts[f"  EDF-rank reference admitting the optimum's requests{name}"] += met(
                    simulate(where, EdfRankReference(drops), load, seed)
                )

    against_the_bound(loads, seeds, add, 78)


def _phases(record: Any) -> tuple[float, float, float]:
    """(queue wait, prefill, after prefill) of a finished request, seconds."""
    return (
        record.started - record.arrival,
        record.prefill_done - record.started,
        record.finished - record.prefill_done,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--router-load",
        choices=("outstanding", "queued"),
        help="the router's load measure (default: the scenario's, outstanding)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("diagnose", help="one policy against the bound")
    one.add_argument("--policy", default="rmlq")
    one.add_argument("--load", type=float, default=0.6)
    one.add_argument("--seeds", default="1")
    one.add_argument("--args", default="{}", help='policy arguments, JSON: {"E": 2}')
    many = sub.add_parser("reachable", help="bounds and references")
    many.add_argument("--loads", default="0.5,0.6,0.7")
    many.add_argument("--seeds", default="1,2,3")
    orders = sub.add_parser("orders", help="the EDF-rank reference under each P2D order")
    orders.add_argument("--loads", default="0.6,0.7")
    orders.add_argument("--seeds", default="1,2,3")
    orders.add_argument("--orders", default=",".join(EdfRankReference.ORDERS))
    best = sub.add_parser("offline", help="the offline optimum with the collectives first")
    best.add_argument("--loads", default="0.5,0.6,0.7")
    best.add_argument("--seeds", default="1,2,3")
    best.add_argument(
        "--slot-ms", type=float, default=0.1, help="the program's time slot (finer: tighter)"
    )
    args = parser.parse_args()
    global ROUTER_LOAD
    ROUTER_LOAD = args.router_load
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.command == "diagnose":
        diagnose(args.policy, args.load, seeds, json.loads(args.args))
    elif args.command == "reachable":
        reachable([float(x) for x in args.loads.split(",")], seeds)
    elif args.command == "offline":
        offline([float(x) for x in args.loads.split(",")], seeds, args.slot_ms / 1e3)
    else:
        compare_orders([float(x) for x in args.loads.split(",")], seeds, args.orders.split(","))


if __name__ == "__main__":
    main()
