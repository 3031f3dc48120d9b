"""GPU check: prove in one short run that NCCL moved the bytes through the flowsched plugin.

    .venv/bin/python bench/gpu/allreduce_check.py [--require-gpu] [--timeout 230]
        [--modes direct,wrap-fstcp,wrap-ofi] [--python PATH] [--out DIR] [--no-build] [--dry-run]

Two processes on one GPU with different ``NCCL_HOSTID`` values (NCCL then sees two nodes and
must use the network: P2P and SHM refuse ranks with different host hashes) run, per mode, a
4 KiB and a 16 MiB all_reduce, one all_to_all (16 MiB per rank), then a second process group
made by ``flowsched.torch.new_group("param_sync", ...)`` and a 1 MiB all_reduce on it. Modes:

* ``direct``: our TCP transport (``NCCL_NET_PLUGIN=<abs path>``, ``NCCL_NET=flowsched``);
* ``wrap-fstcp``: the wrapper around the standalone TCP inner ``libnccl-net-fstcp.so``;
* ``wrap-ofi``: the wrapper around aws-ofi-nccl over libfabric's ``tcp;ofi_rxm`` provider,
  prepared by ``setup_aws_ofi_nccl.sh``; reported as skipped (not passed) where it cannot be
  built.

Each mode gets a flow table of its own, created for the run. Asserted per mode: every result
is right; every ``Channel ... via`` line of both ranks says ``NET/flowsched``; both ranks log
the same commIds; each rank's pid owns send and receive slots with each commId, whose byte
counts cover what the operations had to move; the param_sync group's slots have class
param_sync (the default group's: tp). One deadline (``--timeout``, default 230 s) bounds the
build and every mode. Uses the first Python with a CUDA torch among ``--python``, this
interpreter, ``$FLOWSCHED_GPU_PYTHON`` and the machine's python3 (with this tree on
``PYTHONPATH``).

Exit status: 0 every check passed; 1 a check failed; 2 it could not run and ``--require-gpu``
was given; 77 it could not run (no CUDA torch), nothing was checked.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from flowsched.nccl import gpu_check  # noqa: E402
from flowsched.testbed.daemons import free_ports  # noqa: E402

BUILD = ROOT / "nccl_plugin" / "build"
SETUP_OFI = Path(__file__).resolve().with_name("setup_aws_ofi_nccl.sh")
MODES = ("direct", "wrap-fstcp", "wrap-ofi")
SMALL, LARGE, GROUP_BYTES = 4 << 10, 16 << 20, 1 << 20
EXIT_FAILED, EXIT_CANNOT_RUN_REQUIRED, EXIT_SKIPPED = 1, 2, 77
TORCH_PROBE = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)"


class Deadline:
    """The one overall timeout: what is left of it, for each step."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self, cap: float | None = None) -> float:
        left = max(0.0, self.end - time.monotonic())
        return left if cap is None else min(left, cap)


# ---- the worker (one rank, on the GPU) ---------------------------------------------------


