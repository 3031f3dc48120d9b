"""Pure parts of the testbed: htb commands, counters, BPF, traces, replay, promotion matching."""

from __future__ import annotations

import io
import json
import re
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from flowsched import policies, policyfile
from flowsched.metrics import summarize
from flowsched.testbed import bench, netns, replay, report, runner, sniff, timezero
from flowsched.testbed.daemons import wait_for
from flowsched.testbed.trace import ScenarioParams, Trace, Transfer, generate, params_from_mapping

TC_OUTPUT = """class htb 1:11 parent 1:1 leaf 800a: prio 1 rate 10Mbit ceil 200Mbit burst 32Kb
 Sent 1234 bytes 3 pkt (dropped 0, overlimits 0 requeues 0)
class htb 1:1 root rate 200Mbit ceil 200Mbit burst 32725b cburst 32725b
 Sent 99 bytes 2 pkt (dropped 0, overlimits 0 requeues 0)
"""


def test_parse_class_bytes() -> None:
    assert netns.parse_class_bytes(TC_OUTPUT) == {0x11: 1234, 0x1: 99}


QDISC_OUTPUT = """qdisc htb 1: root refcnt 3 r2q 10 default 0xf direct_packets_stat 0
 Sent 1218135996 bytes 808335 pkt (dropped 7993, overlimits 105460 requeues 0)
 backlog 0b 0p requeues 0
qdisc bfifo 9920: parent 1:15 limit 250Kb
 Sent 387148672 bytes 255939 pkt (dropped 1918, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (QDISC_OUTPUT, 7993),
        ("\n".join(QDISC_OUTPUT.splitlines()[3:]), 0),  # a leaf's drops without the root: none
        ("", 0),
    ],
    ids=["root-counts-its-leaves", "no-root", "empty"],
)
def test_parse_root_drops(text: str, expected: int) -> None:
    assert netns.parse_root_drops(text) == expected


@pytest.mark.parametrize(
    ("dscps", "expected"),
    [
        ([46, 40, 34], {46: 0x10, 40: 0x11, 34: 0x12}),
        ([46, 46, 10, 10], {46: 0x10, 10: 0x11}),
        ([0], {0: 0x10}),
    ],
    ids=["distinct", "shared-queues", "fair"],
)
def test_level_classes(dscps: list[int], expected: dict[int, int]) -> None:
    assert netns.level_classes(dscps) == expected


def test_level_classes_rejects_bad_dscp() -> None:
    with pytest.raises(ValueError, match=r"levels\[1\]\.dscp"):
        netns.level_classes([1, 64])


def test_htb_commands_strict_priority_and_filters() -> None:
    lines = netns.htb_commands(
        "d0", netns.TopologySpec(rate_mbit=200, min_share=0.1), [46, 10], 1000
    )
    assert "classid 1:10 htb rate 20mbit ceil 200mbit prio 0" in " ".join(lines)
    assert any("prio 1 burst" in line and "1:11" in line for line in lines)
    assert any("match ip tos 0xb8 0xfc flowid 1:10" in line for line in lines)
    assert any("match ip tos 0x28 0xfc flowid 1:11" in line for line in lines)
    assert sum("bfifo limit 1000" in line for line in lines) == 4


@pytest.mark.parametrize("prefix", ["", "has space", "x" * 10], ids=["empty", "space", "long"])
def test_spec_rejects_bad_prefix(prefix: str) -> None:
    with pytest.raises(ValueError, match="prefix"):
        netns.TopologySpec(prefix=prefix)


def test_cleanup_refuses_empty_prefix() -> None:
    with pytest.raises(ValueError):
        netns.cleanup("-")


def test_bpf_program_jumps_land_on_returns() -> None:
    program = sniff.bpf_program(4)
    for i, (code, jt, jf, _) in enumerate(program):
        if code == 0x15:
            for offset in (jt, jf):
                assert program[i + 1 + offset][0] in (0x06, 0x20, 0x28, 0x30, 0x54, 0x15)
    assert program[-2] == (0x06, 0, 0, sniff.SNAPLEN) and program[-1] == (0x06, 0, 0, 0)
    with pytest.raises(ValueError):
        sniff.bpf_program(3)


def test_parse_frame() -> None:
    frame = bytes(12) + b"\x08\x00" + bytes([0x45, 0xB8]) + bytes(7) + b"\x06" + bytes(2)
    frame += bytes([10, 0, 0, 1, 10, 0, 0, 2]) + (1234).to_bytes(2, "big")
    frame += (80).to_bytes(2, "big") + bytes(16)
    assert sniff.parse(frame) == ("10.0.0.1", 1234, "10.0.0.2", 80, 0xB8)
    assert sniff.parse(frame[:20]) is None


def test_trace_is_seeded_and_round_trips() -> None:
    params = ScenarioParams(duration=3.0)
    a, b = generate(params, 25e6, 7), generate(params, 25e6, 7)
    assert a == b
    assert Trace.from_json(a.to_json()) == a
    assert generate(params, 25e6, 8).transfers != a.transfers
    assert {t.cls for t in a.transfers} == {"kv", "experience"}


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"bogus": 1}, "testbed.bogus: unknown key"),
        ({"load": "x"}, "testbed.load"),
        ({"hosts": 3}, "testbed.hosts"),
        ({"tp_layers": 1.5}, "testbed.tp_layers"),
        ({"duration": 10**400}, "testbed.duration: expected a non-negative float"),
    ],
    ids=["unknown", "type", "odd-hosts", "not-int", "past-a-floats-range"],
)
def test_params_validation_names_field(table: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        params_from_mapping(table)


def test_replay_fair_vs_static_tp() -> None:
    trace = generate(ScenarioParams(duration=3.0, load=0.6), 25e6, 1)
    fair = summarize(replay.replay(trace, policies.create("fair", num_levels=8)))
    static = summarize(replay.replay(trace, policies.create("static", num_levels=8)))
    assert fair.requests == static.requests == sum(t.cls == "kv" for t in trace.transfers)
    assert static.cct_mean is not None and fair.cct_mean is not None
    # static puts TP on top: its collectives are never slower than under fair sharing
    assert static.cct_mean <= fair.cct_mean
    # a collective of one message alone takes at least message / rate
    assert static.cct_mean >= trace.tp_jobs[0].message_bytes / trace.rate_bytes * 0.999


def test_promotion_latency_matches_new_dscp_after_first_packet() -> None:
    events = [
        {"kind": "tuple", "id": 5, "src": "a", "sport": 1, "dst": "b", "dport": 2},
        {"kind": "level", "id": 5, "level": 3, "decided_ns": 100, "received_ns": 110},
        {"kind": "level", "id": 5, "level": 0, "decided_ns": 1000, "received_ns": 1010},
    ]
    sniffed = {"transitions": [[200, "a:1>b:2", 10 << 2], [1500, "a:1>b:2", 46 << 2]]}
    dscp = [46, 40, 34, 10]
    assert runner.promotion_latencies(events, sniffed, dscp) == [(5, 0, 500 / 1e9)]


@pytest.mark.parametrize("share", [1.0, netns.TCP_PAYLOAD_SHARE])
def test_replay_closed_form_shared_links(share: float) -> None:
    """h0->h2 and h1->h2 share h2's ingress; h1->h3 joins at 10 ms and shares h1's egress.

    Max-min at the payload rate R = 25 MB/s x share: every flow gets R / 2, so the two first
    flows finish at 1.5 MB / (R / 2) = 0.12 s / share; by then the third has sent
    (0.12 / share - 0.01) x R / 2 and sends the rest alone at R: 0.12 s / share + 0.005 s.
    """
    from flowsched.testbed.trace import Transfer

    transfers = [
        Transfer(1, "kv", "h0", "h2", 0.0, 1_500_000, deadline=1.0, request="a", slo=1.0),
        Transfer(2, "kv", "h1", "h2", 0.0, 1_500_000, deadline=1.0, request="b", slo=1.0),
        Transfer(3, "kv", "h1", "h3", 0.01, 1_500_000, deadline=1.0, request="c", slo=1.0),
    ]
    trace = Trace(0, 4, 25e6, 1.0, 0.0, [], transfers)
    records = replay.replay(trace, policies.create("fair", num_levels=1), payload_share=share)
    finished = {f.request: f.finished for f in records.flows}
    expected = {"a": 0.12 / share, "b": 0.12 / share, "c": 0.12 / share + 0.005}
    assert finished == pytest.approx(expected, abs=1e-6)
    assert summarize(records).slo_attainment == 1.0


def _without_testbed(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, **fields: Any
) -> bench.BenchOptions:
    """Options of a 2 s fair + rmlq benchmark on a machine that cannot build the testbed."""
    monkeypatch.setattr(netns, "probe", lambda prefix="fsE-": "not running as root (test)")
    fields.setdefault("seed", 3)
    return bench.BenchOptions(
        out=Path(str(tmp_path)) / "out",
        policies=("fair", "rmlq"),
        params=ScenarioParams(duration=2.0),
        spec=netns.TopologySpec(),
        **fields,
    )


def test_bench_falls_back_to_simulator_and_says_why(
    tmp_path: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    options = _without_testbed(tmp_path, monkeypatch)
    out = options.out
    results = bench.run(options)
    assert [r.testbed for r in results] == [None, None]
    assert "testbed unavailable: not running as root (test)" in capsys.readouterr().err
    meta = json.loads((out / "results.json").read_text())["meta"]
    assert meta["mode"] == "simulator only (not running as root (test))"
    assert (out / "report.md").exists() and (out / "slo_attainment.png").exists()


def test_default_control_is_the_real_control_plane() -> None:
    """Coordinator + agents + plugin unless the minimal controller is asked for by name."""
    import argparse
    import inspect

    from flowsched.cli import bench as bench_cli

    parser = argparse.ArgumentParser()
    bench_cli.register(parser.add_subparsers())
    args = parser.parse_args(["bench", "contention"])
    assert args.control == "agent" and args.ablation_policies == "" and args.seeds == 3
    assert bench.BenchOptions.__dataclass_fields__["control"].default == "agent"
    assert inspect.signature(runner.run_policy).parameters["control"].default == "agent"
    assert bench.other_control("agent") == "mini" and bench.other_control("mini") == "agent"


def test_promotion_latency_skips_levels_without_a_decision_stamp() -> None:
    """The real agent's first level (no coordinator stamp) only sets the starting class."""
    events = [
        {"kind": "tuple", "id": 5, "src": "a", "sport": 1, "dst": "b", "dport": 2},
        {"kind": "level", "id": 5, "level": 3, "decided_ns": None, "received_ns": 110},
        {"kind": "level", "id": 5, "level": 0, "decided_ns": 1000, "received_ns": 1010},
    ]
    sniffed = {"transitions": [[200, "a:1>b:2", 10 << 2], [1300, "a:1>b:2", 46 << 2]]}
    assert runner.promotion_latencies(events, sniffed, [46, 40, 34, 10]) == [(5, 0, 300 / 1e9)]


