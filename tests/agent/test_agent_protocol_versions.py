"""The agent against coordinators of this release and of an earlier one (protocol 1, allowed
with ``allow_unproven_coordinator``): it sends progress as arrays only where the coordinator
said it speaks version 2 or later."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from agent_helpers import agent_config, wait_until

from flowsched import client
from flowsched.agent.threaded import AgentThread
from flowsched.coordinator import CoordinatorConfig
from flowsched.protocol import (
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    Connection,
    Heartbeat,
    ReceiveBuffer,
    Role,
    Welcome,
    decode_body,
    frame,
    write_token,
)


class RecordingCoordinator:
    """A coordinator stand-in on its own thread that records every frame body agents send
    after the handshake, as raw msgpack maps.

    ``old=True`` behaves as the previous release on the wire: its hello check refused every
    version but 1 with an ``error`` frame of code ``version`` (and closed), and it speaks
    version 1 only.
    """

    def __init__(self, token: bytes, *, old: bool) -> None:
        self.old = old
        self.token = token
        self.policy = CoordinatorConfig.from_policy_file(None, token).policy_text
        self.offers: list[int] = []
        self.bodies: list[dict[str, Any]] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None

    def start(self) -> int:
        self._thread.start()
        serving = asyncio.start_server(self._serve, "127.0.0.1", 0)
        self._server = asyncio.run_coroutine_threadsafe(serving, self._loop).result(10)
        self.port: int = self._server.sockets[0].getsockname()[1]
        return self.port

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    async def _shutdown(self) -> None:
        """Close the server and end every connection's handler while the loop still runs (a
        handler collected after the loop closed failed in its ``finally``)."""
        assert self._server is not None
        self._server.close()
        handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        buffer = ReceiveBuffer()
        beats: asyncio.Task[None] | None = None
        try:
            hello = await _next_body(reader, buffer)
            offer = msgpack.unpackb(hello)["version"]
            self.offers.append(offer)
            if self.old and offer != 1:  # what the previous release's hello check did
                reason = f"hello.version: unsupported version {offer} (this end speaks 1)"
                error = {"t": "error", "code": "version", "reason": reason}
                writer.write(frame(msgpack.packb(error)))
                return
            speaks = MIN_PROTOCOL_VERSION if self.old else PROTOCOL_VERSION
            conn = Connection(Role.COORDINATOR, token=self.token, version=speaks)
            conn.receive_data(frame(hello))
            conn.next_event()
            writer.write(conn.challenge())
            conn.receive_data(frame(await _next_body(reader, buffer)))
            conn.next_event()  # the auth, MAC checked
            writer.write(conn.send(Welcome(self.policy, 0.05, time.time(), 0.1)))
            beats = asyncio.create_task(_beat(writer, conn))
            while True:
                body = await _next_body(reader, buffer)
                body = conn.opened(body)  # version 5 on: the MAC checked and taken off
                decode_body(body)  # well-formed, whatever its form
                self.bodies.append(msgpack.unpackb(body))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            if beats is not None:
                beats.cancel()
            writer.close()

    def progress_frames(self) -> list[dict[str, Any]]:
        """The recorded ``flows`` frames that carry progress (in either form)."""
        return [
            b
            for b in list(self.bodies)
            if b["t"] == "flows" and (b.get("progress") or b.get("progress_ids"))
        ]


async def _next_body(reader: asyncio.StreamReader, buffer: ReceiveBuffer) -> bytes:
    while (body := buffer.next_body()) is None:
        async with asyncio.timeout(10):
            data = await reader.read(1 << 16)
        if not data:
            raise asyncio.IncompleteReadError(b"", None)
        buffer.feed(data)
    return body


async def _beat(writer: asyncio.StreamWriter, conn: Connection) -> None:
    with contextlib.suppress(ConnectionError):
        while True:
            writer.write(conn.send(Heartbeat(time.time())))
            await asyncio.sleep(0.1)


@pytest.fixture(params=[False, True], ids=["new-coordinator", "old-coordinator"])
def recording(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RecordingCoordinator]:
    coordinator = RecordingCoordinator(write_token(tmp_path / "token"), old=request.param)
    coordinator.start()
    try:
        yield coordinator
    finally:
        coordinator.stop()


def test_the_agent_sends_progress_in_the_form_its_coordinator_decodes(
    recording: RecordingCoordinator, tmp_path: Path
) -> None:
    config = agent_config(
        tmp_path,
        coordinator=("127.0.0.1", recording.port),
        token_file=str(tmp_path / "token"),
        # the previous release cannot prove it holds the token (protocol 3 can)
        allow_unproven_coordinator=recording.old,
    )
    with AgentThread(config) as running:
        wait_until(lambda: running.agent.connected)
        flow = client.open_flow("bulk", socket_path=config.socket_path)
        try:
            deadline = time.monotonic() + 5.0
            while not recording.progress_frames() and time.monotonic() < deadline:
                flow.add_bytes(1 << 20)
                time.sleep(0.02)
        finally:
            flow.close()
    frames = recording.progress_frames()
    assert frames, "no progress reached the coordinator"
    if recording.old:
        # refused once at version 2, then reconnected offering 1: maps only, never arrays
        assert recording.offers[:2] == [PROTOCOL_VERSION, MIN_PROTOCOL_VERSION]
        assert not any("progress_ids" in b for b in recording.bodies)
        entries = [entry for b in frames for entry in b["progress"]]
        assert entries and all(set(entry) == {"id", "sent"} for entry in entries)
    else:
        assert recording.offers[0] == PROTOCOL_VERSION
        assert not any("progress" in b for b in recording.bodies if b["t"] == "flows")
        assert all(len(b["progress_ids"]) == len(b["progress_sent"]) >= 1 for b in frames)
        assert all(sent >= 1 << 20 for b in frames for sent in b["progress_sent"])
