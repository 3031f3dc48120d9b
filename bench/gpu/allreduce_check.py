"""GPU check of the flowsched NCCL net plugin: all_reduce between two "nodes" on ONE GPU.

    .venv/bin/python bench/gpu/allreduce_check.py [--out results/gpu] [--dry-run]

Runs two processes on GPU 0 with different ``NCCL_HOSTID`` values, so that NCCL sees two
nodes and must use the network transport (P2P and SHM refuse ranks with different host
hashes), once through our plugin (``NCCL_NET_PLUGIN=<absolute path>``, ``NCCL_NET=flowsched``)
and once through NCCL's own ``Socket`` transport, both over ``lo``. For each it

* checks every all_reduce result (SUM of rank-dependent tensors) element by element;
* greps the NCCL INFO log for the lines that prove which network carried the traffic
  (``Loaded net plugin flowsched``, ``Using network flowsched``, ``via NET/flowsched``,
  ``nNodes 2``);
* reports bus bandwidth per message size (all_reduce busbw = algbw * 2(n-1)/n = algbw for 2
  ranks), flowsched next to Socket.

Two processes on one GPU only time-slice, so sizes are modest, channels are limited to one,
and every worker runs under a timeout; the whole script stays under 5 minutes.
Exit status: 0 all good, 1 a check failed, 77 no CUDA/torch (nothing was run).
``--dry-run`` prints the environment of each worker without starting anything (CPU-safe).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SIZES = [4 << 10, 1 << 20, 16 << 20, 64 << 20]  # bytes per all_reduce (float32)
WARMUP, ITERS = 2, 5
WORKER_TIMEOUT_S = 110
TRANSPORTS = ("flowsched", "Socket")

#: log lines (regular expressions) that must appear in each rank's NCCL log
PROOF = {
    "flowsched": [
        r"Loaded net plugin flowsched \(v1[012]\)",
        r"Using network flowsched",
        r"via NET/flowsched",
        r"nNodes 2",
    ],
    "Socket": [r"Using network Socket", r"via NET/Socket", r"nNodes 2"],
}


def find_plugin() -> Path:
    """The built plugin (installed copy first, then the source tree's build)."""
    sys.path.insert(0, str(ROOT))
    from flowsched.nccl import plugin_path

    return plugin_path().resolve()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def worker_env(transport: str, rank: int, port: int, plugin: Path, out: Path) -> dict[str, str]:
    """Environment of one rank: its own NCCL_HOSTID, the network forced, loopback only; NCCL's
    log (which also carries our plugin's lines, through NCCL's logger) goes to a file."""
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "0",
        "NCCL_HOSTID": f"flowsched-node{rank}",
        "NCCL_SOCKET_IFNAME": "lo",
        "NCCL_NET": transport,
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,NET,ENV",
        "NCCL_DEBUG_FILE": str(log_path(out, transport, rank)),
        "NCCL_P2P_DISABLE": "1",
        "NCCL_SHM_DISABLE": "1",
        "NCCL_NVLS_ENABLE": "0",
        "NCCL_MNNVL_ENABLE": "0",
        "NCCL_MAX_NCHANNELS": "1",
        "NCCL_MIN_NCHANNELS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": "2",
    }
    if transport == "flowsched":
        env["NCCL_NET_PLUGIN"] = str(plugin)
        env["FLOWSCHED_SOCKET_IFNAME"] = "lo"
    else:
        env["NCCL_NET_PLUGIN"] = "none"  # NCCL >= 2.28: no external plugin at all
    return env


def log_path(out: Path, transport: str, rank: int) -> Path:
    return (out / f"{transport}-rank{rank}.log").resolve()


def worker() -> int:
    """One rank: init the process group, check and time all_reduce at each size."""
    import datetime

    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    results = []
    for size in SIZES:
        n = size // 4
        base = torch.arange(n, dtype=torch.float32, device="cuda") % 1000
        expected = base * 2 + 1  # rank 0 sends base, rank 1 sends base + 1
        times = []
        for i in range(WARMUP + ITERS):
            tensor = base + rank
            torch.cuda.synchronize()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            torch.cuda.synchronize()
            if i >= WARMUP:
                times.append(time.perf_counter() - start)
            if not torch.equal(tensor, expected):
                print(json.dumps({"rank": rank, "error": f"wrong result at size {size}"}))
                return 1
        seconds = sorted(times)[len(times) // 2]
        results.append({"size": size, "seconds": seconds, "busbw_GBps": size / seconds / 1e9})
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "results": results}), flush=True)
    return 0


def run_transport(transport: str, plugin: Path, out: Path) -> dict[str, Any]:
    """Start both ranks, wait, collect their JSON results and check their logs."""
    port = free_port()
    procs = []
    for rank in range(2):
        log_path(out, transport, rank).unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker"]
        env = worker_env(transport, rank, port, plugin, out)
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    outputs, ok = [], True
    for proc in procs:
        try:
            stdout, _ = proc.communicate(timeout=WORKER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, _ = proc.communicate()
            ok = False
        ok = ok and proc.returncode == 0
        lines = [x for x in stdout.splitlines() if x.startswith("{")]
        outputs.append(json.loads(lines[-1]) if lines else {"error": "no result"})
    proof = check_logs(transport, out)
    ok = ok and all(proof.values()) and all("results" in o for o in outputs)
    return {"ok": ok, "ranks": outputs, "proof": proof}


def check_logs(transport: str, out: Path) -> dict[str, bool]:
    """Which proof lines each rank's log contains."""
    found = {}
    for rank in range(2):
        path = log_path(out, transport, rank)
        text = path.read_text(errors="replace") if path.exists() else ""
        for pattern in PROOF[transport]:
            found[f"rank{rank}: {pattern}"] = re.search(pattern, text) is not None
    return found


def report(runs: dict[str, dict[str, Any]]) -> None:
    print(f"{'size':>10} " + " ".join(f"{t + ' GB/s':>16}" for t in TRANSPORTS) + f"{'ratio':>8}")
    for i, size in enumerate(SIZES):
        cells = []
        for transport in TRANSPORTS:
            rank0 = runs[transport]["ranks"][0]
            cells.append(rank0["results"][i]["busbw_GBps"] if "results" in rank0 else float("nan"))
        ratio = cells[0] / cells[1] if cells[1] else float("nan")
        print(f"{size:>10} " + " ".join(f"{c:>16.3f}" for c in cells) + f"{ratio:>8.2f}")
    for transport, run in runs.items():
        missing = [k for k, v in run["proof"].items() if not v]
        print(
            f"{transport}: {'OK' if run['ok'] else 'FAILED'}"
            + (f"; missing log lines: {missing}" if missing else "; all proof lines found")
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "gpu")
    parser.add_argument("--dry-run", action="store_true", help="print the worker environments")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker()
    plugin = find_plugin()
    if args.dry_run:
        for transport in TRANSPORTS:
            for rank in range(2):
                env = worker_env(transport, rank, 0, plugin, args.out)
                keys = sorted(k for k in env if k.startswith(("NCCL_", "FLOWSCHED_", "CUDA_")))
                print(transport, rank, " ".join(f"{k}={env[k]}" for k in keys))
        return 0
    try:
        import torch
    except ImportError:
        print("torch is not installed: nothing to run", file=sys.stderr)
        return 77
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to run", file=sys.stderr)
        return 77
    args.out.mkdir(parents=True, exist_ok=True)
    runs = {t: run_transport(t, plugin, args.out) for t in TRANSPORTS}
    (args.out / "allreduce_check.json").write_text(json.dumps(runs, indent=2))
    report(runs)
    return 0 if all(r["ok"] for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
