"""The serving benchmark: scaled policy files, the live engine's protocol, one live run."""

from __future__ import annotations

import contextlib
import io
import json
import socket
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flowsched import policyfile, scenario
from flowsched.model import FlowClass
from flowsched.testbed import netns, serving
from flowsched.testbed.live import LiveEngine

DEFAULT_FILE = Path(policyfile.__file__).parent / "data" / "policies" / "default.toml"
DEFAULT = tomllib.loads(DEFAULT_FILE.read_text())


# ----------------------------------------------------------------------------- policy files
@pytest.mark.parametrize(
    ("name", "policy", "drop_late"),
    [
        ("rmlq", "rmlq", None),
        ("static", "static", None),
        ("static+late", "static", True),
        ("edf+late", "edf", True),
    ],
)
def test_policy_files_scale_times_and_swap_the_policy(
    tmp_path: Path, name: str, policy: str, drop_late: bool | None
) -> None:
    cfg = serving.write_policy_file(name, tmp_path / f"{name}.toml")
    assert cfg.policy == policy
    assert cfg.args.get("drop_late") == drop_late
    assert cfg.timer_period == pytest.approx(DEFAULT["policy"]["timer_period"] * serving.TIME_SCALE)
    assert cfg.num_levels == DEFAULT["policy"]["num_levels"]
    assert cfg.levels == policyfile.load(DEFAULT_FILE).levels


def test_rmlq_file_scales_every_argument_in_seconds_and_layers(tmp_path: Path) -> None:
    from flowsched.policies.rmlq import Args

    args = serving.write_policy_file("rmlq", tmp_path / "rmlq.toml").args
    file_args = DEFAULT["policy"]["args"]
    for key in serving.SECONDS_ARGS:
        original = file_args.get(key, getattr(Args(), key))
        assert args[key] == pytest.approx(original * serving.TIME_SCALE), key
    assert args["pace_layers"] == max(1, round(Args().pace_layers / serving.LAYER_GROUP))
    scaled = serving.SECONDS_ARGS | serving.LAYER_ARGS
    assert {k: v for k, v in args.items() if k not in scaled} == {
        k: v for k, v in file_args.items() if k not in scaled
    }


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        serving.policy_document("nope+late")


def test_scenario_is_pd_serving_at_the_time_scale() -> None:
    """The policy files' scale must be the scenario's: compute and timers x TIME_SCALE,
    layers / LAYER_GROUP, bytes / (TIME_SCALE / 10) on links 500x slower, one per server."""
    small, full = scenario.load(serving.SCENARIO), scenario.load("pd-serving")
    s, f = small.serving, full.serving
    assert s is not None and f is not None
    assert s.gpu_tflops * serving.TIME_SCALE == pytest.approx(f.gpu_tflops)
    assert s.gpu_mem_gbps * serving.TIME_SCALE == pytest.approx(f.gpu_mem_gbps)
    assert small.sim.timer_ms == pytest.approx(full.sim.timer_ms * serving.TIME_SCALE)
    assert s.layers * serving.LAYER_GROUP == f.layers
    link_slowdown = f.nic_gbps / s.nic_gbps * f.nics_per_server / s.nics_per_server
    byte_share = s.kv_bytes_per_token_layer / (f.kv_bytes_per_token_layer * serving.LAYER_GROUP)
    assert link_slowdown * byte_share == pytest.approx(serving.TIME_SCALE, rel=1e-3)
    assert scenario.isolated_ttft(s, 1000, 350, 650) > 0


def test_job_nodes_are_the_instance_prefill_servers() -> None:
    cfg = scenario.load(serving.SCENARIO).serving
    assert cfg is not None
    assert serving.job_nodes(cfg, "i0/b3") == ["p0", "p1"]
    assert serving.job_nodes(cfg, "i1/b12") == ["p2", "p3"]


