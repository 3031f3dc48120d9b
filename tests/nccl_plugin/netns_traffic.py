"""Traffic endpoints for the network-namespace promotion test (run with `ip netns exec`).

    netns_traffic.py sink PORT SECONDS            plain TCP receiver
    netns_traffic.py blast HOST PORT TOS SECONDS  plain TCP sender marking its packets with TOS
    netns_traffic.py plugin-recv SECONDS          flowsched plugin receiver (prints its handle)
    netns_traffic.py plugin-send HANDLE SECONDS   flowsched plugin sender, 64 KiB messages

Receivers print one JSON object at the end: {"bins": {ms: bytes}} where ms is
CLOCK_MONOTONIC in milliseconds (the same clock in every namespace).
"""

from __future__ import annotations

import collections
import contextlib
import json
import socket
import sys
import time

MESSAGE = 64 * 1024
IN_FLIGHT = 8


def emit(bins: dict[int, int]) -> None:
    print(json.dumps({"bins": bins}), flush=True)


def sink(port: int, seconds: float) -> None:
    server = socket.create_server(("0.0.0.0", port))
    print("ready", flush=True)
    conn, _ = server.accept()
    conn.settimeout(1.0)
    bins: dict[int, int] = collections.Counter()
    end = time.monotonic() + seconds
    buf = bytearray(1 << 16)
    while time.monotonic() < end:
        try:
            n = conn.recv_into(buf)
        except TimeoutError:
            continue
        if n == 0:
            break
        bins[time.monotonic_ns() // 1_000_000] += n
    emit(bins)


def blast(host: str, port: int, tos: int, seconds: float) -> None:
    sock = socket.create_connection((host, port), timeout=10)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
    data = b"\0" * (1 << 16)
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            sock.sendall(data)
    except OSError:
        pass


def plugin_recv(seconds: float) -> None:
    from flowsched.nccl import plugin_path
    from flowsched.nccl.harness import Plugin, stream

    plugin = Plugin(plugin_path(), 11)
    ctx = plugin.init(comm_id=0x5EED)
    listener = ctx.listen()
    print(listener.handle.hex(), flush=True)
    comm = listener.accept(timeout=30)
    bins: dict[int, int] = collections.Counter()

    def record(size: int) -> None:
        bins[time.monotonic_ns() // 1_000_000] += size

    end = time.monotonic() + seconds
    stream(
        comm, MESSAGE, in_flight=IN_FLIGHT, until=lambda: time.monotonic() > end, on_complete=record
    )
    emit(bins)
    comm.close()  # stops the plugin's threads before the posted buffers are freed
    ctx.finalize()


def plugin_send(handle: str, seconds: float) -> None:
    from flowsched.nccl import plugin_path
    from flowsched.nccl.harness import Plugin, PluginError, stream

    plugin = Plugin(plugin_path(), 11)
    ctx = plugin.init(comm_id=0x5EED)
    comm = ctx.connect(bytes.fromhex(handle), timeout=30)
    end = time.monotonic() + seconds
    with contextlib.suppress(PluginError):  # the receiver finishes first
        stream(comm, MESSAGE, in_flight=IN_FLIGHT, until=lambda: time.monotonic() > end)
    comm.close()
    ctx.finalize()


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "sink":
        sink(int(args[0]), float(args[1]))
    elif mode == "blast":
        blast(args[0], int(args[1]), int(args[2], 0), float(args[3]))
    elif mode == "plugin-recv":
        plugin_recv(float(args[0]))
    elif mode == "plugin-send":
        plugin_send(args[0], float(args[1]))
    else:
        raise SystemExit(f"unknown mode {mode}")
