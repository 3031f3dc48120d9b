"""bench/gpu/allreduce_check.py without a GPU: its arguments, that it refuses properly when it
cannot run, the environment each rank gets, and the log / flow-table assertions it makes,
on NCCL log lines written in NCCL's documented formats and on made-up slots."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from bench_script_loader import load_bench_script

from flowsched.model import FlowClass
from flowsched.nccl import gpu_check
from flowsched.nccl.gpu_check import CommExpectation, Slot
from flowsched.shm import layout

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu" / "allreduce_check.py"
SETUP = ROOT / "bench" / "gpu" / "setup_aws_ofi_nccl.sh"
SEND, RECV = layout.DIR_SEND, layout.DIR_RECV
DEFAULT_ID, GROUP_ID = 0x5E1F2D3C4B5A6978, 0x1122334455667788


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
    )


def load_script() -> ModuleType:
    return load_bench_script("gpu/allreduce_check.py")


def rank_log(rank: int, via: str = "NET/flowsched/0") -> str:
    """What a rank's NCCL_DEBUG=INFO log carries for the run (NCCL 2.28 formats)."""
    lines = [
        f"h:{100 + rank}:{100 + rank} [0] NCCL INFO NET/Plugin: Loaded net plugin flowsched (v11)"
    ]
    for comm_id in (DEFAULT_ID, GROUP_ID):
        lines += [
            f"h:1:1 [0] NCCL INFO ncclCommInitRankConfig comm 0x55d0c8a0 rank {rank} nranks 2 "
            f"cudaDev 0 nvmlDev 0 busId 18000 commId {comm_id:#x} - Init START",
            f"h:1:9 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via {via}",
            "h:1:9 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/flowsched/0",
            f"h:1:1 [0] NCCL INFO ncclCommInitRankConfig comm 0x55d0c8a0 rank {rank} nranks 2 "
            f"cudaDev 0 nvmlDev 0 busId 18000 commId {comm_id:#x} - Init COMPLETE",
        ]
    return "\n".join(lines) + "\n"


def good_slots(pid: int, default_bytes: int, group_bytes: int) -> list[Slot]:
    return [
        Slot(pid, DEFAULT_ID, SEND, int(FlowClass.TP), default_bytes),
        Slot(pid, DEFAULT_ID, RECV, int(FlowClass.TP), default_bytes),
        Slot(pid, GROUP_ID, SEND, int(FlowClass.PARAM_SYNC), group_bytes),
        Slot(pid, GROUP_ID, RECV, int(FlowClass.PARAM_SYNC), group_bytes),
    ]


# ---- the script as a user runs it ----------------------------------------------------------


def test_without_a_cuda_torch_it_skips_or_fails_as_asked(tmp_path: Path) -> None:
    """The interpreter given has no CUDA torch (a stand-in that answers the probe like a
    CPU-only torch, without the seconds a torch import takes here)."""
    cpu_python = tmp_path / "python"
    cpu_python.write_text("#!/bin/sh\nexit 3\n")
    cpu_python.chmod(0o755)
    args = ["--no-build", "--python", str(cpu_python), "--out", str(tmp_path)]
    skipped = run_script(*args)
    assert skipped.returncode == 77 and "not run" in skipped.stderr
    required = run_script(*args, "--require-gpu")
    assert required.returncode == 2 and "CUDA" in required.stderr
    assert not (tmp_path / "allreduce_check.json").exists()  # nothing was reported as run


@pytest.mark.parametrize(
    "args,field",
    [(["--modes", "direct,bogus"], "--modes"), (["--timeout", "0"], "--timeout")],
)
def test_bad_arguments_are_refused_naming_the_field(args: list[str], field: str) -> None:
    result = run_script(*args)
    assert result.returncode == 2 and field in result.stderr


def test_each_mode_and_rank_gets_its_environment() -> None:
    result = run_script("--dry-run")
    assert result.returncode == 0, result.stderr
    rows: dict[tuple[str, int], dict[str, str]] = {}
    for line in result.stdout.splitlines():
        name, number, *pairs = line.split()
        rows[(name, int(number))] = dict(p.split("=", 1) for p in pairs)
    assert set(rows) == {(m, r) for m in ("direct", "wrap-fstcp", "wrap-ofi") for r in (0, 1)}
    for (mode, rank), env in rows.items():
        assert env["NCCL_NET"] == "flowsched" and env["NCCL_HOSTID"] == f"flowsched-node{rank}"
        assert Path(env["NCCL_NET_PLUGIN"]).is_absolute()
        assert env["FLOWSCHED_TABLE"] == "TABLE" and env["NCCL_DEBUG"] == "INFO"
        assert ("FLOWSCHED_NET_INNER" in env) == (mode != "direct")
    assert rows[("wrap-ofi", 0)]["FI_PROVIDER"] == "tcp;ofi_rxm"
    assert "lo" not in rows[("wrap-ofi", 0)]["OFI_NCCL_EXCLUDE_TCP_IF"].split(",")


