"""Run one policy on the testbed: control plane, sniffer, one worker per host, then collect.

Processes (all started here, all stopped here, and all inside the testbed's namespaces, so that
:func:`flowsched.testbed.netns.cleanup` also ends them after a crash):

* the control plane on the management network: the real coordinator in the switch namespace
  and one real agent per host (``control="agent"``, the default; TP through the NCCL plugin),
  or, as an ablation, the minimal controller (:mod:`flowsched.testbed.minictl`,
  ``control="mini"``);
* the sniffer on the switch ports (:mod:`flowsched.testbed.sniff`);
* one worker per host (:mod:`flowsched.testbed.worker`).

The coordinator's token lives in a private temporary folder for the run
(:func:`private_token`), never in the run's output folder, which users copy and share.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowsched.metrics import FlowRecord, RunRecords
from flowsched.policyfile import PolicyConfig
from flowsched.testbed import timezero
from flowsched.testbed.netns import Topology
from flowsched.testbed.procstat import cpu_seconds
from flowsched.testbed.records import RecordBuilder
from flowsched.testbed.trace import Trace

CTL_PORT = 7200
#: seconds between sending time zero, once every worker is ready, and time zero: the workers
#: (and the minimal controller) must read it and wake their flows' threads, which then sleep
#: until their own start, before the trace's first transfers at 0.0 s. Measured on the 2-core
#: machine (rmlq, default scenario): a worker read it 0.1-1.5 ms after it was sent, and the last
#: of a prefill host's 192 threads (20 s trace) was awake 7.4 ms after; 50 ms leaves a loaded
#: machine 6x that, and idles each run 50 ms, where the fixed margin before idled ~2.3 s
START_MARGIN = 0.05
#: the agents' NIC sampling period on the testbed (their link loads are at most this old; the
#: minimal controller samples the switch ports every policy tick). Not shorter: every changed
#: load re-evaluates the flows on that link, and the benchmark's policies take rho from the
#: flows' byte counters (rmlq) or not at all, so faster samples only cost CPU
NIC_INTERVAL = 0.1
#: seconds the run's processes get to exit on SIGTERM before they are killed
STOP_GRACE = 2.0
#: seconds a daemon (coordinator, agent, minimal controller) gets to print its ready line before
#: it is killed and the run fails. Measured: 0.4 s for the coordinator and for an agent with the
#: load average at 2 on the 2-core machine; this is the ready-line wait of the end-to-end tests'
#: daemons (:func:`flowsched.testbed.daemons.spawn`), so only a hung daemon reaches it
READY_TIMEOUT = 30.0
#: seconds the sniffer gets to write its capture and exit on SIGTERM (it writes a few kB)
SNIFFER_STOP_GRACE = 10.0
#: what an agent logs once it holds a coordinator session (flowsched.agent.service)
SESSION_LINE = b"connected to the coordinator"
#: seconds between looks while waiting for an agent's session or the sniffer's ready file
SESSION_POLL = 0.02


@dataclass(slots=True)
class TestbedRun:
    """What one policy run measured."""

    policy: str
    records: RunRecords
    #: (flow id, new level, decision -> first packet in the new class at the bottleneck, s)
    promotions: list[tuple[int, int, float]] = field(default_factory=list)
    #: per transfer: its open at the trace time -> the control plane's first level received
    #: (the SDK open round trip with the agent, or the minimal controller's answer), s
    admission: list[float] = field(default_factory=list)
    #: bytes per htb class minor on each switch port during the run
    class_bytes: dict[str, dict[int, int]] = field(default_factory=dict)
    #: packets the shaped ports (hosts' NICs and switch ports) dropped during the run
    dropped_packets: int = 0
    errors: list[str] = field(default_factory=list)
    control: str = "agent"
    wall_seconds: float = 0.0
    #: CPU seconds (user + system) of the control plane and the sniffer during the run
    cpu_seconds: dict[str, float] = field(default_factory=dict)


def _python(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


@contextlib.contextmanager
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """A list to append started processes to; all are stopped when the block exits."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        # SIGTERM first: the daemons shut down cleanly on it (an agent detaches its table);
        # whatever is still running after a grace period is killed
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + STOP_GRACE
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)


@contextlib.contextmanager
def private_token() -> Iterator[Path]:
    """A fresh coordinator token file (mode 0600) in a private temporary folder (0700),
    both removed when the block exits, also on error: the daemons read it at start, and it
    must not land in a run's output folder (its logs and results get copied and shared)."""
    from flowsched.protocol import write_token

    with tempfile.TemporaryDirectory(prefix="flowsched-token-") as folder:
        token = Path(folder) / "token"
        write_token(token)
        yield token


