"""TEST SUPPORT: one side of a paced transfer through the real flowsched NCCL plugin.

    python real_plugin_peer.py recv COUNT SIZE          prints the listen handle (hex), then
                                                        receives COUNT messages and checks them
    python real_plugin_peer.py send COUNT SIZE HANDLE GAP

Message i is random.Random(1000 + i).randbytes(SIZE); the sender sleeps GAP seconds after each
completed message, so that the transfer lasts long enough to kill things under it. The plugin
finds the flow table through FLOWSCHED_TABLE. Prints "ok COUNT" at the end.
"""

from __future__ import annotations

import random
import sys
import time

from flowsched.nccl import plugin_path
from flowsched.nccl.harness import Plugin

SLACK = 4096


def message(index: int, size: int) -> bytes:
    return random.Random(1000 + index).randbytes(size)


def main() -> int:
    role, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    plugin = Plugin(plugin_path(), 11)
    ctx = plugin.init(comm_id=0xF5F5, traffic_class=-1)
    if role == "recv":
        listener = ctx.listen()
        print(listener.handle.hex(), flush=True)
        comm = listener.accept(timeout=60)
        for index in range(count):
            if comm.recv_message(size + SLACK, timeout=60) != message(index, size):
                raise SystemExit(f"message {index} differs")
    else:
        comm = ctx.connect(bytes.fromhex(sys.argv[4]), timeout=60)
        gap = float(sys.argv[5])
        for index in range(count):
            comm.send_message(message(index, size), timeout=60)
            time.sleep(gap)
    comm.close()
    ctx.finalize()
    plugin.close()
    print(f"ok {count}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
