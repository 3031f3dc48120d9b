#!/usr/bin/env python3
"""Coordinator takeover benchmark: kill -9 of the elected leader under 1,000 agents and 20,000
flows, and how long until every agent is back under global decisions.

Runs a real etcd (Debian's ``etcd-server``) and two real ``flowsched coordinator --etcd``
processes (both pinned to one core with ``taskset`` when it exists: the standby idles until
the kill, then has the core to itself), and drives them from this process on the other core:
``--agents`` simulated agents (raw protocol frames, cheap enough for one core) that know both
addresses, follow a standby's redirect, and send a ``resync`` of ``--flows`` flows each after
every (re)connect, as the real agent does; they offer protocol version 5, every frame after
the handshake sealed, as this release's agents (``--protocols 5,4`` adds runs of agents that
offer 4, unsealed, as the previous release's, side by side). The resync carries no
levels (``level`` nil), so the coordinator must decide and send a level for every flow: an
agent counts as back under global decisions once it holds a level for each of its flows from
the new leader, which proves that the resync was absorbed and decided.

Per run it reports: kill -> a standby leads (its welcome), kill -> every agent back (max and
median over agents), and the new leader's CPU time spent absorbing. Each mode runs ``--runs``
times and the modes run side by side: ``rebuild`` (resynced flows are admitted at once and
re-evaluated once per resync burst) and ``per-turn`` (re-evaluated at every event-loop turn
that received resyncs, ``--no-rebuild-batching``), both with rmlq deciding flows one by one
(``--per-flow-policy yes``); ``whole-table`` and ``whole-table-rebuild`` (every flush
re-evaluates every flow, ``--per-flow-policy no``: what a policy that is not per-flow does,
such as rmlq with RED tiers, and the default policy file did before efbe2df).
``default`` is ``rebuild`` without ``--per-flow-policy``: the policy file decides.

Usage:
    .venv/bin/python bench/takeover.py [--agents 1000] [--flows 20] [--runs 3]
        [--modes rebuild,per-turn,whole-table] [--protocols 5,4] [--lease-ttl 2]
        [--max-batch-delay S] [--json OUT] [--profile DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from flowsched.protocol import (
    FRAME_MAC_VERSION,
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    Challenge,
    Connection,
    Error,
    Levels,
    Message,
    ProtocolError,
    Role,
    Sentinel,
    Welcome,
    frame,
    write_token,
)
from flowsched.testbed.etcd import local_etcd
from flowsched.testbed.procstat import cpu_seconds
from flowsched.testbed.simagent import CLASS_MIX, HEARTBEAT, flow_open, prepare_load_generator

#: seconds allowed for everything after the kill
TAKEOVER_TIMEOUT = 60.0
#: the real agent's pause before reconnecting after a session ended
RECONNECT_PAUSE = 0.1


@dataclass(frozen=True)
class Redirect:
    """A standby's answer: the leader is at ``address``."""

    address: tuple[str, int]


