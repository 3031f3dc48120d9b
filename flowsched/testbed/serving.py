"""The serving benchmark: pd-serving on the netns testbed, live, and in the simulator side by side.

``flowsched bench serving`` runs the scenario ``pd-serving-testbed`` (pd-serving shrunk to the
testbed's 200 Mbit/s links with every time x :data:`TIME_SCALE`; its file says how). For each
seed and load every policy runs once on the testbed and once in the simulator, on the same
request trace, and so does the ideal-network bound: on the testbed its KV and KV-reuse flows
finish at line rate without being sent (private paths) while its all-to-all runs for real, so
that each side's rows are judged against the bound of the same side. On the testbed the simulator's
own serving workload (routing, batching, layer pace, Stage-1 fetches, the EP all-to-all, the
per-layer P2D) drives real flows through :class:`flowsched.testbed.live.LiveEngine`: one host
process per node sends them through the real agent of its host, under the real coordinator.

Policies: ``rmlq`` is ``policies/default.toml``, as ``flowsched sim`` runs it without a policy
file; a baseline takes that file's levels, queues and timer with the policy swapped in
(``NAME+late`` adds ``drop_late``). Every time in the file is multiplied by :data:`TIME_SCALE`
and every layer count divided by :data:`LAYER_GROUP`, so that the policy's timing constants keep
their meaning against the scenario's times.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from flowsched import policies, policyfile, scenario
from flowsched import report as shared_report
from flowsched.data import data_path
from flowsched.metrics import RunRecords, merge
from flowsched.model import FlowClass
from flowsched.sim.run import (
    IDEAL,
    IDEAL_PRIVATE,
    LATE_SUFFIX,
    PolicySpec,
    build_topology,
    ideal_spec,
    variant,
)
from flowsched.sim.run import run as simulate
from flowsched.sim.serving import ServingWorkload
from flowsched.testbed import netns, runner
from flowsched.testbed import report as testbed_report
from flowsched.testbed.live import LiveEngine
from flowsched.testbed.procstat import cpu_times, steal_share

#: the scenario the benchmark runs (bench/scenarios/pd-serving-testbed.toml)
SCENARIO = "pd-serving-testbed"
#: how much slower than pd-serving the scenario runs (its bytes / 10 on links 500x slower,
#: one link per server where pd-serving has two)
TIME_SCALE = 100.0
#: model layers per scenario layer (pd-serving's 32 layers become 8)
LAYER_GROUP = 4
#: policy arguments in seconds (x TIME_SCALE) and in layers (/ LAYER_GROUP)
SECONDS_ARGS = frozenset(
    {
        "urgent_slack",
        "deferred_slack",
        "rho_window",
        "alg1_interval",
        "feasibility_grace",
        "request_memory",
        "promotion_lead",
        "volume_lag",
    }
)
LAYER_ARGS = frozenset({"pace_layers"})
#: the policy file every run derives from
BASE_POLICY_FILE = "default.toml"
#: seconds between telling the connected host processes time zero and time zero
START_MARGIN = 0.5
#: guaranteed share of each level's htb class: none, strict priority as a switch's priority
#: queues serve them. With the contention testbed's 2 % every backlogged lower class takes
#: 4 Mbit/s whatever its priority, and here the KV flows spread over several levels at once
#: (docs/results.md, "pd-serving on the testbed", compares runs with both)
MIN_SHARE = 0.0
#: byte limit of each level's queue on the switch ports. The scenario is an RDMA fabric, which
#: does not drop (PFC), and the simulator's fluid links do not either. With the contention
#: testbed's 256 kB the decoder's port dropped 1 % of its packets in the deferred classes (pd-
#: serving-testbed, rmlq, load 0.6, seed 2); a starved TCP flow that loses its few packets in
#: flight waits out backed-off retransmission timeouts, seconds after the other layers of its
#: request arrived. 8 MB: no drop in that run (docs/results.md, "pd-serving on the testbed")
SWITCH_QUEUE_BYTES = 8_000_000
#: how many of the recorded errors are printed (all of them are in results.json)
SHOWN_ERRORS = 5


@dataclass(frozen=True, slots=True)
class ServingOptions:
    """What ``flowsched bench serving`` was asked to do."""

    out: Path
    policies: tuple[str, ...]
    loads: tuple[float, ...]
    seeds: tuple[int, ...]
    #: policies run in the simulator only (the ideal bound runs in any case, on both sides)
    sim_policies: tuple[str, ...] = (IDEAL,)
    simulate_only: bool = False
    scenario: str = SCENARIO
    prefix: str = "fsv"
    command: str = ""


@dataclass(slots=True)
class LiveRun:
    """What one policy measured on the testbed at one load and seed."""

    records: RunRecords
    errors: list[str] = field(default_factory=list)
    wall_seconds: float = 0.0
    #: share of the machine's CPU time the hypervisor stole during the run (NaN: not reported)
    steal: float = math.nan
    #: packets the testbed's shaped ports dropped during the run
    dropped_packets: int = 0


# ----------------------------------------------------------------------------- policy files
def policy_document(name: str) -> dict[str, Any]:
    """The TOML document of ``name``'s policy file for the scenario (see the module docstring)."""
    text = (data_path("policies") / BASE_POLICY_FILE).read_text(encoding="utf-8")
    document = copy.deepcopy(tomllib.loads(text))
    section = document["policy"]
    base = name.removesuffix(LATE_SUFFIX)
    if base not in policies.names():
        raise ValueError(f"unknown policy {base!r} (known: {', '.join(policies.names())})")
    section["name"], args = variant(name, section["name"], section.get("args", {}))
    section["args"] = args
    if base == "rmlq":  # the code defaults in seconds or layers that the file leaves out
        from flowsched.policies.rmlq import Args

        for key in SECONDS_ARGS | LAYER_ARGS:
            args.setdefault(key, getattr(Args(), key))
    section["timer_period"] = section.get("timer_period", 0.001) * TIME_SCALE
    for key in SECONDS_ARGS & set(args):
        args[key] = args[key] * TIME_SCALE
    for key in LAYER_ARGS & set(args):
        args[key] = max(1, round(args[key] / LAYER_GROUP))
    for rule in document.get("classes", {}).values():
        if "deadline" in rule:
            rule["deadline"] = rule["deadline"] * TIME_SCALE
    document["description"] = f"{name} for {SCENARIO} (times x {TIME_SCALE:g})"
    return document


