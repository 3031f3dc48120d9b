#!/usr/bin/env python3
"""Coordinator saturation against an older commit, side by side: each commit's coordinator under
that commit's own ``bench/coordinator_load.py``, throughput phase only.

Issue #9 asked for saturation "no lower than today's", today being the commit it was filed on
(4d0525d, the default ``--old``). That commit's benchmark has no way to skip its latency phases,
so its ``run_mode(batched=True)`` is called with its ``main()``'s defaults and no rates; the
current one runs through its ``main()`` with ``--phases throughput --modes batched --promotion
timers`` (the shipped configuration), compiled and interpreted. Both count the same thing: the
coordinator's own open + progress + close counters between the two scrapes around the phase,
per wall second, and the coordinator process's CPU time in that window (/proc). This script
records the window from the outside (it wraps each benchmark's ``scrape`` and ``saturate``
without changing them), so every figure of the table is computed by one piece of code.

Order: old | new compiled, new interpreted | new interpreted, new compiled | old, every run with
a fresh coordinator and load generator. The old commit is checked out in a temporary git
worktree, removed at the end. Each run's coordinator must import its own checkout (checked:
its cwd, PYTHONPATH and mapped extension modules are printed), and the load generator too
(``bench/`` comes first on a script's path, so the checkout is put on PYTHONPATH).

What differs between the two benchmarks and is part of what they measure: the old agents send
protocol-1 maps, the current ones protocol 5 with a MAC on every frame (``--form maps`` makes
them send the old frames); the old load generator is 1,000 ``drain()`` tasks, the current one a
single writer (the ``share`` column shows that the coordinator used its whole core either way).

Usage (under the measurement lock, on a quiet machine; about 8 minutes):
    .venv/bin/python bench/coordinator_vs_commit.py [--old 4d0525d] [--duration 60]
        [--agents 1000] [--form sealed|packed|maps] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
#: a run's start-up (coordinator, 1,000 handshakes) and shutdown beyond its phase, at most
RUN_SLACK_S = 75
ORDER = (("old", "interpreted"), ("new", "compiled"), ("new", "interpreted"))
ORDER += tuple(reversed(ORDER))


# -- one run, in a child process whose flowsched is the checkout's ---------------------------


def load_benchmark(repo: Path) -> ModuleType:
    path = repo / "bench" / "coordinator_load.py"
    spec = importlib.util.spec_from_file_location("coordinator_load", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def coordinator_identity(pid: int) -> dict[str, Any]:
    """Where the coordinator runs from, what it was told to import, and which compiled
    (mypyc) modules it has mapped."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    pythonpath = next((e[11:].decode() for e in environ if e.startswith(b"PYTHONPATH=")), "")
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    mapped = sorted(
        {
            line.split()[-1]
            for line in maps
            if "mypyc" in line or ("/flowsched/" in line and line.endswith(".so"))
        }
    )
    return {"cwd": os.readlink(f"/proc/{pid}/cwd"), "pythonpath": pythonpath, "mapped": mapped}