@dataclass
class SimAgent:
    """One simulated agent: handshake, resync, heartbeats, levels; follows redirects."""

    node: str
    addresses: list[tuple[str, int]]
    token: bytes
    flows: int
    #: the protocol version it offers (from FRAME_MAC_VERSION on, its frames are sealed)
    version: int = FRAME_MAC_VERSION
    #: whether its last session's frames were sealed (both ends at FRAME_MAC_VERSION or above)
    sealed: bool = False
    #: monotonic times: welcome from a leader with a higher epoch, all levels from it
    welcomed: float = 0.0
    decided: float = 0.0
    epoch: int = 0
    connected: asyncio.Event = field(default_factory=asyncio.Event)
    _levels: set[int] = field(default_factory=set)

    def resync(self, conn: Connection) -> bytes:
        now = time.time()
        opens = [
            flow_open(self.node, i, CLASS_MIX[i % len(CLASS_MIX)], now, kv_deadline_s=5.0)
            for i in range(self.flows)
        ]
        return conn.send_frame("resync", frame(msgpack.packb({"t": "resync", "opens": opens})))

    async def run(self) -> None:
        """Stay connected to whichever coordinator leads, forever (cancelled at the end)."""
        while True:
            try:
                await self._session()
            except ProtocolError as exc:  # a frame refused (its MAC, say): said, then again
                print(f"{self.node}: {exc}", file=sys.stderr)
            except (ConnectionError, OSError, TimeoutError, RuntimeError):
                pass
            await asyncio.sleep(RECONNECT_PAUSE)

    async def _session(self) -> None:
        queue = list(self.addresses)
        while queue:
            host, port = queue.pop(0)
            try:
                opened = await self._handshake(host, port)
            except (ConnectionError, OSError, TimeoutError):
                continue
            if isinstance(opened, Redirect):
                queue.insert(0, opened.address)
            elif opened is not None:
                await self._serve(*opened)
                return
        raise ConnectionError("no leader")

    async def _handshake(self, host: str, port: int) -> Any:
        async with asyncio.timeout(10):
            reader, writer = await asyncio.open_connection(host, port)
            conn = Connection(Role.AGENT, token=self.token, version=self.version)
            writer.write(conn.hello(self.node))
            challenge = await _next(reader, conn)
            if not isinstance(challenge, Challenge):
                writer.close()
                raise ConnectionError(f"expected challenge, got {challenge!r}")
            writer.write(conn.answer(challenge))
            answer = await _next(reader, conn)
        if isinstance(answer, Welcome):
            if answer.epoch > self.epoch:
                self.epoch, self.welcomed, self.decided = answer.epoch, time.monotonic(), 0.0
                self._levels.clear()
            self.sealed = conn.sealed
            # frames that came with the welcome wait in conn's buffer: take them through conn
            # (which opens sealed ones in sequence) before _serve reads the socket raw
            while isinstance(event := conn.next_event(), Message):
                if isinstance(event, Levels):
                    self._note_levels(u.id for u in event.updates)
                elif isinstance(event, Error):
                    raise ConnectionError(f"refused after the welcome: {event.code}")
            return reader, writer, conn
        writer.close()
        if isinstance(answer, Error) and answer.code == "not_leader":
            found = re.search(r"leader=(\S+):(\d+)", answer.reason)
            return Redirect((found[1], int(found[2]))) if found else None
        return None

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: Connection
    ) -> None:
        writer.write(self.resync(conn))
        self.connected.set()
        buffer = conn.receive_buffer  # what followed the welcome, a frame cut short included
        try:
            while data := await reader.read(1 << 16):
                buffer.feed(data)
                while (body := buffer.next_body()) is not None:
                    self._received(msgpack.unpackb(conn.opened(body)), writer, conn)
        finally:
            self.connected.clear()
            writer.close()

    def _received(
        self, message: dict[str, Any], writer: asyncio.StreamWriter, conn: Connection
    ) -> None:
        if message["t"] == "heartbeat":
            writer.write(conn.send_frame("heartbeat", HEARTBEAT))
        elif message["t"] == "levels":
            self._note_levels(u["id"] for u in message["updates"])

    def _note_levels(self, flow_ids: Iterable[int]) -> None:
        self._levels.update(flow_ids)
        if len(self._levels) >= self.flows and not self.decided:
            self.decided = time.monotonic()


async def _next(reader: asyncio.StreamReader, conn: Connection) -> Any:
    while True:
        event = conn.next_event()
        if not isinstance(event, Sentinel):
            return event
        data = await reader.read(1 << 16)
        if not data:
            raise ConnectionError("closed during the handshake")
        conn.receive_data(data)


# -- coordinators ------------------------------------------------------------------------------


class Coordinator:
    """A ``flowsched coordinator --etcd`` process."""

    def __init__(self, args: argparse.Namespace, workdir: Path, name: str, cpu: int | None) -> None:
        command = [sys.executable]
        if args.profile:
            command += ["-m", "cProfile", "-o", str(workdir / f"{name}.prof")]
        command += ["-m", "flowsched", "coordinator", "--listen", "127.0.0.1:0",
                   "--metrics-port", "0", "--token-file", str(workdir / "token"),
                   "--etcd", args.etcd, "--election-name", workdir.name,
                   "--lease-ttl", str(args.lease_ttl), "--log-level", "WARNING",
                   "--idle-timeout", "60"]  # fmt: skip
        if args.mode in ("per-turn", "whole-table"):
            command.append("--no-rebuild-batching")
        if args.max_batch_delay is not None:
            command += ["--max-batch-delay", str(args.max_batch_delay)]
        # per flow: rmlq deciding each flow on its own; whole table: every flush re-evaluates
        # every flow (a policy that is not per-flow)
        whole = args.mode.startswith("whole-table")
        if args.mode != "default":  # "default": rebuild batching, the policy's own setting
            command += ["--per-flow-policy", "no" if whole else "yes"]
        if cpu is not None and shutil.which("taskset"):
            command = ["taskset", "-c", str(cpu), *command]
        self.log = open(workdir / f"{name}.log", "w")  # noqa: SIM115
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self.log, text=True)
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        found = re.search(r"listening on (\S+):(\d+) metrics", line)
        if not found:
            self.stop()
            raise RuntimeError(f"coordinator did not start: {line!r}")
        self.address = (found[1], int(found[2]))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


