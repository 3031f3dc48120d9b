#!/usr/bin/env python3
"""Coordinator load benchmark: events/s, decision latency and memory at 10,000 flows.

Runs a real ``flowsched coordinator`` process (pinned to one core with ``taskset`` when
available) and drives it from this process (pinned to another core): 1,000 simulated agents
open 10 flows each (a class mix of tp, experience, param_sync, kv and bulk), then

* phase "throughput": every agent sends progress reports as fast as TCP back-pressure allows
  (plus flow churn: every 10th frame closes one kv flow and opens a new one); the coordinator's
  own counters give the sustained flow events per second;
* phases "latency": every agent reports all its flows every ``agents * flows / rate`` seconds,
  i.e. an offered load of ``rate`` events/s, for each rate of ``--rates``; the coordinator's
  decision-latency histogram (event arrival -> level updates queued) gives p50/p99 (linear
  interpolation inside its buckets), and /proc gives its resident memory.

Both phases run for each mode, side by side: "batched" (each agent frame carries its 10
reports, the coordinator runs the policy once per event-loop turn, and also once a batch has
been collecting for 1 ms, its default ``--max-batch-delay``), the baseline
"per-turn" (the same without that bound: once per turn only) and the baseline "unbatched" (one
event per frame, the policy run after every frame, ``--no-batch``), and "batched-tls" (batched,
every agent connected over TLS: ``--tls-cert``, a self-signed certificate made with the
openssl command), whose baseline is "batched"; and for
each promotion scheme of ``--promotion``: "timers" (each deadline flow re-evaluated when the
policy's next promotion time for it comes) and the baseline "sweep" (every deadline flow
re-evaluated each timer period). The ratios are printed at the end. Each latency point
reports the rate asked for, the rate the generator offered and its CPU, and the rate the
coordinator counted: a point where the generator fell short is flagged (it measures the
generator). It also reports the share of the machine's CPU time the hypervisor stole during
the point (/proc/stat): on a virtual machine a stolen millisecond is a millisecond of every
waiting frame's latency, which no code of ours spends, so a p99 next to a high steal share is
the machine's. The coordinator's histogram starts when it reads a frame, so it cannot see a
frame waiting in the kernel while the coordinator is busy: each point therefore also times
the churn opens end to end, from the simulated agent's send to the arrival of the open's
first level update (the generator's own loop delays included: an upper bound), and counts
the coordinator's full garbage collections. ``--phases latency --rates R --profile``
profiles one paced load alone.

Usage:
    .venv/bin/python bench/coordinator_load.py [--agents 1000] [--flows 10] [--duration 5]
        [--rates 10000,30000,100000] [--policy FILE]
        [--modes batched,per-turn,unbatched,batched-tls]
        [--promotion sweep,timers] [--per-flow-policy auto|yes|no]
        [--phases throughput,latency] [--progress-form maps,packed,sealed]
        [--max-batch-delay S]
        [--profile] [--json OUT]

``--progress-form`` sets how the simulated agents send progress: "sealed" (the default:
protocol 5, two integer arrays per frame, and every frame after the handshake carries its
MAC, both ways, as between this release's agents and coordinator), "packed" (the same at
protocol 2, without MACs) or "maps" (protocol 1, an ``{"id", "sent"}`` map per report; they
offer version 1 in their hello). A list runs each in turn with a fresh
coordinator, e.g. ``maps,packed,packed,maps`` or ``packed,sealed,sealed,packed``, and the
report ends with each point's p99, coordinator CPU and steal per run and the ratio of the
means.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import itertools
import json
import math
import os
import random
import re
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from flowsched.compiled import build_tree
from flowsched.protocol import (
    Challenge,
    Connection,
    Levels,
    Message,
    ReceiveBuffer,
    Resync,
    Role,
    Sentinel,
    Welcome,
    frame,
    write_token,
)
from flowsched.testbed.procstat import cpu_times, memory_mib, running_cpu_seconds, steal_share
from flowsched.testbed.simagent import (
    CLASS_MIX,
    HEARTBEAT,
    PROGRESS_FORMS,
    flow_open,
    prepare_load_generator,
    progress_fields,
)
from flowsched.tls import client_context

#: the checkout this benchmark belongs to (the compiled build is made from it)
REPO = Path(__file__).resolve().parents[1]
DRAIN_TIMEOUT = 120.0
#: a latency point whose generator sent less than this share of the rate asked for is flagged
GENERATOR_SHORTFALL = 0.95
#: the coordinator's modes (see the module docstring)
MODES = ("batched", "per-turn", "unbatched", "batched-tls")
#: the paced generator's shortest sleep: the event loop's timers have 1 ms resolution, so a
#: shorter one fires at the next loop turn and the generator spins (at 100,000 events/s that
#: took most of its core); what falls due meanwhile is sent at the next wake-up, at most one
#: tick late
PACE_TICK = 0.001


# -- one simulated agent -----------------------------------------------------------------------


@dataclass
class SimAgent:
    """A minimal agent speaking raw frames (cheap enough to drive 1,000 of them from one core)."""

    node: str
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    flows: list[int]
    next_id: int
    sent: int = 0
    frames: int = 0
    events: int = 0
    updates_received: int = 0
    buffer: ReceiveBuffer = field(default_factory=ReceiveBuffer)
    #: which of every 10 frames carries the churn (0: the 10th, 20th, ... as always)
    churn_phase: int = 0
    #: the heartbeat interval the coordinator announced in its welcome
    beat_interval: float = 0.2
    #: when this agent last sent a frame (time.monotonic())
    last_sent: float = 0.0
    #: whether heartbeats go out as answers to the coordinator's (False while paced() sends
    #: them on each agent's own clock)
    answer_beats: bool = True
    #: churn opens awaiting their first level update: wire id -> time.monotonic() when sent
    #: (only while ``time_opens``: the paced phases)
    open_sent: dict[int, float] = field(default_factory=dict)
    #: seconds from a churn open's send to its first level update's arrival, end to end
    open_latency: list[float] = field(default_factory=list)
    time_opens: bool = False
    #: how progress goes on the wire (simagent.PROGRESS_FORMS): "packed" arrays, "maps", or
    #: "sealed" (packed, every frame with its MAC: its connection seals and opens them)
    progress_form: str = "packed"
    conn: Connection | None = None

    def framed(self, kind: str, data: bytes) -> bytes:
        """``data``, a frame of type ``kind``, as this agent's connection sends it."""
        return data if self.conn is None else self.conn.send_frame(kind, data)

    def open_entry(self, wire_id: int, cls: str, now: float) -> dict[str, Any]:
        return flow_open(self.node, wire_id, cls, now, kv_deadline_s=2.0)

    def progress_frames(self, batched: bool) -> bytes:
        """This agent's next report: all flows' progress (+ churn every 10th frame)."""
        self.sent += 65536
        self.frames += 1
        self.last_sent = time.monotonic()
        ids = list(self.flows)
        opens: list[dict[str, Any]] = []
        closes: list[dict[str, Any]] = []
        if (self.frames + self.churn_phase) % 10 == 0:
            now = time.time()
            old = self.flows.pop(6)  # a kv flow finishes, a new one starts
            closes.append({"id": old, "sent": self.sent, "closed_at": now})
            self.next_id += 1
            self.flows.insert(6, self.next_id)
            opens.append(self.open_entry(self.next_id, "kv", now))
            if self.time_opens:
                self.open_sent[self.next_id] = self.last_sent
        self.events += len(ids) + len(opens) + len(closes)
        form = self.progress_form
        if batched:
            progress = progress_fields(ids, [self.sent] * len(ids), form)
            body = {"t": "flows", "opens": opens, **progress, "closes": closes}
            return self.framed("flows", frame(msgpack.packb(body)))
        singles = [{"t": "flows", **progress_fields([i], [self.sent], form)} for i in ids]
        singles += [{"t": "flows", "opens": [o]} for o in opens]
        singles += [{"t": "flows", "closes": [c]} for c in closes]
        return b"".join(self.framed("flows", frame(msgpack.packb(body))) for body in singles)

    def beat(self) -> None:
        """Send a heartbeat, as an agent does after an interval with nothing else to send."""
        self.writer.write(self.framed("heartbeat", HEARTBEAT))
        self.last_sent = time.monotonic()

    async def listen(self) -> None:
        """Read what the coordinator sends, count level updates; outside the paced phases,
        answer a heartbeat if nothing was sent for an interval (a stand-in for the agent's
        own heartbeat clock, which paced() runs)."""
        with contextlib.suppress(ConnectionError, OSError, asyncio.CancelledError):
            while data := await self.reader.read(1 << 16):
                self.buffer.feed(data)
                while (body := self.buffer.next_body()) is not None:
                    if self.conn is not None:
                        body = self.conn.opened(body)
                    message = msgpack.unpackb(body)
                    if message["t"] == "heartbeat":
                        if self.answer_beats and (
                            time.monotonic() - self.last_sent >= self.beat_interval
                        ):
                            self.beat()
                    elif message["t"] == "levels":
                        self.updates_received += len(message["updates"])
                        if self.open_sent:
                            self._note_open_levels(message["updates"])

    def _note_open_levels(self, updates: list[dict[str, Any]]) -> None:
        arrived = time.monotonic()
        for update in updates:
            sent = self.open_sent.pop(update["id"], None)
            if sent is not None:
                self.open_latency.append(arrived - sent)