def run_policy(
    topo: Topology,
    trace: Trace,
    cfg: PolicyConfig,
    policy_path: Path,
    workdir: Path,
    *,
    control: str = "agent",
) -> TestbedRun:
    """Run ``trace`` under the policy file ``policy_path`` and collect the measurements."""
    workdir.mkdir(parents=True, exist_ok=True)
    sniff_out = workdir / "sniff.json"
    journals = [workdir / f"{h.name}.json" for h in topo.hosts]
    for stale in [sniff_out, *journals]:  # an earlier run's into the same --out: a process
        stale.unlink(missing_ok=True)  # that dies before it writes must not leave its figures
    topo.configure_classes([m.dscp for m in cfg.levels])
    trace_path = workdir / "trace.json"
    trace_path.write_text(trace.to_json(), encoding="utf-8")
    started = time.monotonic()
    before = topo.class_bytes()
    with private_token() as token, processes() as procs:  # (the daemons stop first)
        ctl, controller = _start_control(
            topo, procs, policy_path, trace.rate_bytes, control, workdir, token
        )
        sniffer = _start_sniffer(topo, procs, sniff_out)
        workers = _start_workers(
            topo, procs, trace_path, policy_path, workdir, ctl, control, trace.duration
        )
        send_time_zero([*controller, *workers], timezero.TimeZero.after(START_MARGIN))
        errors = wait_workers(
            workers,
            trace.duration * 3 + 30,
            [h.name for h in topo.hosts],
            _worker_logs(topo, workdir),
        )
        errors += ended_early(p for p in procs if p not in workers and p is not sniffer)
        cpu = {_label(p): cpu_seconds(p.pid) for p in procs if p not in workers}
        errors += stop_sniffer(sniffer, sniff_out)
    after = topo.class_bytes()
    events = [_read_json(journal, []) for journal in journals]
    run = collect(
        trace, cfg.policy, events, _read_json(sniff_out, {}), errors, [m.dscp for m in cfg.levels]
    )
    run.class_bytes = _class_delta(before, after)
    run.dropped_packets = topo.run_drops()
    run.cpu_seconds = {k: v for k, v in cpu.items() if v is not None}
    run.control, run.wall_seconds = control, time.monotonic() - started
    return run


def _start_control(
    topo: Topology,
    procs: list[subprocess.Popen[bytes]],
    policy: Path,
    bandwidth: float,
    control: str,
    workdir: Path,
    token: Path,
) -> tuple[str, list[subprocess.Popen[bytes]]]:
    """Start the control plane; return the address the workers use (mini) or "", and the
    processes of it that wait for time zero (the minimal controller)."""
    if control == "agent":
        start_agents(topo, procs, policy, bandwidth, workdir, token=token)
        return "", []
    address = f"{topo.switch_mgmt_ip}:{CTL_PORT}"
    argv = _python(
        "flowsched.testbed.minictl",
        "--policy",
        str(policy),
        "--listen",
        address,
        "--bandwidth",
        str(bandwidth),
        "--ports",
        json.dumps({h.name: h.switch_port for h in topo.hosts}),
    )
    log = workdir / "minictl.log"
    proc = _spawn_daemon(topo.ns_command(topo.switch_ns, argv), log, stdin=subprocess.PIPE)
    procs.append(proc)
    _expect_line(proc, b"listening", "the testbed controller", log)
    return address, [proc]


def _expect_line(
    proc: subprocess.Popen[bytes],
    marker: bytes,
    what: str,
    log: Path | None = None,
    *,
    timeout: float = READY_TIMEOUT,
) -> bytes:
    """The first stdout line of ``proc``; RuntimeError when it lacks ``marker``, or when no
    whole line comes within ``timeout`` s (``proc`` is then killed), with the exit status and
    the end of ``log`` (where the daemon's stderr, and so its reason, went)."""
    return _expect_lines([(proc, what, log)], marker, timeout=timeout)[0]


#: a process started here, what it is ("the worker of h0") and its log (its stderr), if any
Started = tuple[subprocess.Popen[bytes], str, Path | None]