def write_policy_file(name: str, path: Path) -> policyfile.PolicyConfig:
    """Write ``name``'s policy file to ``path`` and return it parsed (checked)."""
    text = policyfile.to_toml(policy_document(name))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return policyfile.load(path)


def sim_spec(name: str, work: Path) -> PolicySpec:
    """The simulator's spec of ``name`` from the same file the testbed run uses."""
    if name == IDEAL:
        return ideal_spec(write_policy_file("static", work / "ideal.toml").num_levels)
    cfg = write_policy_file(name, work / f"{name}.toml")
    return PolicySpec(
        cfg.policy,
        dict(cfg.args),
        cfg.num_levels,
        cfg.timer_period,
        label=name,
        level_queue=cfg.level_queue,
    )


# ----------------------------------------------------------------------------- one live run
def topology_spec(scen: scenario.Scenario, prefix: str) -> netns.TopologySpec:
    """The testbed of a serving scenario: one host per node, its NIC rate, strict priority,
    switch queues that do not drop."""
    assert scen.serving is not None
    return netns.TopologySpec(
        prefix=prefix,
        hosts=len(build_topology(scen).nodes),
        rate_mbit=scen.serving.nic_gbps * 1000,
        min_share=MIN_SHARE,
        switch_queue_bytes=SWITCH_QUEUE_BYTES,
    )


def node_hosts(topo: netns.Topology, scen: scenario.Scenario) -> dict[str, str]:
    """The scenario's nodes (prefill servers, decode servers, KV store) on testbed hosts."""
    nodes = list(build_topology(scen).nodes)
    if len(nodes) > len(topo.hosts):
        raise ValueError(f"{len(nodes)} nodes need as many hosts, not {len(topo.hosts)}")
    return {node: host.name for node, host in zip(nodes, topo.hosts, strict=False)}


