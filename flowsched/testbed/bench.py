"""The contention benchmark: every policy on the same seeded traces, on the testbed and in sim."""

from __future__ import annotations

import math
import shlex
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from flowsched import policies, policyfile
from flowsched import report as shared_report
from flowsched.data import data_path
from flowsched.metrics import RunMetrics, RunRecords
from flowsched.sim.run import IDEAL, IDEAL_PRIVATE, LATE_SUFFIX, variant
from flowsched.testbed import netns, replay, report, runner
from flowsched.testbed.procstat import cpu_times, steal_share
from flowsched.testbed.trace import ScenarioParams, Trace, Transfer, generate

#: the benchmark's scenario.toml and policies/ (package data; bench/contention links to it)
BENCH_DIR = data_path("contention")


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """What ``flowsched bench contention`` was asked to do."""

    out: Path
    policies: tuple[str, ...]
    params: ScenarioParams
    seed: int
    spec: netns.TopologySpec
    simulate_only: bool = False
    command: str = ""
    calibrate: bool = True
    #: the control plane of the main runs: "agent" = the real coordinator + one agent per
    #: host + the NCCL plugin for TP (the default); "mini" = the testbed's minimal controller
    control: str = "agent"
    #: policies run a second time with the other control plane (an ablation, after the rest)
    ablation_policies: tuple[str, ...] = ()
    #: how many traces: seeds ``seed``, ``seed + 1``, ... Every policy runs every trace (seed
    #: by seed, all policies of a seed back to back) and the records of all are pooled
    seeds: int = 1
    #: policies replayed in the simulator only (the ideal bound, the oracle, more baselines)
    sim_policies: tuple[str, ...] = ()

    @property
    def seed_list(self) -> list[int]:
        """The seeds of the traces, in the order they run."""
        return list(range(self.seed, self.seed + max(1, self.seeds)))


def other_control(control: str) -> str:
    """The control plane an ablation run uses: the one the main runs did not."""
    return "mini" if control == "agent" else "agent"


#: result of the last :func:`calibrate` run (reported in the notes)
CALIBRATION: dict[str, float] = {}
#: what went wrong in the last calibration run (its figure is then left out; notes and stderr)
CALIBRATION_ERRORS: list[str] = []


def policy_path(name: str) -> Path:
    """The benchmark's policy file for ``name`` (``bench/contention/policies/NAME.toml``)."""
    path = BENCH_DIR / "policies" / f"{name}.toml"
    if not path.exists():
        raise FileNotFoundError(f"no benchmark policy file {path}")
    return path


def policy_document(name: str) -> tuple[dict[str, Any], Path]:
    """``name``'s benchmark policy file as a TOML document, and the file it is made from.

    A name with its own file (``bench/contention/policies/NAME.toml``) is that file;
    ``NAME+late`` is NAME's file with ``drop_late = true`` (late-dropping: a KV transfer past
    its deadline goes to the scavenger level); a registered policy without a file (e.g.
    ``llf``) takes static's file (the K, hardware queues, marking and timer every benchmark
    file shares) with the policy swapped in. FileNotFoundError when there is neither."""
    own = BENCH_DIR / "policies" / f"{name}.toml"
    base = name.removesuffix(LATE_SUFFIX)
    path = own if own.exists() else BENCH_DIR / "policies" / f"{base}.toml"
    if not path.exists():
        if base not in policies.names():
            raise FileNotFoundError(
                f"no benchmark policy file {own} and no registered policy {base!r}"
            )
        path = policy_path("static")
    document = tomllib.loads(path.read_text(encoding="utf-8"))
    if path != own:
        section = document["policy"]
        section["name"], section["args"] = variant(name, section["name"], section.get("args", {}))
        document["description"] = f"{document.get('description', base)} ({name})"
    return document, path


def policy_config(name: str) -> policyfile.PolicyConfig:
    """``name``'s benchmark policy, parsed and checked (:func:`policy_document` says which);
    :class:`~flowsched.policyfile.PolicyFileError` for a ``NAME+late`` NAME does not take."""
    document, path = policy_document(name)
    source = str(path) if path.stem == name else f"{path} ({name})"
    return policyfile.from_mapping(document, source=source)