async def connect(
    host: str,
    port: int,
    node: str,
    token: bytes,
    flows: int,
    progress_form: str = "packed",
    tls: ssl.SSLContext | None = None,
) -> SimAgent:
    """A simulated agent, connected (over TLS with ``tls``) and authenticated, its ``flows``
    flows opened; it offers the protocol version of ``progress_form`` (maps: version 1, as the
    previous release)."""
    reader, writer = await asyncio.open_connection(host, port, ssl=tls)
    # a small send buffer keeps the backlog a saturated coordinator builds up bounded
    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
    conn = Connection(Role.AGENT, token=token, version=PROGRESS_FORMS[progress_form])
    writer.write(conn.hello(node))
    writer.write(conn.answer(await _expect(reader, conn, Challenge)))
    welcome = await _expect(reader, conn, Welcome)
    if conn.version < PROGRESS_FORMS[progress_form]:
        raise RuntimeError(f"the coordinator speaks protocol {conn.version}: no {progress_form}")
    agent = SimAgent(node, reader, writer, list(range(flows)), flows)
    agent.progress_form = progress_form
    agent.conn = conn if conn.sealed else None
    # frames that came along with the welcome wait in conn's buffer: take them through conn
    # (which opens sealed ones in sequence) before listen() reads the socket raw, into the
    # same buffer (a frame cut short stays whole)
    while isinstance(event := conn.next_event(), Message):
        if isinstance(event, Levels):
            agent.updates_received += len(event.updates)
    agent.buffer = conn.receive_buffer
    agent.beat_interval = welcome.heartbeat_interval or agent.beat_interval
    now = time.time()
    opens = [agent.open_entry(i, CLASS_MIX[i % len(CLASS_MIX)], now) for i in range(flows)]
    writer.write(conn.send(Resync(())))
    writer.write(agent.framed("flows", frame(msgpack.packb({"t": "flows", "opens": opens}))))
    return agent


async def _expect(reader: asyncio.StreamReader, conn: Connection, kind: type) -> Any:
    while True:
        event = conn.next_event()
        if isinstance(event, kind):
            return event
        if not isinstance(event, Sentinel):
            raise RuntimeError(f"expected {kind.__name__}, got {event!r}")
        data = await reader.read(1 << 16)
        if not data:
            raise RuntimeError("coordinator closed the connection during the handshake")
        conn.receive_data(data)