# ----------------------------------------------------------------------------- the live engine
class FakeHost:
    """A host process stand-in: says hello, records the engine's lines, reports completions."""

    def __init__(self, path: Path, name: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(path))
        self.sock.settimeout(10)
        self.sock.sendall(json.dumps({"t": "hello", "host": name}).encode() + b"\n")
        self.lines = self.sock.makefile("rb")

    def next(self) -> dict[str, Any]:
        return dict(json.loads(self.lines.readline()))

    def close(self) -> None:
        self.lines.close()
        self.sock.close()

    def done(self, flow_id: int, at: float, ok: bool = True) -> None:
        message = {"t": "done", "id": flow_id, "at": at, "ok": ok, "error": "boom"}
        self.sock.sendall(json.dumps(message).encode() + b"\n")


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[LiveEngine, FakeHost, FakeHost]]:
    path = tmp_path / "engine.sock"
    live = LiveEngine(path, {"p0": "h0", "d0": "h1"}, lambda job: ["h0"])
    hosts = FakeHost(path, "h0"), FakeHost(path, "h1")
    live.wait_for_hosts({"h0", "h1"}, 10)
    live.start(0.0)
    for host in hosts:
        assert host.next() == {"t": "start", "t0_ns": live.t0_ns, "t0_wall": live.t0_wall}
    yield live, *hosts
    live.stop()
    for host in hosts:
        host.close()


def test_engine_sends_a_flow_to_its_source_and_finishes_it_at_the_reported_time(
    engine: tuple[LiveEngine, FakeHost, FakeHost],
) -> None:
    live, source, _ = engine
    finished: list[float] = []
    live.open_flow(
        FlowClass.KV,
        1000,
        ("p0.nic0.tx", "d0.nic0.rx"),
        lambda flow: finished.append(live.now),
        request="q1",
        deadline=2.5,
        consumer_index=3,
        job="i0/b1",
    )
    opened = source.next()
    assert opened == {
        "t": "open",
        "id": 1,
        "cls": "kv",
        "size": 1000,
        "dst": "h1",
        "deadline": 2.5,
        "request": "q1",
        "job": "i0/b1",
        "step": 3,
    }
    threading.Thread(target=source.done, args=(1, 0.125), daemon=True).start()
    live.run(10)
    assert finished == [0.125]
    (record,) = live.records.flows
    assert (record.cls, record.size, record.finished, record.request) == ("kv", 1000, 0.125, "q1")


def test_engine_runs_timers_in_order_at_their_time(
    engine: tuple[LiveEngine, FakeHost, FakeHost],
) -> None:
    live, _, _ = engine
    fired: list[tuple[str, float]] = []
    start = live.clock()
    live.at(start + 0.05, lambda: fired.append(("b", live.now)))
    live.at(start + 0.01, lambda: fired.append(("a", live.now)))
    live.at(start + 0.01, lambda: live.after(0.02, lambda: fired.append(("c", live.now))))
    live.run(10)
    assert [name for name, _ in fired] == ["a", "c", "b"]
    assert fired[1][1] == pytest.approx(start + 0.03)
    assert live.clock() >= start + 0.05


def test_engine_reports_job_progress_to_the_job_hosts_once_per_change(
    engine: tuple[LiveEngine, FakeHost, FakeHost],
) -> None:
    live, source, _ = engine
    live.set_job_index("i0/b1", 2)
    live.set_job_index("i0/b1", 2)
    live.set_job_index("i0/b1", 3)
    assert source.next() == {"t": "job", "job": "i0/b1", "step": 2}
    assert source.next() == {"t": "job", "job": "i0/b1", "step": 3}


def test_engine_reports_a_jobs_end_to_the_job_hosts_once(
    engine: tuple[LiveEngine, FakeHost, FakeHost],
) -> None:
    """As the simulator ends a batch's job when its prefill ends, the live engine tells the
    job's hosts, whose SDK clients tell the agents and so the coordinator."""
    live, source, _ = engine
    live.set_job_index("i0/b1", 8)
    live.end_job("i0/b1")
    live.end_job("i0/b1")  # ended already: nothing more
    live.set_job_index("i0/b2", 1)
    assert source.next() == {"t": "job", "job": "i0/b1", "step": 8}
    assert source.next() == {"t": "job_done", "job": "i0/b1", "step": 8}
    assert source.next() == {"t": "job", "job": "i0/b2", "step": 1}
    assert "i0/b1" not in live.job_index


def test_engine_keeps_failed_and_unknown_reports_as_errors(
    engine: tuple[LiveEngine, FakeHost, FakeHost],
) -> None:
    live, source, receiver = engine
    live.open_flow(FlowClass.KV, 10, ("p0.nic0.tx", "d0.nic0.rx"))
    source.next()
    receiver.done(99, 0.1)
    receiver.done(1, 0.2, ok=False)
    live.run(10)
    assert live.errors == [
        "a host reported flow 99, which is not in flight",
        "flow 1: boom",
    ]
    assert live.failed == {1}