def testbed_policy_file(name: str, work: Path) -> Path:
    """The policy file a testbed run of ``name`` loads: the benchmark's own file, or the
    document :func:`policy_document` makes, written to ``work``."""
    document, path = policy_document(name)
    if path.stem == name:
        return path
    work.mkdir(parents=True, exist_ok=True)
    made = work / f"{name}.toml"
    made.write_text(policyfile.to_toml(document), encoding="utf-8")
    return made


class Progress:
    """The shared progress bar (:class:`flowsched.report.Progress`), one unit per run."""

    def __init__(self, total: int) -> None:
        self._bar = shared_report.Progress(total)

    def step(self, label: str) -> None:
        self._bar.advance(label)

    def close(self) -> None:
        self._bar.close()


def run(options: BenchOptions, stream: TextIO | None = None) -> list[report.PolicyResult]:
    """Run the benchmark, print its table and write its report into ``options.out``.

    Without a testbed (no root, a kernel feature or program missing, a build that failed) it
    says so on stderr and runs the simulator only. Errors the testbed runs recorded are listed
    on stderr (the affected rows are marked); the caller decides the exit status from each
    result's ``errors``. :class:`~flowsched.testbed.netns.TestbedBusy` (another run holds the
    testbed, or another testbed benchmark runs: :func:`~flowsched.testbed.netns.benchmark_lock`)
    propagates: that is no reason to fall back; so does a plugin the testbed runs need and
    that is not built (:func:`check_plugin`), at once.
    """
    stream = sys.stdout if stream is None else stream  # at call time (a redirected stdout)
    traces = [generate(options.params, options.spec.rate_bytes, s) for s in options.seed_list]
    reason = None if options.simulate_only else netns.probe(options.spec.prefix)
    if reason is None and not options.simulate_only:
        check_plugin(options)
    results = [report.PolicyResult(name, None, RunMetrics()) for name in options.policies]
    steal = math.nan
    sim_only = [report.PolicyResult(name, None, RunMetrics()) for name in options.sim_policies]
    progress: Progress | None = None
    mode = "testbed + simulator replay"
    if reason is None and not options.simulate_only:
        with netns.benchmark_lock():  # one testbed benchmark at a time (their timings)
            progress = _progress(options, len(traces), testbed=True)
            machine = cpu_times()
            try:
                _testbed(options, traces, results, progress)
            except netns.TestbedUnavailable as exc:  # the build failed, before any run
                progress.close()
                reason = str(exc)
                for result in results:
                    result.seeds.clear()
            else:
                steal = steal_share(machine, cpu_times())
    if reason is not None:
        print(f"testbed unavailable: {reason}; running the simulator only", file=sys.stderr)
    if reason is not None or options.simulate_only:
        progress = _progress(options, len(traces), testbed=False)
        for trace in traces:
            for result in results:
                sim = _simulate(trace, result.policy, progress)
                result.seeds.append(report.SeedRun(trace.seed, sim))
        mode = "simulator only" + (f" ({reason})" if reason else "")
    assert progress is not None
    for trace in traces:  # cheap: after the testbed, so a long replay never delays it
        for result in sim_only:
            result.seeds.append(
                report.SeedRun(trace.seed, _simulate(trace, result.policy, progress))
            )
    results += sim_only
    progress.close()
    for result in results:
        result.pool()
    meta = _meta(options, traces, mode, results)
    if not math.isnan(steal):
        meta["steal"] = round(steal, 4)
    _print_summary(results, steal, stream)  # before the files: a write error keeps the table
    report_errors(results)
    if CALIBRATION_ERRORS:
        print(f"error: {_calibration_failed()}", file=sys.stderr)
    paths = report.write(results, meta, options.out)
    print("wrote " + ", ".join(str(p) for p in paths), file=stream)
    return results