def test_setup_script_says_why_it_cannot_prepare_aws_ofi_nccl(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_OFI_NCCL")}
    env["AWS_OFI_NCCL_PREFIX"] = str(tmp_path / "none")
    missing = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, env=env)
    assert missing.returncode == 3 and "AWS_OFI_NCCL_SRC" in missing.stderr
    built = tmp_path / "libnccl-net-ofi.so"
    built.write_bytes(b"")
    found = subprocess.run(
        ["bash", str(SETUP)],
        capture_output=True,
        text=True,
        env={**env, "AWS_OFI_NCCL_LIB": str(built)},
    )
    assert found.returncode == 0 and found.stdout.strip().splitlines()[-1] == str(built)


# ---- the assertions, on logs and slots -----------------------------------------------------


def test_channel_lines() -> None:
    assert gpu_check.check_channels(rank_log(0)) == []
    assert (
        gpu_check.check_channels(rank_log(0, via="P2P/CUMEM"))
        == ["a channel went via P2P/CUMEM, not NET/flowsched"] * 2
    )
    assert gpu_check.check_channels(rank_log(0, via="NET/Socket/0"))
    assert gpu_check.check_channels("NCCL INFO Using network flowsched\n")  # no channel at all


def test_comm_ids_in_first_seen_order() -> None:
    assert gpu_check.comm_ids(rank_log(1)) == [DEFAULT_ID, GROUP_ID]
    assert gpu_check.comm_ids("nothing here") == []


def test_byte_floors() -> None:
    assert gpu_check.allreduce_floor(16 << 20) == 16 << 20  # 2 ranks: the buffer once
    assert gpu_check.allreduce_floor(12, nranks=4) == 18
    assert gpu_check.alltoall_floor(16 << 20) == 8 << 20


EXPECT = {
    DEFAULT_ID: CommExpectation("default group", int(FlowClass.TP), 1000),
    GROUP_ID: CommExpectation("param_sync group", int(FlowClass.PARAM_SYNC), 100),
}


@pytest.mark.parametrize(
    "slots,problem",
    [
        (good_slots(7, 1000, 100), None),
        (good_slots(8, 1000, 100), "no send slot"),  # another process owns them
        (good_slots(7, 999, 100), "less than the 1000"),
        ([s for s in good_slots(7, 1000, 100) if s.direction == SEND], "no receive slot"),
        (
            [
                s if s.comm_id == DEFAULT_ID else Slot(7, GROUP_ID, s.direction, 0, 100)
                for s in good_slots(7, 1000, 100)
            ],
            "expected 2",
        ),
    ],
    ids=["good", "other-pid", "too-few-bytes", "no-receive", "group-not-param-sync"],
)
def test_slot_checks(slots: list[Slot], problem: str | None) -> None:
    problems = gpu_check.check_slots(slots, 7, EXPECT)
    if problem is None:
        assert problems == []
    else:
        assert any(problem in p for p in problems), problems


def test_check_run_on_a_recorded_run(tmp_path: Path) -> None:
    """The driver's whole assertion step: logs of both ranks, slots of both pids."""
    script = load_script()
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    for rank, path in enumerate(logs):
        path.write_text(rank_log(rank))
    floor = script.expectations([DEFAULT_ID, GROUP_ID])
    default_bytes, group_bytes = floor[DEFAULT_ID].min_bytes, floor[GROUP_ID].min_bytes
    ranks = [{"pid": 11, "errors": []}, {"pid": 12, "errors": []}]
    slots = good_slots(11, default_bytes, group_bytes) + good_slots(12, default_bytes, group_bytes)
    assert script.check_run(ranks, logs, slots) == []
    short = good_slots(11, default_bytes, group_bytes) + good_slots(
        12, default_bytes - 1, group_bytes
    )
    assert any("pid 12" in p for p in script.check_run(ranks, logs, short))
    logs[1].write_text(rank_log(1, via="NET/Socket/0"))
    assert any("rank 1" in p and "NET/Socket" in p for p in script.check_run(ranks, logs, slots))
    logs[1].write_text("")
    assert any("commIds" in p for p in script.check_run(ranks, logs, slots))
