"""Run one scenario with one policy at one load: topology, workloads, engine, metrics."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from flowsched import policies
from flowsched.metrics import RunMetrics, RunRecords, summarize
from flowsched.model import FlowClass
from flowsched.policies.base import Policy
from flowsched.scenario import Request, Scenario, nodes, rl_plan, serving_trace
from flowsched.sim.engine import SimConfig, Simulator
from flowsched.sim.rl import RlWorkload
from flowsched.sim.serving import ServingWorkload
from flowsched.sim.topology import Topology

#: what the ideal-network bound takes off the shared links: P2D and Stage-1 KV transfers, the
#: RL param sync and experience (every deferrable transfer); collectives stay on the real links
IDEAL_PRIVATE = frozenset(
    {FlowClass.KV, FlowClass.KV_REUSE, FlowClass.PARAM_SYNC, FlowClass.EXPERIENCE}
)
#: the label of the ideal-network bound in tables and plots
IDEAL = "ideal"
#: suffix of a baseline with late-dropping (``drop_late = true``), as in ``static+late``
LATE_SUFFIX = "+late"
#: why a policy that has no ``+late`` variant needs none, where it is not just "it has no rule"
LATE_BY_ITSELF = {"rmlq": "it prunes late requests by itself"}


def late_variants() -> list[str]:
    """The registered policies that have a ``NAME+late`` variant: those whose arguments
    include ``drop_late`` (the baselines' late-dropping rule, ``policies.common.LateDrop``)."""
    return [
        name
        for name in policies.names()
        if "drop_late" in {f.name for f in fields(policies.module(name).Args)}
    ]


def late_problem(name: str) -> str | None:
    """Why ``name`` (``NAME+late``, ``NAME`` registered) is no policy, or None when it is one
    (or has no ``+late``)."""
    base = name.removesuffix(LATE_SUFFIX)
    variants = late_variants()
    if base == name or base in variants:
        return None
    why = f": {LATE_BY_ITSELF[base]}" if base in LATE_BY_ITSELF else ""
    return (
        f"{name!r}: {base} has no late-dropping variant{why} (NAME+late is for the policies "
        f"that take drop_late: {', '.join(variants)})"
    )


def variant(
    name: str, file_policy: str | None, file_args: Mapping[str, Any]
) -> tuple[str, dict[str, Any]]:
    """The registered policy and the arguments that run ``name`` from a policy file whose
    policy is ``file_policy`` with ``file_args``: the file's arguments when it names the same
    policy (none otherwise), plus ``drop_late = true`` for ``NAME+late``."""
    base = name.removesuffix(LATE_SUFFIX)
    args = dict(file_args) if base == file_policy else {}
    if base != name:
        args["drop_late"] = True
    return base, args


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """How to build a policy for a run: registry name, arguments, levels, timer, hw queues.

    ``label`` names the run in reports (default: ``name``); ``level_queue`` maps levels to the
    hardware queues that carry them (empty: one queue per level); ``private_classes`` puts those
    classes on private full-rate paths (only the ideal-network bound does).
    """

    name: str
    args: Mapping[str, Any] = field(default_factory=dict)
    num_levels: int = 8
    timer_period: float | None = None
    label: str = ""
    level_queue: tuple[int, ...] = ()
    private_classes: frozenset[FlowClass] = frozenset()

    @property
    def title(self) -> str:
        """The name reports show."""
        return self.label or self.name

    @property
    def bound(self) -> bool:
        """True for the ideal-network bound (a ceiling, never a competitor)."""
        return bool(self.private_classes)

    def build(self) -> Policy:
        """A fresh policy object (runs never share policy state)."""
        return policies.create(self.name, dict(self.args), num_levels=self.num_levels)


def ideal_spec(num_levels: int) -> PolicySpec:
    """The ideal-network bound: every KV, KV-reuse, param-sync and experience flow on a private
    full-rate path, collectives first (``static``) on the real links: the collectives see no
    other traffic and every deferrable transfer runs at line rate. It bounds attainment pooled
    over seeds, not seed by seed: batching is not monotone (faster transfers change which
    requests share a batch and where the router sends the next), and a reference schedule
    on the shared links beat it by one request on 2 of 36 (load, seed) pairs of
    pd-serving-testbed (bench/scenarios/README.md)."""
    return PolicySpec("static", {}, num_levels, label=IDEAL, private_classes=IDEAL_PRIVATE)


@dataclass(slots=True)
class RunResult:
    """Records and metrics of one run, with its wall-clock cost."""

    policy: str
    load: float
    records: RunRecords
    metrics: RunMetrics
    wall_s: float
    flows: int
    events: int


def build_topology(scenario: Scenario) -> Topology:
    """Every node the scenario's workloads use; workloads naming the same node share links."""
    oversub = scenario.sim.oversubscription or None
    topo = Topology(oversubscription=oversub)
    for node, nics, gbps, _ in nodes(scenario.serving, scenario.rl):
        if node in topo.nodes:
            if topo.nodes[node] != nics or topo.capacity[f"{node}.nic0.tx"] != gbps * 1e9 / 8:
                raise ValueError(f"node {node}: workloads disagree on its NICs")
            continue
        topo.add_node(node, nics, gbps)
    return topo


def sim_config(scenario: Scenario, spec: PolicySpec) -> SimConfig:
    """Engine knobs from the scenario's ``[sim]`` table (timer: policy file wins)."""
    timer = spec.timer_period if spec.timer_period is not None else scenario.sim.timer_ms / 1e3
    return SimConfig(
        chunk_bytes=scenario.sim.chunk_kib * 1024,
        timer_period=timer,
        load_tau=scenario.sim.load_tau_ms / 1e3,
        level_queue=spec.level_queue,
        private_classes=spec.private_classes,
        payload_share=scenario.sim.payload_share,
    )


def run(
    scenario: Scenario,
    spec: PolicySpec,
    load: float,
    seed: int | None = None,
    *,
    observer: Callable[[Simulator], None] | None = None,
    simulator: Callable[..., Simulator] = Simulator,
    trace: list[Request] | None = None,
) -> RunResult:
    """Simulate ``scenario`` at ``load`` under the policy ``spec``; same seed = same trace.

    ``simulator`` builds the engine from (capacity, policy, config): a Simulator subclass
    that models something more (bench/serving_gap.py). ``trace`` replaces the seeded serving
    trace (hand-made requests: ``load`` and ``seed`` then no longer shape it)."""
    seed = scenario.scenario.seed if seed is None else seed
    started = time.perf_counter()
    topo = build_topology(scenario)
    sim = simulator(topo.capacity, spec.build(), sim_config(scenario, spec))
    sim.observer = observer
    serving = None
    if scenario.serving is not None:
        if trace is None:
            trace = serving_trace(scenario.serving, load, seed)
        serving = ServingWorkload(sim, topo, scenario.serving, trace)
        serving.start()
    if scenario.rl is not None:
        RlWorkload(sim, topo, scenario.rl, rl_plan(scenario.rl, load)).start()
    sim.run()
    if serving is not None:
        serving.finish()
    metrics = summarize(sim.records)
    wall = time.perf_counter() - started
    return RunResult(
        spec.title, load, sim.records, metrics, wall, len(sim.records.flows), sim.events_processed
    )