def test_table_labels_the_control_plane_of_each_row() -> None:

    trace = generate(ScenarioParams(duration=2.0, load=0.3), 25e6, 3)
    metrics = summarize(replay.replay(trace, policies.create("fair", num_levels=8)))
    main = report.PolicyResult("fair", metrics, metrics, control="agent")
    ablated = report.PolicyResult(
        "rmlq", metrics, metrics, control="agent", ablation=metrics, ablation_control="mini"
    )
    sources = [row[1] for row in report.table_rows([main, ablated])]
    assert sources == ["testbed", "sim", "testbed", "testbed, mini ctl (ablation)", "sim"]


def test_admission_delays_pair_open_and_admitted() -> None:
    events = [
        {"kind": "open", "id": 1, "t": 1.0},
        {"kind": "admitted", "id": 1, "t": 1.03},
        {"kind": "open", "id": 2, "t": 2.0},
        {"kind": "admitted", "id": 2, "t": 2.01},
        {"kind": "admitted", "id": 3, "t": 5.0},  # no open recorded: ignored
    ]
    assert runner.admission_delays(events) == pytest.approx([0.01, 0.03])


def test_bench_pools_every_seed_and_reports_each(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--seeds N: every policy runs each seed's trace; metrics pool all requests of all seeds."""
    options = _without_testbed(tmp_path, monkeypatch, seed=4, seeds=2)
    out = options.out
    results = bench.run(options)
    singles = {
        seed: [r.sim for r in bench.run(replace_options(options, out, seed))] for seed in (4, 5)
    }
    for i, result in enumerate(results):
        assert [s.seed for s in result.seeds] == [4, 5]
        assert result.sim.requests == singles[4][i].requests + singles[5][i].requests
        met = sum(
            round((singles[s][i].slo_attainment or 0.0) * singles[s][i].requests) for s in (4, 5)
        )
        assert result.sim.slo_attainment == pytest.approx(met / result.sim.requests)
        assert [run.sim_attainment for run in result.seeds] == [
            singles[4][i].slo_attainment,
            singles[5][i].slo_attainment,
        ]
    doc = json.loads((out / "results.json").read_text())
    assert doc["meta"]["seeds"] == [4, 5]
    assert [p["seed"] for p in doc["policies"]["rmlq"]["per_seed"]] == [4, 5]
    text = (out / "report.md").read_text()
    assert "seeds 4, 5" in text and "SLO attainment seed by seed" in text
    assert "seed 4 % | seed 5 % | pooled %" in text


def replace_options(options: bench.BenchOptions, out: Path, seed: int) -> bench.BenchOptions:
    """The same options for one seed, written elsewhere."""
    return replace(options, out=out.parent / f"single{seed}", seed=seed, seeds=1)


def test_bench_cli_refuses_zero_seeds(capsys: pytest.CaptureFixture[str]) -> None:
    from flowsched.cli import main

    assert main(["bench", "contention", "--seeds", "0", "--simulate-only"]) == 2
    assert "--seeds must be at least 1" in capsys.readouterr().err


def test_procstat_reads_this_process_and_knows_an_exited_one() -> None:
    import os
    import subprocess
    import sys

    from flowsched.testbed import procstat

    rss, peak = procstat.memory_mib(os.getpid())
    assert 0 < rss <= peak
    assert (procstat.cpu_seconds(os.getpid()) or 0.0) > 0
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert procstat.cpu_seconds(dead.pid) is None
    with pytest.raises(ProcessLookupError):
        procstat.running_cpu_seconds(dead.pid)


@pytest.mark.parametrize(
    ("before", "after", "share"),
    [
        ([0] * 8, [10, 0, 0, 70, 0, 0, 0, 20], 0.2),  # user 10, idle 70, steal 20 of 100 ticks
        ([5, 0, 5, 5, 0, 0, 0, 5, 0, 0], [15, 0, 5, 5, 0, 0, 0, 5, 0, 0], 0.0),  # no steal
        ([0] * 8, [0] * 8, None),  # no time passed
        ([], [1] * 8, None),  # no /proc/stat
        ([0] * 7, [1] * 7, None),  # a kernel that reports no steal column
        # guest and guest_nice ticks are already in user and nice (proc(5)): not counted twice
        ([0] * 10, [30, 0, 0, 50, 0, 0, 0, 20, 30, 0], 0.2),
    ],
)
def test_steal_share_is_stolen_ticks_over_all_ticks(
    before: list[int], after: list[int], share: float | None
) -> None:
    from flowsched.testbed.procstat import steal_share

    got = steal_share(before, after)
    assert (got != got) if share is None else got == pytest.approx(share)


def test_the_machine_cpu_times_include_a_steal_column() -> None:
    from flowsched.testbed.procstat import cpu_times

    times = cpu_times()
    if not times:
        pytest.skip("no /proc/stat on this system")
    assert len(times) >= 8 and all(t >= 0 for t in times)


def test_report_scores_attainment_and_collectives_jointly() -> None:
    """The bound first, oracles last; rmlq's attainment, collective time and top-level share
    are stated next to edf's, and 'both' only when rmlq wins attainment without slower TP."""

    trace = generate(ScenarioParams(duration=2.0, load=0.5), 25e6, 3)

    def result(name: str) -> report.PolicyResult:
        cfg = bench.policy_config(name) if name != "ideal" else bench.policy_config("static")
        records = replay.replay(
            trace,
            cfg.make_policy(),
            level_queue=cfg.level_queue,
            private_classes=bench.IDEAL_PRIVATE if name == "ideal" else frozenset(),
        )
        metrics = summarize(records)
        return report.PolicyResult(name, None, metrics, sim_records=records)

    results = [result(n) for n in ("edf", "rmlq", "llf+late", "ideal", "edf+late")]
    rows = report.table_rows(results)
    names = ["ideal (bound)", "edf", "rmlq", "edf+late", "llf+late (oracle)"]
    assert [r[0] for r in rows] == names
    assert rows[0][3] == "1.00"
    edf, rmlq = results[0].sim, results[1].sim
    assert edf.slo_attainment is not None and rmlq.slo_attainment is not None
    assert edf.cct_mean is not None and rmlq.cct_mean is not None
    lines = report.headline(results)
    joint = next(line for line in lines if line.startswith("- sim: "))
    assert f"rmlq {rmlq.slo_attainment * 100:.1f}% vs edf {edf.slo_attainment * 100:.1f}%" in joint
    assert f"{rmlq.cct_mean * 1e3:.1f} vs {edf.cct_mean * 1e3:.1f} ms" in joint
    both = rmlq.slo_attainment >= edf.slo_attainment and rmlq.cct_mean <= edf.cct_mean
    assert joint.endswith("both." if both else "not both.")
    top = report.top_share(results[1].sim_records)  # type: ignore[arg-type]
    above = report.above_collectives_share(results[1].sim_records)  # type: ignore[arg-type]
    assert top is not None and above is not None
    assert f"admits {top:.0%} of KV flows at the top level and {above:.0%} above the" in joint
    late = results[4].sim
    assert late is not None and late.slo_attainment is not None and late.cct_mean is not None
    joint_late = next(line for line in lines if "vs edf+late" in line)
    assert joint_late.startswith("- sim: ") and "admits" not in joint_late
    assert f"vs edf+late {late.slo_attainment * 100:.1f}%" in joint_late
    both = rmlq.slo_attainment >= late.slo_attainment and rmlq.cct_mean <= late.cct_mean
    assert joint_late.endswith(f"<= edf+late's: {'both' if both else 'not both'}.")


def test_report_names_the_source_of_the_ratio_line_without_edf() -> None:
    """Without edf there is no joint line: rmlq's ratio to static says which source it is."""

    trace = generate(ScenarioParams(duration=2.0, load=0.5), 25e6, 3)
    results = []
    for name in ("static", "rmlq"):
        cfg = bench.policy_config(name)
        records = replay.replay(trace, cfg.make_policy(), level_queue=cfg.level_queue)
        results.append(report.PolicyResult(name, None, summarize(records), sim_records=records))
    lines = report.headline(results)
    assert any(re.fullmatch(r"- sim: rmlq attains [0-9.]+x static\.", line) for line in lines), (
        lines
    )


def test_policies_without_a_benchmark_file_share_statics_settings() -> None:
    cfg = bench.policy_config("llf+late")
    static = bench.policy_config("static")
    assert cfg.policy == "llf" and cfg.args == {"drop_late": True}
    assert (cfg.num_levels, cfg.hw_queues, cfg.timer_period) == (
        static.num_levels,
        static.hw_queues,
        static.timer_period,
    )
    with pytest.raises(FileNotFoundError, match="no registered policy 'nope'"):
        bench.policy_config("nope")


@pytest.mark.parametrize("name", ["edf", "static"])
def test_late_dropping_is_the_files_policy_with_drop_late(name: str) -> None:
    plain, late = bench.policy_config(name), bench.policy_config(name + "+late")
    assert late.args == {**plain.args, "drop_late": True}
    assert late.source == f"{plain.source} ({name}+late)"
    assert late.description == f"{plain.description} ({name}+late)"
    assert replace(late, args=plain.args, source=plain.source, description=plain.description) == (
        plain
    )
    with pytest.raises(FileNotFoundError, match=f"no registered policy '{name}-late'"):
        bench.policy_config(name + "-late")


def test_late_dropping_of_a_policy_without_the_rule_is_refused() -> None:
    with pytest.raises(policyfile.PolicyFileError, match="drop_late"):
        bench.policy_config("rmlq+late")


@pytest.mark.parametrize("name", ["edf", "static"])
def test_testbed_runs_late_dropping_from_the_files_policy_with_drop_late(
    name: str, tmp_path: Path
) -> None:
    assert bench.testbed_policy_file(name, tmp_path) == bench.policy_path(name)
    path = bench.testbed_policy_file(name + "+late", tmp_path)
    assert path.parent == tmp_path
    loaded, expected = policyfile.load(path), bench.policy_config(name + "+late")
    assert replace(loaded, source=expected.source) == expected


def test_testbed_runs_a_policy_without_a_file_on_statics_settings(tmp_path: Path) -> None:
    path = bench.testbed_policy_file("llf+late", tmp_path)
    assert path.parent == tmp_path
    loaded, expected = policyfile.load(path), bench.policy_config("llf+late")
    assert (loaded.policy, loaded.args) == ("llf", {"drop_late": True})
    assert replace(loaded, source=expected.source) == expected


@pytest.mark.parametrize(
    ("policies", "refusal"),
    [
        ("llf", "no benchmark policy file"),
        ("llf+late", "no benchmark policy file"),
        ("fair+late", "fair has no late-dropping variant"),
        ("rmlq+late", "rmlq has no late-dropping variant"),
    ],
)
def test_bench_cli_runs_on_the_testbed_only_policies_with_a_file(
    policies: str, refusal: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from flowsched.cli import main

    assert main(["bench", "contention", "--policies", policies, "--simulate-only"]) == 2
    assert refusal in capsys.readouterr().err


def test_a_coordinator_that_fails_to_start_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The coordinator's stderr goes to its log file, off the terminal: when it exits before
    its ready line, the error must carry the reason it gave, not just an empty line."""
    topo = netns.plan(netns.TopologySpec(prefix="fsU-", hosts=2))
    failing = ["sh", "-c", "echo 'error: policy file: no such level' >&2; exit 2"]
    monkeypatch.setattr(netns.Topology, "ns_command", lambda self, ns, argv: failing)
    procs: list[Any] = []
    try:
        with pytest.raises(RuntimeError) as raised:
            runner.start_agents(
                topo, procs, tmp_path / "policy.toml", 1e6, tmp_path, token=tmp_path / "token"
            )
        message = str(raised.value)
        assert "the coordinator did not start" in message
        assert "no such level" in message
        assert str(tmp_path / "coordinator.log") in message
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
            proc.stdout.close()


#: fake daemons that hang without a whole ready line: one says nothing, one prints part of it
_HUNG_DAEMONS = {
    "silent": "import sys, time; print('loading the policy', file=sys.stderr, flush=True); "
    "time.sleep(60)",
    "partial-line": "import sys, time; print('loading the policy', file=sys.stderr, flush=True); "
    "sys.stdout.write('listening'); sys.stdout.flush(); time.sleep(60)",
}


@pytest.mark.parametrize("code", list(_HUNG_DAEMONS.values()), ids=list(_HUNG_DAEMONS))
def test_a_daemon_that_hangs_before_its_ready_line_is_killed_and_named(
    code: str, tmp_path: Path
) -> None:
    """A daemon that hangs without printing its ready line must not block the run: after the
    timeout it is killed, and the error names it, the line it waited for, the timeout and its
    log."""
    log = tmp_path / "coordinator.log"
    with log.open("ab") as sink:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=sink)
    try:
        wait_for(lambda: log.read_bytes(), 30, "the fake daemon's log line")
        with pytest.raises(RuntimeError) as raised:
            runner._expect_line(proc, b"listening on", "the coordinator", log, timeout=0.3)
        message = str(raised.value)
        assert "the coordinator did not start" in message
        assert "'listening on' within 0.3 s" in message
        assert f"its log {log} ends:\nloading the policy" in message
        assert proc.returncode == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()


def test_the_ready_line_is_the_first_line_only() -> None:
    code = "import time; print('listening on 10.78.0.254:7 metrics x\\nmore'); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        line = runner._expect_line(proc, b"listening on", "the coordinator", timeout=30)
        assert line == b"listening on 10.78.0.254:7 metrics x\n"
    finally:
        proc.kill()
        proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()


#: fake agents after their ready line: one logs its session, one never does, one exits
_SESSION_AGENTS = {
    "session": ("import sys, time; print('INFO connected to the coordinator (epoch 1)', "
                "file=sys.stderr, flush=True); time.sleep(60)", None),
    "no-session": ("import sys, time; print('WARNING cannot reach the coordinator', "
                   "file=sys.stderr, flush=True); time.sleep(60)",
                   "no coordinator session within 0.3 s; killed"),
    "exits": ("import sys; print('ERROR token refused', file=sys.stderr, flush=True); "
              "sys.exit(3)", "exited with status 3 before its coordinator session"),
}  # fmt: skip


@pytest.mark.parametrize(
    ("code", "problem"), list(_SESSION_AGENTS.values()), ids=list(_SESSION_AGENTS)
)
def test_the_benchmark_waits_for_each_agents_coordinator_session(
    code: str, problem: str | None, tmp_path: Path
) -> None:
    """An agent prints its ready line before it connects: the run goes on only once the agent
    logged its session, and an agent that never gets one fails the run, named, with its log."""
    log = tmp_path / "agent-h0.log"
    with log.open("ab") as sink:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=sink)
    try:
        wait_for(lambda: log.read_bytes(), 30, "the fake agent's log line")
        if problem is None:
            runner._expect_session(proc, log, "the agent of h0", timeout=30)
            assert proc.poll() is None
            return
        with pytest.raises(RuntimeError) as raised:
            runner._expect_session(proc, log, "the agent of h0", timeout=0.3)
        message = str(raised.value)
        assert message.startswith(f"the agent of h0 did not connect: {problem}"), message
        assert f"its log {log} ends:\n" in message
    finally:
        proc.kill()
        proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()


#: fake sniffers (``python -c CODE --out OUT DEV...``): each writes its ready file and then
#: does, on SIGTERM, what its name says (``exits-at-start`` never gets ready)
_SNIFFER = (
    "import json, pathlib, signal, sys, time\n"
    "out = pathlib.Path(sys.argv[2])\n"
    "def on_term(signum, frame):\n"
    "    {on_term}\n"
    "signal.signal(signal.SIGTERM, on_term)\n"
    "out.with_suffix('.ready').write_text('ready')\n"
    "while True:\n"
    "    time.sleep(1)\n"
)
_SNIFFERS = {
    "clean": _SNIFFER.format(on_term="out.write_text('{\"transitions\": []}'); sys.exit(0)"),
    "no-capture": _SNIFFER.format(on_term="sys.exit(0)"),
    "fails": _SNIFFER.format(on_term="print('OSError: disk full', file=sys.stderr); sys.exit(3)"),
    "ignores-sigterm": _SNIFFER.format(on_term="pass"),
    "exits-at-start": "import sys; print('PermissionError: [Errno 1] Operation not permitted',"
    " file=sys.stderr, flush=True); sys.exit(1)",
}
#: how a fake that waits for time zero says ready (``ready(who, line)``): it prints ``line``,
#: reads its stdin's line and, with $FAKE_ZERO_SEEN set, appends there as JSON who it is, that
#: line, and when it said ready and when it got the line
_TAKE_TIME_ZERO = (
    "import json, os, sys, time\n"
    "def ready(who, line):\n"
    "    ready_ns = time.monotonic_ns()\n"
    "    print(line, flush=True)\n"
    "    line = sys.stdin.readline()\n"
    "    got = {'who': who, 'line': line, 'ready_ns': ready_ns,\n"
    "           'received_ns': time.monotonic_ns()}\n"
    "    if os.environ.get('FAKE_ZERO_SEEN'):\n"
    "        with open(os.environ['FAKE_ZERO_SEEN'], 'a') as out:\n"
    "            out.write(json.dumps(got) + '\\n')\n"
)
#: fake minimal controllers (``python -c CODE --policy ...``), after their ready line: one
#: takes time zero and runs until stopped, one dies before time zero
_CONTROL = {
    "runs": _TAKE_TIME_ZERO + "ready('minictl', 'minictl listening on 127.0.0.1:7200')\n"
    "time.sleep(60)\n",
    "dies": "import sys; print('minictl listening on 127.0.0.1:7200', flush=True);"
    " sys.exit('minictl: policy file changed under the run')",
    "fails-to-start": "import sys; sys.exit('minictl: cannot bind 10.9.0.1:7200')",
}
#: a fake worker (``python -c CODE --trace T --host H ...``): it does what $FAKE_WORKERS (JSON,
#: host -> "exits", "hangs", "slow": ready after 1 s, or "crashes": killed after time zero,
#: its journal unwritten) says, else it says ready, takes time zero and exits
_WORKER = _TAKE_TIME_ZERO + (
    "host = sys.argv[sys.argv.index('--host') + 1]\n"
    "does = json.loads(os.environ.get('FAKE_WORKERS', '{}')).get(host)\n"
    "if does == 'exits':\n"
    "    sys.exit('ModuleNotFoundError: No module named flowsched')\n"
    "if does == 'hangs':\n"
    "    print('connecting to the TP peer', file=sys.stderr, flush=True)\n"
    "    time.sleep(60)\n"
    "if does == 'slow':\n"
    "    time.sleep(1)\n"
    "ready(host, 'ready')\n"
    "if does == 'crashes':\n"
    "    import signal; os.kill(os.getpid(), signal.SIGKILL)\n"
)


#: a fake coordinator or agent (``python -c CODE coordinator|agent ARGS...``): it appends
#: what it found at its ``--token-file`` (the path, the file's and its folder's modes, the
#: token) as a JSON line to $FAKE_DAEMON_SEEN, then, with $FAKE_DAEMON_FAIL set, exits at
#: once; else it prints its ready line (an agent: and logs its session) and runs until stopped
_DAEMON = (
    "import json, os, pathlib, stat, sys, time\n"
    "args = sys.argv[1:]\n"
    "token = pathlib.Path(args[args.index('--token-file') + 1])\n"
    "def mode(path): return stat.S_IMODE(path.stat().st_mode)\n"
    "seen = {'role': args[0], 'path': str(token), 'mode': mode(token),\n"
    "        'folder_mode': mode(token.parent), 'token': token.read_text().strip()}\n"
    "with open(os.environ['FAKE_DAEMON_SEEN'], 'a') as out:\n"
    "    out.write(json.dumps(seen) + '\\n')\n"
    "if os.environ.get('FAKE_DAEMON_FAIL'):\n"
    "    sys.exit('error: policy file: no such level')\n"
    "if args[0] == 'coordinator':\n"
    "    print('flowsched-coordinator listening on 127.0.0.1:1 metrics -', flush=True)\n"
    "else:\n"
    "    print('ready', flush=True)\n"
    "    print('INFO connected to the coordinator (epoch 1)', file=sys.stderr, flush=True)\n"
    "time.sleep(60)\n"
)


def _fake_testbed(monkeypatch: pytest.MonkeyPatch, sniffer: str, control: str = "runs") -> None:
    """run_policy outside namespaces and tc: the sniffer and the minimal controller are the
    fakes named, the workers :data:`_WORKER`, and the coordinator and agents :data:`_DAEMON`."""
    codes = {
        "flowsched.testbed.sniff": _SNIFFERS[sniffer],
        "flowsched.testbed.minictl": _CONTROL[control],
        "flowsched.testbed.worker": _WORKER,
    }
    monkeypatch.setattr(
        runner, "_python", lambda module, *args: [sys.executable, "-c", codes[module], *args]
    )

    def command(self: netns.Topology, ns: str, argv: list[str]) -> list[str]:
        if argv[1:3] == ["-m", "flowsched"]:  # the coordinator, an agent
            return [sys.executable, "-c", _DAEMON, *argv[3:]]
        return list(argv)

    monkeypatch.setattr(netns.Topology, "ns_command", command)
    monkeypatch.setattr(netns.Topology, "configure_classes", lambda self, dscp: None)
    monkeypatch.setattr(netns.Topology, "class_bytes", lambda self: {})
    monkeypatch.setattr(netns.Topology, "run_drops", lambda self: 0)


def _fake_run(
    monkeypatch: pytest.MonkeyPatch, work: Path, sniffer: str, control: str = "runs"
) -> runner.TestbedRun:
    """run_policy with the minimal controller outside namespaces and tc (:func:`_fake_testbed`),
    the controller the fake named."""
    _fake_testbed(monkeypatch, sniffer, control)
    topo = netns.plan(netns.TopologySpec(prefix="fsU-", hosts=2))
    trace = Trace(0, 2, 25e6, 0.1, 0.0, [], [])
    path = bench.policy_path("fair")
    return runner.run_policy(topo, trace, bench.policy_config("fair"), path, work, control="mini")


def test_a_sniffer_that_exits_before_it_is_ready_fails_the_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without its sniffer a run reports no promotion latency, as if it had measured none: a
    sniffer that does not get ready fails the run, named, with its exit status and its reason."""
    with pytest.raises(RuntimeError) as raised:
        _fake_run(monkeypatch, tmp_path, "exits-at-start")
    message = str(raised.value)
    assert message.startswith("the sniffer did not start: exited with status 1 before its ready")
    assert f"its log {tmp_path / 'sniffer.log'} ends:\nPermissionError" in message


def test_a_sniffer_that_hangs_before_it_is_ready_is_killed_and_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    hung = [sys.executable, "-c", "import time; time.sleep(60)"]
    monkeypatch.setattr(netns.Topology, "ns_command", lambda self, ns, argv: hung)
    topo = netns.plan(netns.TopologySpec(prefix="fsU-", hosts=2))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with pytest.raises(RuntimeError) as raised:
            runner._start_sniffer(topo, procs, tmp_path / "sniff.json", timeout=0.3)
        assert str(raised.value).startswith(
            "the sniffer did not start: no ready file within 0.3 s; killed"
        )
        assert procs[0].returncode == -signal.SIGKILL
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)


@pytest.mark.parametrize(
    ("sniffer", "problem"),
    [
        ("clean", None),
        ("no-capture", "left no capture in {work}/sniff.json"),
        ("fails", "exited with status 3"),
        ("ignores-sigterm", "did not exit within 0.3 s of SIGTERM; killed"),
    ],
)
def test_a_sniffer_that_ends_without_its_capture_is_a_run_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sniffer: str, problem: str | None
) -> None:
    """The run's promotion latencies come from the capture the sniffer writes when it is
    stopped: when it fails to, the run says that they are missing instead of reporting none."""
    monkeypatch.setattr(runner, "SNIFFER_STOP_GRACE", 0.3)
    run = _fake_run(monkeypatch, tmp_path, sniffer)
    missing = f": this run's promotion latencies are missing (its log: {tmp_path}/sniffer.log)"
    expected = [] if problem is None else [f"the sniffer {problem.format(work=tmp_path)}{missing}"]
    assert run.errors == expected
    assert not (tmp_path / "sniff.ready").exists()


