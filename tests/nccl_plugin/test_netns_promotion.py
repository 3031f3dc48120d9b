"""Priority on the wire, end to end, through a real htb bottleneck between two namespaces.

Topology: namespace fsC-tx... --veth--> fsC-rx...; htb on the sender's egress with a 200 Mbit/s
parent and three strict-priority children selected by u32 filters on the TOS byte:
  1:10 prio 0 (DSCP 46, level 0)   1:20 prio 3 (DSCP 34, a competing plain TCP flow)
  1:30 prio 7 (DSCP 1, level 7, and the default)
A plugin connection of class bulk starts at level 7 and is starved by the competitor; the test
writes level 0 into its slot (as the agent would), checks that the kernel's class counters
move from 1:30 to 1:10 (the DSCP on the wire changed), and measures the time from the level
write until the promoted flow carries >= 90% of the bottleneck's bytes.
The bytes are counted as they leave the bottleneck, at the kernel's timestamps (an AF_PACKET
capture on the sender's device): when the receiving processes get a core, which on shared
cores may be tens of milliseconds late, is no part of what is measured. Every promotion must
take the bottleneck within PROMOTED_S, and the fastest within 100 ms: on cores shared with
other work the sender's own waits for a core add to some tries (single tries of 110-260 ms
and a median of 150 ms were seen with two busy loops beside it), never take any away, so the
best try is what the mechanism needs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from plugin_table import TestTable

from flowsched.shm import layout
from flowsched.testbed.daemons import wait_for
from flowsched.testbed.netns import veth_pair

pytestmark = [pytest.mark.netns, pytest.mark.slow]

TRAFFIC = Path(__file__).with_name("netns_traffic.py")
RATE_MBIT = 200
SHARE = 0.9
WINDOW_MS = 20
TRIES = 4
STARVE_S = 1.0
PROMOTED_S = 0.8
SETTLE_S = 0.2
TX_ADDR, RX_ADDR = "10.231.7.1", "10.231.7.2"


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    return None


class Bed:
    """Two namespaces joined by a veth pair, htb on the sender's side."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.tx, self.rx = f"fsC-tx{tag}", f"fsC-rx{tag}"
        self.dev_tx, self.dev_rx = f"fsC-a{tag}", f"fsC-b{tag}"

    def up(self) -> None:
        veth_pair((self.tx, self.dev_tx, TX_ADDR), (self.rx, self.dev_rx, RX_ADDR))
        # Small GSO packets bound what a starved socket keeps queued in its old class.
        _run("ip", "-n", self.tx, "link", "set", "dev", self.dev_tx, "gso_max_size", "16384")
        self._htb()

    def _htb(self) -> None:
        tc = ("tc", "-n", self.tx)
        dev = ("dev", self.dev_tx)
        _run(*tc, "qdisc", "add", *dev, "root", "handle", "1:", "htb", "default", "30")
        _run(
            *tc,
            "class",
            "add",
            *dev,
            "parent",
            "1:",
            "classid",
            "1:1",
            "htb",
            "rate",
            f"{RATE_MBIT}mbit",
            "ceil",
            f"{RATE_MBIT}mbit",
        )
        for classid, rate, prio in (("1:10", 5, 0), ("1:20", 5, 3), ("1:30", 20, 7)):
            _run(
                *tc,
                "class",
                "add",
                *dev,
                "parent",
                "1:1",
                "classid",
                classid,
                "htb",
                "rate",
                f"{rate}mbit",
                "ceil",
                f"{RATE_MBIT}mbit",
                "prio",
                str(prio),
            )
        for tos, classid in ((46 << 2, "1:10"), (34 << 2, "1:20"), (1 << 2, "1:30")):
            _run(
                *tc,
                "filter",
                "add",
                *dev,
                "parent",
                "1:",
                "protocol",
                "ip",
                "prio",
                "1",
                "u32",
                "match",
                "ip",
                "tos",
                hex(tos),
                "0xfc",
                "flowid",
                classid,
            )

    def class_bytes(self) -> dict[str, int]:
        out = _run("tc", "-n", self.tx, "-s", "class", "show", "dev", self.dev_tx)
        found = re.findall(r"class htb (1:\d+) .*?Sent (\d+) bytes", out, re.S)
        return {classid: int(sent) for classid, sent in found}

    def down(self) -> None:
        for ns in (self.tx, self.rx):
            subprocess.run(["ip", "netns", "pids", ns], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def spawn(
        self, ns: str, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        full_env = {**os.environ, **(env or {})}
        return subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, str(TRAFFIC), *args],
            stdout=subprocess.PIPE,
            text=True,
            env=full_env,
        )


@pytest.fixture
def bed() -> Iterator[Bed]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    b = Bed()
    try:
        b.up()
    except subprocess.CalledProcessError as exc:
        b.down()
        pytest.skip(f"cannot build the namespace testbed: {exc.stderr.strip()}")
    try:
        yield b
    finally:
        b.down()


def _last_json(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=60)
    last = [line for line in out.splitlines() if line.startswith("{")][-1]
    result: dict[str, Any] = json.loads(last)
    return result