def job_nodes(cfg: scenario.ServingSection, job: str) -> list[str]:
    """The prefill servers of a batch's instance (batch jobs are named ``i<instance>/b<n>``)."""
    instance = int(job.split("/", 1)[0].removeprefix("i"))
    first = instance * cfg.servers_per_instance
    return [f"{cfg.prefill_prefix}{first + s}" for s in range(cfg.servers_per_instance)]


def run_live(
    topo: netns.Topology,
    scen: scenario.Scenario,
    load: float,
    seed: int,
    policy_path: Path,
    workdir: Path,
    *,
    private: frozenset[FlowClass] = frozenset(),
) -> LiveRun:
    """One policy at one load and seed on the testbed; the records as the simulator keeps them.

    Flows of the ``private`` classes finish at line rate without being sent (the ideal bound).
    """
    assert scen.serving is not None
    cfg = policyfile.load(policy_path)
    workdir.mkdir(parents=True, exist_ok=True)
    for journal in workdir.glob("host-*.json"):  # an earlier run's: a host that writes none
        journal.unlink()  # (killed, crashed) must not pass its errors or flows off as this run's
    topo.configure_classes([m.dscp for m in cfg.levels])
    hosts = node_hosts(topo, scen)
    trace = scenario.serving_trace(scen.serving, load, seed)
    timeout = trace[-1].arrival * 3 + 60 if trace else 60.0
    started, machine = time.monotonic(), cpu_times()
    errors: list[str] = []
    with runner.private_token() as token, runner.processes() as procs:
        runner.start_agents(topo, procs, policy_path, topo.spec.rate_bytes, workdir, token=token)
        serving = scen.serving
        engine = LiveEngine(
            workdir / "engine.sock",
            hosts,
            lambda job: [hosts[node] for node in job_nodes(serving, job)],
            private=private,
            private_rate=topo.spec.rate_bytes * netns.TCP_PAYLOAD_SHARE,
        )
        try:  # the engine's socket and thread must not outlive a start that fails
            names = sorted(set(hosts.values()))
            workers = _start_hosts(topo, procs, names, workdir)
            workload = ServingWorkload(engine, build_topology(scen), serving, trace)
            try:
                engine.wait_for_hosts(set(hosts.values()), 30.0)
                engine.start(START_MARGIN)
                workload.start()
                engine.run(timeout)
            except TimeoutError as exc:
                errors.append(str(exc))
        finally:
            engine.stop()
        workload.finish()
        unfinish_failed(engine.records, engine.failed)
        errors += runner.wait_workers(workers, 30.0, names, [_host_log(workdir, n) for n in names])
        errors += runner.ended_early(p for p in procs if p not in workers)
    errors += engine.errors + journal_errors(workdir, engine.failed)
    return LiveRun(
        engine.records,
        errors,
        time.monotonic() - started,
        steal_share(machine, cpu_times()),
        topo.run_drops(),
    )


def unfinish_failed(records: RunRecords, failed: set[int]) -> int:
    """Mark as never finished every request with a KV or KV-reuse flow in ``failed`` (the
    flow ids the hosts reported failed): the engine finishes a failed flow so that the workload
    goes on, but its bytes never arrived. Returns how many requests it marked."""
    classes = {FlowClass.KV.label, FlowClass.KV_REUSE.label}
    lost = {
        f.request
        for f in records.flows
        if f.flow_id in failed and f.cls in classes and f.request is not None
    }
    marked = 0
    for request in records.requests:
        if request.request in lost and request.finished is not None:
            request.finished = None
            marked += 1
    return marked


def journal_errors(workdir: Path, reported: set[int]) -> list[str]:
    """The errors in the hosts' journals (``host-*.json``) of flows other than ``reported``
    (those the engine heard of already), each named with its host."""
    errors = []
    for path in sorted(workdir.glob("host-*.json")):
        try:
            events = json.loads(path.read_text(encoding="utf-8") or "[]")
        except (OSError, ValueError) as exc:  # a host killed while it wrote it
            errors.append(f"{path.stem}: journal unreadable ({exc})")
            continue
        errors += [
            f"{path.stem}: flow {e['id']}: {e['error']}"
            for e in events
            if "error" in e and e.get("id") not in reported
        ]
    return errors