# -- one run -----------------------------------------------------------------------------------


@dataclass
class Run:
    mode: str
    #: the protocol version the simulated agents offered
    protocol: int
    #: how many of them the new leader's sessions sealed
    sealed_agents: int
    lead_s: float
    all_back_s: float
    median_back_s: float
    absorb_cpu_s: float


async def one_run(args: argparse.Namespace, workdir: Path) -> Run:
    workdir.mkdir()
    write_token(workdir / "token")
    token = (workdir / "token").read_bytes().strip()
    first = Coordinator(args, workdir, "a", args.leader_cpu)
    await asyncio.sleep(0.5)  # let it win before the other stands
    second = Coordinator(args, workdir, "b", args.standby_cpu)
    addresses = [first.address, second.address]
    agents = [
        SimAgent(f"node-{i}", addresses, token, args.flows, args.protocol)
        for i in range(args.agents)
    ]
    tasks: list[asyncio.Task[None]] = []
    try:
        for start in range(0, len(agents), 64):  # connect in waves, as a rollout would
            tasks += [asyncio.create_task(a.run()) for a in agents[start : start + 64]]
            await asyncio.sleep(0.02)
        await _until(lambda: all(a.decided for a in agents), 120, "agents on the first leader")
        old_epoch = agents[0].epoch
        cpu_before = cpu_seconds(second.process.pid) or 0.0
        killed = time.monotonic()
        first.process.kill()
        first.process.wait()
        await _until(
            lambda: all(a.epoch > old_epoch and a.decided > killed for a in agents),
            TAKEOVER_TIMEOUT, "every agent back under the new leader",
        )  # fmt: skip
        absorb_cpu = (cpu_seconds(second.process.pid) or 0.0) - cpu_before
        backs = sorted(a.decided - killed for a in agents)
        return Run(
            mode=args.mode,
            protocol=args.protocol,
            sealed_agents=sum(a.sealed for a in agents),
            lead_s=min(a.welcomed for a in agents) - killed,
            all_back_s=backs[-1],
            median_back_s=statistics.median(backs),
            absorb_cpu_s=absorb_cpu,
        )
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        first.stop()
        second.stop()
        if args.profile and (workdir / "b.prof").exists():
            Path(args.profile).mkdir(parents=True, exist_ok=True)
            shutil.copy(workdir / "b.prof", Path(args.profile) / f"{workdir.name}.prof")