def _expect_lines(
    started: list[Started], marker: bytes, *, timeout: float = READY_TIMEOUT
) -> list[bytes]:
    """The first stdout line of each of ``started``, read side by side; RuntimeError at the
    first that exits or prints a line without ``marker`` (naming it, with its exit status or
    line and its log's end), or, when lines are missing after ``timeout`` s, naming each
    process still silent (each is then killed: it must not outlive the failed start)."""
    lines = {proc: b"" for proc, _, _ in started}
    deadline = time.monotonic() + timeout
    while silent := [s for s in started if b"\n" not in lines[s[0]]]:
        readable = _readable([proc for proc, _, _ in silent], deadline)
        if not readable:
            for proc, _, _ in silent:
                _kill(proc)
            detail = f"no line with {marker.decode()!r} within {timeout:g} s; killed"
            raise RuntimeError("\n".join(_not_started(s, detail) for s in silent))
        for proc, what, log in silent:
            if proc not in readable:
                continue
            assert proc.stdout is not None
            chunk = os.read(proc.stdout.fileno(), 4096)
            lines[proc] += chunk
            line = lines[proc].split(b"\n", 1)[0] + b"\n"
            if not chunk:  # end of output: it exited
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=STOP_GRACE)
                detail = f"exited with status {proc.returncode} before its ready line"
                raise RuntimeError(_not_started((proc, what, log), detail))
            if b"\n" in lines[proc] and marker not in line:
                raise RuntimeError(_not_started((proc, what, log), repr(line)))
    return [lines[proc].split(b"\n", 1)[0] + b"\n" for proc, _, _ in started]


def _readable(
    procs: list[subprocess.Popen[bytes]], deadline: float
) -> list[subprocess.Popen[bytes]]:
    """Those of ``procs`` with stdout to read (output or its end), waiting until ``deadline``
    at most; [] when none has by then."""
    by_fd = {proc.stdout.fileno(): proc for proc in procs if proc.stdout is not None}
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return []
    return [by_fd[fd] for fd in select.select(list(by_fd), [], [], remaining)[0]]


def _not_started(started: Started, detail: str) -> str:
    """``started`` did not start, with ``detail`` and the end of its log."""
    _, what, log = started
    return f"{what} did not start: {detail}" + ("" if log is None else _log_tail(log))


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill ``proc`` and reap it (a process that does not die within STOP_GRACE is left)."""
    proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_GRACE)


def _log_tail(log: Path) -> str:
    try:
        tail = log.read_text(encoding="utf-8", errors="replace")[-2000:].strip()
    except OSError as exc:
        tail = f"(unreadable: {exc})"
    return f"; its log {log} ends:\n{tail or '(empty)'}"


def _expect_session(
    proc: subprocess.Popen[bytes],
    log: Path,
    what: str,
    *,
    since: int = 0,
    timeout: float = READY_TIMEOUT,
) -> None:
    """Wait until the agent ``proc`` logs its first coordinator session (:data:`SESSION_LINE`:
    it took the welcome and sent its resync) in ``log`` past byte ``since`` (its size before
    ``proc`` started: a run into the same ``--out`` appends to an earlier run's log, whose
    session line says nothing of this agent); RuntimeError naming it, with its log's tail, when
    it exits first or ``timeout`` s pass (it is then killed). An agent prints its ready line
    before it connects, and until its resync the flows it opens and closes are never reported
    and the trace's first transfers would run at their class defaults."""
    problem = _wait_until(
        proc, lambda: SESSION_LINE in _read_from(log, since), "coordinator session", timeout
    )
    if problem is not None:
        raise RuntimeError(f"{what} did not connect: {problem}{_log_tail(log)}")


def _read_from(path: Path, offset: int) -> bytes:
    """``path``'s bytes from ``offset`` on."""
    with path.open("rb") as file:
        file.seek(offset)
        return file.read()


def _size(path: Path) -> int:
    """``path``'s size in bytes, 0 when it does not exist."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _wait_until(
    proc: subprocess.Popen[bytes], done: Callable[[], bool], goal: str, timeout: float
) -> str | None:
    """Poll ``done()`` until it holds (None), else why it never did: ``proc`` exited first
    (its status) or ``timeout`` s passed (``proc`` is then killed); ``goal`` names the wait."""
    deadline = time.monotonic() + timeout
    while not done():
        if proc.poll() is not None:
            return f"exited with status {proc.returncode} before its {goal}"
        if time.monotonic() >= deadline:
            _kill(proc)
            return f"no {goal} within {timeout:g} s; killed"
        time.sleep(SESSION_POLL)
    return None


def table_path(topo: Topology, host: str) -> Path:
    """The host's agent flow table (``/dev/shm`` is shared by every namespace)."""
    return Path(f"/dev/shm/{topo.spec.prefix}{host}-table")