def test_journal_errors_skip_the_flows_the_engine_reported(tmp_path: Path) -> None:
    # a host journals a failed send and reports it to the engine: one error, not two
    journal = [
        {"kind": "open", "id": 5, "t": 1.0},
        {"kind": "error", "id": 5, "error": "send stalled for 60.0 s"},
        {"kind": "error", "id": 6, "error": "refused"},
        {"kind": "error", "id": -1, "error": "channel lost"},
    ]
    (tmp_path / "host-h2.json").write_text(json.dumps(journal))
    (tmp_path / "host-h3.json").write_text("")
    assert serving.journal_errors(tmp_path, {5}) == [
        "host-h2: flow 6: refused",
        "host-h2: flow -1: channel lost",
    ]
    assert len(serving.journal_errors(tmp_path, set())) == 3
    # a host killed while it wrote its journal: an error of the run, not a traceback
    (tmp_path / "host-h4.json").write_text('[{"kind": "open", "id": 7, "t"')
    (unreadable,) = [e for e in serving.journal_errors(tmp_path, {5}) if "host-h4" in e]
    assert unreadable.startswith("host-h4: journal unreadable (")


def test_engine_times_out_naming_the_flows_in_flight(
    engine: tuple[LiveEngine, FakeHost, FakeHost],
) -> None:
    live = engine[0]
    live.open_flow(FlowClass.TP, 10, ("p0.nic0.tx", "d0.nic0.rx"))
    with pytest.raises(TimeoutError, match="1 flows still in flight"):
        live.run(0.2)


def test_flow_inside_a_node_finishes_at_once(engine: tuple[LiveEngine, FakeHost, FakeHost]) -> None:
    live, _, _ = engine
    done: list[int] = []
    live.open_flow(FlowClass.TP, 10, (), lambda flow: done.append(flow.flow_id))
    live.run(10)
    assert done == [1]


def test_private_flows_finish_at_line_rate_without_reaching_a_host(tmp_path: Path) -> None:
    path = tmp_path / "engine.sock"
    live = LiveEngine(
        path,
        {"p0": "h0", "d0": "h1"},
        lambda job: [],
        private=frozenset({FlowClass.KV}),
        private_rate=1e6,
    )
    source = FakeHost(path, "h0")
    try:
        live.wait_for_hosts({"h0"}, 10)
        live.start(0.0)
        assert source.next()["t"] == "start"
        finished: list[tuple[str, float]] = []
        live.open_flow(
            FlowClass.KV,
            50_000,
            ("p0.nic0.tx", "d0.nic0.rx"),
            lambda f: finished.append(("kv", live.now)),
        )
        live.open_flow(
            FlowClass.TP,
            10,
            ("p0.nic0.tx", "d0.nic0.rx"),
            lambda f: finished.append(("tp", live.now)),
        )
        assert source.next()["cls"] == "tp"  # the private flow was never sent
        threading.Thread(target=source.done, args=(2, 0.01), daemon=True).start()
        live.run(10)
        assert finished == [("tp", 0.01), ("kv", pytest.approx(0.05))]
        assert [r.finished for r in live.records.flows if r.cls == "kv"] == [pytest.approx(0.05)]
    finally:
        live.stop()
        source.close()


def test_private_classes_need_a_rate(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"private_rate: 0.0 must be positive"):
        LiveEngine(tmp_path / "e.sock", {}, lambda job: [], private=frozenset({FlowClass.KV}))


def test_engine_names_hosts_that_never_connect(tmp_path: Path) -> None:
    live = LiveEngine(tmp_path / "e.sock", {"p0": "h0"}, lambda job: [])
    try:
        with pytest.raises(TimeoutError, match="did not connect within 0 s: h0"):
            live.wait_for_hosts({"h0"}, 0.1)
    finally:
        live.stop()


# ----------------------------------------------------------------------------- one live run
TINY = """
[scenario]
name = "tiny"
[sim]
chunk_kib = 64
timer_ms = 50.0
load_tau_ms = 50.0
[serving]
instances = 2
servers_per_instance = 2
gpus_per_server = 4
nics_per_server = 1
nic_gbps = 0.2
decode_servers = 1
decode_nics = 1
kv_store_nodes = 1
kv_store_nics = 1
layers = 2
kv_bytes_per_token_layer = 819
a2a_bytes_per_token_layer = 6554
flops_per_token_layer = 3.12e9
weight_bytes_per_gpu_layer = 1408e6
gpu_tflops = 6.24
gpu_mem_gbps = 40.0
lookahead = 1
mean_prompt_tokens = 500.0
prefix_groups = 16
cached_groups = 4
load_basis = "network"
warmup_requests = 0
requests = 6
"""


