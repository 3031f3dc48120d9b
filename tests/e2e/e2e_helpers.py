"""TEST SUPPORT for the end-to-end tests: real coordinator / agent processes, scraping."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from flowsched.testbed.daemons import Daemon as Service
from flowsched.testbed.daemons import agent_in_session as agent_in_session  # re-exported
from flowsched.testbed.daemons import scrape as scrape  # re-exported for the e2e tests
from flowsched.testbed.daemons import spawn
from flowsched.testbed.daemons import wait_for as wait_for  # re-exported for the e2e tests

HERE = Path(__file__).resolve().parent


def start_coordinator(
    tmp: Path,
    token: Path,
    port: int = 0,
    *,
    extra: tuple[str, ...] = (),
    fd_limit: int | None = None,
    cwd: Path | None = None,
) -> Service:
    """``flowsched coordinator`` on 127.0.0.1 (``fd_limit``: its soft and hard open-file
    limit; ``extra``: more flags; ``cwd``: see :func:`spawn`)."""
    return spawn(
        "coordinator",
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
        cwd=cwd,
    )


def start_agent(
    tmp: Path,
    token: Path,
    coordinator_port: int,
    *,
    node: str = "n1",
    fallback_after: float = 1.0,
    extra: tuple[str, ...] = (),
    cwd: Path | None = None,
) -> Service:
    """``flowsched agent`` on lo, following the coordinator on 127.0.0.1 (``extra``: more
    flags; ``cwd``: see :func:`spawn`)."""
    return spawn(
        "agent",
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
            *extra,
        ],
        tmp / f"agent-{node}.log",
        r"ready node=(?P<node>\S+) table=(?P<table>\S+) socket=(?P<socket>\S+) "
        r"metrics=(?P<mhost>[\d.]+):(?P<mport>\d+)",
        cwd=cwd,
    )


def total(metrics: dict[str, float], prefix: str, **labels: str) -> float:
    """Sum of the samples whose name starts with ``prefix`` and carry every given label."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(
        v for k, v in metrics.items() if k.split("{")[0] == prefix and all(w in k for w in wanted)
    )


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