def _spawn_daemon(
    command: list[str],
    log: Path,
    *,
    stdin: int | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start a daemon whose ready line we read from stdout and whose log goes to ``log``
    (kept with the run's journals, off the user's terminal); ``stdin``, ``env``: as for
    Popen."""
    with log.open("ab") as sink:
        return subprocess.Popen(command, stdin=stdin, stdout=subprocess.PIPE, stderr=sink, env=env)


def start_agents(
    topo: Topology,
    procs: list[subprocess.Popen[bytes]],
    policy: Path,
    bandwidth: float,
    workdir: Path,
    *,
    token: Path,
) -> None:
    """The real coordinator in the switch namespace and one real agent per host, their logs
    and sockets in ``workdir``; ``token``: their token file, kept out of ``workdir``
    (:func:`private_token`)."""
    argv = [
        sys.executable,
        "-m",
        "flowsched",
        "coordinator",
        "--policy",
        str(policy),
        "--listen",
        f"{topo.switch_mgmt_ip}:0",
        "--metrics-port",
        "0",
        "--token-file",
        str(token),
    ]
    coord_log = workdir / "coordinator.log"
    coord = _spawn_daemon(topo.ns_command(topo.switch_ns, argv), coord_log)
    procs.append(coord)
    ready = _expect_line(coord, b"listening on", "the coordinator", coord_log)
    address = ready.split()[3].decode()
    agents: list[tuple[subprocess.Popen[bytes], Path, int, str]] = []
    for host in topo.hosts:
        argv = [
            sys.executable,
            "-m",
            "flowsched",
            "agent",
            "--coordinator",
            address,
            "--node",
            host.name,
            "--token-file",
            str(token),
            "--policy",
            str(policy),
            "--table",
            str(table_path(topo, host.name)),
            "--socket",
            str(workdir / f"{host.name}.sock"),
            "--metrics-port",
            "-1",
            "--interface",
            host.data_dev,
            "--link-bandwidth",
            str(bandwidth),
            # veth pairs report 10 Gbit/s: the agents are told the shaped rate of the host links
            "--link-capacity",
            repr(bandwidth),
            "--nic-interval",
            str(NIC_INTERVAL),
        ]
        agent_log = workdir / f"agent-{host.name}.log"
        since = _size(agent_log)  # (the log of an earlier run into the same --out goes on)
        agent = _spawn_daemon(topo.ns_command(host.netns, argv), agent_log)
        procs.append(agent)
        _expect_line(agent, b"ready", f"the agent of {host.name}", agent_log)
        agents.append((agent, agent_log, since, f"the agent of {host.name}"))
    for agent, agent_log, since, what in agents:
        _expect_session(agent, agent_log, what, since=since)


def _start_sniffer(
    topo: Topology,
    procs: list[subprocess.Popen[bytes]],
    out: Path,
    *,
    timeout: float = READY_TIMEOUT,
) -> subprocess.Popen[bytes]:
    """Start the sniffer on the switch ports and wait for its ready file; RuntimeError naming
    it, with its exit status and its log's tail (its stderr, so its reason), when it exits first
    or ``timeout`` s pass (it is then killed). Without it the run would report no promotion
    latency, which reads as a run in which no promotion was measured."""
    ready = out.with_suffix(".ready")
    ready.unlink(missing_ok=True)
    argv = _python(
        "flowsched.testbed.sniff", "--out", str(out), *(h.switch_port for h in topo.hosts)
    )
    log = sniffer_log(out)
    with log.open("ab") as sink:
        proc = subprocess.Popen(topo.ns_command(topo.switch_ns, argv), stderr=sink)
    procs.append(proc)
    problem = _wait_until(proc, ready.exists, "ready file", timeout)
    if problem is not None:
        raise RuntimeError(f"the sniffer did not start: {problem}{_log_tail(log)}")
    return proc


def sniffer_log(out: Path) -> Path:
    """Where the sniffer writing ``out`` logs (its stderr), next to ``out``."""
    return out.with_name("sniffer.log")


def stop_sniffer(proc: subprocess.Popen[bytes], out: Path) -> list[str]:
    """Stop the sniffer (on SIGTERM it writes its capture to ``out``); the run's errors: one
    when it does not exit within :data:`SNIFFER_STOP_GRACE` s (it is then killed), exits with
    an error or leaves no capture, since that run's promotion latencies are then missing."""
    proc.send_signal(signal.SIGTERM)
    problem: str | None
    try:
        code = proc.wait(timeout=SNIFFER_STOP_GRACE)
    except subprocess.TimeoutExpired:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_GRACE)
        problem = f"did not exit within {SNIFFER_STOP_GRACE:g} s of SIGTERM; killed"
    else:
        problem = f"exited with status {code}" if code else None
    out.with_suffix(".ready").unlink(missing_ok=True)
    if problem is None and not isinstance(_read_json(out, None), dict):
        problem = f"left no capture in {out}"
    if problem is None:
        return []
    return [
        f"the sniffer {problem}: this run's promotion latencies are missing "
        f"(its log: {sniffer_log(out)})"
    ]