def check_plugin(options: BenchOptions) -> None:
    """:class:`~flowsched.nccl.PluginNotFoundError`, saying how to build it, when a testbed
    run of ``options`` drives the NCCL plugin (the TP ranks of the agent control plane) and
    the library is not there (an install with ``FLOWSCHED_SKIP_PLUGIN=1``): each such run
    failed only after its testbed and daemons were up, an error per run."""
    controls = {options.control}
    if options.ablation_policies:
        controls.add(other_control(options.control))
    if "agent" not in controls:
        return
    from flowsched.nccl import PluginNotFoundError, plugin_path

    try:
        plugin_path()
    except PluginNotFoundError as exc:
        raise PluginNotFoundError(
            f"the testbed's TP ranks drive the NCCL plugin (agent control plane): {exc}; "
            "or run with --control mini (no plugin, no agents) or --simulate-only"
        ) from None


def _progress(options: BenchOptions, traces: int, *, testbed: bool) -> Progress:
    """The progress bar of a run with or without the testbed (one unit per run)."""
    per_trace = len(options.policies) * (2 if testbed else 1) + len(options.sim_policies)
    if testbed:
        per_trace += len(options.ablation_policies)
    return Progress(traces * per_trace)


def _print_summary(results: list[report.PolicyResult], steal: float, stream: TextIO) -> None:
    print(report.render_table(report.table_rows(results)), file=stream)
    for line in report.headline(results):
        print(line, file=stream)
    header, rows = report.seed_rows(results)
    if len(header) > 4:
        print("\nSLO attainment seed by seed:", file=stream)
        print(report.render_table(rows, columns=header), file=stream)
    promo = report.promotion_summary(results)
    if promo.get("count"):
        print(
            f"promotion latency: median {promo['median'] * 1e3:.1f} ms "
            f"(p90 {promo['p90'] * 1e3:.1f} ms, n={promo['count']})",
            file=stream,
        )
    if not math.isnan(steal):  # a stolen millisecond delays every packet and promotion
        print(
            f"the hypervisor stole {steal:.1%} of the machine's CPU time during the testbed runs"
            " (/proc/stat)",
            file=stream,
        )
        print(report.drops_line(results), file=stream)


#: how many recorded errors are printed (all of them are in results.json)
SHOWN_ERRORS = 5


def report_errors(results: list[report.PolicyResult], stream: TextIO | None = None) -> int:
    """Print how many errors the testbed runs recorded and the first :data:`SHOWN_ERRORS` of
    them on ``stream`` (default stderr); return the count (0: nothing printed)."""
    stream = sys.stderr if stream is None else stream
    errors = [f"{r.policy}: {e}" for r in results for e in r.errors]
    if errors:
        print(
            f"error: {len(errors)} errors were recorded during the testbed runs; the rows "
            f"marked '{report.ERROR_MARK}' measured incomplete runs (all in results.json):",
            file=stream,
        )
        for line in errors[:SHOWN_ERRORS]:
            print(f"  {line}", file=stream)
        if len(errors) > SHOWN_ERRORS:
            print(f"  ... and {len(errors) - SHOWN_ERRORS} more", file=stream)
    return len(errors)


def simulate(trace: Trace, name: str) -> RunRecords:
    """``trace`` replayed in the simulator under the benchmark's policy ``name``
    (:func:`policy_config`), or under :data:`IDEAL`, the ideal-network bound."""
    # the ceiling: transfers on private full-rate paths, TP alone on the links
    ideal = name == IDEAL
    cfg = policy_config("static" if ideal else name)
    return replay.replay(
        trace,
        cfg.make_policy(),
        timer_period=cfg.timer_period,
        level_queue=cfg.level_queue,
        private_classes=IDEAL_PRIVATE if ideal else frozenset(),
    )


def _simulate(trace: Trace, name: str, progress: Progress) -> RunRecords:
    records = simulate(trace, name)
    progress.step(f"{name}: simulator, seed {trace.seed}")
    return records


def calibration_trace(rate_bytes: float, size: int = 1_500_000, count: int = 8) -> Trace:
    """Isolated KV transfers h0 -> h2, one at a time: the testbed's per-transfer overhead."""
    transfers = [
        Transfer(i + 1, "kv", "h0", "h2", round(0.1 + i * 0.35, 3), size) for i in range(count)
    ]
    return Trace(0, 4, rate_bytes, 0.1 + count * 0.35, 0.0, [], transfers)


