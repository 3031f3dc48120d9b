"""One side of a two-process plugin transfer, run as a subprocess by the tests.

    python plugin_peer.py recv VERSION SIZES [COMM_ID]   prints the listen handle (hex), then
                                                          receives and verifies every message
    python plugin_peer.py send VERSION SIZES HANDLE [COMM_ID]

SIZES is a comma-separated list; message i carries random.Random(i).randbytes(size). Up to 8
messages are in flight, receive buffers are larger than the sends. Prints "ok N" at the end.
"""

from __future__ import annotations

import random
import sys

from flowsched.nccl import plugin_path
from flowsched.nccl.harness import Buffer, Plugin, Request

IN_FLIGHT = 8
SLACK = 4096


def payload(index: int, size: int) -> bytes:
    return random.Random(index).randbytes(size)


def run(role: str, version: int, sizes: list[int], handle: str | None, comm_id: int) -> int:
    plugin = Plugin(plugin_path(), version)
    ctx = plugin.init(comm_id=comm_id, traffic_class=-1)
    if role == "recv":
        listener = ctx.listen()
        print(listener.handle.hex(), flush=True)
        comm = listener.accept(timeout=60)
    else:
        assert handle is not None
        comm = ctx.connect(bytes.fromhex(handle), timeout=60)
    pending: list[tuple[int, Buffer, Request]] = []
    for index, size in enumerate(sizes):
        buffer = comm.register(size + SLACK)
        if role == "send":
            buffer.write(payload(index, size))
            pending.append((index, buffer, comm.post(buffer, size, tag=3)))  # type: ignore[union-attr]
        else:
            pending.append((index, buffer, comm.post(buffer, size + SLACK, tag=3)))  # type: ignore[union-attr]
        while len(pending) >= IN_FLIGHT or (index == len(sizes) - 1 and pending):
            finish(role, sizes, *pending.pop(0))
    comm.close()
    ctx.finalize()
    plugin.close()
    print(f"ok {len(sizes)}", flush=True)
    return 0


def finish(role: str, sizes: list[int], index: int, buffer: Buffer, request: Request) -> None:
    got = request.wait(timeout=60)
    if got != sizes[index]:
        raise SystemExit(f"message {index}: size {got}, expected {sizes[index]}")
    if role == "recv" and buffer.read(got) != payload(index, got):
        raise SystemExit(f"message {index}: payload differs")
    buffer.release()


if __name__ == "__main__":
    role, version, sizes_text = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    sizes = [int(s) for s in sizes_text.split(",")]
    handle = sys.argv[4] if role == "send" else None
    rest = sys.argv[5:] if role == "send" else sys.argv[4:]
    sys.exit(run(role, version, sizes, handle, int(rest[0]) if rest else 0))