def live_tiny_run(
    tmp_path: Path, policy_name: str, prefix: str, private: frozenset[FlowClass] = frozenset()
) -> tuple[serving.LiveRun, float]:
    """The tiny scenario at load 0.5, seed 1, live on a fresh testbed; the run, the link rate."""
    policy = tmp_path / f"{policy_name}.toml"
    serving.write_policy_file(policy_name, policy)
    scen = scenario.parse(TINY, "tiny.toml")
    spec = serving.topology_spec(scen, prefix)
    with netns.testbed(spec) as topo:
        run = serving.run_live(
            topo, scen, 0.5, 1, policy, tmp_path / "work", private=private
        )  # fmt: skip
    return run, spec.rate_bytes


def test_topology_spec_is_one_host_per_node_at_the_nic_rate_with_deep_switch_queues() -> None:
    spec = serving.topology_spec(scenario.parse(TINY, "tiny.toml"), "fsE-x-")
    # 4 prefill servers, a decoder and a KV store; nic_gbps 0.2
    assert (spec.hosts, spec.rate_mbit, spec.min_share) == (6, 200.0, serving.MIN_SHARE)
    assert spec.switch_queue_bytes == serving.SWITCH_QUEUE_BYTES
    assert spec.switch_queue_bytes > netns.TopologySpec().switch_queue_bytes


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.usefixtures("netns_ok")
def test_live_run_serves_every_request_through_the_real_agents(tmp_path: Path) -> None:
    run, rate = live_tiny_run(tmp_path, "rmlq", "fsE-sv-")
    assert run.errors == []
    assert run.dropped_packets == 0  # the switch queues hold what six requests send
    scen = scenario.parse(TINY, "tiny.toml")
    trace = scenario.serving_trace(scen.serving, 0.5, 1)  # type: ignore[arg-type]
    assert sorted(r.request for r in run.records.requests) == sorted(r.request_id for r in trace)
    assert all(r.finished is not None and r.finished > r.arrival for r in run.records.requests)
    classes = {f.cls for f in run.records.flows}
    assert {"tp", "kv"} <= classes
    # every P2D flow crossed the testbed: its completion is at least its bytes at line rate
    for flow in run.records.flows:
        if flow.cls == "kv":
            assert flow.finished - flow.opened >= flow.size / rate * 0.9
    # the agents saw the flows: each host journalled the levels its SDK flows were given
    levels = [
        e
        for path in (tmp_path / "work").glob("host-*.json")
        for e in json.loads(path.read_text())
        if e["kind"] == "level"
    ]
    assert levels


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.usefixtures("netns_ok")
def test_live_ideal_bound_sends_only_the_all_to_all(tmp_path: Path) -> None:
    from flowsched.sim.run import IDEAL_PRIVATE

    # an earlier run's journal in the same folder (a host that writes none this time: killed,
    # crashed) must not pass its errors and flows off as this run's
    stale = tmp_path / "work" / "host-zz.json"
    stale.parent.mkdir()
    stale.write_text(json.dumps([{"kind": "open", "id": 1, "t": 0.0},
                                 {"kind": "error", "id": 2, "error": "from before"}]))  # fmt: skip
    run, rate = live_tiny_run(tmp_path, "static", "fsE-si-", IDEAL_PRIVATE)
    assert run.errors == []
    assert all(r.finished is not None for r in run.records.requests)
    kv = [f for f in run.records.flows if f.cls == "kv"]
    assert kv and {f.cls for f in run.records.flows} >= {"tp"}
    payload_rate = rate * netns.TCP_PAYLOAD_SHARE
    for flow in kv:  # a private path: exactly its bytes at the link's TCP payload rate
        assert flow.finished - flow.opened == pytest.approx(flow.size / payload_rate)
    opened = [
        e
        for path in (tmp_path / "work").glob("host-*.json")
        for e in json.loads(path.read_text())
        if e["kind"] == "open"
    ]
    assert opened == []  # no P2D or Stage-1 flow went through an agent