# -- phases ------------------------------------------------------------------------------------


#: bytes an agent's transport may hold unsent before saturate() skips it (asyncio's default
#: high-water mark, which drain() waited on before)
SATURATE_BACKLOG = 1 << 16


async def saturate(agents: list[SimAgent], batched: bool, seconds: float) -> None:
    """Offer every agent's next report whenever its connection has room, for ``seconds``.

    One task walks the agents round-robin and yields to the loop after each pass (a
    millisecond's sleep when every connection was full). 1,000 tasks each awaiting ``drain()``
    cost the generator more than the frames: on a 2.45 GHz core it saturated before the
    compiled coordinator did."""
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        offered = False
        for agent in agents:
            transport = agent.writer.transport
            if transport.get_write_buffer_size() < SATURATE_BACKLOG and not transport.is_closing():
                agent.writer.write(agent.progress_frames(batched))
                offered = True
        await asyncio.sleep(0 if offered else 1e-3)


async def paced(agents: list[SimAgent], batched: bool, seconds: float, rate: float) -> None:
    """Every agent reports all its flows once per ``agents * flows / rate`` seconds, each at
    its own random phase, for ``seconds``, and, like the real agent, sends a heartbeat each
    heartbeat interval after its last frame while no report is due (none when it reports more
    often): one task walks a heap of due times (1,000 sleeping tasks cost the generator more
    than the frames; both wake on the loop's ~1 ms timers)."""
    events_per_round = sum(len(a.flows) for a in agents)
    interval = events_per_round / rate
    start = time.monotonic()
    stop = start + seconds
    # (when, agent, whether a heartbeat); each agent's next report is in next_report
    due = [(start + random.random() * interval, index, False) for index in range(len(agents))]
    next_report = [when for when, _, _ in due]
    due = [entry for entry in due if entry[0] < stop]
    heapq.heapify(due)
    for agent in agents:
        agent.answer_beats = False
    try:
        while due:
            now = time.monotonic()
            while due and due[0][0] <= now:
                when, index, is_beat = heapq.heappop(due)
                agent = agents[index]
                if is_beat:
                    agent.beat()
                else:
                    agent.writer.write(agent.progress_frames(batched))
                    next_report[index] = when + interval
                    if when + interval < stop:
                        heapq.heappush(due, (when + interval, index, False))
                beat_at = when + agent.beat_interval
                if beat_at < min(next_report[index], stop):
                    heapq.heappush(due, (beat_at, index, True))
            if due:  # never less than a tick: a shorter sleep spins the loop (see PACE_TICK)
                await asyncio.sleep(max(PACE_TICK, due[0][0] - time.monotonic()))
    finally:
        for agent in agents:
            agent.answer_beats = True


# -- the coordinator process and its metrics ---------------------------------------------------


@dataclass
class Scrape:
    events: float
    frames: float
    latency_buckets: list[tuple[float, float]]
    flush_buckets: list[tuple[float, float]]
    latency_count: float
    active_flows: float
    agents: float
    sweeps: float
    overruns: float
    cpu_seconds: float
    #: the coordinator's full (generation 2) garbage collections so far
    full_collections: float
    when: float


def metrics_text(address: str, timeout: float = 300) -> str:
    """The coordinator's /metrics page at ``address``."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as response:
        text: str = response.read().decode()
    return text


def scrape(address: str, pid: int) -> Scrape:
    text = metrics_text(address)

    def total(pattern: str) -> float:
        return sum(float(v) for v in re.findall(pattern + r" ([0-9.e+-]+)\n", text))

    def buckets(name: str) -> list[tuple[float, float]]:
        pattern = name + r'_bucket\{le="([^"]+)"\} ([0-9.e+-]+)'
        found = re.findall(pattern, text)
        return [(float("inf") if le == "+Inf" else float(le), float(v)) for le, v in found]

    return Scrape(
        events=total(r'flowsched_coordinator_events_total\{kind="(?:open|progress|close)"\}'),
        frames=total(r"flowsched_coordinator_frames_total"),
        latency_buckets=buckets("decision_latency_seconds"),
        flush_buckets=buckets("flush_seconds"),
        latency_count=total(r"flowsched_coordinator_decision_latency_seconds_count"),
        active_flows=total(r"flowsched_coordinator_active_flows\{[^}]*\}"),
        agents=total(r"flowsched_coordinator_agents_connected"),
        sweeps=total(r"flowsched_coordinator_timer_sweeps_total"),
        overruns=total(r"flowsched_coordinator_timer_overruns_total"),
        cpu_seconds=running_cpu_seconds(pid),
        full_collections=total(r'python_gc_collections_total\{generation="2"\}'),
        when=time.monotonic(),
    )


def check_build(address: str, build: str) -> None:
    """Fail unless the coordinator at ``address`` runs ``build`` (its flowsched_build_info)."""
    text = metrics_text(address, timeout=60)
    found = re.search(r'flowsched_build_info\{[^}]*compiled="(true|false)"', text)
    runs = None if found is None else ("compiled" if found[1] == "true" else "interpreted")
    if runs != build:
        raise RuntimeError(f"asked for the {build} coordinator, it runs {runs or 'unknown'}")


def preemptions(pid: int) -> int:
    """Times the kernel took the CPU away from the coordinator (involuntary switches)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"nonvoluntary_ctxt_switches:\s+(\d+)", status)[1])  # type: ignore[index]


def quantile(before: Scrape, after: Scrape, q: float, histogram: str = "latency") -> float:
    """Quantile of a histogram's observations between two scrapes (linear within a bucket)."""
    now, then = getattr(after, f"{histogram}_buckets"), getattr(before, f"{histogram}_buckets")
    counts = [(le, a - b) for (le, a), (_, b) in zip(now, then, strict=True)]
    total = counts[-1][1] if counts else 0.0
    if total <= 0:
        return float("nan")
    target = q * total
    lower, below = 0.0, 0.0
    for le, cumulative in counts:
        if cumulative >= target:
            if le == float("inf"):
                return float("inf")
            share = (target - below) / max(cumulative - below, 1e-12)
            return lower + (le - lower) * share
        lower, below = le, cumulative
    return float("inf")