async def _until(predicate: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise RuntimeError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def report(runs: list[Run], args: argparse.Namespace) -> None:
    print(f"\nkill -9 of the leader, {args.agents} agents x {args.flows} flows "
          f"({args.agents * args.flows} flows), lease TTL {args.lease_ttl} s:")  # fmt: skip
    print(f"{'mode':<11} {'run':>3} {'leads s':>8} {'all back s':>10} {'median s':>9} "
          f"{'absorb CPU s':>12}")  # fmt: skip
    for i, r in enumerate(runs):
        print(f"{_label(r.mode, r.protocol):<11} {i:>3} {r.lead_s:>8.3f} {r.all_back_s:>10.3f} "
              f"{r.median_back_s:>9.3f} {r.absorb_cpu_s:>12.2f}")  # fmt: skip
    by_mode: dict[str, list[Run]] = {}
    for r in runs:
        by_mode.setdefault(_label(r.mode, r.protocol), []).append(r)
    print(f"\n{'mode':<11} {'all back: min':>13} {'median':>7} {'max':>6}  {'absorb CPU':>10}")
    for mode, every in by_mode.items():
        rows = [r for r in every if not math.isnan(r.all_back_s)]
        if not rows:
            print(f"{mode:<11} every run timed out")
            continue
        backs = sorted(r.all_back_s for r in rows)
        cpu = statistics.median(r.absorb_cpu_s for r in rows)
        print(f"{mode:<11} {backs[0]:>13.3f} {statistics.median(backs):>7.3f} {backs[-1]:>6.3f}"
              f"  {cpu:>10.2f}")  # fmt: skip
    ok = {m: [r for r in rows if not math.isnan(r.all_back_s)] for m, rows in by_mode.items()}
    if ok.get("rebuild"):
        new = statistics.median(r.all_back_s for r in ok["rebuild"])
        for baseline in ("per-turn", "whole-table", "whole-table-rebuild"):
            if ok.get(baseline):
                old = statistics.median(r.all_back_s for r in ok[baseline])
                print(f"{baseline} / rebuild: {old / new:.2f}x (median time until all are back)")
    for label, rows in ok.items():
        sealed = ok.get(label.split("-v")[0]) if "-v" in label else None
        if sealed and rows:
            old = statistics.median(r.all_back_s for r in rows)
            new = statistics.median(r.all_back_s for r in sealed)
            print(f"{label} / sealed: {old / new:.2f}x (median time until all are back)")


def _label(mode: str, protocol: int) -> str:
    """``mode``, with ``-vN`` when its agents offered a version before sealed frames."""
    return mode if protocol >= FRAME_MAC_VERSION else f"{mode}-v{protocol}"


def _one(args: argparse.Namespace, workdir: Path, loop_factory: Any) -> Run:
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(one_run(args, workdir))
    except RuntimeError as exc:  # a mode that cannot keep up: reported, not fatal
        print(f"{_label(args.mode, args.protocol)} run: {exc}", file=sys.stderr)
        nan = float("nan")
        return Run(args.mode, args.protocol, 0, nan, nan, nan, nan)


def _protocols(text: str) -> list[int]:
    """``--protocols``: comma-separated versions this release can offer."""
    try:
        versions = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated versions: {text!r}") from None
    for version in versions:
        if not MIN_PROTOCOL_VERSION <= version <= PROTOCOL_VERSION:
            raise argparse.ArgumentTypeError(
                f"version {version} not in {MIN_PROTOCOL_VERSION}..{PROTOCOL_VERSION}"
            )
    return versions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--flows", type=int, default=20, help="flows per agent")
    parser.add_argument("--runs", type=int, default=3, help="runs per mode")
    parser.add_argument("--modes", default="rebuild,per-turn,whole-table")
    parser.add_argument(
        "--protocols", type=_protocols, default=[FRAME_MAC_VERSION],
        help="protocol versions the simulated agents offer, each a run per mode (from "
        f"{FRAME_MAC_VERSION} on, sealed frames), e.g. {FRAME_MAC_VERSION},{FRAME_MAC_VERSION - 1}",
    )  # fmt: skip
    parser.add_argument("--lease-ttl", type=int, default=2)
    parser.add_argument(
        "--max-batch-delay",
        type=float,
        metavar="S",
        help="the coordinators' --max-batch-delay (default: theirs, 0.001; inf: per turn only)",
    )
    parser.add_argument("--leader-cpu", type=int, default=0)
    parser.add_argument(
        "--standby-cpu", type=int, default=0,
        help="the standby shares the idle-leader's core: after the kill it has it to itself",
    )  # fmt: skip
    parser.add_argument("--loadgen-cpu", type=int, default=1)
    parser.add_argument("--json", help="write the runs here")
    parser.add_argument(
        "--profile", metavar="DIR",
        help="run the coordinators in cProfile; the new leader's profile of each run goes here",
    )  # fmt: skip
    args = parser.parse_args()
    loop_factory = prepare_load_generator(args.loadgen_cpu)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="fsD2-takeover-") as tmp, local_etcd() as etcd:
        args.etcd = etcd
        for index in range(args.runs):
            for mode in args.modes.split(","):
                for protocol in args.protocols:
                    args.mode, args.protocol = mode, protocol
                    runs.append(_one(args, Path(tmp) / f"{mode}-{protocol}-{index}", loop_factory))
                    print(f"[{time.strftime('%H:%M:%S')}] {_label(mode, protocol)} run {index}: "
                          f"every agent back {runs[-1].all_back_s:.3f} s after the kill",
                          file=sys.stderr)  # fmt: skip
    report(runs, args)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in runs], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