def _start_hosts(
    topo: netns.Topology,
    procs: list[subprocess.Popen[bytes]],
    names: Iterable[str],
    workdir: Path,
) -> list[subprocess.Popen[bytes]]:
    ips = json.dumps({h.name: h.data_ip for h in topo.hosts})
    by_name = {h.name: h for h in topo.hosts}
    started = []
    for name in names:
        argv = [
            sys.executable,
            "-m",
            "flowsched.testbed.serving_host",
            "--host",
            name,
            "--engine",
            str(workdir / "engine.sock"),
            "--ips",
            ips,
            "--out",
            str(workdir / f"host-{name}.json"),
        ]
        env = dict(os.environ, FLOWSCHED_SOCKET=str(workdir / f"{name}.sock"))
        with _host_log(workdir, name).open("ab") as log:  # off the user's terminal
            proc = subprocess.Popen(topo.ns_command(by_name[name].netns, argv), env=env, stderr=log)
        procs.append(proc)
        started.append(proc)
    return started


def _host_log(workdir: Path, name: str) -> Path:
    """Where the serving host ``name`` logs (its stderr)."""
    return workdir / f"host-{name}.log"


# ----------------------------------------------------------------------------- the benchmark
def run(
    options: ServingOptions,
    stream: TextIO | None = None,
    recorded_errors: list[str] | None = None,
) -> list[shared_report.Outcome]:
    """Run the benchmark, print its table and write its report into ``options.out``.

    The errors the testbed runs recorded are printed on stderr (a count and the first few) and
    appended to ``recorded_errors`` when given (the CLI exits 1 on any). TestbedBusy when
    another testbed benchmark runs (:func:`~flowsched.testbed.netns.benchmark_lock`)."""
    # sys.stdout at call time: a default bound at import wrote past a redirected stdout
    stream = sys.stdout if stream is None else stream
    scen = scenario.load(options.scenario)
    if scen.serving is None:
        raise ValueError(f"{options.scenario}: not a serving scenario")
    work = options.out / "work"
    specs = {name: sim_spec(name, work / "policies") for name in options.policies if name != IDEAL}
    sim_only = {
        name: sim_spec(name, work / "policies")
        for name in dict.fromkeys((IDEAL, *options.sim_policies))
        if name not in specs
    }
    spec = topology_spec(scen, options.prefix)
    reason = "asked" if options.simulate_only else netns.probe(spec.prefix)
    runs = len(options.loads) * len(options.seeds)
    testbed: dict[tuple[str, float], list[RunRecords]] = {}
    errors: list[str] = []
    live_runs: list[dict[str, Any]] = []
    steal = None
    if reason is None:
        live = [IDEAL, *specs]
        with netns.benchmark_lock():  # one testbed benchmark at a time (their timings)
            progress = shared_report.Progress(runs * (len(specs) + len(sim_only) + len(live)))
            machine = cpu_times()
            try:
                with netns.testbed(spec, probed=True) as topo:
                    errors = _testbed_runs(topo, scen, options, live, testbed, progress, live_runs)
            except netns.TestbedUnavailable as exc:  # the build failed, before any run
                progress.close()
                reason = str(exc)
            else:
                steal = steal_share(machine, cpu_times())
    if reason is not None:
        if not options.simulate_only:
            print(f"testbed unavailable: {reason}; running the simulator only", file=sys.stderr)
        progress = shared_report.Progress(runs * (len(specs) + len(sim_only)))
    outcomes = _outcomes(scen, options, {**sim_only, **specs}, testbed, progress)
    progress.close()
    title = f"{scen.scenario.name}, seeds {', '.join(map(str, options.seeds))} pooled"
    print(shared_report.table(outcomes, title), file=stream)
    if steal is not None:
        print(f"the hypervisor stole {steal:.1%} of the machine's CPU time", file=stream)
        dropped = [r["dropped_packets"] for r in live_runs]
        print(
            f"the testbed's ports dropped {sum(dropped)} packets"
            f" ({sum(1 for d in dropped if d == 0)} of {len(dropped)} runs without a drop)",
            file=stream,
        )
    if errors:
        print(
            f"error: {len(errors)} errors were recorded during the testbed runs; the testbed "
            "figures measure incomplete runs (all in results.json):",
            file=sys.stderr,
        )
        for line in errors[:SHOWN_ERRORS]:
            print(f"  {line}", file=sys.stderr)
        if len(errors) > SHOWN_ERRORS:
            print(f"  ... and {len(errors) - SHOWN_ERRORS} more", file=sys.stderr)
    if recorded_errors is not None:
        recorded_errors += errors
    meta = {
        "command": options.command or "flowsched bench serving",
        "scenario": scen.scenario.name,
        "seeds": list(options.seeds),
        "loads": list(options.loads),
        "mode": "testbed + simulator" if reason is None else f"simulator only ({reason})",
        "time_scale": TIME_SCALE,
        "switch_queue_bytes": spec.switch_queue_bytes,
        "steal": steal,
        "errors": errors,
        "testbed_runs": live_runs,
    }
    paths = shared_report.write_all(options.out, outcomes, meta)
    print("wrote " + ", ".join(str(p) for p in paths), file=stream)
    return outcomes


