"""pd-serving: where a policy loses against the ideal-network bound, and what is reachable.

Two commands (seeds pooled; every run uses the simulator and the bundled scenario as
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

Both take minutes per load and seed on one core; run them under
``flock -s /tmp/flowsched-measure.lock`` on a shared machine. docs/rmlq.md has the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

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
    """One run of ``policy`` (a Policy object) with the CLI's engine settings."""
    assert scen.serving is not None
    base = PolicySpec("static", {}, LEVELS, level_queue=hwqueues.table(LEVELS, LEVELS))
    topo = build_topology(scen)
    sim = Simulator(topo.capacity, policy, sim_config(scen, base))
    trace = scenario.serving_trace(scen.serving, load, seed)
    workload = ServingWorkload(sim, topo, scen.serving, trace)
    if observer is not None:
        sim.observer = lambda s: observer(s, workload)
    workload.start()
    sim.run()
    workload.finish()
    return sim.records


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


# -- commands -----------------------------------------------------------------------------------


def against_the_bound(
    loads: list[float],
    seeds: list[int],
    add: Callable[[scenario.Scenario, float, int, RunRecords, Counter[str]], None],
    width: int,
) -> None:
    """Per load: the bound on each seed, then ``add(scenario, load, seed, the bound's records,
    counts)`` counts the measured requests each other row meets on that seed; print every row
    (names ``width`` wide) against the bound."""
    scen = scenario.load(SCENARIO)
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
    scen = scenario.load(SCENARIO)
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


def _phases(record: Any) -> tuple[float, float, float]:
    """(queue wait, prefill, after prefill) of a finished request, seconds."""
    return (
        record.started - record.arrival,
        record.prefill_done - record.started,
        record.finished - record.prefill_done,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.command == "diagnose":
        diagnose(args.policy, args.load, seeds, json.loads(args.args))
    elif args.command == "reachable":
        reachable([float(x) for x in args.loads.split(",")], seeds)
    else:
        compare_orders([float(x) for x in args.loads.split(",")], seeds, args.orders.split(","))


if __name__ == "__main__":
    main()
