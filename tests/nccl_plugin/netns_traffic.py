"""Traffic endpoints for the network-namespace promotion test (run with `ip netns exec`).

    netns_traffic.py sink PORT SECONDS            plain TCP receiver
    netns_traffic.py blast HOST PORT TOS SECONDS  plain TCP sender marking its packets with TOS
    netns_traffic.py plugin-recv SECONDS          flowsched plugin receiver (prints its handle)
    netns_traffic.py plugin-send HANDLE SECONDS   flowsched plugin sender, 64 KiB messages
    netns_traffic.py wire DEV PORT SECONDS        the bytes leaving DEV (after its qdisc)

Receivers print one JSON object at the end: {"bins": {ms: bytes}} where ms is
CLOCK_MONOTONIC in milliseconds (the same clock in every namespace). ``wire`` prints
{"bins": ..., "other": ..., "drops": n}: the TCP bytes to any port but PORT, and to PORT, per
millisecond of the kernel's timestamp as they left DEV's qdisc, so that how the link was
shared does not depend on when the receivers were scheduled; drops: packets the capture lost.
"""

from __future__ import annotations

import collections
import contextlib
import json
import selectors
import socket
import struct
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


SO_TIMESTAMPNS = 35
SO_RCVBUFFORCE = 33
SOL_PACKET = 263
PACKET_STATISTICS = 6


def _stamp_ns(ancillary: list[tuple[int, int, bytes]], offset: int) -> int | None:
    """The kernel's timestamp of a captured packet (CLOCK_REALTIME), as CLOCK_MONOTONIC."""
    for level, kind, data in ancillary:
        if (level, kind) == (socket.SOL_SOCKET, SO_TIMESTAMPNS) and len(data) >= 16:
            sec, nsec = struct.unpack_from("qq", data)
            return int(sec * 1_000_000_000 + nsec - offset)
    return None


def wire(dev: str, port: int, seconds: float) -> None:
    from flowsched.testbed.sniff import SNAPLEN, open_port, parse

    sock = open_port(dev, 1)  # outgoing IPv4 TCP, every packet, headers only
    # Each captured packet holds its whole buffer's size against the limit (a GSO packet, up
    # to 64 KiB): seconds of traffic, not milliseconds, while this process waits for a core.
    sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 256 << 20)
    offset = time.time_ns() - time.monotonic_ns()
    mine: dict[int, int] = collections.Counter()
    other: dict[int, int] = collections.Counter()
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    print("ready", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not sel.select(0.2):
            continue
        while True:
            try:
                frame, ancillary, _, _ = sock.recvmsg(SNAPLEN, 64)
            except BlockingIOError:
                break
            fields, stamp = parse(frame), _stamp_ns(ancillary, offset)
            if fields is not None and stamp is not None:
                bins = other if fields[3] == port else mine
                bins[stamp // 1_000_000] += struct.unpack_from("!H", frame, 16)[0]  # IP length
    drops = struct.unpack("II", sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))[1]
    print(json.dumps({"bins": mine, "other": other, "drops": drops}), flush=True)


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
    elif mode == "wire":
        wire(args[0], int(args[1]), float(args[2]))
    else:
        raise SystemExit(f"unknown mode {mode}")