@dataclass
class LatencyPoint:
    #: the rate asked for (--rates); what the generator sent; what the coordinator counted
    nominal_rate: float
    offered_rate: float
    achieved_rate: float
    loadgen_cpu: float
    coordinator_cpu: float
    p50_ms: float
    p99_ms: float
    flush_p50_ms: float
    flush_p99_ms: float
    samples: float
    timer_sweeps_per_s: float
    #: flushes (policy runs) per second: frames per flush is how much the loop batched
    flushes_per_s: float
    preemptions_per_s: float
    #: share of the machine's CPU time stolen by the hypervisor during the point (see
    #: steal_share)
    steal: float = math.nan
    #: full garbage collections during the point (each stops the coordinator a while)
    full_collections: float = 0.0
    #: churn opens timed end to end (agent's send -> its first level update received, which
    #: includes the time a frame waits in the kernel while the coordinator is busy, which the
    #: coordinator's own histogram cannot see), their p50 / p99, and how many got no update
    opens_timed: int = 0
    open_p50_ms: float = math.nan
    open_p99_ms: float = math.nan
    opens_unanswered: int = 0


@dataclass
class ModeResult:
    mode: str
    #: "interpreted" (the editable checkout) or "compiled" (flowsched/compiled.py's tree)
    build: str
    events_per_s: float
    frames_per_s: float
    coordinator_cpu: float
    loadgen_cpu: float
    rss_mib: float
    peak_rss_mib: float
    active_flows: float
    agents: float
    latency: list[LatencyPoint]
    #: how the simulated agents sent progress (simagent.PROGRESS_FORMS)
    progress_form: str = "packed"
    #: share of the machine's CPU time stolen during the throughput phase (steal_share)
    steal: float = math.nan

    @property
    def label(self) -> str:
        """Mode, promotion scheme and progress form, e.g. ``batched/timers/packed``."""
        return f"{self.mode}/{self.progress_form}"

    @property
    def events_per_cpu_second(self) -> float:
        return self.events_per_s / max(self.coordinator_cpu, 1e-9)


