"""A tiny asyncio HTTP endpoint serving one Prometheus registry (``GET /metrics``).

Served on the coordinator's own event loop, so a scrape reads the flow table between two
events and never races with it (a scrape thread would).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

_Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

REQUEST_TIMEOUT = 5.0
_MAX_REQUEST = 16 * 1024
_HTTP_ERRORS = (
    TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError,
)  # fmt: skip


def make_handler(registry: CollectorRegistry) -> _Handler:
    """An ``asyncio.start_server`` callback answering ``GET /metrics`` from ``registry``."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
            status, body, ctype = _respond(head, registry)
            writer.write(_response(status, body, ctype))
            async with asyncio.timeout(REQUEST_TIMEOUT):
                await writer.drain()
        except _HTTP_ERRORS as exc:
            log.debug("metrics request failed: %r", exc)
        finally:
            writer.close()

    return handle


def _respond(head: bytes, registry: CollectorRegistry) -> tuple[str, bytes, str]:
    parts = head.split(b"\r\n", 1)[0].split()
    if len(parts) != 3 or parts[0] not in (b"GET", b"HEAD"):
        return "405 Method Not Allowed", b"only GET /metrics\n", "text/plain"
    if parts[1].split(b"?")[0] not in (b"/metrics", b"/"):
        return "404 Not Found", b"try /metrics\n", "text/plain"
    body = b"" if parts[0] == b"HEAD" else generate_latest(registry)
    return "200 OK", body, CONTENT_TYPE_LATEST


def _response(status: str, body: bytes, content_type: str) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


async def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> asyncio.Server:
    """Listen on ``host:port`` (0 = any free port) and serve ``registry``."""
    return await asyncio.start_server(make_handler(registry), host, port, limit=_MAX_REQUEST)