def test_a_control_plane_daemon_that_dies_during_the_run_is_a_run_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A coordinator, agent or minimal controller that exits mid-run leaves the workers with
    stale levels and no error of their own: the run must say so."""
    run = _fake_run(monkeypatch, tmp_path, "clean", control="dies")
    assert len(run.errors) == 1 and run.errors[0].endswith("exited with status 1 during the run")


def test_the_minimal_controllers_log_is_kept_with_the_run_and_named_when_it_fails_to_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The minimal controller's stderr goes to minictl.log in the run's folder, as the
    daemons' logs do, not to the user's terminal; a controller that fails to start is named
    with its exit status and its log's end."""
    run = _fake_run(monkeypatch, tmp_path / "ran", "clean", control="dies")
    assert run.errors and "policy file changed" not in capfd.readouterr().err
    assert (tmp_path / "ran" / "minictl.log").read_text() == (
        "minictl: policy file changed under the run\n"
    )
    with pytest.raises(RuntimeError) as raised:
        _fake_run(monkeypatch, tmp_path / "failed", "clean", control="fails-to-start")
    log = tmp_path / "failed" / "minictl.log"
    assert str(raised.value) == (
        "the testbed controller did not start: exited with status 1 before its ready line; "
        f"its log {log} ends:\nminictl: cannot bind 10.9.0.1:7200"
    )


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("sys.exit(0)", []),
        ("sys.exit(3)", ["worker kv exited with status 3 (its log: {log})"]),
        ("time.sleep(30)", ["worker kv did not finish within 1 s (its log: {log})"]),
    ],
    ids=["clean", "fails", "hangs"],
)  # fmt: skip
def test_waiting_for_the_workers_names_each_by_its_host(
    tmp_path: Path, code: str, expected: list[str]
) -> None:
    """An error names the worker's host and log, whatever the worker's place in the list (the
    serving testbed's hosts are not h0, h1, ...)."""
    fine = subprocess.Popen([sys.executable, "-c", "pass"])
    tested = subprocess.Popen([sys.executable, "-c", f"import sys, time; {code}"])
    logs = [tmp_path / "host-d0.log", tmp_path / "host-kv.log"]
    try:
        errors = runner.wait_workers([fine, tested], 1.0, ["d0", "kv"], logs)
    finally:
        tested.kill()
        tested.wait()
    assert errors == [e.format(log=logs[1]) for e in expected]


