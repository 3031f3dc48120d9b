"""Plugin vs a plain C TCP pair, side by side in one run, over loopback.

    .venv/bin/python bench/plugin_bench.py [--trials 5] [--out results/plugin_bench.json]

Measures, alternating plugin and baseline runs so that both see the same machine load:
  * streaming throughput for 1 MiB, 4 MiB and 64 MiB messages: the plugin (driven by the C
    harness as NCCL's proxy does, 8 requests in flight) vs bench/plain_tcp.c (one blocking
    TCP connection); goal >= 0.9x;
  * 8-byte round-trip latency (ping-pong), goal <= 1.5x;
  * the per-isend cost of the priority check: relaxed loads of the slot's level and of the
    table's config_seq from a mapped table plus the compares
    (nccl_plugin/bench/prio_read_bench.c), in ns.
The plugin runs with a real flow table (so every isend reads shared memory), loopback only.
Reports medians over the trials and the ratios; nothing is hard-coded.

The plugin is polled the way NCCL's progress thread polls it (test() in a loop, yielding when
idle) while the baseline blocks in the kernel; on a shared, oversubscribed machine the
polling side loses the CPU to other processes. ``--sched fifo`` runs BOTH sides under the same
SCHED_FIFO priority (root only) to take other tenants out of the comparison; the default
``both`` reports the normal and the fifo measurements next to each other.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from flowsched.shm import layout  # noqa: E402

BUILD = ROOT / "nccl_plugin" / "build"
SIZES = {"1MiB": (1 << 20, 1500), "4MiB": (4 << 20, 400), "64MiB": (64 << 20, 30)}
RTT_COUNT = 20000
GOALS = {"throughput_min_ratio": 0.9, "rtt_max_ratio": 1.5}


def make_table(path: Path) -> None:
    """A minimal agent-initialised table (header only, every slot FREE)."""
    num_slots = 64
    mem = bytearray(layout.table_size(num_slots))
    fields = {name: (off, fmt) for name, off, fmt in layout.HEADER_FIELDS}
    for name, value in (
        ("magic", layout.MAGIC),
        ("version", layout.VERSION),
        ("header_size", layout.HEADER_SIZE),
        ("slot_size", layout.SLOT_SIZE),
        ("num_slots", num_slots),
        ("num_levels", 8),
    ):
        off, fmt = fields[name]
        struct.pack_into(fmt, mem, off, value)
    off, fmt = fields["level_marking"]
    marks = [v for i in range(layout.MAX_LEVELS) for v in (46 if i == 0 else 8, 6 if i == 0 else 1)]
    struct.pack_into(fmt, mem, off, *marks)
    path.write_bytes(bytes(mem))


def run_json(cmd: list[str], env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, timeout=300)
    line = [x for x in out.stdout.splitlines() if x.startswith("{")][-1]
    result: dict[str, Any] = json.loads(line)
    return result


def trial(env: dict[str, str], prefix: list[str]) -> dict[str, float]:
    """One plugin/baseline round of every measurement (alternating, same load)."""
    lib = str(BUILD / "libnccl-net-flowsched.so")
    harness = [*prefix, str(BUILD / "harness"), lib]
    plain = [*prefix, str(BUILD / "plain_tcp")]
    row: dict[str, float] = {}
    for label, (size, count) in SIZES.items():
        bw = ["bw", str(size), str(count)]
        row[f"plain_{label}_MBps"] = run_json([*plain, *bw], env)["MBps"]
        row[f"plugin_{label}_MBps"] = run_json([*harness, *bw], env)["MBps"]
    row["plain_rtt_us"] = run_json([*plain, "rtt", str(RTT_COUNT)], env)["rtt_us"]
    row["plugin_rtt_us"] = run_json([*harness, "rtt", str(RTT_COUNT)], env)["rtt_us"]
    return row


def summarize(rows: list[dict[str, float]]) -> dict[str, Any]:
    med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    ratios = {
        f"throughput_{label}": med[f"plugin_{label}_MBps"] / med[f"plain_{label}_MBps"]
        for label in SIZES
    }
    ratios["rtt_8B"] = med["plugin_rtt_us"] / med["plain_rtt_us"]
    return {
        "trials": rows,
        "median": med,
        "ratios": ratios,
        "load_average": os.getloadavg(),
    }


def print_report(report: dict[str, Any]) -> None:
    for sched, part in report["schedulers"].items():
        med, ratios = part["median"], part["ratios"]
        print(f"== scheduling: {sched} (load average {part['load_average'][0]:.1f})")
        print(f"{'metric':<22}{'plain':>12}{'plugin':>12}{'ratio':>9}")
        for label in SIZES:
            print(
                f"{'throughput ' + label + ' MB/s':<22}{med[f'plain_{label}_MBps']:>12.1f}"
                f"{med[f'plugin_{label}_MBps']:>12.1f}{ratios['throughput_' + label]:>9.2f}"
            )
        print(
            f"{'8 B round trip us':<22}{med['plain_rtt_us']:>12.2f}"
            f"{med['plugin_rtt_us']:>12.2f}{ratios['rtt_8B']:>9.2f}"
        )
    prio = report["priority_read"]
    print(
        f"priority check per isend: {prio['level_check_ns']:.2f} ns "
        f"(with per-message accounting: {prio['level_check_and_account_ns']:.2f} ns; "
        f"empty loop {prio['empty_loop_ns']:.2f} ns)"
    )
    print(
        f"goals: throughput ratio >= {GOALS['throughput_min_ratio']}, "
        f"round-trip ratio <= {GOALS['rtt_max_ratio']}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--sched", choices=("normal", "fifo", "both"), default="both")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    parser.add_argument("--no-build", action="store_true")
    args = parser.parse_args()
    if not args.no_build:
        subprocess.run(["make", "-s", "-C", str(ROOT / "nccl_plugin"), "all"], check=True)
    modes = ["normal", "fifo"] if args.sched == "both" else [args.sched]
    if os.geteuid() != 0 and "fifo" in modes:
        print("not root: skipping the SCHED_FIFO measurement", file=sys.stderr)
        modes.remove("fifo")
    report: dict[str, Any] = {"goals": GOALS, "schedulers": {}}
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        table = Path(tmp) / "table"
        make_table(table)
        env = {**os.environ, "FLOWSCHED_SOCKET_IFNAME": "lo", "FLOWSCHED_TABLE": str(table)}
        for mode in modes:
            prefix = ["chrt", "-f", "20"] if mode == "fifo" else []
            rows = [trial(env, prefix) for _ in range(args.trials)]
            report["schedulers"][mode] = summarize(rows)
        report["priority_read"] = run_json([str(BUILD / "prio_read_bench"), "50000000"], env)
    print_report(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