def worker() -> int:
    """One rank: the operations, each result checked; prints one JSON line."""
    import datetime

    import torch
    import torch.distributed as dist

    from flowsched import torch as fs_torch

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=90))
    timings: dict[str, float] = {}

    def timed(name: str, fn: Any) -> None:
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        timings[name] = time.perf_counter() - start

    errors = []
    for name, nbytes in (("all_reduce_4KiB", SMALL), ("all_reduce_16MiB", LARGE)):
        base = torch.arange(nbytes // 4, dtype=torch.float32, device="cuda") % 1000
        tensor = base + rank
        timed(name, lambda t=tensor: dist.all_reduce(t))
        if not torch.equal(tensor, base * 2 + 1):
            errors.append(f"{name}: wrong result")
    n = LARGE // 4
    send = torch.full((n,), float(rank + 1), device="cuda")
    recv = torch.empty_like(send)
    timed("all_to_all_16MiB", lambda: dist.all_to_all_single(recv, send))
    if not (torch.all(recv[: n // 2] == 1) and torch.all(recv[n // 2 :] == 2)):
        errors.append("all_to_all: wrong result")
    made = fs_torch.new_group("param_sync", ranks=[0, 1])
    tensor = torch.full((GROUP_BYTES // 4,), float(rank + 1), device="cuda")
    timed("param_sync_all_reduce_1MiB", lambda: dist.all_reduce(tensor, group=made.group))
    if not torch.all(tensor == 3):
        errors.append("param_sync all_reduce: wrong result")
    dist.destroy_process_group(made.group)
    dist.destroy_process_group()
    result = {"rank": rank, "pid": os.getpid(), "group_method": made.method, "errors": errors}
    print(json.dumps({**result, "seconds": timings}), flush=True)
    return 0 if not errors else 1


# ---- the driver --------------------------------------------------------------------------


def find_cuda_python(explicit: str | None, timeout: float) -> str | None:
    """The first interpreter whose torch sees a CUDA device."""
    candidates: list[str | None] = [explicit] if explicit else []
    if not explicit:
        candidates += [sys.executable, os.environ.get("FLOWSCHED_GPU_PYTHON")]
        candidates += ["/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3")]
    seen = set()
    for python in candidates:
        if not python or python in seen or not Path(python).exists():
            continue
        seen.add(python)
        try:
            probe = subprocess.run(
                [python, "-c", TORCH_PROBE], capture_output=True, timeout=timeout
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return python
    return None


def mode_env(
    mode: str, rank: int, port: int, table: Path, log: Path, inner: Path | None
) -> dict[str, str]:
    """One rank's environment: its NCCL_HOSTID, our network forced, loopback, the run's table."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        ),
        "CUDA_VISIBLE_DEVICES": "0",
        "NCCL_HOSTID": f"flowsched-node{rank}",
        "NCCL_NET_PLUGIN": str(BUILD / "libnccl-net-flowsched.so"),
        "NCCL_NET": "flowsched",
        "NCCL_SOCKET_IFNAME": "lo",
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,NET,ENV",
        "NCCL_DEBUG_FILE": str(log),
        "NCCL_P2P_DISABLE": "1",
        "NCCL_SHM_DISABLE": "1",
        "NCCL_NVLS_ENABLE": "0",
        "NCCL_MNNVL_ENABLE": "0",
        "NCCL_MAX_NCHANNELS": "1",
        "NCCL_MIN_NCHANNELS": "1",
        "FLOWSCHED_SOCKET_IFNAME": "lo",
        "FLOWSCHED_TABLE": str(table),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": "2",
    }
    env.pop("FLOWSCHED_CLASS", None)
    if mode != "direct":
        assert inner is not None
        env["FLOWSCHED_NET_INNER"] = str(inner)
    if mode == "wrap-fstcp":
        env["FSTCP_SOCKET_IFNAME"] = "lo"
    if mode == "wrap-ofi":
        env.update(
            {
                "FI_PROVIDER": "tcp;ofi_rxm",
                "FI_TCP_IFACE": "lo",
                "OFI_NCCL_EXCLUDE_TCP_IF": "docker0",  # its default also drops lo
            }
        )
    return env


def create_table(directory: Path) -> Any:
    """A flow table for the run, configured from the embedded default policy."""
    from flowsched import policyfile
    from flowsched.agent.policy_view import PolicyView
    from flowsched.shm.table import FlowTable

    table, _ = FlowTable.create_or_attach(str(directory / "table"), num_slots=512)
    table.write_config(PolicyView(policyfile.embedded_default()).table_config())
    return table


def expectations(ids: list[int]) -> dict[int, gpu_check.CommExpectation]:
    """The default group's commId is the first NCCL logged, the param_sync group's the last."""
    from flowsched.model import FlowClass

    floor_default = (
        gpu_check.allreduce_floor(SMALL)
        + gpu_check.allreduce_floor(LARGE)
        + gpu_check.alltoall_floor(LARGE)
    )
    return {
        ids[0]: gpu_check.CommExpectation("default group", int(FlowClass.TP), floor_default),
        ids[-1]: gpu_check.CommExpectation(
            "param_sync group", int(FlowClass.PARAM_SYNC), gpu_check.allreduce_floor(GROUP_BYTES)
        ),
    }


def run_mode(
    mode: str, python: str, out: Path, inner: Path | None, deadline: Deadline
) -> dict[str, Any]:
    """Both ranks of one mode, then every assertion on their logs and the run's table."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="flowsched-gpu-", dir="/dev/shm") as tmp:
        table = create_table(Path(tmp))
        try:
            (port,) = free_ports(1)
            logs = [out / f"{mode}-rank{r}.log" for r in range(2)]
            procs = []
            for rank in range(2):
                logs[rank].unlink(missing_ok=True)
                env = mode_env(mode, rank, port, Path(tmp) / "table", logs[rank], inner)
                cmd = [python, str(Path(__file__).resolve()), "--worker"]
                procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
            ranks, problems = collect(procs, deadline)
            slots = gpu_check.slots_from_table(table.slots())
        finally:
            table.close()
    problems += check_run(ranks, logs, slots)
    return {"ok": not problems, "problems": problems, "ranks": ranks}


def collect(procs: list[subprocess.Popen[str]], deadline: Deadline) -> tuple[list[Any], list[str]]:
    """Each rank's JSON line; a rank that fails or overruns the deadline is a problem."""
    ranks: list[Any] = []
    problems = []
    for rank, proc in enumerate(procs):
        try:
            stdout, _ = proc.communicate(timeout=deadline.left())
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            stdout, _ = proc.communicate()
            problems.append(f"rank {rank} did not finish before the deadline")
        lines = [x for x in (stdout or "").splitlines() if x.startswith("{")]
        ranks.append(json.loads(lines[-1]) if lines else None)
        if proc.returncode != 0 or not lines:
            problems.append(f"rank {rank} exited with status {proc.returncode}")
        elif ranks[-1]["errors"]:
            problems += [f"rank {rank}: {e}" for e in ranks[-1]["errors"]]
    return ranks, problems


def check_run(ranks: list[Any], logs: list[Path], slots: list[gpu_check.Slot]) -> list[str]:
    """The log and flow-table assertions for one mode."""
    problems = []
    texts = [p.read_text(errors="replace") if p.exists() else "" for p in logs]
    ids = [gpu_check.comm_ids(t) for t in texts]
    for rank, text in enumerate(texts):
        problems += [f"rank {rank}: {p}" for p in gpu_check.check_channels(text)]
    if ids[0] != ids[1] or len(ids[0]) < 2:
        problems.append(
            f"commIds in the logs: rank 0 {ids[0]}, rank 1 {ids[1]} (two shared ones expected)"
        )
        return problems
    for info in ranks:
        if info is not None:
            problems += gpu_check.check_slots(slots, info["pid"], expectations(ids[0]))
    return problems


def prepare_inner(mode: str, deadline: Deadline) -> tuple[Path | None, str | None]:
    """The inner plugin of a wrapping mode, or why it is not available."""
    if mode == "direct":
        return None, None
    if mode == "wrap-fstcp":
        inner = BUILD / "libnccl-net-fstcp.so"
        return (inner, None) if inner.exists() else (None, f"{inner} was not built")
    try:
        setup = subprocess.run(
            ["bash", str(SETUP_OFI)], capture_output=True, text=True, timeout=deadline.left(120)
        )
    except subprocess.TimeoutExpired:
        return None, "setup_aws_ofi_nccl.sh ran out of time"
    lines = setup.stdout.strip().splitlines()
    if setup.returncode != 0 or not lines:
        return None, (setup.stderr.strip().splitlines() or ["setup failed"])[-1]
    return Path(lines[-1]), None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "gpu")
    parser.add_argument("--timeout", type=float, default=230.0, help="overall seconds")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--python", default=None, help="interpreter with a CUDA torch")
    parser.add_argument("--require-gpu", action="store_true", help="exit 2 when it cannot run")
    parser.add_argument("--no-build", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="print each rank's environment")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if not modes or unknown:
        parser.error(f"--modes: expected some of {','.join(MODES)}, got {args.modes!r}")
    if not 0 < args.timeout <= 3600:
        parser.error("--timeout must be in (0, 3600] seconds")
    args.mode_list = modes
    return args


def cannot_run(reason: str, required: bool) -> int:
    print(f"GPU check not run: {reason}", file=sys.stderr)
    return EXIT_CANNOT_RUN_REQUIRED if required else EXIT_SKIPPED


def main(argv: list[str] | None = None) -> int:
    """Build, find a CUDA torch, run every mode within the deadline, report."""
    args = parse_args(argv)
    if args.worker:
        return worker()
    deadline = Deadline(args.timeout)
    if args.dry_run:
        for mode in args.mode_list:
            for rank in range(2):
                env = mode_env(mode, rank, 0, Path("TABLE"), Path("LOG"), Path("INNER"))
                keys = sorted(
                    k
                    for k in env
                    if k.startswith(("NCCL_", "FLOWSCHED_", "FSTCP_", "FI_", "OFI_", "CUDA_"))
                )
                print(mode, rank, " ".join(f"{k}={env[k]}" for k in keys))
        return 0
    if not args.no_build:
        build = subprocess.run(
            ["make", "-s", "-C", str(ROOT / "nccl_plugin"), "all"], timeout=deadline.left(180)
        )
        if build.returncode != 0:
            print("building the plugin failed", file=sys.stderr)
            return EXIT_FAILED
    python = find_cuda_python(args.python, deadline.left(60))
    if python is None:
        return cannot_run("no Python with a CUDA-enabled torch and a visible GPU", args.require_gpu)
    report: dict[str, Any] = {"python": python, "modes": {}}
    for mode in args.mode_list:
        inner, missing = prepare_inner(mode, deadline)
        if missing is not None:
            report["modes"][mode] = {"ok": None, "skipped": missing}
        elif deadline.left() < 20:
            report["modes"][mode] = {"ok": False, "problems": ["no time left before the deadline"]}
        else:
            report["modes"][mode] = run_mode(mode, python, args.out, inner, deadline)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "allreduce_check.json").write_text(json.dumps(report, indent=2))
    print_report(report)
    return 0 if all(m["ok"] is not False for m in report["modes"].values()) else EXIT_FAILED


def print_report(report: dict[str, Any]) -> None:
    for mode, result in report["modes"].items():
        if result["ok"] is None:
            print(f"{mode}: SKIPPED ({result['skipped']})")
            continue
        print(f"{mode}: {'OK' if result['ok'] else 'FAILED'}")
        for problem in result.get("problems", []):
            print(f"  - {problem}")
        for info in result.get("ranks") or []:
            if info:
                times = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in info["seconds"].items())
                who = f"rank {info['rank']} (pid {info['pid']}, group via {info['group_method']})"
                print(f"  {who}: {times}")


if __name__ == "__main__":
    sys.exit(main())