class CoordinatorProcess:
    def __init__(
        self,
        args: argparse.Namespace,
        workdir: Path,
        mode: str,
        promotion: str,
        tree: Path | None,
    ) -> None:
        token_path = workdir / "token"
        write_token(token_path)
        self.token = (token_path.read_bytes()).strip()
        command = [sys.executable]
        if args.profile:
            command += ["-m", "cProfile", "-o", str(workdir / f"coordinator-{mode}.prof")]
        command += ["-m", "flowsched", "coordinator", "--listen", "127.0.0.1:0",
                    "--metrics-port", "0", "--token-file", str(token_path),
                    "--log-level", "WARNING",
                    # a load generator starved of CPU on a shared machine can go quiet for
                    # seconds; that is not what this benchmark measures
                    "--idle-timeout", "60"]  # fmt: skip
        if args.policy:
            command += ["--policy", args.policy]
        #: what the simulated agents connect with (batched-tls: the certificate made here)
        self.tls: ssl.SSLContext | None = None
        if mode == "batched-tls":
            cert, key = self_signed_certificate(workdir)
            command += ["--tls-cert", str(cert), "--tls-key", str(key)]
            self.tls = client_context(str(cert))
        if mode == "unbatched":
            command.append("--no-batch")
        elif mode == "per-turn":
            command += ["--max-batch-delay", "inf"]
        elif args.max_batch_delay is not None:
            command += ["--max-batch-delay", str(args.max_batch_delay)]
        command += ["--promotion", promotion]
        if args.per_flow_policy != "auto":
            command += ["--per-flow-policy", args.per_flow_policy]
        if shutil.which("taskset") and args.coordinator_cpu is not None:
            command = ["taskset", "-c", str(args.coordinator_cpu), *command]
        self.log = open(workdir / "coordinator.log", "w")  # noqa: SIM115
        env, cwd = None, None
        if tree is not None:  # the compiled build: its tree first on the path (-m: cwd first)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
            cwd = tree
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, cwd=cwd
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        found = re.fullmatch(
            r"flowsched-coordinator listening on (\S+):(\d+) metrics (\S+)\n", line
        )
        if not found:
            self.stop()  # do not leave it running behind the error
            raise RuntimeError(f"coordinator did not start: {line!r}")
        self.host, self.port, self.metrics = found[1], int(found[2]), found[3]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def self_signed_certificate(workdir: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1, its own CA, and its key (the openssl command)."""
    cert, key = workdir / "tls.pem", workdir / "tls.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=bench",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


async def run_mode(
    args: argparse.Namespace,
    mode: str,
    promotion: str,
    workdir: Path,
    tree: Path | None,
    form: str = "packed",
) -> ModeResult:
    coordinator = CoordinatorProcess(args, workdir, mode, promotion, tree)
    batched = mode != "unbatched"  # whether each frame carries an agent's 10 reports
    pid = coordinator.process.pid
    agents: list[SimAgent] = []
    listeners: list[asyncio.Task[None]] = []
    try:
        gate = asyncio.Semaphore(64)

        async def one(index: int) -> SimAgent:
            async with gate:
                agent = await connect(
                    coordinator.host,
                    coordinator.port,
                    f"node-{index}",
                    coordinator.token,
                    args.flows,
                    form,
                    coordinator.tls,
                )
            listeners.append(asyncio.create_task(agent.listen()))
            return agent

        mode = f"{mode}/{promotion}"
        build = "compiled" if tree is not None else "interpreted"
        await asyncio.to_thread(check_build, coordinator.metrics, build)
        log(f"{build} {mode}, progress as {form}: connecting {args.agents} agents")
        agents = list(await asyncio.gather(*(one(i) for i in range(args.agents))))
        if args.churn_phase == "random":  # each agent's churn in its own tenth of the round
            for agent in agents:
                agent.churn_phase = random.randrange(10)
        await wait_for_flows(coordinator, pid, args.agents * args.flows)
        throughput = frames = coordinator_cpu = loadgen_cpu = steal = float("nan")
        if "throughput" in args.phases:
            own, machine = os.times(), cpu_times()
            before = await asyncio.to_thread(scrape, coordinator.metrics, pid)
            for agent in agents:
                agent.events = 0
            log(f"{mode}: throughput phase ({args.duration:g} s)")
            await saturate(agents, batched, args.duration)
            after = await asyncio.to_thread(scrape, coordinator.metrics, pid)
            own_after = os.times()
            elapsed = after.when - before.when
            loadgen_cpu = (own_after.user + own_after.system - own.user - own.system) / elapsed
            throughput = (after.events - before.events) / elapsed
            frames = (after.frames - before.frames) / elapsed
            coordinator_cpu = (after.cpu_seconds - before.cpu_seconds) / elapsed
            steal = steal_share(machine, cpu_times())
            log(f"{mode}: waiting for the coordinator to drain its backlog")
            await wait_for_events(coordinator, pid, before.events + sum(a.events for a in agents))
        points = []
        for rate in args.rates if "latency" in args.phases else ():
            log(f"{mode}: latency phase ({rate:g} events/s offered, {args.duration:g} s)")
            points.append(await latency_point(coordinator, pid, agents, batched, args, rate))
        rss, peak = memory_mib(pid)
        final = await asyncio.to_thread(scrape, coordinator.metrics, pid)
        return ModeResult(
            mode=mode,
            build=build,
            progress_form=form,
            events_per_s=throughput,
            frames_per_s=frames,
            steal=steal,
            coordinator_cpu=coordinator_cpu,
            loadgen_cpu=loadgen_cpu,
            rss_mib=rss,
            peak_rss_mib=peak,
            active_flows=final.active_flows,
            agents=final.agents,
            latency=points,
        )
    finally:
        for task in listeners:
            task.cancel()
        for agent in agents:
            agent.writer.close()
        await asyncio.sleep(0.1)
        coordinator.stop()
        warnings = [line for line in (workdir / "coordinator.log").read_text().splitlines()
                    if "WARNING" in line and "connection_lost" not in line]  # fmt: skip
        if warnings:
            print(f"coordinator logged {len(warnings)} warnings, first: {warnings[:3]}")


async def wait_for_flows(coordinator: CoordinatorProcess, pid: int, expected: int) -> None:
    give_up = time.monotonic() + DRAIN_TIMEOUT
    while (await asyncio.to_thread(scrape, coordinator.metrics, pid)).active_flows < expected:
        if time.monotonic() > give_up:
            raise RuntimeError(f"the coordinator never reached {expected} active flows")
        await asyncio.sleep(0.2)


async def latency_point(
    coordinator: CoordinatorProcess,
    pid: int,
    agents: list[SimAgent],
    batched: bool,
    args: argparse.Namespace,
    rate: float,
) -> LatencyPoint:
    before = await asyncio.to_thread(scrape, coordinator.metrics, pid)
    preempted = preemptions(pid)
    machine = cpu_times()
    for agent in agents:
        agent.events = 0
        agent.open_sent.clear()
        agent.open_latency.clear()
        agent.time_opens = True
    own = os.times()
    await paced(agents, batched, args.duration, rate)
    for agent in agents:
        agent.time_opens = False
    own_after = os.times()
    after = await asyncio.to_thread(scrape, coordinator.metrics, pid)
    preempted = preemptions(pid) - preempted
    steal = steal_share(machine, cpu_times())
    elapsed = after.when - before.when
    point = LatencyPoint(
        nominal_rate=rate,
        offered_rate=sum(a.events for a in agents) / elapsed,
        loadgen_cpu=(own_after.user + own_after.system - own.user - own.system) / elapsed,
        achieved_rate=(after.events - before.events) / elapsed,
        coordinator_cpu=(after.cpu_seconds - before.cpu_seconds) / elapsed,
        p50_ms=quantile(before, after, 0.50) * 1e3,
        p99_ms=quantile(before, after, 0.99) * 1e3,
        flush_p50_ms=quantile(before, after, 0.50, "flush") * 1e3,
        flush_p99_ms=quantile(before, after, 0.99, "flush") * 1e3,
        samples=after.latency_count - before.latency_count,
        full_collections=after.full_collections - before.full_collections,
        timer_sweeps_per_s=(after.sweeps - before.sweeps) / elapsed,
        flushes_per_s=(after.flush_buckets[-1][1] - before.flush_buckets[-1][1]) / elapsed
        if after.flush_buckets
        else math.nan,
        preemptions_per_s=preempted / elapsed,
        steal=steal,
    )
    await wait_for_events(coordinator, pid, before.events + sum(a.events for a in agents))
    await _time_opens(agents, point)
    return point


async def _time_opens(agents: list[SimAgent], point: LatencyPoint) -> None:
    """Fill in ``point``'s end-to-end open latencies once the last level updates are in."""
    give_up = time.monotonic() + 5.0
    while any(a.open_sent for a in agents) and time.monotonic() < give_up:
        await asyncio.sleep(0.05)
    latencies = sorted(x for a in agents for x in a.open_latency)
    point.opens_timed = len(latencies)
    point.opens_unanswered = sum(len(a.open_sent) for a in agents)
    if latencies:
        point.open_p50_ms = latencies[len(latencies) // 2] * 1e3
        point.open_p99_ms = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1e3


async def wait_for_events(coordinator: CoordinatorProcess, pid: int, expected: float) -> None:
    give_up = time.monotonic() + DRAIN_TIMEOUT
    while (now := await asyncio.to_thread(scrape, coordinator.metrics, pid)).events < expected:
        if time.monotonic() > give_up:
            print(f"warning: coordinator still {expected - now.events:.0f} events behind")
            return
        await asyncio.sleep(0.2)


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def print_profile(path: Path, limit: int = 18) -> None:
    import pstats

    if path.exists():
        print(f"\n-- coordinator profile ({path.name}), top {limit} by own time --")
        pstats.Stats(str(path)).sort_stats("tottime").print_stats(limit)


def report(results: list[ModeResult]) -> None:
    print("\nthroughput (saturating load), memory at 10,000 flows / 1,000 agents:")
    print(f"{'build':<11} {'mode':<24} {'events/s':>9} {'frames/s':>9} {'coordCPU':>8} "
          f"{'events/CPU-s':>12} {'genCPU':>6} {'RSS MiB':>7} {'peak':>6} {'flows':>6} "
          f"{'agents':>6} {'steal':>6}")  # fmt: skip
    for r in results:
        print(f"{r.build:<11} {r.label:<24} {r.events_per_s:>9.0f} {r.frames_per_s:>9.0f} "
              f"{r.coordinator_cpu:>8.2f} {r.events_per_cpu_second:>12.0f} {r.loadgen_cpu:>6.2f} "
              f"{r.rss_mib:>7.1f} {r.peak_rss_mib:>6.1f} {r.active_flows:>6.0f} "
              f"{r.agents:>6.0f} {r.steal:>6.1%}")  # fmt: skip
    print("\ndecision latency (frame read by the coordinator -> level updates queued) and")
    print("flush time (one policy run + its sends) at paced loads: 'rate' asked for, 'offered'")
    print("sent by the generator, 'achieved' counted by the coordinator (events/s):")
    print(f"{'build':<11} {'mode':<24} {'rate':>7} {'offered':>8} {'achieved':>8} {'genCPU':>6} "
          f"{'coordCPU':>8} {'p50 ms':>7} {'p99 ms':>7} {'flush50':>7} {'flush99':>7} "
          f"{'samples':>8} {'sweeps/s':>8} {'flush/s':>7} {'preempt/s':>9} "
          f"{'steal':>6}")  # fmt: skip
    short = []
    for r in results:
        for p in r.latency:
            print(f"{r.build:<11} {r.label:<24} {p.nominal_rate:>7.0f} {p.offered_rate:>8.0f} "
                  f"{p.achieved_rate:>8.0f} {p.loadgen_cpu:>6.2f} "
                  f"{p.coordinator_cpu:>8.2f} {p.p50_ms:>7.2f} {p.p99_ms:>7.2f} "
                  f"{p.flush_p50_ms:>7.3f} {p.flush_p99_ms:>7.3f} {p.samples:>8.0f} "
                  f"{p.timer_sweeps_per_s:>8.1f} {p.flushes_per_s:>7.0f} "
                  f"{p.preemptions_per_s:>9.0f} "
                  f"{p.steal:>6.1%}")  # fmt: skip
            if p.opens_timed or p.opens_unanswered:
                print(f"{'':<11} {'':<24} {'':>7} churn opens end to end "
                      "(agent send -> level received): "
                      f"p50 {p.open_p50_ms:.2f} ms, p99 {p.open_p99_ms:.2f} ms over "
                      f"{p.opens_timed} opens, {p.opens_unanswered} unanswered; "
                      f"{p.full_collections:.0f} full GC")  # fmt: skip
            if p.offered_rate < GENERATOR_SHORTFALL * p.nominal_rate:
                short.append(f"{r.build} {r.label} at {p.nominal_rate:.0f}")
    if short:
        print(f"note: the generator offered less than {GENERATOR_SHORTFALL:.0%} of the rate asked "
              f"for ({', '.join(short)}): those points measure the generator, not the "
              "coordinator")  # fmt: skip
    for build, form in dict.fromkeys((r.build, r.progress_form) for r in results):
        same = [r for r in results if (r.build, r.progress_form) == (build, form)]
        compare_modes(f"{build} ({form})", same)
    compare_builds(results)
    compare_forms(results)


def compare_forms(results: list[ModeResult]) -> None:
    """Each progress form against "packed" (maps: the previous release's agents; sealed: this
    release's, every frame with its MAC), per build, mode and rate: every run's p99,
    coordinator CPU and steal in run order (e.g. A B B A), then the means' ratio; and the
    saturation (events per coordinator CPU second) of each run and the means' ratio."""
    forms = list(dict.fromkeys(r.progress_form for r in results))
    if len(forms) < 2 or "packed" not in forms:
        return
    for build, mode in dict.fromkeys((r.build, r.mode) for r in results):
        runs = [r for r in results if (r.build, r.mode) == (build, mode)]
        others = [f for f in forms if f != "packed"]
        print(f"\n{build} {mode}, progress as {' / '.join(others)} vs packed (runs in order):")
        saturation = ", ".join(
            f"{r.progress_form} {r.events_per_s:.0f} events/s "
            f"({r.events_per_cpu_second:.0f} per CPU s)"
            for r in runs
        )
        print(f"  saturation: {saturation}")
        for form in others:
            ratio = _saturation_ratio(runs, form)
            if ratio is not None:
                print(f"  {'':>8}  events per coordinator CPU second {form} / packed {ratio:.3f}x")
        for index, rate in enumerate(p.nominal_rate for p in runs[0].latency):
            points = [(r.progress_form, r.latency[index]) for r in runs if len(r.latency) > index]
            each = ", ".join(f"{form} p99 {p.p99_ms:.2f} ms coordCPU {p.coordinator_cpu:.2f} "
                             f"steal {p.steal:.1%}" for form, p in points)  # fmt: skip
            print(f"  {rate:>8.0f} events/s: {each}")
            means = {
                form: [statistics.fmean(getattr(p, what) for f, p in points if f == form)
                       for what in ("p99_ms", "coordinator_cpu")]
                for form in forms if any(f == form for f, _ in points)
            }  # fmt: skip
            if "packed" not in means:
                continue
            p99_packed, cpu_packed = means["packed"]
            for form in [f for f in others if f in means]:
                p99, cpu = means[form]
                print(f"  {'':>8}  mean p99 {form} {p99:.2f} / packed {p99_packed:.2f} ms "
                      f"({p99 / max(p99_packed, 1e-9):.2f}x), coordinator CPU {cpu:.2f} / "
                      f"{cpu_packed:.2f} ({cpu / max(cpu_packed, 1e-9):.2f}x)")  # fmt: skip


def _saturation_ratio(runs: list[ModeResult], form: str) -> float | None:
    """Mean events per coordinator CPU second of ``form``'s runs / of packed's; None when
    either has none."""
    mine = [r.events_per_cpu_second for r in runs if r.progress_form == form]
    base = [r.events_per_cpu_second for r in runs if r.progress_form == "packed"]
    if not mine or not base:
        return None
    return statistics.fmean(mine) / max(statistics.fmean(base), 1e-9)


def _lower(ours: float, theirs: float) -> str:
    """``ours`` against ``theirs``, as "1.4x lower" or, when it is not lower, "1.2x higher"."""
    if ours <= theirs:
        return f"{theirs / max(ours, 1e-9):.1f}x lower"
    return f"{ours / max(theirs, 1e-9):.1f}x higher"


def compare_modes(build: str, results: list[ModeResult]) -> None:
    """The batched / unbatched, batched / per-turn and timers / sweep ratios of one build."""
    by_mode = {r.mode: r for r in results}
    promotions = sorted({r.mode.split("/")[1] for r in results})
    for promotion in promotions:
        bounded = by_mode.get(f"batched/{promotion}")
        per_turn = by_mode.get(f"per-turn/{promotion}")
        if bounded and per_turn:
            compare_batch_delay(build, promotion, bounded, per_turn)
        batched = by_mode.get(f"batched/{promotion}")
        unbatched = by_mode.get(f"unbatched/{promotion}")
        if batched and unbatched:
            ratio = batched.events_per_s / max(unbatched.events_per_s, 1e-9)
            per_cpu = batched.events_per_cpu_second / max(unbatched.events_per_cpu_second, 1e-9)
            print(f"\n{build}, batched / unbatched ({promotion}): {ratio:.2f}x events/s, "
                  f"{per_cpu:.2f}x events per CPU-second")  # fmt: skip
        secure = by_mode.get(f"batched-tls/{promotion}")
        if batched and secure:
            compare_tls(build, promotion, secure, batched)
    for mode in sorted({r.mode.split("/")[0] for r in results}):
        timers, sweep = by_mode.get(f"{mode}/timers"), by_mode.get(f"{mode}/sweep")
        if not (timers and sweep):
            continue
        ratio = timers.events_per_s / max(sweep.events_per_s, 1e-9)
        print(f"\n{build} {mode}, timers / sweep: {ratio:.2f}x events/s at saturation")
        for fast, slow in zip(timers.latency, sweep.latency, strict=False):
            print(f"  {fast.nominal_rate:>8.0f} events/s: p99 {fast.p99_ms:.2f} ms vs "
                  f"{slow.p99_ms:.2f} ms ({_lower(fast.p99_ms, slow.p99_ms)}), "
                  f"p50 {fast.p50_ms:.2f} vs {slow.p50_ms:.2f} ms")  # fmt: skip


def compare_batch_delay(
    build: str, promotion: str, bounded: ModeResult, per_turn: ModeResult
) -> None:
    """Batches flushed by the delay bound too vs once per loop turn: CPU per event, and at
    each rate the coordinator's p99 and the churn opens' end-to-end p99."""
    per_cpu = bounded.events_per_cpu_second / max(per_turn.events_per_cpu_second, 1e-9)
    print(
        f"\n{build}, batched (bounded) / per-turn ({promotion}): {per_cpu:.2f}x events per "
        f"CPU-second at saturation (steal {bounded.steal:.1%} / {per_turn.steal:.1%})"
    )
    for new, old in zip(bounded.latency, per_turn.latency, strict=False):
        print(f"  {new.nominal_rate:>8.0f} events/s: p99 {new.p99_ms:.2f} ms vs {old.p99_ms:.2f} "
              f"ms, churn opens end to end p99 {new.open_p99_ms:.2f} vs {old.open_p99_ms:.2f} ms, "
              f"coordinator CPU {new.coordinator_cpu:.2f} vs {old.coordinator_cpu:.2f}, "
              f"steal {new.steal:.1%} / {old.steal:.1%}")  # fmt: skip


def compare_tls(build: str, promotion: str, secure: ModeResult, plain: ModeResult) -> None:
    """Every agent over TLS vs plain TCP: CPU per event and, at each rate, the p99s."""
    per_cpu = secure.events_per_cpu_second / max(plain.events_per_cpu_second, 1e-9)
    print(
        f"\n{build}, batched over TLS / plain ({promotion}): {per_cpu:.2f}x events per "
        f"CPU-second at saturation (steal {secure.steal:.1%} / {plain.steal:.1%}), peak RSS "
        f"{secure.peak_rss_mib:.1f} / {plain.peak_rss_mib:.1f} MiB"
    )
    for new, old in zip(secure.latency, plain.latency, strict=False):
        print(f"  {new.nominal_rate:>8.0f} events/s: p99 {new.p99_ms:.2f} ms vs {old.p99_ms:.2f} "
              f"ms, churn opens end to end p99 {new.open_p99_ms:.2f} vs {old.open_p99_ms:.2f} ms, "
              f"coordinator CPU {new.coordinator_cpu:.2f} vs {old.coordinator_cpu:.2f}, "
              f"steal {new.steal:.1%} / {old.steal:.1%}")  # fmt: skip


def compare_builds(results: list[ModeResult]) -> None:
    """compiled / interpreted, mode by mode: saturation, CPU per event and tail latency."""
    interpreted = {r.label: r for r in results if r.build == "interpreted"}
    for fast in (r for r in results if r.build == "compiled"):
        slow = interpreted.get(fast.label)
        if slow is None:
            continue
        ratio = fast.events_per_s / max(slow.events_per_s, 1e-9)
        per_cpu = fast.events_per_cpu_second / max(slow.events_per_cpu_second, 1e-9)
        print(f"\n{fast.mode}, compiled / interpreted: {ratio:.2f}x events/s at saturation, "
              f"{per_cpu:.2f}x events per CPU-second")  # fmt: skip
        for new, old in zip(fast.latency, slow.latency, strict=False):
            print(f"  {new.nominal_rate:>8.0f} events/s: p99 {new.p99_ms:.2f} ms vs "
                  f"{old.p99_ms:.2f} ms ({_lower(new.p99_ms, old.p99_ms)}), "
                  f"coordinator CPU {new.coordinator_cpu:.2f} vs {old.coordinator_cpu:.2f}, "
                  f"steal {new.steal:.1%} / {old.steal:.1%}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--flows", type=int, default=10, help="flows per agent")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per phase")
    parser.add_argument(
        "--rates", default="10000,30000,100000",
        help="offered loads (events/s, comma-separated) of the latency phases",
    )  # fmt: skip
    parser.add_argument("--policy", help="policy file (default: the embedded default, RMLQ)")
    parser.add_argument(
        "--modes", default="batched,per-turn,unbatched",
        help="coordinator modes to run side by side (comma-separated): batched (the default"
        " service), per-turn (batched without --max-batch-delay's bound), unbatched,"
        " batched-tls (batched with every agent over TLS)",
    )  # fmt: skip
    parser.add_argument(
        "--max-batch-delay",
        type=float,
        metavar="S",
        help="the batched mode's --max-batch-delay (default: the coordinator's, 0.001)",
    )
    parser.add_argument(
        "--promotion", default="sweep,timers",
        help="promotion schemes to run side by side (comma-separated: sweep, timers)",
    )  # fmt: skip
    parser.add_argument(
        "--per-flow-policy", choices=["auto", "yes", "no"], default="auto",
        help="passed to the coordinator unless 'auto' (the default: the policy object says;"
        " the default policy, rmlq with Algorithm 1 pruning, decides each flow on its own)",
    )  # fmt: skip
    parser.add_argument(
        "--phases", default="throughput,latency",
        help="phases to run (comma-separated: throughput, latency); e.g. one latency phase"
        " alone with --profile",
    )  # fmt: skip
    parser.add_argument(
        "--churn-phase", choices=["aligned", "random"], default="aligned",
        help="aligned (default): every agent's flow churn comes in the same frame"
        " of a round, i.e. 1,000 opens and 1,000 closes within one tenth of each second at"
        " 100k events/s; random: each agent's in its own frame (same events, spread over the"
        " round). The aligned wave sets the p99 at 100k events/s (docs/results.md)",
    )  # fmt: skip
    parser.add_argument(
        "--build", default="interpreted,compiled",
        help="coordinator builds to run side by side (comma-separated): interpreted (this"
        " checkout as Python) and compiled (the modules of flowsched/compiled.py built with"
        " mypyc, as a wheel installs them; built once into build/compiled/, ~30 s)",
    )  # fmt: skip
    parser.add_argument(
        "--progress-form", default="sealed",
        help="how the simulated agents send progress (comma-separated, run in the order given,"
        " repeats allowed: e.g. packed,sealed,sealed,packed for an A B B A comparison):"
        " sealed (protocol 5, two integer arrays in frames that carry MACs both ways, as"
        " this release's agents; the default), packed (the same without MACs, protocol 2) or"
        " maps ({id, sent} each, protocol 1)",
    )  # fmt: skip
    parser.add_argument("--coordinator-cpu", type=int, default=0)
    parser.add_argument("--loadgen-cpu", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="run the coordinator in cProfile")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    args.rates = [float(rate) for rate in args.rates.split(",")]
    args.phases = set(args.phases.split(","))
    if not args.phases <= {"throughput", "latency"}:
        parser.error(f"--phases: expected throughput and/or latency, got {sorted(args.phases)}")
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES):
        parser.error(f"--modes: expected some of {', '.join(MODES)}, got {modes}")
    builds = args.build.split(",")
    if not set(builds) <= {"interpreted", "compiled"}:
        parser.error(f"--build: expected interpreted and/or compiled, got {builds}")
    forms = args.progress_form.split(",")
    if not set(forms) <= set(PROGRESS_FORMS):
        parser.error(f"--progress-form: expected {' and/or '.join(PROGRESS_FORMS)}, got {forms}")
    trees: dict[str, Path | None] = {"interpreted": None}
    if "compiled" in builds:
        log("building the compiled modules (flowsched/compiled.py)")
        trees["compiled"] = build_tree(REPO, REPO / "build" / "compiled")
    loop_factory = prepare_load_generator(args.loadgen_cpu)
    results = []
    with tempfile.TemporaryDirectory(prefix="fsD-bench-") as tmp:
        runs = itertools.product(builds, modes, args.promotion.split(","), forms)
        for index, (build, mode, promotion, form) in enumerate(runs):
            workdir = Path(tmp) / f"{index}-{build}-{mode}-{promotion}-{form}"
            workdir.mkdir()
            with asyncio.Runner(loop_factory=loop_factory) as runner:
                results.append(
                    runner.run(run_mode(args, mode, promotion, workdir, trees[build], form))
                )
                if args.profile:
                    print_profile(workdir / f"coordinator-{mode}.prof")
    report(results)
    if args.json:
        rows = [{**asdict(r), "events_per_cpu_second": r.events_per_cpu_second} for r in results]
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