def _start_workers(
    topo: Topology,
    procs: list[subprocess.Popen[bytes]],
    trace: Path,
    policy: Path,
    workdir: Path,
    ctl: str,
    control: str,
    duration: float,
) -> list[subprocess.Popen[bytes]]:
    """Start one worker per host (its stderr to ``worker-<host>.log`` in ``workdir``) and wait
    until every one is ready for time zero (:func:`_expect_lines`: RuntimeError naming those
    that are not within :data:`READY_TIMEOUT` s)."""
    ips = json.dumps({h.name: h.data_ip for h in topo.hosts})
    logs = _worker_logs(topo, workdir)
    started: list[Started] = []
    for host, log in zip(topo.hosts, logs, strict=True):
        argv = _python(
            "flowsched.testbed.worker",
            "--trace",
            str(trace),
            "--host",
            host.name,
            "--ips",
            ips,
            "--policy",
            str(policy),
            "--control",
            control,
            "--ctl",
            ctl,
            "--timeout",
            str(duration * 3 + 20),
            "--out",
            str(workdir / f"{host.name}.json"),
        )
        env = dict(os.environ, FLOWSCHED_SOCKET_IFNAME=host.data_dev, FLOWSCHED_CLASS="tp")
        if control == "agent":
            env["FLOWSCHED_SOCKET"] = str(workdir / f"{host.name}.sock")
            env["FLOWSCHED_TABLE"] = str(table_path(topo, host.name))
        proc = _spawn_daemon(topo.ns_command(host.netns, argv), log, stdin=subprocess.PIPE, env=env)
        procs.append(proc)
        started.append((proc, f"the worker of {host.name}", log))
    _expect_lines(started, timezero.READY, timeout=READY_TIMEOUT)
    return [proc for proc, _, _ in started]


def _worker_logs(topo: Topology, workdir: Path) -> list[Path]:
    """Where each host's worker logs (its stderr), in the order of the hosts."""
    return [workdir / f"worker-{host.name}.log" for host in topo.hosts]


def send_time_zero(procs: Iterable[subprocess.Popen[bytes]], zero: timezero.TimeZero) -> None:
    """Give each of ``procs`` (ready, waiting on stdin) time zero, and close its stdin. One that
    has exited meanwhile is skipped: the run reports its exit (:func:`wait_workers`,
    :func:`ended_early`)."""
    line = zero.line()
    for proc in procs:
        if proc.stdin is None:
            continue
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.write(line)
            proc.stdin.flush()
        with contextlib.suppress(BrokenPipeError):  # (what a failed flush left is dropped)
            proc.stdin.close()


def _label(proc: subprocess.Popen[bytes]) -> str:
    """``module`` or ``flowsched <command> --node N`` of a process started here."""
    argv = [str(a) for a in proc.args] if isinstance(proc.args, list) else [str(proc.args)]
    words = argv[argv.index("-m") + 1 :] if "-m" in argv else argv
    node = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--node"]
    return " ".join(words[:2] if words and words[0] == "flowsched" else words[:1]) + (
        f" {node[0]}" if node else ""
    )


def wait_workers(
    workers: list[subprocess.Popen[bytes]],
    timeout: float,
    hosts: list[str],
    logs: list[Path] | None = None,
) -> list[str]:
    """Wait for every worker to exit (killing those still running at ``timeout``); the errors,
    each naming the worker's host (``hosts``, one per worker) and its log if ``logs`` (one per
    worker) says where it is."""
    deadline, errors = time.monotonic() + timeout, []
    for i, proc in enumerate(workers):
        see = "" if logs is None else f" (its log: {logs[i]})"
        try:
            code = proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            errors.append(f"worker {hosts[i]} did not finish within {timeout:.0f} s{see}")
            continue
        if code != 0:
            errors.append(f"worker {hosts[i]} exited with status {code}{see}")
    return errors