def calibrate(
    topo: netns.Topology,
    rate_bytes: float,
    work: Path,
    control: str = "agent",
    errors: list[str] | None = None,
) -> dict[str, float]:
    """Median completion time of an isolated transfer on the testbed vs the simulator's: size /
    the link's payload rate (:data:`netns.TCP_PAYLOAD_SHARE` of ``rate_bytes``). Empty, with
    the reasons appended to ``errors``, when the run recorded errors or no transfer completed:
    an incomplete run's median is not the testbed's overhead."""
    trace = calibration_trace(rate_bytes)
    path = policy_path("fair")
    try:
        run = runner.run_policy(topo, trace, policyfile.load(path), path, work, control=control)
    except (RuntimeError, OSError) as exc:  # a daemon or worker that did not start
        if errors is not None:
            errors.append(str(exc))
        return {}
    fcts = [f.fct for f in run.records.flows]
    problems = run.errors + ([] if fcts else ["no transfer completed"])
    if problems:
        if errors is not None:
            errors += problems
        return {}
    size, median = trace.transfers[0].size, report.nearest_rank(fcts, 0.5)
    ideal = size / (rate_bytes * netns.TCP_PAYLOAD_SHARE)
    return {
        "size": size,
        "ideal_s": ideal,
        "testbed_median_s": median,
        "overhead_s": median - ideal,
        "samples": len(fcts),
    }


def _testbed(
    options: BenchOptions,
    traces: list[Trace],
    results: list[report.PolicyResult],
    progress: Progress,
) -> None:
    work = options.out / "work"
    other = other_control(options.control)
    with netns.testbed(options.spec, probed=True) as topo:  # run() has probed
        if options.calibrate:
            CALIBRATION_ERRORS.clear()
            CALIBRATION.update(
                calibrate(
                    topo,
                    traces[0].rate_bytes,
                    work / "calibration",
                    options.control,
                    CALIBRATION_ERRORS,
                )
            )
        for trace in traces:
            suffix = f"-seed{trace.seed}" if len(traces) > 1 else ""
            for result in results:
                records = _testbed_run(
                    topo, trace, result, work / f"{result.policy}{suffix}", options
                )
                progress.step(f"{result.policy}: testbed, seed {trace.seed}")
                sim = _simulate(trace, result.policy, progress)
                result.seeds.append(report.SeedRun(trace.seed, sim, records))
            for result in results:
                if result.policy in options.ablation_policies:
                    path = work / f"{result.policy}-{other}{suffix}"
                    _ablation_run(topo, trace, result, path, other)
                    progress.step(f"{result.policy}: testbed, {other} control (ablation)")


def _testbed_run(
    topo: netns.Topology,
    trace: Trace,
    result: report.PolicyResult,
    work: Path,
    options: BenchOptions,
) -> RunRecords | None:
    """One policy on one trace on the testbed: returns its records; the other measurements
    accumulate in ``result``. A run that could not start (a daemon or worker that failed,
    a tc error) is an error of ``result`` and has no records: the other runs go on."""
    path = testbed_policy_file(result.policy, work)
    result.control = options.control
    try:
        measured = runner.run_policy(
            topo, trace, policyfile.load(path), path, work, control=options.control
        )
    except (RuntimeError, OSError) as exc:
        result.errors.append(f"seed {trace.seed}: {exc}")
        return None
    result.promotions += [p[2] for p in measured.promotions]
    for port, classes in measured.class_bytes.items():
        total = result.class_bytes.setdefault(port, {})
        for minor, count in classes.items():
            total[minor] = total.get(minor, 0) + count
    result.dropped_packets += measured.dropped_packets
    result.errors += [f"seed {trace.seed}: {e}" for e in measured.errors]
    result.wall_seconds += measured.wall_seconds
    for name, seconds in measured.cpu_seconds.items():
        result.cpu_seconds[name] = round(result.cpu_seconds.get(name, 0.0) + seconds, 2)
    result.admission = sorted(result.admission + measured.admission)
    return measured.records


