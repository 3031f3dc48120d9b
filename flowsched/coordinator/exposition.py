"""A tiny asyncio HTTP endpoint: one Prometheus registry and the health probes.

``GET /metrics`` (also ``/``): the registry in the text format. ``GET /healthz`` (alias
``/livez``): 200 whenever the event loop answers; it never depends on a peer, so an outage of
the coordinator or etcd never restarts every pod. ``GET /readyz``: 200 when the daemon's
``ready()`` callback returns None, else 503 with the reason it returned. ``HEAD`` gets what
``GET`` would, without the body; other methods get 405.

Served on the daemon's own event loop, so a scrape reads the flow table between two events
and never races with it (a scrape thread would).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

_Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
#: returns None when the daemon is ready, else a one-line reason why not
Readiness = Callable[[], str | None]

REQUEST_TIMEOUT = 5.0
#: connections served at once; at the cap the oldest one still waiting for its request is
#: closed for the newcomer, so idle connections cannot lock scrapes out (nor take the
#: descriptors the daemon keeps for its agents)
MAX_CONNECTIONS = 32
_MAX_REQUEST = 16 * 1024
_METHODS = (b"GET", b"HEAD")
_HTTP_ERRORS = (
    TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError,
)  # fmt: skip


def make_handler(
    registry: CollectorRegistry,
    ready: Readiness | None = None,
    max_connections: int = MAX_CONNECTIONS,
) -> _Handler:
    """An ``asyncio.start_server`` callback answering ``/metrics`` from ``registry`` and the
    probes (``ready`` None: ready as soon as it listens), ``max_connections`` at once."""
    served: set[asyncio.StreamWriter] = set()
    waiting: dict[asyncio.StreamWriter, None] = {}  # no request yet, oldest first

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(served) >= max_connections:
            if not waiting:
                writer.close()
                return
            oldest = next(iter(waiting))
            del waiting[oldest]
            oldest.close()
        served.add(writer)
        waiting[writer] = None
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
            waiting.pop(writer, None)
            writer.transport.set_write_buffer_limits(0)  # drain(): until all is in the kernel
            writer.write(_answer(head, registry, ready))
            async with asyncio.timeout(REQUEST_TIMEOUT):
                await writer.drain()
        except _HTTP_ERRORS as exc:
            log.debug("metrics request failed: %r", exc)
        except asyncio.CancelledError:
            pass  # the loop is ending (Python 3.11 logs a connection task that ends cancelled)
        finally:
            served.discard(writer)
            waiting.pop(writer, None)
            _close(writer)

    return handle


def _close(writer: asyncio.StreamWriter) -> None:
    """Close ``writer``'s connection; abort it while part of the answer is still queued (the
    client stopped reading): a graceful close would keep its socket and the rest of the body
    for as long as the client holds its end open, no longer counted by the connection cap."""
    transport = writer.transport
    if transport.get_write_buffer_size():
        transport.abort()
    else:
        writer.close()


def _answer(head: bytes, registry: CollectorRegistry, ready: Readiness | None) -> bytes:
    """The whole response to the request whose head is ``head``. A HEAD request gets the head
    a GET would (its Content-Length included: RFC 9110, 9.3.2) and no body."""
    parts = head.split(b"\r\n", 1)[0].split()
    if len(parts) != 3 or parts[0] not in _METHODS:
        allow = ", ".join(m.decode() for m in _METHODS)
        body = f"only {allow}\n".encode()
        return _response("405 Method Not Allowed", body, "text/plain", f"Allow: {allow}\r\n")
    status, body, ctype = _respond(parts[1].split(b"?")[0], registry, ready)
    response = _response(status, body, ctype)
    return response if parts[0] == b"GET" else response[: len(response) - len(body)]


def _respond(
    path: bytes, registry: CollectorRegistry, ready: Readiness | None
) -> tuple[str, bytes, str]:
    if path in (b"/metrics", b"/"):
        return "200 OK", generate_latest(registry), CONTENT_TYPE_LATEST
    if path in (b"/healthz", b"/livez"):
        return "200 OK", b"ok\n", "text/plain"
    if path == b"/readyz":
        reason = ready() if ready is not None else None
        if reason is None:
            return "200 OK", b"ready\n", "text/plain"
        return "503 Service Unavailable", f"not ready: {reason}\n".encode(), "text/plain"
    return "404 Not Found", b"try /metrics, /healthz or /readyz\n", "text/plain"


def _response(status: str, body: bytes, content_type: str, extra_headers: str = "") -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n{extra_headers}"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


async def start_metrics_server(
    registry: CollectorRegistry, host: str, port: int, *, ready: Readiness | None = None
) -> asyncio.Server:
    """Listen on ``host:port`` (0 = any free port); serve ``registry`` and the probes."""
    handler = make_handler(registry, ready)
    return await asyncio.start_server(handler, host, port, limit=_MAX_REQUEST)