def identify_coordinator(address: str, pid: int) -> tuple[dict[str, Any], str]:
    """The coordinator's identity (above) and its ``flowsched_build_info`` series."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=60) as response:
        found = re.search(r"flowsched_build_info\{[^}]*\}", response.read().decode())
    return coordinator_identity(pid), found[0] if found else "(no flowsched_build_info metric)"


class WindowRecorder:
    """The benchmark's scrapes right before and right after its ``saturate()``: wraps the two
    module-level functions without changing what they do."""

    def __init__(self, bench: ModuleType, identify: Any = identify_coordinator) -> None:
        self.identity: dict[str, Any] | None = None
        self.build_info = ""
        self.last: Any = None
        self.before: Any = None
        self.after: Any = None
        self.in_phase = False
        self.generator_cpu_s = 0.0
        scrape, saturate = bench.scrape, bench.saturate

        def recording_scrape(address: str, pid: int) -> Any:
            result = scrape(address, pid)
            if self.identity is None:
                self.identity, self.build_info = identify(address, pid)
            if self.before is not None and self.after is None and not self.in_phase:
                self.after = result
            self.last = result
            return result

        async def recording_saturate(*args: Any) -> None:
            self.before, self.in_phase = self.last, True
            started = os.times()
            try:
                await saturate(*args)
            finally:
                self.in_phase = False
                ended = os.times()
                self.generator_cpu_s = ended.user + ended.system - started.user - started.system

        bench.scrape, bench.saturate = recording_scrape, recording_saturate


async def _skip_drain(*_args: Any, **_kwargs: Any) -> None:
    """The wait for the coordinator to drain its backlog comes after the window: no figure."""


def run_old(bench: ModuleType, args: argparse.Namespace) -> None:
    """The old commit's ``run_mode(batched=True)`` with its ``main()``'s defaults, no rates."""
    options = argparse.Namespace(
        agents=args.agents,
        flows=10,
        duration=args.duration,
        rates=[],
        policy=None,
        per_flow_policy="yes",
        coordinator_cpu=0,
        loadgen_cpu=1,
        profile=False,
        json=None,
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setaffinity(0, {options.loadgen_cpu})
    import uvloop

    with (
        tempfile.TemporaryDirectory(prefix="flowsched-vs-") as tmp,
        asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner,
    ):
        runner.run(bench.run_mode(options, True, Path(tmp)))


def run_new(bench: ModuleType, args: argparse.Namespace) -> None:
    """The current benchmark's ``main()``: throughput phase, shipped configuration."""
    sys.argv = [
        "coordinator_load.py",
        "--phases",
        "throughput",
        "--modes",
        "batched",
        "--promotion",
        "timers",
        "--build",
        args.build,
        "--progress-form",
        args.form,
        "--duration",
        str(args.duration),
        "--agents",
        str(args.agents),
    ]
    if bench.main() != 0:
        raise SystemExit("the current benchmark failed")


def one_run(args: argparse.Namespace) -> int:
    """``--one-run``: run one benchmark from the working directory's checkout, write its row."""
    repo = Path.cwd().resolve()
    bench = load_benchmark(repo)
    import flowsched

    imports = str(Path(flowsched.__file__).resolve())
    if not imports.startswith(f"{repo}/"):
        raise SystemExit(f"the load generator imports {imports}, not {repo}'s flowsched")
    bench.wait_for_events = _skip_drain
    recorder = WindowRecorder(bench)
    (run_old if args.one_run == "old" else run_new)(bench, args)
    before, after = recorder.before, recorder.after
    if before is None or after is None:
        raise SystemExit("the throughput window's scrapes were not seen")
    wall = after.when - before.when
    row = {
        "wall_s": wall,
        "events": after.events - before.events,
        "coordinator_cpu_s": after.cpu_seconds - before.cpu_seconds,
        "generator_cpu_s": recorder.generator_cpu_s,
        "coordinator": recorder.identity,
        "build_info": recorder.build_info,
        "generator_imports": imports,
    }
    args.json.write_text(json.dumps(row))
    return 0


# -- the side-by-side ------------------------------------------------------------------------