# ----------------------------------------------------------------------------- the command
def test_simulate_only_reports_the_bound_and_each_policy(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flowsched",
            "bench",
            "serving",
            "--simulate-only",
            "--policies",
            "rmlq,static+late",
            "--sim-policies",
            "llf+late",  # the ideal bound runs without being named
            "--loads",
            "0.6",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for row in ("ideal (bound)", "rmlq sim", "static+late sim", "llf+late"):
        assert row in proc.stdout
    assert "testbed" not in proc.stdout.split("pooled", 1)[1]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["meta"]["mode"] == "simulator only (asked)"
    assert results["meta"]["time_scale"] == serving.TIME_SCALE
    assert (tmp_path / "work" / "policies" / "static+late.toml").exists()


def test_the_table_goes_to_the_stdout_of_the_call(tmp_path: Path) -> None:
    """run's stream defaulted to the sys.stdout of import time: a caller's redirect_stdout
    (or pytest's capture, closed after the test that imported the module) did not get the
    table, or the run failed: 'I/O operation on closed file'."""
    options = serving.ServingOptions(
        tmp_path, ("rmlq",), (0.6,), (1,), sim_policies=(), simulate_only=True
    )
    with contextlib.redirect_stdout(io.StringIO()) as caught:
        serving.run(options)
    assert "ideal (bound)" in caught.getvalue() and "rmlq sim" in caught.getvalue()


def test_unknown_policy_exits_2_naming_it(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "flowsched", "bench", "serving", "--simulate-only"),
            *("--policies", "rmlq,nope", "--out", str(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "unknown policy 'nope'" in proc.stderr


def test_the_testbed_scenario_simulates_tcps_payload_rate() -> None:
    """The simulator side runs the links at the payload rate TCP gets on the testbed's."""
    scen = scenario.load(serving.SCENARIO)
    assert scen.sim.payload_share == pytest.approx(netns.TCP_PAYLOAD_SHARE, abs=1e-4)


# ----------------------------------------------------------------------------- the report
def test_oracle_rows_are_marked_and_last(monkeypatch: pytest.MonkeyPatch) -> None:
    # llf and llf+late know every flow's true deadline: the table marks them and puts them
    # after the real policies, as flowsched sim does, on the simulator's side and the testbed's
    from flowsched import report
    from flowsched.metrics import RequestRecord, RunRecords
    from flowsched.sim.run import PolicySpec, ideal_spec

    def fake_simulate(_scen: Any, _spec: Any, _load: float, _seed: int) -> Any:
        records = RunRecords(requests=[RequestRecord("q0", 0.0, 1.0, 0.5)])
        return type("Result", (), {"records": records})()

    monkeypatch.setattr(serving, "simulate", fake_simulate)
    options = serving.ServingOptions(
        out=Path("unused"), policies=("rmlq", "llf+late"), loads=(0.6,), seeds=(1,)
    )
    specs = {
        "ideal": ideal_spec(8),
        "rmlq": PolicySpec("rmlq", label="rmlq"),
        "llf+late": PolicySpec("llf", {"drop_late": True}, label="llf+late"),
        "llf": PolicySpec("llf", label="llf"),
    }
    live = [RunRecords(requests=[RequestRecord("q0", 0.0, 1.0, 0.5)])]
    testbed = {("rmlq", 0.6): live, ("llf+late", 0.6): live, ("ideal", 0.6): live}
    outcomes = serving._outcomes(
        scenario.load(serving.SCENARIO), options, specs, testbed, report.Progress(8, io.StringIO())
    )
    oracle = {o.policy: o.oracle for o in outcomes}
    assert oracle == {
        "ideal": False,
        "rmlq sim": False,
        "llf+late sim": True,
        "llf": True,
        "ideal testbed": False,
        "rmlq testbed": False,
        "llf+late testbed": True,
    }
    lines = report.table(outcomes).splitlines()[2:]
    names = [line.split("  ")[1].strip() for line in lines]
    assert names[-3:] == ["llf+late sim (oracle)", "llf (oracle)", "llf+late testbed (oracle)"]


def test_rmlq_volume_lag_is_scaled_like_every_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # volume_lag is seconds (how old the byte counts are): at x 100 a live cluster's 0.12 s
    # is 12 s of the testbed's time, as the file's other times are
    policies_dir = tmp_path / "policies"
    policies_dir.mkdir()
    text = DEFAULT_FILE.read_text().replace("volume_lag = 0.0", "volume_lag = 0.12")
    assert "volume_lag = 0.12" in text
    (policies_dir / "default.toml").write_text(text)
    monkeypatch.setattr(serving, "data_path", lambda name: tmp_path / name)
    args = serving.policy_document("rmlq")["policy"]["args"]
    assert args["volume_lag"] == pytest.approx(0.12 * serving.TIME_SCALE)
    assert args["urgent_slack"] == pytest.approx(0.025 * serving.TIME_SCALE)


def test_a_request_whose_kv_transfer_failed_is_a_miss() -> None:
    # the engine finishes a failed flow so that the workload goes on, but its request's KV
    # never reached the decoder: it counts as never finished, as the contention benchmark
    # counts a failed transfer (and metrics' convention for requests that never finished)
    from flowsched.metrics import FlowRecord, RequestRecord, RunRecords, summarize

    records = RunRecords(
        flows=[
            FlowRecord(1, "kv", 10, 0.0, 0.2, request="q0"),
            FlowRecord(2, "kv", 10, 0.0, 0.3, request="q1"),
            FlowRecord(3, "kv_reuse", 10, 0.0, 0.1, request="q2"),
            FlowRecord(4, "tp", 10, 0.0, 0.1, job="i0/b1"),
        ],
        requests=[
            RequestRecord("q0", 0.0, 1.0, 0.5),
            RequestRecord("q1", 0.0, 1.0, 0.5),
            RequestRecord("q2", 0.0, 1.0, 0.5),
        ],
    )
    assert serving.unfinish_failed(records, {1, 3, 4}) == 2
    assert [r.finished for r in records.requests] == [None, 0.5, None]
    assert summarize(records).slo_attainment == pytest.approx(1 / 3)


def test_a_stopped_engine_leaves_no_socket_file(tmp_path: Path) -> None:
    live = LiveEngine(tmp_path / "engine.sock", {"p0": "h0"}, lambda job: [])
    live.stop()
    assert not (tmp_path / "engine.sock").exists()


def test_a_live_run_whose_hosts_fail_to_start_stops_its_engine(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The engine listens before the host processes start: when they cannot, its socket (and
    its accept thread) must not outlive the run, nor the agents' token file its private
    folder (never the run's folder, which gets shared)."""
    tokens: list[Path] = []

    def start_agents(*args: object, token: Path) -> None:
        assert token.read_bytes() and not token.is_relative_to(tmp_path / "work")
        tokens.append(token)

    def cannot_start(*args: object) -> None:
        raise OSError("no such namespace")

    monkeypatch.setattr(netns.Topology, "configure_classes", lambda self, dscp: None)
    monkeypatch.setattr(serving.runner, "start_agents", start_agents)
    monkeypatch.setattr(serving, "_start_hosts", cannot_start)
    scen = scenario.parse(TINY, "tiny.toml")
    topo = netns.plan(serving.topology_spec(scen, "fsU-"))
    policy = tmp_path / "rmlq.toml"
    serving.write_policy_file("rmlq", policy)
    with pytest.raises(OSError, match="no such namespace"):
        serving.run_live(topo, scen, 0.5, 1, policy, tmp_path / "work")
    assert not (tmp_path / "work" / "engine.sock").exists()
    assert len(tokens) == 1 and not tokens[0].parent.exists()


@pytest.mark.usefixtures("lock_dir")
def test_a_live_run_that_fails_to_start_is_an_error_and_the_others_go_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A live run whose agents or hosts do not start (run_live's RuntimeError) is a recorded
    error (exit status 1) and the other runs and the report go on; it ended the whole
    benchmark with a traceback, every finished run lost."""
    from flowsched.cli import main
    from flowsched.metrics import RunRecords

    ran: list[Path] = []

    def run_live(
        topo: Any, scen: Any, load: float, seed: int, path: Path, *a: Any, **k: Any
    ) -> Any:
        ran.append(path)
        if path.stem == "rmlq":
            raise RuntimeError("the agent of d0 did not start: exited with status 1")
        return serving.LiveRun(RunRecords())

    monkeypatch.setattr(netns, "_build", lambda topo, dscp: None)
    monkeypatch.setattr(netns, "cleanup", lambda prefix: [])
    monkeypatch.setattr(netns, "probe", lambda prefix="fsE-": None)
    monkeypatch.setattr(serving, "run_live", run_live)
    out = tmp_path / "out"
    argv = ["--out", str(out), "--policies", "rmlq,static+late", "--sim-policies", ""]
    status = main(["bench", "serving", *argv])
    err = capsys.readouterr().err
    assert status == 1 and "Traceback" not in err
    assert [p.stem for p in ran] == ["ideal", "rmlq", "static+late"]
    errors = json.loads((out / "results.json").read_text())["meta"]["errors"]
    assert errors == ["rmlq, load 0.6, seed 1: the agent of d0 did not start: exited with status 1"]
