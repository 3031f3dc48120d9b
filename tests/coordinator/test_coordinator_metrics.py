"""The metrics endpoint's probes, the deadline lateness/earliness split and name hygiene."""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
import subprocess
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from flowsched.coordinator import exposition
from flowsched.coordinator.exposition import make_handler, start_metrics_server
from flowsched.coordinator.histogram import DeadlineSlack
from flowsched.coordinator.metrics import register_standard_collectors
from flowsched.model import SLACK_CAP


async def _exchange(port: int, path: str, method: str = "GET") -> tuple[bytes, bytes]:
    """The response's head and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    response = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = response.partition(b"\r\n\r\n")
    return head, body


async def _get(port: int, path: str, method: str = "GET") -> tuple[int, bytes]:
    head, body = await _exchange(port, path, method)
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


class _FixedCollector:
    """One gauge whose value never changes, so that two scrapes read the same bytes."""

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("fixed", "A constant.", value=1.0)


@pytest.mark.parametrize("path", ["/metrics", "/healthz", "/readyz", "/nope"])
@pytest.mark.asyncio
async def test_head_gets_the_head_a_get_would_and_no_body(path: str) -> None:
    registry = CollectorRegistry()
    registry.register(_FixedCollector())
    server = await start_metrics_server(registry, "127.0.0.1", 0, ready=lambda: "starting")
    port = server.sockets[0].getsockname()[1]
    try:
        get_head, get_body = await _exchange(port, path, "GET")
        head_head, head_body = await _exchange(port, path, "HEAD")
    finally:
        server.close()
    assert get_body
    assert head_head == get_head  # Content-Length included: the GET body's length
    assert f"Content-Length: {len(get_body)}".encode() in head_head
    assert head_body == b""


@pytest.mark.asyncio
async def test_a_method_not_allowed_names_the_allowed_ones() -> None:
    server = await start_metrics_server(CollectorRegistry(), "127.0.0.1", 0)
    try:
        head, body = await _exchange(server.sockets[0].getsockname()[1], "/metrics", "DELETE")
    finally:
        server.close()
    assert head.startswith(b"HTTP/1.1 405 ")
    assert b"\r\nAllow: GET, HEAD\r\n" in head
    assert body == b"only GET, HEAD\n"


@pytest.mark.parametrize(
    ("slacks", "late_count", "late_sum", "early_count", "early_sum"),
    [
        ([], 0, 0.0, 0, 0.0),
        ([0.5, 0.0], 0, 0.0, 2, 0.5),  # exactly on time counts as met, early by 0
        ([-2.0, -0.25], 2, 2.25, 0, 0.0),
        ([-1.0, 3.0, -0.5, 0.125], 2, 1.5, 2, 3.125),
        # a client's far deadline (finite, so the protocol takes it) adds SLACK_CAP, not 1e308
        ([1.7e308, 1.7e308, 0.5], 0, 0.0, 3, 2 * SLACK_CAP + 0.5),
        ([-1.7e308, -2.0], 2, SLACK_CAP + 2.0, 0, 0.0),
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


class _ManyLinks:
    """A collector whose exposition is about 1 MB: the link series of a large cluster."""

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("many_links", "One series per link.", labels=["link"])
        for index in range(20_000):
            family.add_metric([f"node-{index:05d}:tx"], index)
        yield family


@pytest.mark.parametrize("client_reads", [True, False])
@pytest.mark.asyncio
async def test_a_scrape_not_taken_within_the_timeout_is_aborted(
    monkeypatch: pytest.MonkeyPatch, client_reads: bool
) -> None:
    """A client that asks for a large /metrics and stops reading must lose its connection at
    the request timeout: a graceful close kept its socket and the rest of the body for as long
    as it held its end open, outside the connection cap (each such client one more descriptor
    than the 32 the daemons reserve). A client that reads gets the whole body."""
    if not client_reads:  # (a reader keeps the usual 5 s: a slow machine must not fail it)
        monkeypatch.setattr(exposition, "REQUEST_TIMEOUT", 0.5)
    registry = CollectorRegistry()
    registry.register(_ManyLinks())
    handler = make_handler(registry)
    served: asyncio.Queue[asyncio.StreamWriter] = asyncio.Queue()

    async def with_small_send_buffer(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        # the kernel holds little of the answer: the rest waits in the transport's buffer
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        await handler(reader, writer)
        served.put_nowait(writer)

    server = await asyncio.start_server(with_small_send_buffer, "127.0.0.1", 0)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(client, server.sockets[0].getsockname())
        reader, writer = await asyncio.open_connection(sock=client)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        response = b""
        if client_reads:
            async with asyncio.timeout(10):
                response = await reader.read()
        async with asyncio.timeout(5):  # the server's side of the connection is gone
            server_side = await served.get()
            await server_side.wait_closed()
        if client_reads:
            head, _, body = response.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 OK")
            assert body == generate_latest(registry)
        writer.close()
    finally:
        client.close()
        server.close()