def _ablation_run(
    topo: netns.Topology, trace: Trace, result: report.PolicyResult, work: Path, control: str
) -> None:
    """The same policy on the same trace with the other control plane."""
    path = testbed_policy_file(result.policy, work)
    result.ablation_control = control
    try:
        measured = runner.run_policy(
            topo, trace, policyfile.load(path), path, work, control=control
        )
    except (RuntimeError, OSError) as exc:
        result.errors.append(f"seed {trace.seed}, ablation ({control} control): {exc}")
        return
    run = next(s for s in result.seeds if s.seed == trace.seed)
    run.ablation_records = measured.records
    result.ablation_promotions += [p[2] for p in measured.promotions]
    result.errors += [
        f"seed {trace.seed}, ablation ({control} control): {e}" for e in measured.errors
    ]


def _meta(
    options: BenchOptions, traces: list[Trace], mode: str, results: list[report.PolicyResult]
) -> dict[str, object]:
    spec = options.spec
    return {
        "command": options.command or "flowsched bench contention",
        "mode": mode,
        "setup": (
            f"{spec.hosts} host namespaces + a switch namespace (Linux bridge), veth links at "
            f"{spec.rate_mbit:g} Mbit/s, htb strict priority by DSCP on every host egress and "
            f"switch port, {spec.min_share:.0%} guaranteed per class, switch queues "
            f"{spec.switch_queue_bytes // 1000} kB per class."
        ),
        "seed": traces[0].seed,
        "seeds": [t.seed for t in traces],
        "duration": traces[0].duration,
        "load": traces[0].load,
        "flows": sum(len(t.transfers) for t in traces),
        "rate_mbit": spec.rate_mbit,
        "control": options.control,
        "ablation_policies": list(options.ablation_policies),
        "notes": _notes(results),
    }


#: who carries what, per control plane (the report's first notes)
CONTROL_NOTES = {
    "agent": "levels from the real `flowsched coordinator` (switch namespace, management "
    "network) and one real `flowsched agent` per host (table /dev/shm/fsE-hN-table, own SDK "
    "socket, NIC counters sampled every 100 ms, link capacity set to the shaped rate; links "
    "<host>:tx and <host>:rx); KV, "
    "parameter-sync and experience transfers open their flow through flowsched.client with "
    "dst_node = the receiving host (so the flow's links include the receiver's ingress) and "
    "send with flowsched.transfer (socket marked with the flow's level, follows promotions); "
    "TP collectives go through the NCCL net plugin driven by flowsched.nccl.harness "
    "(FLOWSCHED_TABLE, FLOWSCHED_CLASS=tp), the plugin marking its sockets from the table.",
    "mini": "levels from the testbed's minimal controller (flowsched.testbed.minictl, the same "
    "policy objects as the simulator, link loads of both directions of every host link from "
    "the switch port counters); KV, parameter-sync and experience transfers through "
    "flowsched.transfer; TP collectives over plain TCP sockets marked with the TP flow's "
    "level (no agent, no plugin).",
}