def _testbed_runs(
    topo: netns.Topology,
    scen: scenario.Scenario,
    options: ServingOptions,
    names: list[str],
    testbed: dict[tuple[str, float], list[RunRecords]],
    progress: shared_report.Progress,
    runs: list[dict[str, Any]],
) -> list[str]:
    """Every policy at every load and seed on the testbed, into ``testbed`` (and each run's
    wall time and CPU steal into ``runs``); the errors. A run that could not start is one
    of them, without records: the other runs go on."""
    errors: list[str] = []
    work = options.out / "work"
    for load in options.loads:
        for seed in options.seeds:
            for name in names:
                where = f"{name}, load {load:g}, seed {seed}"
                try:
                    measured = run_live(
                        topo,
                        scen,
                        load,
                        seed,
                        work / "policies" / f"{name}.toml",
                        work / f"{name}-load{load:g}-seed{seed}",
                        private=IDEAL_PRIVATE if name == IDEAL else frozenset(),
                    )
                except (RuntimeError, OSError) as exc:  # an agent or host that did not start
                    errors.append(f"{where}: {exc}")
                    progress.advance(f"{where}: testbed (did not start)")
                    continue
                testbed.setdefault((name, load), []).append(measured.records)
                errors += [f"{where}: {e}" for e in measured.errors]
                runs.append(
                    {
                        "policy": name,
                        "load": load,
                        "seed": seed,
                        "wall_s": round(measured.wall_seconds, 1),
                        "steal": None if math.isnan(measured.steal) else round(measured.steal, 4),
                        "dropped_packets": measured.dropped_packets,
                    }
                )
                progress.advance(f"{where}: testbed")
    return errors


def _outcomes(
    scen: scenario.Scenario,
    options: ServingOptions,
    specs: Mapping[str, PolicySpec],
    testbed: Mapping[tuple[str, float], list[RunRecords]],
    progress: shared_report.Progress,
) -> list[shared_report.Outcome]:
    """The simulator's runs, and one row per policy and load for each source."""
    outcomes = []
    for load in options.loads:
        for name, policy_spec in specs.items():
            seeds = []
            for seed in options.seeds:
                seeds.append(simulate(scen, policy_spec, load, seed).records)
                progress.advance(f"{name}, load {load:g}, seed {seed}: simulator")
            label = f"{name} sim" if name in options.policies else name
            outcomes.append(
                shared_report.Outcome.from_records(
                    label,
                    load,
                    merge(seeds),
                    bound=policy_spec.bound,
                    oracle=testbed_report.is_oracle(name),
                    seeds=seeds,
                )
            )
        for name in dict.fromkeys((IDEAL, *specs)):
            if (records := testbed.get((name, load))) is not None:
                outcomes.append(
                    shared_report.Outcome.from_records(
                        f"{name} testbed",
                        load,
                        merge(records),
                        bound=name == IDEAL,
                        oracle=testbed_report.is_oracle(name),
                        seeds=records,
                        source="testbed",
                    )
                )
    return outcomes