def test_the_workers_and_the_controller_get_one_time_zero_once_every_worker_is_ready(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Time zero is START_MARGIN after the last worker said ready (it was a fixed margin after
    the control plane started: a worker slower than that lost the trace's start, and a fast one
    idled), and every process that keeps the run's clock gets the same one."""
    seen = tmp_path / "zero.jsonl"
    monkeypatch.setenv("FAKE_ZERO_SEEN", str(seen))
    monkeypatch.setenv("FAKE_WORKERS", json.dumps({"h1": "slow"}))
    monkeypatch.setattr(runner, "START_MARGIN", 0.2)
    run = _fake_run(monkeypatch, tmp_path / "work", "clean")
    assert run.errors == []
    got = [json.loads(line) for line in seen.read_text().splitlines()]
    assert sorted(g["who"] for g in got) == ["h0", "h1", "minictl"]
    assert len({g["line"] for g in got}) == 1
    zero = timezero.TimeZero.parse(got[0]["line"].encode())
    assert zero.ns - max(g["ready_ns"] for g in got) >= 0.2e9
    for g in got:  # sent START_MARGIN ahead of time zero, so received at most that far ahead
        assert zero.ns - g["received_ns"] <= 0.2e9, g["who"]


@pytest.mark.parametrize(
    ("does", "problem", "said"),
    [
        ("exits", "exited with status 1 before its ready line",
         "ModuleNotFoundError: No module named flowsched"),
        ("hangs", "no line with 'ready' within 2 s; killed", "connecting to the TP peer"),
    ],
    ids=["exits", "hangs"],
)  # fmt: skip
def test_a_worker_that_never_gets_ready_fails_the_run_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, does: str, problem: str, said: str
) -> None:
    """No time zero without every worker: the run fails, naming the worker that did not get
    ready (not the one that did), with its exit status or the wait it ran out of, and its log."""
    monkeypatch.setenv("FAKE_WORKERS", json.dumps({"h1": does}))
    monkeypatch.setattr(runner, "READY_TIMEOUT", 2.0)
    work = tmp_path / "work"
    with pytest.raises(RuntimeError) as raised:
        _fake_run(monkeypatch, work, "clean")
    log = work / "worker-h1.log"
    assert (
        str(raised.value)
        == f"the worker of h1 did not start: {problem}; its log {log} ends:\n{said}"
    )


