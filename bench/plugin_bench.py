"""Plugin vs a plain C TCP pair, side by side in one run, over loopback.

    .venv/bin/python bench/plugin_bench.py [--trials 7] [--out results/plugin_bench.json]
    .venv/bin/python bench/plugin_bench.py --sizes 1MiB --no-rtt   # a quick A/B subset
    .venv/bin/python bench/plugin_bench.py --against OLD/libnccl-net-flowsched.so
        # also this build against an earlier commit's, in the same trials (no goal)

Measures, alternating plugin and baseline runs (the order flips every trial) so that both
see the same machine load:
  * streaming throughput for 1 MiB, 4 MiB and 64 MiB messages: the plugin (driven by the C
    harness as NCCL's proxy does: requests in flight, test() polled, sched_yield when idle)
    vs nccl_plugin/bench/plain_tcp.c (one blocking TCP connection between two processes);
    goals >= 0.95x on a quiet machine and >= 0.9x with a CPU hog;
  * 8-byte round-trip latency (ping-pong), goal <= 1.5x;
  * the per-isend cost of the priority check (nccl_plugin/bench/prio_read_bench.c), in ns.
Each measurement runs in two conditions in the same run: ``quiet`` (nothing of ours besides
the pair) and ``hog`` (a busy loop pinned to CPU 0 for the whole condition), so the hog
figures are measured against a baseline that suffers the same hog. Where the scheduler puts the
harness's progress threads, which spin and yield as NCCL's proxy does, moves the hog figures
from run to run; two more conditions, no goals, pin every measured process of both sides:
``hog-apart`` to the CPUs the hog leaves free, ``hog-shared`` to the hog's CPU.
The plugin runs with a real flow table (so every isend reads shared memory), loopback only.
The run holds /tmp/flowsched-measure.lock (flock) so that other measurements on this shared
machine do not overlap it; the load average at the start and end of each condition is in
the report. Reports medians over the trials and their ratios; nothing is hard-coded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from flowsched.shm import layout  # noqa: E402
from flowsched.testbed.measure_lock import LOCK_PATH, measurement_lock  # noqa: E402

BUILD = ROOT / "nccl_plugin" / "build"
SIZES = {"1MiB": (1 << 20, 1500), "4MiB": (4 << 20, 400), "64MiB": (64 << 20, 30)}
RTT_COUNT = 20000
GOALS = {"quiet_min_ratio": 0.95, "hog_min_ratio": 0.9, "rtt_max_ratio": 1.5}
#: every condition: whether it runs the hog, and where the measured processes are pinned
#: ("apart": the CPUs the hog leaves free; "shared": the hog's CPU; None: not pinned)
CONDITIONS = {
    "quiet": (False, None),
    "hog": (True, None),
    "hog-apart": (True, "apart"),
    "hog-shared": (True, "shared"),
}
HOG_CODE = "while True:\n    pass\n"


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


def run_json(cmd: list[str], env: dict[str, str], cpus: set[int] | None = None) -> dict[str, Any]:
    """Run one measurement program (pinned to ``cpus``, with its children and threads, when
    given) and parse its last JSON line."""
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    out = subprocess.run(
        cmd, check=True, capture_output=True, text=True, env=env, timeout=300, preexec_fn=pin
    )
    line = [x for x in out.stdout.splitlines() if x.startswith("{")][-1]
    result: dict[str, Any] = json.loads(line)
    return result


def trial(
    build: Path,
    env: dict[str, str],
    plugin_first: bool,
    sizes: list[str],
    rtt: bool,
    against: Path | None = None,
    cpus: set[int] | None = None,
) -> dict[str, float]:
    """One plugin/baseline round of every measurement (back to back, same load, every program
    pinned to ``cpus`` when given); with ``against``, another build of the plugin driven by the
    same harness joins the round."""
    lib = str(build / "libnccl-net-flowsched.so")
    programs = {"plugin": [str(build / "harness"), lib], "plain": [str(build / "plain_tcp")]}
    order = ["plugin", "plain"] if plugin_first else ["plain", "plugin"]
    if against is not None:
        programs["against"] = [str(build / "harness"), str(against)]
        order.insert(1, "against")
    row: dict[str, float] = {}
    for label in sizes:
        size, count = SIZES[label]
        for who in order:
            row[f"{who}_{label}_MBps"] = run_json(
                [*programs[who], "bw", str(size), str(count)], env, cpus
            )["MBps"]
    for who in order if rtt else []:
        answer = run_json([*programs[who], "rtt", str(RTT_COUNT)], env, cpus)
        row[f"{who}_rtt_us"] = answer["rtt_us"]
    return row


@contextlib.contextmanager
def cpu_hog(cpu: int) -> Iterator[None]:
    """A busy loop pinned to one CPU for the duration of the block."""
    hog = subprocess.Popen([sys.executable, "-c", HOG_CODE])
    try:
        os.sched_setaffinity(hog.pid, {cpu})
        yield
    finally:
        hog.kill()
        hog.wait()


def measure(
    build: Path,
    env: dict[str, str],
    trials: int,
    sizes: list[str],
    rtt: bool,
    against: Path | None = None,
    cpus: set[int] | None = None,
) -> dict[str, Any]:
    """Medians, ratios and load for one condition (``against``: also this build against
    another build of the plugin, as ``against_*`` ratios, which are no goals; ``cpus``: where
    every measured program is pinned)."""
    load_start = os.getloadavg()
    rows = [trial(build, env, i % 2 == 0, sizes, rtt, against, cpus) for i in range(trials)]
    med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    ratios = {
        f"throughput_{label}": med[f"plugin_{label}_MBps"] / med[f"plain_{label}_MBps"]
        for label in sizes
    }
    if rtt:
        ratios["rtt_8B"] = med["plugin_rtt_us"] / med["plain_rtt_us"]
    if against is not None:
        for label in sizes:
            ratios[f"against_throughput_{label}"] = (
                med[f"plugin_{label}_MBps"] / med[f"against_{label}_MBps"]
            )
        if rtt:
            ratios["against_rtt_8B"] = med["plugin_rtt_us"] / med["against_rtt_us"]
    return {
        "trials": rows,
        "median": med,
        "ratios": ratios,
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "cpus": sorted(cpus) if cpus else None,
    }


def pinned_cpus(placement: str | None, hog_cpu: int) -> set[int] | None:
    """The CPUs a condition's programs are pinned to (None: not pinned); ValueError when the
    hog's CPU is not this process's to use, or leaves none free."""
    if placement is None:
        return None
    allowed = os.sched_getaffinity(0)
    if hog_cpu not in allowed:
        raise ValueError(f"--hog-cpu {hog_cpu} is not among this process's CPUs {sorted(allowed)}")
    if placement == "shared":
        return {hog_cpu}
    if placement == "apart":
        if allowed == {hog_cpu}:
            raise ValueError("hog-apart needs a CPU besides the hog's")
        return allowed - {hog_cpu}
    raise ValueError(f"unknown placement {placement!r}")


def goals_met(report: dict[str, Any]) -> dict[str, bool]:
    """Which goal holds in which condition (throughput at every size, round trip)."""
    met: dict[str, bool] = {}
    for cond, part in report["conditions"].items():
        if f"{cond}_min_ratio" not in GOALS:
            continue  # a pinned diagnostic condition: no goal
        floor = GOALS[f"{cond}_min_ratio"]
        for name, ratio in part["ratios"].items():
            if name.startswith("against_"):
                continue  # this build against another: a comparison, not a goal
            if name == "rtt_8B":
                met[f"{cond}_rtt_8B"] = ratio <= GOALS["rtt_max_ratio"]
            else:
                met[f"{cond}_{name}"] = ratio >= floor
    return met


def print_report(report: dict[str, Any]) -> None:
    """The side-by-side table, one block per condition."""
    for cond, part in report["conditions"].items():
        med, ratios = part["median"], part["ratios"]
        start, end = part["load_average_start"][0], part["load_average_end"][0]
        goal = GOALS.get(f"{cond}_min_ratio")
        what = f"goal >= {goal}x" if goal else f"pinned to CPUs {part['cpus']}, no goal"
        print(
            f"== {cond} ({what}; "
            f"load average {start:.2f} -> {end:.2f}; {len(part['trials'])} trials, medians)"
        )
        print(f"{'metric':<22}{'plain':>12}{'plugin':>12}{'ratio':>9}")
        for label in SIZES:
            if f"throughput_{label}" in ratios:
                print(
                    f"{'throughput ' + label + ' MB/s':<22}{med[f'plain_{label}_MBps']:>12.1f}"
                    f"{med[f'plugin_{label}_MBps']:>12.1f}{ratios['throughput_' + label]:>9.3f}"
                )
        if "rtt_8B" in ratios:
            print(
                f"{'8 B round trip us':<22}{med['plain_rtt_us']:>12.2f}"
                f"{med['plugin_rtt_us']:>12.2f}{ratios['rtt_8B']:>9.3f}"
            )
        for name, ratio in ratios.items():
            if name.startswith("against_"):
                print(f"{'this build / --against':<22}{name[len('against_') :]:>24}{ratio:>9.3f}")
    prio = report.get("priority_read")
    if prio is None:
        print("priority check: skipped (--no-rtt run)")
    else:
        print(
            f"priority check per isend: {prio['level_check_ns']:.2f} ns "
            f"(with per-message accounting: {prio['level_check_and_account_ns']:.2f} ns; "
            f"empty loop {prio['empty_loop_ns']:.2f} ns)"
        )
    failed = [name for name, ok in report["goals_met"].items() if not ok]
    print("goals: all met" if not failed else f"goals not met: {', '.join(failed)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument(
        "--conditions",
        default="quiet,hog",
        help=f"comma-separated subset of {','.join(CONDITIONS)} (default: quiet,hog, in the "
        "same run; the pinned ones have no goal)",
    )
    parser.add_argument(
        "--sizes",
        default=",".join(SIZES),
        help=f"comma-separated subset of {','.join(SIZES)} (default: all; for quick A/Bs)",
    )
    parser.add_argument(
        "--no-rtt", action="store_true", help="skip the round trip and priority-check runs"
    )
    parser.add_argument("--hog-cpu", type=int, default=0, help="CPU the hog is pinned to")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    parser.add_argument("--no-build", action="store_true")
    parser.add_argument(
        "--build-dir", type=Path, default=BUILD, help="where the plugin and tools were built"
    )
    parser.add_argument(
        "--against",
        type=Path,
        default=None,
        metavar="LIB",
        help="another build of libnccl-net-flowsched.so (an earlier commit's) to run with the "
        "same harness in every trial: reports this build / that one (no goal)",
    )
    parser.add_argument("--no-lock", action="store_true", help=f"do not take {LOCK_PATH}")
    parser.add_argument("--check", action="store_true", help="exit 1 when a goal is not met")
    args = parser.parse_args(argv)
    conditions = [c for c in args.conditions.split(",") if c]
    if not conditions or any(c not in CONDITIONS for c in conditions):
        parser.error(
            f"--conditions: expected a subset of {','.join(CONDITIONS)}, got {args.conditions!r}"
        )
    if args.trials < 1:
        parser.error("--trials must be at least 1")
    sizes = [s for s in args.sizes.split(",") if s]
    if not sizes or any(s not in SIZES for s in sizes):
        parser.error(f"--sizes: expected a subset of {','.join(SIZES)}, got {args.sizes!r}")
    args.condition_list = conditions
    args.size_list = [s for s in SIZES if s in sizes]
    return args


def main(argv: list[str] | None = None) -> int:
    """Build, measure both conditions under the lock, print and optionally save the report."""
    args = parse_args(argv)
    if not args.no_build:
        subprocess.run(["make", "-s", "-C", str(args.build_dir.parent), "all"], check=True)
    report: dict[str, Any] = {"goals": GOALS, "conditions": {}}
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp, measurement_lock(not args.no_lock):
        table = Path(tmp) / "table"
        make_table(table)
        env = {**os.environ, "FLOWSCHED_SOCKET_IFNAME": "lo", "FLOWSCHED_TABLE": str(table)}
        for cond in args.condition_list:
            with_hog, placement = CONDITIONS[cond]
            cpus = pinned_cpus(placement, args.hog_cpu)
            hog = cpu_hog(args.hog_cpu) if with_hog else contextlib.nullcontext()
            with hog:
                report["conditions"][cond] = measure(
                    args.build_dir, env, args.trials, args.size_list, not args.no_rtt,
                    args.against, cpus,
                )  # fmt: skip
        if not args.no_rtt:
            prio_bench = str(args.build_dir / "prio_read_bench")
            report["priority_read"] = run_json([prio_bench, "50000000"], env)
    report["goals_met"] = goals_met(report)
    print_report(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 1 if args.check and not all(report["goals_met"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