def _notes(results: list[report.PolicyResult]) -> list[str]:
    controls = sorted({r.control for r in results if r.testbed is not None})
    notes = [f"Rows '{report.CONTROL_LABELS[c]}': {CONTROL_NOTES[c]}" for c in controls]
    ablations = sorted({r.ablation_control for r in results if r.ablation is not None})
    notes += [
        f"Rows '{report.CONTROL_LABELS[c]} (ablation)': the same trace again, {CONTROL_NOTES[c]}"
        for c in ablations
    ]
    if CALIBRATION:
        c = CALIBRATION
        notes.append(
            f"Measured per-transfer overhead: an isolated {c['size'] / 1e6:.1f} MB KV transfer "
            f"completes in {c['testbed_median_s'] * 1e3:.1f} ms (median of {c['samples']:.0f}) "
            f"on the testbed against {c['ideal_s'] * 1e3:.1f} ms (size / payload rate) in the "
            f"simulator ({c['overhead_s'] * 1e3:+.1f} ms: connection setup, admission, TCP slow "
            "start, digest and acknowledgement)."
        )
    if CALIBRATION_ERRORS:
        notes.append(_calibration_failed())
    notes += [_gap_note(r) for r in results if r.testbed_records is not None]
    admitted = [r for r in results if r.admission]
    if admitted:
        notes.append(
            "Admission on the testbed (a transfer's open -> its first level in hand; the "
            "simulator admits instantly), median / p90: "
            + ", ".join(
                f"{r.policy} {report.nearest_rank(r.admission, 0.5) * 1e3:.1f} / "
                f"{report.nearest_rank(r.admission, 0.9) * 1e3:.1f} ms"
                for r in admitted
            )
            + "."
        )
    static = next((r for r in results if r.policy == "static" and r.testbed), None)
    if static and static.testbed and static.testbed.cct_mean and static.sim.cct_mean:
        notes.append(
            "Under static, TP is alone in the top class, so testbed minus simulator CCT is the "
            "cost of a collective exchange itself (a Python TP rank driving the NCCL plugin, "
            "or its socket pair under --control mini, with TCP and htb, on 2 shared cores): "
            f"{(static.testbed.cct_mean - static.sim.cct_mean) * 1e3:+.1f} ms per "
            "collective; the other policies' CCT gaps include it."
        )
    notes += [_ablation_note(r) for r in results if r.ablation is not None]
    errors = sum(len(r.errors) for r in results)
    if errors:
        notes.append(f"{errors} errors were recorded (see results.json).")
    return notes


def _calibration_failed() -> str:
    """The line saying why the per-transfer overhead is missing (notes and stderr)."""
    return (
        "The calibration run (isolated transfers: the testbed's per-transfer overhead) was "
        f"incomplete, so its figure is left out: {'; '.join(CALIBRATION_ERRORS)}."
    )


def _kv_gaps(testbed: RunRecords, sim: RunRecords) -> list[float]:
    sim_fct = {f.request: f.fct for f in sim.flows if f.cls == "kv"}
    return [
        f.fct - sim_fct[f.request] for f in testbed.flows if f.cls == "kv" and f.request in sim_fct
    ]


def pooled_kv_gap(result: report.PolicyResult) -> tuple[int, float] | None:
    """(matched KV flows, median testbed - simulator completion time in seconds) over every
    seed of ``result``; a testbed flow is matched with the simulated flow of its request in the
    same seed's replay."""
    gaps = [
        g
        for run in result.seeds
        if run.testbed_records is not None
        for g in _kv_gaps(run.testbed_records, run.sim_records)
    ]
    return (len(gaps), report.nearest_rank(gaps, 0.5)) if gaps else None


def _gap_note(r: report.PolicyResult) -> str:
    gap = pooled_kv_gap(r)
    if gap is None:
        return f"{r.policy}: no KV flow completed on both."
    return (
        f"{r.policy}: the same KV flow completes {abs(gap[1]) * 1e3:.1f} ms "
        f"{'later' if gap[1] >= 0 else 'earlier'} on the testbed than in the simulator "
        f"(median over {gap[0]} flows matched by request)."
    )


def _ablation_note(r: report.PolicyResult) -> str:
    main = report.top_share(r.testbed_records) if r.testbed_records else None
    other = report.top_share(r.ablation_records) if r.ablation_records else None
    text = f"{r.policy} with the {r.ablation_control} control plane (ablation): "
    if main is not None and other is not None:
        text += (
            f"{other:.0%} of KV flows were admitted at level 0 against {main:.0%} with the "
            f"{r.control} control plane. "
        )
    if r.ablation_promotions:
        med = report.nearest_rank(r.ablation_promotions, 0.5)
        text += (
            f"Decision -> first packet in the new class at the switch: median "
            f"{med * 1e3:.1f} ms over {len(r.ablation_promotions)} changes."
        )
    return text


def command_line(argv: list[str]) -> str:
    """The command as the user typed it (for the report)."""
    return "flowsched bench contention " + " ".join(shlex.quote(a) for a in argv)
