"""Another user's SDK opens while one local user floods the agent, next to the same opens with
no flood, in one run (docs/security.md, "The SDK socket: limits per user and per node").

    sudo .venv/bin/python bench/sdk_flood.py [--seconds 45] [--interval 0.25]

Starts a real coordinator and a real agent (its SDK socket handed to a group that ``nobody``
is put in) and, from this process (root), makes a fresh connection to the SDK socket and sends
one ``open`` every ``--interval`` seconds for ``--seconds``, timing each until its answer; an
open not answered within the SDK's timeout (``client.OPEN_TIMEOUT``, 2 s, after which a client
runs on static defaults) counts as failed. First with the agent idle (the baseline), then while
a child process, as ``nobody``, keeps 200 connections full of opens
(:mod:`flowsched.testbed.sdk_flood`: refused once it holds its 4,096 flows, answers read and
dropped). Also reports how many of the flood's opens the agent answered meanwhile, and whether
the agent kept its coordinator session (no switch to the local policy, no second handshake).
Needs root: the flood comes from another uid.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from flowsched import client
from flowsched.agent import sdk_server
from flowsched.protocol import sdk
from flowsched.testbed.daemons import Daemon, spawn, wait_for
from flowsched.testbed.sdk_flood import FLOOD_CONNECTIONS, flooding, shareable_group

OPENS = 'flowsched_agent_sdk_requests_total{type="open"}'
CLIENTS = "flowsched_agent_sdk_clients"
SWITCHES = "flowsched_agent_fallback_switches_total"
CONNECTS = "flowsched_agent_coordinator_connects_total"


@dataclass
class Phase:
    """One phase's open times (s; None: not answered within the SDK's timeout) and what the
    agent did meanwhile."""

    name: str
    times: list[float | None]
    flood_opens: float
    switches: float
    connects: float

    def summary(self) -> str:
        answered = [t for t in self.times if t is not None]
        failed = len(self.times) - len(answered)
        text = f"{self.name}: {failed} of {len(self.times)} opens unanswered within "
        text += f"{client.OPEN_TIMEOUT:g} s"
        if answered:
            text += (f"; answered: median {statistics.median(answered) * 1e3:.1f} ms, "
                     f"slowest {max(answered) * 1e3:.1f} ms")  # fmt: skip
        text += f"; the flood's opens answered meanwhile: {self.flood_opens:,.0f}"
        text += f"; the agent's switches to the local policy {self.switches:g}, "
        text += f"coordinator handshakes {self.connects:g}"
        return text


def timed_open(path: str) -> float | None:
    """Seconds from connecting to the SDK socket ``path`` to the answer of one ``open`` on that
    fresh connection, or None when none came within the SDK's timeout."""
    start = time.perf_counter()
    end = time.monotonic() + client.OPEN_TIMEOUT
    request = sdk.Open(1, "kv", 1000, time.time() + 60)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(client.OPEN_TIMEOUT)
            sock.connect(path)
            sock.sendall(sdk.encode(request))
            decoder = sdk.SdkDecoder("client")
            while (answer := decoder.next_message()) is None:
                sock.settimeout(max(0.001, end - time.monotonic()))
                data = sock.recv(65536)
                if not data:
                    return None
                decoder.feed(data)
    except OSError:  # timeout included
        return None
    if not isinstance(answer, sdk.Opened):
        raise RuntimeError(f"the agent answered the open with {answer!r}")
    return time.perf_counter() - start


def run_phase(name: str, agent: Daemon, path: str, seconds: float, interval: float) -> Phase:
    """One open every ``interval`` s for ``seconds`` s, each on a fresh connection."""
    before = agent.metrics()
    times: list[float | None] = []
    next_at = time.monotonic()
    end = next_at + seconds
    while next_at < end:
        times.append(timed_open(path))
        next_at += interval
        time.sleep(max(0.0, next_at - time.monotonic()))
    after = agent.metrics()
    return Phase(
        name,
        times,
        flood_opens=after.get(OPENS, 0) - before.get(OPENS, 0) - len(times),
        switches=after.get(SWITCHES, 0),
        connects=after.get(CONNECTS, 0),
    )