def ended_early(daemons: Iterable[subprocess.Popen[bytes]]) -> list[str]:
    """An error for each of ``daemons`` (the control plane, which runs until the run stops it)
    that has exited already: from then on the run's levels were not its policy's."""
    return [
        f"{_label(proc)} exited with status {proc.returncode} during the run"
        for proc in daemons
        if proc.poll() is not None
    ]


def _read_json(path: Path, default: Any) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return default


def _class_delta(
    before: dict[str, dict[int, int]], after: dict[str, dict[int, int]]
) -> dict[str, dict[int, int]]:
    return {
        port: {
            minor: count - before.get(port, {}).get(minor, 0) for minor, count in classes.items()
        }
        for port, classes in after.items()
    }


def collect(
    trace: Trace,
    policy: str,
    journals: list[list[dict[str, Any]]],
    sniff: dict[str, Any],
    errors: list[str],
    dscp: list[int],
) -> TestbedRun:
    """Build the run's records and promotion latencies from the workers' journals."""
    events = [e for journal in journals for e in journal]
    builder = RecordBuilder(trace)
    opened = {e["id"]: e["t"] for e in events if e["kind"] == "open"}
    levels: dict[int, list[int]] = {}
    for e in events:
        if e["kind"] == "level":
            levels.setdefault(e["id"], []).append(e["level"])
    flows = []
    by_id = {t.flow_id: t for t in trace.transfers}
    for e in events:
        if e["kind"] == "done" and e["id"] in by_id and e.get("ok", True):
            t = by_id[e["id"]]
            builder.transfer_done(t.flow_id, e["t"])
            seen = levels.get(t.flow_id, [-1])
            flows.append(
                FlowRecord(
                    t.flow_id,
                    t.cls,
                    t.size,
                    opened.get(t.flow_id, t.start),
                    e["t"],
                    t.deadline,
                    t.job,
                    t.request,
                    seen[0],
                    seen[-1],
                )
            )
        elif e["kind"] == "span":
            builder.span(e["span"], e["job"], e["start"], e["end"])
        elif e["kind"] == "error":
            errors.append(f"{e.get('what') or 'flow ' + str(e['id'])}: {e['error']}")
    end = max([f.finished for f in flows] + [s.end for s in builder.spans] + [0.0])
    run = TestbedRun(policy, builder.build(flows, end_time=end), errors=errors)
    run.promotions = promotion_latencies(events, sniff, dscp)
    run.admission = admission_delays(events)
    return run


def admission_delays(events: list[dict[str, Any]]) -> list[float]:
    """Seconds from each transfer's open to its admission (first level in hand), sorted."""
    opened = {e["id"]: e["t"] for e in events if e["kind"] == "open"}
    return sorted(
        e["t"] - opened[e["id"]] for e in events if e["kind"] == "admitted" and e["id"] in opened
    )


def promotion_latencies(
    events: list[dict[str, Any]], sniff: dict[str, Any], dscp: list[int]
) -> list[tuple[int, int, float]]:
    """Decision -> first packet in the new class at the bottleneck, for every level change
    that changes the flow's DSCP after its first packet."""
    tuples = {
        e["id"]: f"{e['src']}:{e['sport']}>{e['dst']}:{e['dport']}"
        for e in events
        if e["kind"] == "tuple"
    }
    transitions: dict[str, list[tuple[int, int]]] = {}
    for mono, key, tos in sniff.get("transitions", []):
        transitions.setdefault(key, []).append((mono, tos >> 2))
    out: list[tuple[int, int, float]] = []
    last_dscp: dict[int, int] = {}
    for e in sorted((e for e in events if e["kind"] == "level"), key=lambda e: e["received_ns"]):
        new, old = dscp[e["level"]], last_dscp.get(e["id"])
        last_dscp[e["id"]] = new
        key = tuples.get(e["id"])
        if old is None or old == new or key not in transitions or e.get("decided_ns") is None:
            continue
        seen = transitions[key]
        if not seen or seen[0][0] >= e["decided_ns"]:
            continue  # the change came before the flow's first packet: not a promotion on the wire
        later = [mono for mono, tos in seen if mono >= e["decided_ns"] and tos == new]
        if later:
            out.append((e["id"], e["level"], (later[0] - e["decided_ns"]) / 1e9))
    return out
