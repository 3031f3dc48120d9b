"""End to end: a real ``flowsched coordinator`` process, 1,000 simulated agents and a fuzzer.

Every bad connection must be closed with a reason logged for its exact peer address, the
coordinator must stay up, and the good agents must keep receiving their level updates.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import resource
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import pytest

from flowsched.model import FlowClass
from flowsched.protocol import (
    FRAME_MAC_VERSION,
    Challenge,
    Connection,
    FlowOpen,
    Flows,
    Heartbeat,
    Levels,
    Resync,
    Role,
    Sentinel,
    frame,
    write_token,
)
from flowsched.protocol.aio import AgentLink, LinkClosed, connect_agent

AGENTS = 1000
FLOWS_PER_AGENT = 10
SIZE = 64 << 20
# SJF with base 1 MiB and ratio 2: remaining 64 MiB -> level 6, 16 MiB -> 5, 4 MiB -> 3
POLICY = """
[policy]
name = "sjf"
num_levels = 8
timer_period = 0.2
[policy.args]
base = 1048576
ratio = 2.0
"""
ROUNDS = ((48 << 20, 5), (60 << 20, 3))


@dataclass
class Coordinator:
    process: subprocess.Popen[str]
    host: str
    port: int
    metrics: str
    log: Path
    token: bytes


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[Coordinator]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 3 * AGENTS:
        pytest.skip(f"needs {3 * AGENTS} file descriptors, hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    token = write_token(tmp_path / "token")
    (tmp_path / "policy.toml").write_text(POLICY)
    log = tmp_path / "coordinator.log"
    command = [
        sys.executable, "-m", "flowsched", "coordinator", "--policy", str(tmp_path / "policy.toml"),
        "--listen", "127.0.0.1:0", "--metrics-port", "0", "--token-file", str(tmp_path / "token"),
        # a stalled handshake is dropped quickly (the deadline covers the whole handshake,
        # which a fuzz peer needs to finish while 1,000 agents connect); a busy test machine
        # never looks idle
        "--handshake-timeout", "3", "--idle-timeout", "10",
    ]  # fmt: skip
    with open(log, "w") as log_file:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log_file, text=True)
    try:
        assert process.stdout is not None
        ready = process.stdout.readline()
        match = re.fullmatch(
            r"flowsched-coordinator listening on (\S+):(\d+) metrics (\S+:\d+)\n", ready
        )
        assert match, f"unexpected ready line {ready!r}; log: {log.read_text()}"
        yield Coordinator(process, match[1], int(match[2]), match[3], log, token)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# -- good agents -------------------------------------------------------------------------------


@dataclass
class GoodAgent:
    node: str
    link: AgentLink
    levels: dict[int, int] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    failure: BaseException | None = None
    listener: asyncio.Task[None] | None = None

    async def listen(self) -> None:
        try:
            while True:
                message = await self.link.recv()
                if isinstance(message, Levels):
                    self.levels.update((u.id, u.level) for u in message.updates)
                    self.changed.set()
                elif isinstance(message, Heartbeat):
                    await self.link.send(Heartbeat(time.time()))  # keeps the idle timeout away
        except (LinkClosed, OSError) as exc:
            self.failure = exc

    async def wait_levels(self, level: int, timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while sorted(self.levels.values()) != [level] * FLOWS_PER_AGENT:
                self.changed.clear()
                await self.changed.wait()


async def _start_agent(c: Coordinator, index: int, gate: asyncio.Semaphore) -> GoodAgent:
    async with gate:
        link = await connect_agent(c.host, c.port, node=f"node-{index}", token=c.token, timeout=20)
    now = time.time()
    opens = tuple(FlowOpen(i, FlowClass.PARAM_SYNC, now, size=SIZE) for i in range(FLOWS_PER_AGENT))
    await link.send(Resync(()))
    await link.send(Flows(opens=opens))
    agent = GoodAgent(f"node-{index}", link)
    agent.listener = asyncio.create_task(agent.listen())
    return agent


# -- the fuzzer --------------------------------------------------------------------------------

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def _challenge(reader: asyncio.StreamReader, conn: Connection) -> Challenge:
    while True:
        event = conn.next_event()
        if isinstance(event, Challenge):
            return event
        assert isinstance(event, Sentinel)
        conn.receive_data(await reader.read(65536))


async def _authenticated(
    stream: Stream, c: Coordinator, node: str, version: int = FRAME_MAC_VERSION - 1
) -> Connection:
    """An agent end that sent its auth, at a version whose frames are not sealed unless told:
    the frames the fuzzer sends next are raw."""
    reader, writer = stream
    conn = Connection(Role.AGENT, token=c.token, version=version)
    writer.write(conn.hello(node))
    writer.write(conn.answer(await _challenge(reader, conn)))
    return conn


def _body(data: object) -> bytes:
    return frame(msgpack.packb(data, use_bin_type=True))


async def fuzz_random_bytes(stream: Stream, c: Coordinator, rng: random.Random) -> None:
    stream[1].write(rng.randbytes(rng.randint(1, 400)))


async def fuzz_oversized_frame(stream: Stream, c: Coordinator, rng: random.Random) -> None:
    stream[1].write((0xFFFFFFFF).to_bytes(4, "big") + b"x" * 100)


async def fuzz_wrong_types(stream: Stream, c: Coordinator, rng: random.Random) -> None:
    stream[1].write(_body({"t": "hello", "version": "1", "node": 17}))


async def fuzz_unauthenticated(stream: Stream, c: Coordinator, rng: random.Random) -> None:
    stream[1].write(_body({"t": "flows", "opens": [], "progress": [], "closes": []}))


async def fuzz_unknown_version(stream: Stream, c: Coordinator, rng: random.Random) -> None:
    # a hello offers the agent's highest version: 0 is below every version (99 would be
    # answered with the coordinator's own)
    stream[1].write(_body({"t": "hello", "version": 0, "node": "x"}))


async def fuzz_wrong_token(stream: Stream, c: Coordinator, rng: random.Random) -> None:
    reader, writer = stream
    conn = Connection(Role.AGENT, token=b"guessed-token-guessed-token")
    writer.write(conn.hello("guesser"))
    writer.write(conn.answer(await _challenge(reader, conn)))


async def fuzz_replayed_auth(stream: Stream, c: Coordinator, rng: random.Random) -> None:
    # record a genuine auth frame on one connection, replay it on another
    earlier = await asyncio.open_connection(c.host, c.port)
    conn = Connection(Role.AGENT, token=c.token)
    earlier[1].write(conn.hello("replayed"))
    recorded = conn.answer(await _challenge(earlier[0], conn))
    earlier[1].close()
    reader, writer = stream
    victim = Connection(Role.AGENT, token=None)
    writer.write(victim.hello("replayed"))
    await _challenge(reader, victim)
    writer.write(recorded)


async def fuzz_bad_field_after_auth(stream: Stream, c: Coordinator, rng: random.Random) -> None:
    await _authenticated(stream, c, f"fuzz-{rng.randrange(10**6)}")
    stream[1].write(_body({"t": "flows", "progress": [{"id": "one", "sent": 1}]}))


async def fuzz_unknown_type_after_auth(stream: Stream, c: Coordinator, rng: random.Random) -> None:
    await _authenticated(stream, c, f"fuzz-{rng.randrange(10**6)}")
    stream[1].write(_body({"t": "exec", "cmd": "rm -rf /"}))


async def fuzz_unsealed_after_auth(stream: Stream, c: Coordinator, rng: random.Random) -> None:
    # a frame without its MAC (injected by someone on the path) on a sealed connection
    await _authenticated(stream, c, f"fuzz-{rng.randrange(10**6)}", FRAME_MAC_VERSION)
    stream[1].write(_body({"t": "heartbeat", "t_sent": 1.0}))


async def fuzz_truncated_frame(stream: Stream, c: Coordinator, rng: random.Random) -> None:
    stream[1].write((100).to_bytes(4, "big") + b"\x81")
    stream[1].write_eof()


async def fuzz_stalled_handshake(stream: Stream, c: Coordinator, rng: random.Random) -> None:
    stream[1].write(_body({"t": "hello", "version": 1, "node": "slow"})[:7])  # then silence


FUZZ_CASES: list[Callable[[Stream, Coordinator, random.Random], Awaitable[None]]] = [
    fuzz_random_bytes, fuzz_oversized_frame, fuzz_wrong_types, fuzz_unauthenticated,
    fuzz_unknown_version, fuzz_wrong_token, fuzz_replayed_auth, fuzz_bad_field_after_auth,
    fuzz_unknown_type_after_auth, fuzz_unsealed_after_auth, fuzz_truncated_frame,
    fuzz_stalled_handshake,
]  # fmt: skip


async def _fuzz_one(c: Coordinator, case: Callable[..., Awaitable[None]], seed: int) -> int:
    """Run one bad connection; return its local port once the coordinator has closed it."""
    reader, writer = await asyncio.open_connection(c.host, c.port)
    port: int = writer.get_extra_info("sockname")[1]
    try:
        await case((reader, writer), c, random.Random(seed))
        async with asyncio.timeout(10):
            while await reader.read(65536):
                pass
    except ConnectionResetError:
        pass  # closed by the coordinator while our bytes were unread: also a close
    finally:
        writer.close()
    return port


# -- the test ----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.asyncio
async def test_thousand_agents_survive_a_fuzzer(coordinator: Coordinator) -> None:
    gate = asyncio.Semaphore(64)
    agents = await asyncio.gather(*(_start_agent(coordinator, i, gate) for i in range(AGENTS)))
    try:
        await asyncio.gather(*(a.wait_levels(6, timeout=30) for a in agents))
        fuzzing = asyncio.gather(
            *(_fuzz_one(coordinator, case, seed) for seed in range(3) for case in FUZZ_CASES)
        )
        for sent, level in ROUNDS:
            progress = Flows(
                progress_ids=tuple(range(FLOWS_PER_AGENT)),
                progress_sent=(sent,) * FLOWS_PER_AGENT,
            )
            await asyncio.gather(*(a.link.send(progress) for a in agents))
            await asyncio.gather(*(a.wait_levels(level, timeout=30) for a in agents))
        bad_ports = await fuzzing
        assert [a.node for a in agents if a.failure is not None] == []
        metrics = await asyncio.to_thread(_scrape, coordinator.metrics)
    finally:
        for agent in agents:
            if agent.listener is not None:
                agent.listener.cancel()
        await asyncio.gather(*(a.link.close() for a in agents), return_exceptions=True)
    assert coordinator.process.poll() is None, "the coordinator died"
    assert f"flowsched_coordinator_agents_connected {AGENTS}.0" in metrics
    assert f'active_flows{{class="param_sync",level="3"}} {AGENTS * FLOWS_PER_AGENT}.0' in metrics
    _assert_closes_logged_and_counted(coordinator.log.read_text(), metrics, len(bad_ports))


def _assert_closes_logged_and_counted(log: str, metrics: str, bad: int) -> None:
    # every kind of bad connection is logged with its reason (closes before authentication at
    # a falling rate per reason, so that a flood cannot flood the log), and every one counted
    lines = re.findall(r"WARNING .*closing connection peer=127\.0\.0\.1:\d+ .*", log)
    codes = {re.search(r"state=\w+: (\w+):", line)[1] for line in lines}  # type: ignore[index]
    assert {"frame_too_large", "bad_field", "bad_state", "version", "auth_failed"} <= codes
    assert {"bad_type", "bad_frame", "bad_mac", "timeout"} <= codes
    counted = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("flowsched_coordinator_closed_connections") and "peer_closed" not in line
    )
    assert counted >= bad


def _scrape(address: str) -> str:
    with contextlib.closing(urllib.request.urlopen(f"http://{address}/metrics", timeout=10)) as r:
        text: str = r.read().decode()
    return text


def test_refuses_to_start_with_a_group_readable_token(tmp_path: Path) -> None:
    write_token(tmp_path / "token")
    os.chmod(tmp_path / "token", 0o640)
    result = subprocess.run(
        [sys.executable, "-m", "flowsched", "coordinator", "--token-file", str(tmp_path / "token"),
         "--listen", "127.0.0.1:0", "--metrics-port", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "lets group/other access it" in result.stderr


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        pytest.param("--idle-timeout", "0.1", id="idle-timeout-below-the-heartbeat-interval"),
        pytest.param("--max-batch-delay", "-1", id="negative-max-batch-delay"),
        pytest.param("--max-unauthenticated", "0", id="no-room-for-a-handshake"),
    ],
)
def test_refuses_a_setting_that_cannot_work_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    from flowsched.cli import main

    write_token(tmp_path / "token")
    args = ["coordinator", "--token-file", str(tmp_path / "token"), "--listen", "127.0.0.1:0",
            "--metrics-port", "0", flag, value]  # fmt: skip
    assert main(args) == 2
    assert f"{flag}:" in capsys.readouterr().err