@pytest.mark.parametrize(
    ("workers", "sniffer", "stale", "problem"),
    [
        (
            {"h0": "crashes"},
            "clean",
            "h0.json",
            f"worker h0 exited with status {-signal.SIGKILL} (its log: {{work}}/worker-h0.log)",
        ),
        (
            {},
            "no-capture",
            "sniff.json",
            "the sniffer left no capture in {work}/sniff.json: this run's promotion latencies "
            "are missing (its log: {work}/sniffer.log)",
        ),
    ],
    ids=["worker-journal", "sniffer-capture"],
)
def test_a_process_that_wrote_nothing_leaves_no_earlier_runs_figures(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    workers: dict[str, str],
    sniffer: str,
    stale: str,
    problem: str,
) -> None:
    """A run into the same ``--out`` finds the earlier run's journals and capture in its
    folder: a worker killed before it wrote its journal (a crash in the plugin, the OOM
    killer, the timeout) left the earlier run's, read as this run's completions, and a sniffer
    that wrote no capture passed for one that had (no error, the earlier promotions)."""
    monkeypatch.setenv("FAKE_WORKERS", json.dumps(workers))
    work = tmp_path / "work"
    work.mkdir()
    earlier: dict[str, Any] = {
        "h0.json": [{"kind": "open", "id": 1, "t": 0.0}, {"kind": "done", "id": 1, "t": 0.01}],
        "sniff.json": {"transitions": []},
    }
    (work / stale).write_text(json.dumps(earlier[stale]), encoding="utf-8")
    _fake_testbed(monkeypatch, sniffer)
    topo = netns.plan(netns.TopologySpec(prefix="fsU-", hosts=2))
    kv = Transfer(1, "kv", "h0", "h1", 0.0, 1000, request="r1", slo=0.05)
    trace = Trace(0, 2, 25e6, 0.1, 0.0, [], [kv])
    path = bench.policy_path("fair")
    run = runner.run_policy(topo, trace, bench.policy_config("fair"), path, work, control="mini")
    assert run.errors == [problem.format(work=work)]
    assert run.records.flows == []
    assert [r.finished for r in run.records.requests] == [None]