def run_in(
    checkout: Path, code: str, build: str, args: argparse.Namespace, out: Path
) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--one-run", code, "--build", build]
    command += ["--form", args.form, "--duration", str(args.duration), "--agents", str(args.agents)]
    env = dict(os.environ, PYTHONPATH=str(checkout))
    # a session of its own: a run past its time is killed with its coordinator, which would
    # otherwise stay pinned to its core, spinning, under the next runs
    child = subprocess.Popen(
        [*command, "--json", str(out)],
        cwd=checkout,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = child.communicate(timeout=args.duration + RUN_SLACK_S)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        output, _ = child.communicate()
        raise SystemExit(f"the {code} {build} run took too long:\n{output[-2000:]}") from None
    if child.returncode != 0:
        raise SystemExit(f"the {code} {build} run failed:\n{output[-4000:]}")
    return with_rates(json.loads(out.read_text()))


def with_rates(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with its events per wall second and per coordinator CPU-second."""
    row["events_per_s"] = row["events"] / row["wall_s"]
    row["events_per_cpu_s"] = row["events"] / max(row["coordinator_cpu_s"], 1e-9)
    return row


def ratios(rows: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """Per build of the new code: its mean events/s and events per CPU-second over its runs,
    each over the old code's mean."""
    olds = [r for r in rows if r["code"] == "old"]
    result = {}
    for build in ("compiled", "interpreted"):
        news = [r for r in rows if r["code"] == "new" and r["build"] == build]
        if olds and news:
            result[build] = (
                mean_ratio(news, olds, "events_per_s"),
                mean_ratio(news, olds, "events_per_cpu_s"),
            )
    return result


def mean_ratio(news: list[dict[str, Any]], olds: list[dict[str, Any]], key: str) -> float:
    return statistics.fmean(r[key] for r in news) / statistics.fmean(r[key] for r in olds)


def print_table(rows: list[dict[str, Any]], old: str, new: str) -> None:
    print(f"\nsaturation, throughput phase (old = {old}, new = {new}):")
    print(
        f"{'run':>3} {'code':<8} {'build':<11} {'wall s':>6} {'events/s':>9} {'coord CPU-s':>11} "
        f"{'share':>5} {'events/CPU-s':>12} {'gen CPU':>7}"
    )
    for n, r in enumerate(rows, 1):
        print(
            f"{n:>3} {r['commit']:<8} {r['build']:<11} {r['wall_s']:>6.2f} "
            f"{r['events_per_s']:>9.0f} "
            f"{r['coordinator_cpu_s']:>11.2f} {r['coordinator_cpu_s'] / r['wall_s']:>5.2f} "
            f"{r['events_per_cpu_s']:>12.0f} {r['generator_cpu_s'] / r['wall_s']:>7.2f}"
        )
    for n, r in enumerate(rows, 1):
        c = r["coordinator"]
        print(
            f"run {n}: coordinator cwd {c['cwd']}, PYTHONPATH {c['pythonpath']}, compiled modules "
            f"mapped: {len(c['mapped'])}; {r['build_info']}; "
            f"generator imports {r['generator_imports']}"
        )
    for build, (per_s, per_cpu_s) in ratios(rows).items():
        runs = sum(r["build"] == build and r["code"] == "new" for r in rows)
        old_runs = sum(r["code"] == "old" for r in rows)
        print(
            f"new {build} / old, means of {runs} and {old_runs} runs: {per_s:.2f}x events/s, "
            f"{per_cpu_s:.2f}x events per coordinator CPU-second"
        )


def side_by_side(args: argparse.Namespace) -> int:
    new = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short=7", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    from flowsched.compiled import build_tree

    # the compiled build (~30 s when stale) now, so that no run's time allowance pays for it
    build_tree(REPO, REPO / "build" / "compiled")
    with tempfile.TemporaryDirectory(prefix="flowsched-vs-") as tmp:
        old_tree = Path(tmp) / "old"
        subprocess.run(
            [
                "git",
                "-C",
                str(REPO),
                "worktree",
                "add",
                "--detach",
                "--quiet",
                str(old_tree),
                args.old,
            ],
            check=True,
        )
        try:
            rows = []
            for n, (code, build) in enumerate(ORDER, 1):
                print(f"run {n}: {code} {build}, {args.duration:g} s", flush=True)
                checkout = old_tree if code == "old" else REPO
                row = run_in(checkout, code, build, args, Path(tmp) / f"run{n}.json")
                row.update(code=code, build=build, commit=args.old[:7] if code == "old" else new)
                rows.append(row)
        finally:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(old_tree)],
                check=False,
            )  # its files go with the temporary directory either way
    print_table(rows, args.old, new)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--old", default="4d0525d", help="the commit to compare with (default 4d0525d)"
    )
    parser.add_argument(
        "--duration", type=float, default=60.0, help="seconds of each throughput phase"
    )
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument(
        "--form",
        choices=("sealed", "packed", "maps"),
        default="sealed",
        help="how the current benchmark's agents send progress (default: as this release's)",
    )
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--one-run", choices=("old", "new"), help=argparse.SUPPRESS)
    parser.add_argument("--build", default="interpreted", help=argparse.SUPPRESS)
    args = parser.parse_args()
    return one_run(args) if args.one_run else side_by_side(args)


if __name__ == "__main__":
    sys.exit(main())