def _bins(record: dict[str, Any], key: str = "bins") -> dict[int, int]:
    return {int(k): v for k, v in record[key].items()}


def time_to_share(flow: dict[int, int], other: dict[int, int], start_ms: float) -> float | None:
    """Milliseconds from start_ms until the flow carries >= SHARE of the bytes in a window."""
    first = int(start_ms)
    for end in range(first + 1, first + int(PROMOTED_S * 1000)):
        lo = max(end - WINDOW_MS, first)
        mine = sum(flow.get(t, 0) for t in range(lo, end))
        total = mine + sum(other.get(t, 0) for t in range(lo, end))
        if end - lo >= WINDOW_MS // 2 and total > 0 and mine >= SHARE * total:
            return end - start_ms
    return None


def run_promotions(bed: Bed, table: TestTable, slot: int) -> tuple[list[float], list[Any]]:
    """Demote, starve, promote, TRIES times; returns promotion times and the class counters
    of each settled window (starting SETTLE_S after a level write)."""
    promote_ms: list[float] = []
    windows = []
    for _ in range(TRIES):
        table.set_level(slot, 7)
        time.sleep(SETTLE_S)
        starved_start = bed.class_bytes()
        time.sleep(STARVE_S - SETTLE_S)
        starved_end = bed.class_bytes()
        promote_ms.append(table.set_level(slot, 0) / 1e6)
        time.sleep(SETTLE_S)
        promoted_start = bed.class_bytes()
        time.sleep(PROMOTED_S - SETTLE_S)
        windows.append((starved_start, starved_end, promoted_start, bed.class_bytes()))
    return promote_ms, windows


def test_promotion_changes_dscp_and_takes_the_bottleneck(
    bed: Bed, tmp_path: Path, plugin_lib: Path
) -> None:
    table_path = Path("/dev/shm") / f"fsC-table-{os.getpid()}"
    table = TestTable(table_path)
    duration = 3 + TRIES * (STARVE_S + PROMOTED_S)
    env = {
        "FLOWSCHED_TABLE": str(table_path),
        "FLOWSCHED_CLASS": "bulk",
        "FLOWSCHED_PLUGIN": str(plugin_lib),
    }
    procs: list[subprocess.Popen[str]] = []
    try:
        wire = bed.spawn(bed.tx, "wire", bed.dev_tx, "5201", str(duration + 2))
        procs.append(wire)
        assert wire.stdout is not None and wire.stdout.readline().strip() == "ready"
        sink = bed.spawn(bed.rx, "sink", "5201", str(duration + 2))
        procs.append(sink)
        assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"
        procs.append(bed.spawn(bed.tx, "blast", RX_ADDR, "5201", hex(34 << 2), str(duration + 2)))
        recv = bed.spawn(
            bed.rx, "plugin-recv", str(duration), env={**env, "FLOWSCHED_SOCKET_IFNAME": bed.dev_rx}
        )
        procs.append(recv)
        assert recv.stdout is not None
        handle = recv.stdout.readline().strip()
        procs.append(
            bed.spawn(
                bed.tx,
                "plugin-send",
                handle,
                str(duration + 2),
                env={**env, "FLOWSCHED_SOCKET_IFNAME": bed.dev_tx},
            )
        )

        def send_slots() -> list[int]:
            active = table.slots(layout.SLOT_ACTIVE)
            return [i for i, slot in active if slot["direction"] == layout.DIR_SEND]

        wait_for(send_slots, 10, "the plugin's send connection in the table")
        sends = send_slots()
        assert len(sends) == 1, table.slots()
        promote_ms, windows = run_promotions(bed, table, sends[0])
        for receiver in (recv, sink):
            assert _bins(_last_json(receiver)), "a receiver got nothing"
        on_wire = _last_json(wire)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        table.close()
        table_path.unlink(missing_ok=True)
    check_dscp_on_wire(windows)
    assert on_wire["drops"] == 0, f"the capture lost {on_wire['drops']} packets"
    flow, other = _bins(on_wire), _bins(on_wire, "other")
    latencies = [time_to_share(flow, other, t) for t in promote_ms]
    done = [lat for lat in latencies if lat is not None]
    report = {
        "latencies_ms": latencies,
        "median_ms": statistics.median(done) if done else None,
        "window_ms": WINDOW_MS,
        "share": SHARE,
    }
    (tmp_path / "promotion.json").write_text(json.dumps(report))
    print("promotion latency (ms):", latencies)
    assert len(done) == len(latencies), report
    assert min(done) <= 100, report


def check_dscp_on_wire(windows: list[Any]) -> None:
    """While promoted the kernel classifies our bytes as DSCP 46 (1:10); while starved as
    DSCP 1 (1:30), and nothing of ours reaches 1:10."""
    for starved_start, starved_end, promoted_start, promoted_end in windows:
        starved = {k: starved_end[k] - starved_start[k] for k in starved_start}
        promoted = {k: promoted_end[k] - promoted_start[k] for k in promoted_start}
        assert starved["1:30"] > 0 and starved["1:10"] == 0, starved
        assert promoted["1:10"] > 10 * promoted["1:30"], promoted