@pytest.mark.usefixtures("lock_dir")
def test_an_incomplete_calibration_run_is_left_out_and_said(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The calibration's overhead figure from a run that recorded errors would be an
    incomplete run's: it is left out, and the report and stderr say why."""

    def calibration_run(topo: object, trace: Trace, *args: object, **kwargs: object) -> Any:
        records = replay.replay(trace, policies.create("fair", num_levels=8))
        return runner.TestbedRun("fair", records, errors=["worker h0 exited with status 1"])

    def simulated_testbed_run(topo: object, trace: Trace, *args: object) -> Any:
        return replay.replay(trace, policies.create("fair", num_levels=8))

    monkeypatch.setattr(netns, "_build", lambda topo, dscp: None)
    monkeypatch.setattr(netns, "cleanup", lambda prefix: [])
    monkeypatch.setattr(netns, "probe", lambda prefix="fsE-": None)
    monkeypatch.setattr(runner, "run_policy", calibration_run)
    monkeypatch.setattr(bench, "_testbed_run", simulated_testbed_run)
    monkeypatch.setattr(bench, "CALIBRATION", {})
    options = bench.BenchOptions(
        out=tmp_path / "out",
        policies=("fair",),
        params=ScenarioParams(duration=1.0),
        seed=1,
        spec=netns.TopologySpec(prefix="fsU-"),
    )
    bench.run(options, stream=io.StringIO())
    said = "The calibration run (isolated transfers: the testbed's per-transfer overhead) was "
    said += "incomplete, so its figure is left out: worker h0 exited with status 1."
    notes = json.loads((tmp_path / "out" / "results.json").read_text())["meta"]["notes"]
    assert said in notes
    assert not any(note.startswith("Measured per-transfer overhead") for note in notes)
    assert f"error: {said}" in capsys.readouterr().err


def test_an_earlier_runs_session_line_does_not_count(tmp_path: Path) -> None:
    """The agents' logs are opened for appending, and a benchmark run into the same ``--out``
    finds the previous run's in its folders: that run's session line made the wait for this
    agent's session return at once."""
    log = tmp_path / "agent-h0.log"
    log.write_text("INFO connected to the coordinator (epoch 1); resync sent (0 flows)\n")
    since = log.stat().st_size  # (start_agents takes it before it spawns the agent)
    code = _SESSION_AGENTS["no-session"][0]
    with log.open("ab") as sink:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=sink)
    try:
        wait_for(lambda: b"cannot reach" in log.read_bytes(), 30, "the fake agent's log line")
        with pytest.raises(RuntimeError, match=r"no coordinator session within 0\.3 s; killed"):
            runner._expect_session(proc, log, "the agent of h0", since=since, timeout=0.3)
    finally:
        proc.kill()
        proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()


