"""TEST SUPPORT for the end-to-end tests: real coordinator / agent processes, scraping."""

from __future__ import annotations

import contextlib
import os
import re
import resource
import select
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass
class Service:
    """A started flowsched process and what its ready line said."""

    proc: subprocess.Popen[str]
    ready_line: str
    fields: dict[str, str] = field(default_factory=dict)

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


def _spawn(
    args: list[str], log: Path, pattern: str, timeout: float = 30.0, fd_limit: int | None = None
) -> Service:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    err = log.open("a")

    def limit_fds() -> None:  # in the child: soft and hard open-file limit
        if fd_limit is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit))

    proc = subprocess.Popen(
        [sys.executable, "-m", "flowsched", *args],
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
        env=env,
        preexec_fn=limit_fds if fd_limit is not None else None,
    )
    err.close()
    assert proc.stdout is not None
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            match = re.search(pattern, line)
            if match:
                return Service(proc, line.strip(), match.groupdict())
        if proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"{args[0]} did not become ready; log:\n{log.read_text()[-3000:]}")


def start_coordinator(
    tmp: Path,
    token: Path,
    port: int = 0,
    *,
    extra: tuple[str, ...] = (),
    fd_limit: int | None = None,
) -> Service:
    """``flowsched coordinator`` on 127.0.0.1 (``fd_limit``: its soft and hard open-file
    limit; ``extra``: more flags)."""
    return _spawn(
        [
            "coordinator",
            "--listen",
            f"127.0.0.1:{port}",
            "--metrics-port",
            "0",
            "--token-file",
            str(token),
            "--log-level",
            "INFO",
            *extra,
        ],
        tmp / "coordinator.log",
        r"listening on (?P<host>[\d.]+):(?P<port>\d+) metrics (?P<mhost>[\d.]+):(?P<mport>\d+)",
        fd_limit=fd_limit,
    )


def start_agent(
    tmp: Path, token: Path, coordinator_port: int, *, node: str = "n1", fallback_after: float = 1.0
) -> Service:
    return _spawn(
        [
            "agent",
            "--coordinator",
            f"127.0.0.1:{coordinator_port}",
            "--node",
            node,
            "--token-file",
            str(token),
            "--table",
            str(tmp / f"{node}.table"),
            "--socket",
            str(tmp / f"{node}.sock"),
            "--slots",
            "64",
            "--metrics-port",
            "0",
            "--fallback-after",
            str(fallback_after),
            "--interface",
            "lo",
            "--log-level",
            "INFO",
        ],
        tmp / f"agent-{node}.log",
        r"ready node=(?P<node>\S+) table=(?P<table>\S+) socket=(?P<socket>\S+) "
        r"metrics=(?P<mhost>[\d.]+):(?P<mport>\d+)",
    )


def scrape(port: int | str) -> dict[str, float]:
    """``{'name{labels}': value}`` of a Prometheus endpoint on localhost."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def total(metrics: dict[str, float], prefix: str, **labels: str) -> float:
    """Sum of the samples whose name starts with ``prefix`` and carry every given label."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(
        v for k, v in metrics.items() if k.split("{")[0] == prefix and all(w in k for w in wanted)
    )


def wait_for(
    predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.01
) -> float:
    """Poll until true; return the seconds it took (AssertionError naming ``what`` otherwise)."""
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


def emulated_plugin(
    tmp: Path,
    table: str,
    to: tuple[str, int],
    *,
    name: str,
    class_id: int,
    messages: int,
    gap: float,
    peer: int = -1,
) -> subprocess.Popen[str]:
    """Start tests/e2e/plugin_emulator.py (plugin-like traffic on a table slot)."""
    return subprocess.Popen(
        [
            sys.executable,
            str(HERE / "plugin_emulator.py"),
            "--table",
            table,
            "--to",
            f"{to[0]}:{to[1]}",
            "--class-id",
            str(class_id),
            "--peer",
            str(peer),
            "--messages",
            str(messages),
            "--gap",
            str(gap),
            "--out",
            str(tmp / f"{name}.json"),
        ],
        stderr=(tmp / f"{name}.log").open("w"),
        text=True,
    )


@contextlib.contextmanager
def cleanup(*items: object) -> Iterator[list[object]]:
    """Yield a list; everything appended (Service / Popen) is stopped at exit."""
    started: list[object] = list(items)
    try:
        yield started
    finally:
        for item in reversed(started):
            if isinstance(item, Service):
                item.stop()
            elif isinstance(item, subprocess.Popen) and item.poll() is None:
                item.kill()
                item.wait(timeout=10)
