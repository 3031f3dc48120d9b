"""The agent's coordinator link lets go of its socket within CLOSE_TIMEOUT of a close, whatever
the coordinator does: one that stopped reading (hung, stopped, or behind a broken path) never
takes the agent's queued bytes nor, over TLS, answers its close_notify."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from flowsched import tls
from flowsched.model import FlowClass
from flowsched.protocol import (
    NEED_DATA,
    Auth,
    Connection,
    FlowOpen,
    Hello,
    Resync,
    Role,
    Welcome,
)
from flowsched.protocol.aio import CLOSE_TIMEOUT, AgentLink, connect_agent

TlsFiles = Any  # tests/conftest.py's (conftest modules are not imported by name)
Runner = Callable[[Coroutine[Any, Any, None]], None]
TOKEN = b"k" * 32
#: seconds the agent's socket may stay open after a close (CLOSE_TIMEOUT and some slack)
WAIT = CLOSE_TIMEOUT + 2.0


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Runner:
    """Runs a scenario on asyncio's loop, then on uvloop's (the agent's CLI runs uvloop):
    their TLS layers differ."""
    runner: Runner = asyncio.run if request.param == "asyncio" else uvloop.run
    return runner


class SilentCoordinator:
    """A coordinator stand-in on a thread: it runs the handshake, then reads nothing more (so
    it never answers a close_notify either) until :meth:`stop`."""

    def __init__(self, context: ssl.SSLContext | None) -> None:
        self._context = context
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _serve(self) -> None:
        with self._listener:
            raw, _ = self._listener.accept()
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills quickly
        sock = raw if self._context is None else self._context.wrap_socket(raw, server_side=True)
        with sock:
            sock.settimeout(10)
            conn = Connection(Role.COORDINATOR, token=TOKEN)
            for answer in (conn.challenge, lambda: conn.send(Welcome("", 0.2, time.time()))):
                event = conn.next_event()
                while event is NEED_DATA:
                    conn.receive_data(sock.recv(65536))
                    event = conn.next_event()
                assert isinstance(event, Hello | Auth)
                sock.sendall(answer())
            self._stop.wait(60)  # (the test ends sooner)


def _open(sock: socket.socket) -> Callable[[], bool]:
    """Whether the descriptor ``sock`` has now is still open on the same socket."""
    fd, inode = sock.fileno(), os.fstat(sock.fileno()).st_ino

    def still() -> bool:
        try:
            return os.fstat(fd).st_ino == inode
        except OSError:
            return False

    return still


async def _fill(link: AgentLink) -> None:
    """Send until the coordinator's buffers and the agent's are full (a send waits)."""
    opens = tuple(FlowOpen(i, FlowClass.BULK, 1.0) for i in range(2000))
    try:
        async with asyncio.timeout(1.0):
            while True:
                await link.send(Resync(opens))
    except TimeoutError:
        pass


@pytest.mark.parametrize(
    ("secure", "unsent"),
    [(False, True), (True, False), (True, True)],
    ids=["tcp-unsent-bytes", "tls", "tls-unsent-bytes"],
)
def test_a_link_to_a_coordinator_that_stopped_reading_closes_in_close_timeout(
    run: Runner, tls_files: TlsFiles, secure: bool, unsent: bool
) -> None:
    """AgentLink.close's TimeoutError (an OSError) was swallowed by its own suppression of
    OSError, so the transport was never aborted: over TCP the socket stayed open for as long
    as the coordinator read nothing, over TLS 30 s (the TLS layer's default shutdown timeout,
    waiting for a close_notify that never came)."""
    context = None
    if secure:
        context = tls.server_context(str(tls_files.server_cert), str(tls_files.server_key))
    stand_in = SilentCoordinator(context)

    async def scenario() -> None:
        link = await connect_agent(
            "127.0.0.1", stand_in.port, node="n1", token=TOKEN, timeout=5,
            tls=tls.client_context(str(tls_files.ca)) if secure else None,
            server_hostname="localhost",
        )  # fmt: skip
        if unsent:
            await _fill(link)
        still_open = _open(link._writer.get_extra_info("socket"))
        started = time.monotonic()
        await link.close()
        assert time.monotonic() - started < CLOSE_TIMEOUT + 1.0
        while still_open():
            held = time.monotonic() - started
            assert held < WAIT, f"the agent's socket was still open {held:.1f} s after the close"
            await asyncio.sleep(0.01)

    try:
        run(scenario())
    finally:
        stand_in.stop()