@pytest.mark.parametrize("fails", [False, True], ids=["run", "coordinator-fails"])
def test_the_token_stays_out_of_the_runs_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fails: bool
) -> None:
    """A run's folder (logs, results, plots) gets copied and shared: the coordinator's token
    is in a private folder (0700, the file 0600) while the daemons run, and that folder is
    gone when the run ends, also when it fails. It was written into the run's folder."""
    seen = tmp_path / "seen.jsonl"
    monkeypatch.setenv("FAKE_DAEMON_SEEN", str(seen))
    if fails:
        monkeypatch.setenv("FAKE_DAEMON_FAIL", "1")
    _fake_testbed(monkeypatch, "clean")
    topo = netns.plan(netns.TopologySpec(prefix="fsU-", hosts=2))
    trace = Trace(0, 2, 25e6, 0.1, 0.0, [], [])
    path, work = bench.policy_path("fair"), tmp_path / "out"
    if fails:
        with pytest.raises(RuntimeError, match="the coordinator did not start"):
            runner.run_policy(topo, trace, bench.policy_config("fair"), path, work)
    else:
        assert runner.run_policy(topo, trace, bench.policy_config("fair"), path, work).errors == []
    daemons = [json.loads(line) for line in seen.read_text().splitlines()]
    roles = ["coordinator"] if fails else ["coordinator", "agent", "agent"]
    assert [daemon["role"] for daemon in daemons] == roles
    token, files = Path(daemons[0]["path"]), [f for f in work.rglob("*") if f.is_file()]
    assert files, "the run wrote its logs and trace"
    leaked = [f for f in files if daemons[0]["token"].encode() in f.read_bytes()]
    assert leaked == []
    assert {(d["path"], d["mode"], d["folder_mode"]) for d in daemons} == {
        (str(token), 0o600, 0o700)
    }
    assert not token.parent.exists()


def test_deferring_rmlq_file_defers_kv_transfers_and_shortens_collectives() -> None:
    """bench/contention/policies/rmlq-defer.toml does what its comment says on the benchmark's
    trace: far fewer KV transfers start above the collectives than with rmlq.toml (whose rho
    from the urgent tier makes nearly every one urgent), and the collectives finish sooner."""
    trace = generate(ScenarioParams(duration=4.0), 25e6, 1)
    default, deferring = bench.simulate(trace, "rmlq"), bench.simulate(trace, "rmlq-defer")
    default_share = report.above_collectives_share(default)
    deferring_share = report.above_collectives_share(deferring)
    assert default_share is not None and deferring_share is not None
    assert deferring_share < 0.5 < default_share
    default_cct, deferring_cct = summarize(default).cct_mean, summarize(deferring).cct_mean
    assert default_cct is not None and deferring_cct is not None
    assert deferring_cct < default_cct
