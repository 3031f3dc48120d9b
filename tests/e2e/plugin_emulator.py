"""TEST SUPPORT: a process that behaves like the NCCL plugin's send path, in Python.

It claims a slot of the node's flow table, then sends ``--messages`` messages of
``--message-size`` bytes over one TCP connection (flowsched.transfer's framing, verified by
the receiver), pausing ``--gap`` seconds between messages. Before each message it reads the
slot's level (falling back to the class default, as the plugin does) and, when it changed,
re-marks the socket (IP_TOS, then SO_PRIORITY). It writes what it saw as JSON to ``--out``.

Run as a script: ``python plugin_emulator.py --table T --to HOST:PORT --class-id 2 ...``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import socket
import time

from flowsched import transfer
from flowsched.shm.table import EmulatedPluginSlot, FlowTable


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--table", required=True)
    parser.add_argument("--to", required=True)
    parser.add_argument("--class-id", type=int, default=0)
    parser.add_argument("--peer", type=int, default=-1)
    parser.add_argument("--messages", type=int, default=100)
    parser.add_argument("--message-size", type=int, default=256 * 1024)
    parser.add_argument("--gap", type=float, default=0.02)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    host, _, port = args.to.rpartition(":")
    table = FlowTable.open(args.table, writable=True)
    slot = EmulatedPluginSlot(table, class_id=args.class_id, peer_rank=args.peer)
    sock = socket.create_connection((host, int(port)), timeout=30)
    marker = transfer.SocketMarker(sock)
    size = args.messages * args.message_size
    sock.sendall(transfer.HEADER.pack(transfer.MAGIC, 0, size, slot.index))
    digest, levels, current = hashlib.sha256(), [], None
    last, max_gap = time.monotonic(), 0.0
    payload = b"".join(transfer.pattern(size, seed=slot.index))
    for i in range(args.messages):
        level = slot.send(args.message_size)
        if level != current:
            current = level
            mark = table.read_config().marking(level)
            marker.apply(level, mark.dscp, mark.so_priority)
            levels.append([time.time(), level, slot.raw_level()])
        chunk = payload[i * args.message_size : (i + 1) * args.message_size]
        digest.update(chunk)
        sock.sendall(chunk)
        now = time.monotonic()
        max_gap, last = max(max_gap, now - last), now
        time.sleep(args.gap)
    sock.sendall(digest.digest())
    ack = sock.recv(1)
    slot.close()
    with open(args.out, "w") as fh:
        json.dump(
            {
                "ok": ack == b"\x01",
                "levels": levels,
                "bytes": size,
                "slot": [slot.index, slot.claim_seq],
                "digest": digest.hexdigest(),
                "max_gap": max_gap - args.gap,
            },
            fh,
        )


if __name__ == "__main__":
    main()
