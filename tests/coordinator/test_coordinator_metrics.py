"""The metrics endpoint's probes, the deadline lateness/earliness split and name hygiene."""

from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from flowsched.coordinator.exposition import start_metrics_server
from flowsched.coordinator.histogram import DeadlineSlack
from flowsched.coordinator.metrics import register_standard_collectors


async def _get(port: int, path: str, method: str = "GET") -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    response = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


@pytest.mark.parametrize(
    ("path", "method", "ready", "status", "body_has"),
    [
        ("/metrics", "GET", None, 200, b"flowsched_build_info{"),
        ("/", "GET", None, 200, b"process_cpu_seconds_total"),
        ("/metrics", "HEAD", None, 200, b""),
        ("/healthz", "GET", "coordinator gone", 200, b"ok"),  # liveness ignores peers
        ("/livez", "GET", None, 200, b"ok"),
        ("/readyz", "GET", None, 200, b"ready"),
        ("/readyz?verbose", "GET", "no coordinator connection", 503, b"no coordinator connection"),
        ("/nope", "GET", None, 404, b"/readyz"),
        ("/metrics", "POST", None, 405, b"only GET"),
    ],
)
@pytest.mark.asyncio
async def test_endpoint_paths(
    path: str, method: str, ready: str | None, status: int, body_has: bytes
) -> None:
    registry = CollectorRegistry()
    register_standard_collectors(registry)
    server = await start_metrics_server(registry, "127.0.0.1", 0, ready=lambda: ready)
    try:
        got_status, body = await _get(server.sockets[0].getsockname()[1], path, method)
    finally:
        server.close()
    assert got_status == status
    assert body_has in body


@pytest.mark.parametrize(
    ("slacks", "late_count", "late_sum", "early_count", "early_sum"),
    [
        ([], 0, 0.0, 0, 0.0),
        ([0.5, 0.0], 0, 0.0, 2, 0.5),  # exactly on time counts as met, early by 0
        ([-2.0, -0.25], 2, 2.25, 0, 0.0),
        ([-1.0, 3.0, -0.5, 0.125], 2, 1.5, 2, 3.125),
    ],
)
def test_deadline_slack_splits_into_two_non_negative_histograms(
    slacks: list[float], late_count: int, late_sum: float, early_count: int, early_sum: float
) -> None:
    slack = DeadlineSlack()
    for value in slacks:
        slack.observe(value)
    assert (slack.late.count, slack.late.sum) == (late_count, late_sum)
    assert (slack.early.count, slack.early.sum) == (early_count, early_sum)
    assert sum(slack.counts) == len(slacks)
    for hist in (slack.late, slack.early):
        cumulative = [count for _, count in hist.cumulative()]
        assert cumulative == sorted(cumulative) and cumulative[-1] == hist.count


def test_standard_collectors_give_build_info_process_and_platform() -> None:
    registry = CollectorRegistry()
    register_standard_collectors(registry)
    text = generate_latest(registry).decode()
    from flowsched import __version__
    from flowsched.compiled import is_compiled

    compiled = "true" if is_compiled() else "false"  # the editable checkout: false
    assert f'flowsched_build_info{{compiled="{compiled}",version="{__version__}"}} 1.0' in text
    assert "process_resident_memory_bytes" in text and "python_info{" in text


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_lint_accepts_the_standard_families() -> None:
    registry = CollectorRegistry()
    register_standard_collectors(registry)
    lint = subprocess.run(
        ["promtool", "check", "metrics"], input=generate_latest(registry), capture_output=True
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_a_connection_open_when_the_loop_ends_closes_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """asyncio.run cancels the handler of a scrape still waiting for its request: Python 3.11's
    stream server logged that as "Exception in callback ... CancelledError"."""

    async def main() -> None:
        server = await start_metrics_server(CollectorRegistry(), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.sleep(0)  # the server accepts; its handler waits for the request
        while not [t for t in asyncio.all_tasks() if "handle" in t.get_coro().__qualname__]:
            await asyncio.sleep(0.001)
        writer.transport.abort()  # the client side goes; the server's handler stays put

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(main())
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []
