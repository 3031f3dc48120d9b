"""One testbed host of the live serving run (runs inside the host's network namespace).

It connects to the run's :class:`flowsched.testbed.live.LiveEngine` over a unix socket, says
hello, learns the run's time zero, then: receives every flow addressed to its host and reports
each completion (the time its last byte arrived); opens each flow the engine asks for through the
real agent (``flowsched.client`` with the flow's class, size, deadline, request, job and consumer
step, ``dst_node`` = the receiving host) and sends it with ``flowsched.transfer.send_flow``, so
the socket follows the flow's level; passes job progress on to the agent. Collectives (class
``tp``, the EP all-to-all) go as messages over one persistent connection per peer host, registered
once as a ``tp`` flow, as NCCL keeps its connections for the communicator's lifetime. Level
changes, timings and errors go to ``--out`` as JSON at the end, as the contention benchmark's
workers journal them.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import threading
import time
from typing import Any

from flowsched import client, transfer
from flowsched.testbed.live import MAX_LINE
from flowsched.testbed.timezero import TimeZero
from flowsched.testbed.worker import (
    CHUNK,
    REPORT_EVERY,
    TP_PORT,
    TRANSFER_PORT,
    Clock,
    Journal,
    connect_retry,
    skip_exact,
)

#: a collective message on a channel: flow id and payload size, then the payload
_MESSAGE = struct.Struct("!QQ")


class _Channel:
    """One persistent collective connection to a peer host, marked as its ``tp`` flow."""

    def __init__(self, sock: socket.socket, handle: client.FlowHandle) -> None:
        self.sock, self.handle = sock, handle
        self.lock = threading.Lock()
        transfer.SocketMarker(sock).follow(handle)
        self.payload = memoryview(bytes(CHUNK))

    def send(self, flow_id: int, size: int) -> None:
        with self.lock:
            self.sock.sendall(_MESSAGE.pack(flow_id, size))
            left = size
            while left:
                n = min(left, CHUNK)
                self.sock.sendall(self.payload[:n])
                left -= n

    def close(self) -> None:
        self.handle.close()
        self.sock.close()


class ServingHost:
    """The host's side of the engine's protocol (see :mod:`flowsched.testbed.live`)."""

    def __init__(self, host: str, ips: dict[str, str], journal: Journal) -> None:
        self.host, self.ips, self.journal = host, ips, journal
        #: the run's time zero, from the engine's ``start`` (no flow comes before it)
        self.clock = Clock(TimeZero.after(0.0))
        self._engine: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._channels: dict[str, _Channel] = {}
        self._channels_lock = threading.Lock()
        self._receiver: transfer.Receiver | None = None

    def run(self, engine_path: str, timeout: float) -> None:
        """Serve the engine until it says stop or its socket closes."""
        receiver = transfer.Receiver((self.ips[self.host], TRANSFER_PORT), timeout=timeout)
        receiver.start()
        channels = socket.create_server((self.ips[self.host], TP_PORT))
        threading.Thread(target=self._accept_channels, args=(channels,), daemon=True).start()
        engine = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        engine.settimeout(10)
        engine.connect(engine_path)
        engine.settimeout(None)
        self._engine = engine
        self._report({"t": "hello", "host": self.host})
        self._receiver = receiver
        try:
            with engine.makefile("rb") as lines:
                for raw in iter(lambda: lines.readline(MAX_LINE), b""):
                    if not self._command(json.loads(raw)):
                        break
        finally:
            receiver.stop()
            channels.close()
            for channel in self._channels.values():
                channel.close()
            engine.close()

    def _command(self, message: dict[str, Any]) -> bool:
        kind = message.get("t")
        if kind == "start":
            self.clock = Clock(TimeZero(int(message["t0_ns"]), float(message["t0_wall"])))
            threading.Thread(target=self._drain, args=(self._receiver,), daemon=True).start()
        elif kind == "open" and message.get("cls") == "tp":
            threading.Thread(target=self._send_collective, args=(message,), daemon=True).start()
        elif kind == "open":
            threading.Thread(target=self._send_flow, args=(message,), daemon=True).start()
        elif kind in ("job", "job_done"):
            done = kind == "job_done"
            client.job_progress(str(message["job"]), int(message["step"]), done=done)
        return kind != "stop"

    def _report(self, message: dict[str, Any]) -> None:
        assert self._engine is not None
        with self._send_lock:
            self._engine.sendall(json.dumps(message).encode() + b"\n")

    def _drain(self, receiver: transfer.Receiver) -> None:
        while True:
            stats = receiver.results.get()
            at = (stats.completed * 1e9 - self.clock.t0_ns) / 1e9
            report = {"t": "done", "id": stats.flow_id, "at": at, "ok": stats.ok}
            if not stats.ok:
                report["error"] = f"received {stats.bytes} of {stats.expected} bytes: {stats.error}"
            self._report(report)

    def _send_flow(self, message: dict[str, Any]) -> None:
        flow_id = int(message["id"])
        deadline = message.get("deadline")
        self.journal.add("open", id=flow_id, t=self.clock.now())
        try:
            with client.flow(
                message["cls"],
                bytes=int(message["size"]),
                deadline=None if deadline is None else self.clock.t0_wall + float(deadline),
                consumer_step=message.get("step"),
                request=message.get("request"),
                job=message.get("job"),
                dst_node=message["dst"],
            ) as handle:
                handle.add_listener(lambda h: self._journal_level(flow_id, h))
                self._journal_level(flow_id, handle)
                self.journal.add("admitted", id=flow_id, t=self.clock.now())
                with connect_retry((self.ips[message["dst"]], TRANSFER_PORT), 5.0) as sock:
                    self.journal.add("connected", id=flow_id, t=self.clock.now())
                    transfer.send_flow(
                        sock,
                        int(message["size"]),
                        flow_handle=handle,
                        chunk=CHUNK,
                        flow_id=flow_id,
                        report_every=REPORT_EVERY,
                    )
        except (OSError, transfer.TransferError) as exc:
            # the receiver never reports a flow that did not arrive: report it here
            self.journal.add("error", id=flow_id, error=str(exc))
            self._report(
                {"t": "done", "id": flow_id, "at": self.clock.now(), "ok": False, "error": str(exc)}
            )

    # -- collectives --------------------------------------------------------------------
    def _send_collective(self, message: dict[str, Any]) -> None:
        flow_id, dst = int(message["id"]), str(message["dst"])
        try:
            self._channel(dst).send(flow_id, int(message["size"]))
        except OSError as exc:
            self.journal.add("error", id=flow_id, error=str(exc))
            self._report(
                {"t": "done", "id": flow_id, "at": self.clock.now(), "ok": False, "error": str(exc)}
            )

    def _channel(self, dst: str) -> _Channel:
        with self._channels_lock:
            channel = self._channels.get(dst)
            if channel is None:
                sock = connect_retry((self.ips[dst], TP_PORT), 5.0)
                handle = client.open_flow("tp", dst_node=dst)
                handle.add_listener(lambda h: self._journal_level(-1, h))
                channel = self._channels[dst] = _Channel(sock, handle)
            return channel

    def _accept_channels(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._read_channel, args=(conn,), daemon=True).start()

    def _read_channel(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    flow_id, size = _MESSAGE.unpack(transfer.recv_exact(conn, _MESSAGE.size))
                    skip_exact(conn, size)
                except (OSError, transfer.TransferError):
                    return  # the peer finished (or died: its flows never complete, the run says)
                self._report({"t": "done", "id": flow_id, "at": self.clock.now(), "ok": True})

    def _journal_level(self, flow_id: int, handle: Any) -> None:
        self.journal.add(
            "level",
            id=flow_id,
            level=handle.level,
            decided_ns=handle.decided_ns,
            received_ns=time.monotonic_ns(),
        )


def main(argv: list[str] | None = None) -> int:
    """Entry point (``python -m flowsched.testbed.serving_host ...``), started by the runner."""
    parser = argparse.ArgumentParser(prog="flowsched.testbed.serving_host")
    parser.add_argument("--host", required=True)
    parser.add_argument("--engine", required=True, help="the engine's unix socket")
    parser.add_argument("--ips", required=True, help="JSON host -> data IP")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    journal = Journal()
    host = ServingHost(args.host, json.loads(args.ips), journal)
    try:
        host.run(args.engine, args.timeout)
    finally:
        journal.write(args.out, "serving host", args.host)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