@contextlib.contextmanager
def services(tmp: Path, group: str) -> Iterator[tuple[Daemon, str]]:
    """A coordinator and an agent following it, its SDK socket usable by ``group``; yields the
    agent and its socket path once the agent holds its coordinator session."""
    token = tmp / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    path = str(tmp / "run" / "agent.sock")
    started: list[Daemon] = []
    try:
        coordinator = spawn(
            "coordinator",
            ["coordinator", "--listen", "127.0.0.1:0", "--metrics-port", "0", "--token-file",
             str(token), "--log-level", "WARNING"],
            tmp / "coordinator.log",
            r"listening on [\d.]+:(?P<port>\d+) metrics [\d.]+:(?P<mport>\d+)",
        )  # fmt: skip
        started.append(coordinator)
        agent = spawn(
            "agent",
            ["agent", "--coordinator", f"127.0.0.1:{coordinator.fields['port']}", "--node", "n1",
             "--token-file", str(token), "--table", str(tmp / "table"), "--socket", path,
             "--group", group, "--metrics-port", "0", "--interface", "lo",
             "--log-level", "WARNING"],
            tmp / "agent.log",
            r"metrics=[\d.]+:(?P<mport>\d+)",
        )  # fmt: skip
        started.append(agent)
        wait_for(lambda: agent.metrics().get("flowsched_agent_coordinator_connected") == 1.0,
                 timeout=30, what="the agent's coordinator session")  # fmt: skip
        yield agent, path
    finally:
        for daemon in reversed(started):
            daemon.stop()


@contextlib.contextmanager
def flood_served(agent: Daemon, path: str, gid: int) -> Iterator[None]:
    """One user's flood of ``path`` (:func:`~flowsched.testbed.sdk_flood.flooding`) while the
    block runs, from once all its connections are in and its opens are refused at its flow cap."""
    with flooding(path, gid):
        base = agent.metrics().get(OPENS, 0)
        refused_from = base + 2 * sdk_server.MAX_FLOWS_PER_UID
        wait_for(
            lambda: (
                (m := agent.metrics()).get(CLIENTS, 0) >= FLOOD_CONNECTIONS
                and m.get(OPENS, 0) > refused_from
            ),
            timeout=60,
            what="the flood's connections and opens",
            interval=0.1,
        )
        yield


def measure(seconds: float, interval: float) -> list[Phase]:
    """The baseline phase, then the flood phase (root only; RuntimeError without a group to
    give the flooding user)."""
    group = shareable_group()
    if group is None:
        raise RuntimeError("no group among users/nogroup/daemon/staff to give the flooding user")
    # nobody must traverse to the socket: not under a 0700 directory
    tmp = Path(tempfile.mkdtemp(prefix="flowsched-sdk-flood-", dir="/tmp"))
    try:
        tmp.chmod(0o755)
        with services(tmp, group.gr_name) as (agent, path):
            phases = [run_phase("idle agent (baseline)", agent, path, seconds, interval)]
            with flood_served(agent, path, group.gr_gid):
                flooded = f"{FLOOD_CONNECTIONS} connections of nobody flooding"
                phases.append(run_phase(flooded, agent, path, seconds, interval))
        return phases
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=45.0, help="length of each phase")
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between opens")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/sdk_flood.py needs root: the flood comes from another uid (nobody)")
    phases = measure(args.seconds, args.interval)
    print(f"root's opens, one every {args.interval:g} s for {args.seconds:g} s, each on a "
          f"fresh connection, until answered:")  # fmt: skip
    for phase in phases:
        print(" ", phase.summary())


if __name__ == "__main__":
    main()
