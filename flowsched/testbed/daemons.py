"""Started ``python -m flowsched`` processes for the end-to-end and HA tests: spawn one, wait
for its ready line, scrape its metrics, stop it (SIGTERM, then SIGKILL) or kill -9 it;
:func:`agent_in_session`, whether an agent holds a coordinator session; :func:`wait_for`,
polling a condition with a deadline; :func:`free_ports` for servers that cannot listen on port
0 (etcd's peer URLs, Prometheus); :func:`closed_port` for a port that refuses connections;
:func:`reap`, the end of any process a test started with pipes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import resource
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Daemon:
    """A started flowsched process, its ready line and that line's named fields."""

    proc: subprocess.Popen[str]
    ready_line: str
    fields: dict[str, str] = field(default_factory=dict)
    name: str = ""

    def kill9(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill9()

    def metrics(self) -> dict[str, float]:
        """``{'name{labels}': value}`` of its metrics endpoint (ready-line field ``mport``)."""
        return scrape(self.fields["mport"], timeout=2)


#: the agent's gauge that is 1 while it holds a coordinator session
AGENT_SESSION = "flowsched_agent_coordinator_connected"


def agent_in_session(agent: Daemon) -> bool:
    """Whether the agent ``agent`` holds a coordinator session: it took the welcome and sent
    its resync (its metrics' :data:`AGENT_SESSION`).

    Wait on this, not on the coordinator's ``flowsched_coordinator_agents_connected``, before
    anything that needs the session: the coordinator counts the agent from its handshake, before
    the agent has read the welcome. Until the resync, a flow the agent opens and closes is never
    reported, an older agent answers an open with its class default, and the agent's log has no
    ``connected to the coordinator`` line yet.
    """
    return agent.metrics().get(AGENT_SESSION) == 1.0


def spawn(
    name: str,
    args: list[str],
    log: Path,
    pattern: str,
    *,
    timeout: float = 30.0,
    fd_limit: int | None = None,
    cwd: Path | None = None,
    wrapper: Sequence[str] = (),
) -> Daemon:
    """Start ``python -m flowsched ARGS`` (stderr appended to ``log``; ``fd_limit``: its soft
    and hard open-file limit; ``cwd``: its working directory, whose ``flowsched`` package, if
    it has one, is the one it runs; ``wrapper``: a command that execs it, such as ``ip netns
    exec NS``) and wait for a stdout line matching ``pattern``; AssertionError with the log's
    tail when it exits or ``timeout`` passes first."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")

    def limit_fds() -> None:  # in the child: soft and hard open-file limit
        if fd_limit is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit))

    with log.open("a") as err:
        proc = subprocess.Popen(
            [*wrapper, sys.executable, "-m", "flowsched", *args],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
            preexec_fn=limit_fds if fd_limit is not None else None,
            cwd=cwd,
        )
    assert proc.stdout is not None
    try:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            ready, _, _ = select.select([proc.stdout], [], [], 0.2)
            if ready:
                line = proc.stdout.readline()
                found = re.search(pattern, line)
                if found:
                    return Daemon(proc, line.strip(), found.groupdict(), name)
            if proc.poll() is not None:
                break
        raise AssertionError(f"{name} did not become ready; log:\n{log.read_text()[-3000:]}")
    except BaseException:
        # not ready, or the wait itself failed (Ctrl-C, a bad pattern): the process must not
        # outlive the call, nor stay a zombie holding its pipe
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        proc.stdout.close()
        raise


#: where :func:`free_ports` looks when the kernel's ephemeral range leaves room below it
PORT_BAND = (10000, 20000)
#: the kernel's ephemeral port range (``connect`` and bind to port 0 pick from it)
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback TCP ports that were free a moment ago, for a server started
    next that must be told its port.

    Probing with a bind to port 0 and closing is racy twice over: the kernel may hand the same
    port to the next probe, and any ``connect`` may take it as its local port before the server
    binds it (etcd then exits "bind: address already in use"). So every probe stays bound until
    all are chosen, and the ports come from :data:`PORT_BAND`, below the ephemeral range, which
    the kernel never hands out by itself; only where that range starts too low for the band do
    the probes fall back to port 0.
    """
    low, high = PORT_BAND
    with contextlib.suppress(OSError, ValueError):
        high = min(high, int(EPHEMERAL_RANGE.read_text().split()[0]))
    candidates = random.sample(range(low, high), min(high - low, 8 * count)) if high > low else []
    ports: list[int] = []
    with contextlib.ExitStack() as held:
        for port in [*candidates, *[0] * count]:
            if len(ports) == count:
                break
            probe = held.enter_context(socket.socket())
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            ports.append(probe.getsockname()[1])
    if len(ports) < count:
        raise RuntimeError(f"found {len(ports)} of {count} free loopback ports")
    return ports


@contextlib.contextmanager
def closed_port() -> Iterator[int]:
    """A loopback TCP port that refuses connections while the ``with`` block runs: a dead
    server's address.

    A socket holds the port bound but never listens: the kernel answers a connect there with a
    reset, and no other socket can bind the port meanwhile (a probe closed at once could be
    taken by the next bind to port 0 or a connect's local port, and then accept).
    """
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        yield holder.getsockname()[1]


def scrape(port: int | str, timeout: float = 5.0) -> dict[str, float]:
    """``{'name{labels}': value}`` of a Prometheus endpoint on localhost."""
    url = f"http://127.0.0.1:{port}/metrics"
    body = urllib.request.urlopen(url, timeout=timeout).read().decode()
    out: dict[str, float] = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def wait_until(
    predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.01
) -> float:
    """:func:`wait_for` on the running event loop: poll every ``interval`` s, sleeping with
    asyncio between polls; the seconds it took (AssertionError naming ``what``)."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(interval)
    return time.monotonic() - start


def wait_for(
    predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.01
) -> float:
    """Poll every ``interval`` s until true (OSError counts as not yet); return the seconds it
    took (AssertionError naming ``what`` after ``timeout``)."""
    start = time.monotonic()
    while True:
        try:
            if predicate():
                return time.monotonic() - start
        except OSError:
            pass
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def reap(proc: subprocess.Popen[Any]) -> None:
    """Kill ``proc`` (if still running), wait for it and close its pipes."""
    proc.kill()
    proc.wait(timeout=30)
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            with contextlib.suppress(BrokenPipeError):  # (a stdin whose reader is gone)
                pipe.close()
