"""TEST SUPPORT for the HA tests: a real etcd per test (skipped with the reason when absent)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from flowsched.testbed.etcd import etcd_binary, local_etcd


def need_etcd() -> None:
    """Skip the calling test, with the reason, where etcd or its client cannot run."""
    if etcd_binary() is None:
        pytest.skip("etcd is not installed (Debian: apt-get install etcd-server)")
    if importlib.util.find_spec("etcd3gw") is None:
        pytest.skip("the etcd3gw client is not installed (pip install 'flowsched[ha]')")


@pytest.fixture
def etcd_url(tmp_path: Path) -> Iterator[str]:
    """A fresh single-member etcd on free loopback ports (its log: tmp_path/etcd.log)."""
    need_etcd()
    with local_etcd(tmp_path / "etcd.log") as url:
        yield url


# -- real processes --------------------------------------------------------------------------

E2E = Path(__file__).resolve().parents[1] / "e2e"


@dataclass
class Daemon:
    """A started flowsched process and the fields of its ready line."""

    proc: subprocess.Popen[str]
    fields: dict[str, str]
    name: str

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
        """``{'name{labels}': value}`` of its metrics endpoint."""
        url = f"http://127.0.0.1:{self.fields['mport']}/metrics"
        body = urllib.request.urlopen(url, timeout=2).read().decode()
        out: dict[str, float] = {}
        for line in body.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out


def total(metrics: dict[str, float], prefix: str) -> float:
    """Sum of the samples of metric ``prefix`` (every label set)."""
    return sum(v for k, v in metrics.items() if k.split("{")[0] == prefix)


def spawn(name: str, args: list[str], log: Path, pattern: str, timeout: float = 30.0) -> Daemon:
    """Start ``python -m flowsched ARGS`` and wait for the ready line matching ``pattern``."""
    with log.open("a") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flowsched", *args],
            stdout=subprocess.PIPE, stderr=err, text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )  # fmt: skip
    assert proc.stdout is not None
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            found = re.search(pattern, proc.stdout.readline())
            if found:
                return Daemon(proc, found.groupdict(), name)
        if proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"{name} did not become ready; log:\n{log.read_text()[-3000:]}")


def start_coordinator(tmp: Path, token: Path, etcd: str, name: str) -> Daemon:
    """A coordinator of the election ``ha`` on free ports."""
    return spawn(
        name,
        ["coordinator", "--listen", "127.0.0.1:0", "--metrics-port", "0", "--token-file",
         str(token), "--etcd", etcd, "--election-name", "ha", "--log-level", "INFO"],
        tmp / f"{name}.log",
        r"listening on (?P<host>[\d.]+):(?P<port>\d+) metrics [\d.]+:(?P<mport>\d+)",
    )  # fmt: skip


def start_agent(tmp: Path, token: Path, coordinators: list[Daemon], node: str) -> Daemon:
    """An agent that knows every coordinator's address."""
    addresses = ",".join(f"127.0.0.1:{c.fields['port']}" for c in coordinators)
    return spawn(
        node,
        ["agent", "--coordinator", addresses, "--node", node, "--token-file", str(token),
         "--table", str(tmp / f"{node}.table"), "--socket", str(tmp / f"{node}.sock"),
         "--slots", "64", "--metrics-port", "0", "--interface", "lo", "--log-level", "INFO"],
        tmp / f"agent-{node}.log",
        r"ready node=(?P<node>\S+) table=(?P<table>\S+) socket=(?P<socket>\S+) "
        r"metrics=[\d.]+:(?P<mport>\d+)",
    )  # fmt: skip


def emulated_plugin(
    tmp: Path, table: str, to: tuple[str, int], name: str, messages: int, gap: float
) -> subprocess.Popen[str]:
    """tests/e2e/plugin_emulator.py: plugin-like traffic on a table slot, verified bytes."""
    return subprocess.Popen(
        [sys.executable, str(E2E / "plugin_emulator.py"), "--table", table,
         "--to", f"{to[0]}:{to[1]}", "--class-id", "0", "--messages", str(messages),
         "--gap", str(gap), "--out", str(tmp / f"{name}.json")],
        stderr=(tmp / f"{name}.log").open("w"), text=True,
    )  # fmt: skip


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> float:
    """Poll every 5 ms until true; the seconds it took (AssertionError naming ``what``)."""
    start = time.monotonic()
    while True:
        try:
            if predicate():
                return time.monotonic() - start
        except OSError:
            pass
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)
