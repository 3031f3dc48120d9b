"""`flowsched policy check` notes DSCPs RoCE fabrics usually reserve (no shipped file uses one)
and warns that karuna's rate caps apply in the simulator only."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowsched import policyfile
from flowsched.cli import main
from flowsched.cli.policy import live_warnings, roce_notes
from flowsched.data import data_path

SHIPPED = sorted(data_path("policies").glob("*.toml")) + sorted(
    data_path("contention", "policies").glob("*.toml")
)

RESERVED = """\
[policy]
name = "static"
num_levels = 3
hw_queues = 3
[[queues]]
dscp = 26
so_priority = 3
[[queues]]
dscp = 48
so_priority = 2
[[queues]]
dscp = 18
so_priority = 0
"""


def test_reserved_code_points_get_a_note_but_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "roce.toml"
    path.write_text(RESERVED)
    assert main(["policy", "check", str(path)]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if ": note: " in line]
    assert len(notes) == 2
    assert "queues[0].dscp = 26" in notes[0] and "lossless" in notes[0]
    assert "queues[1].dscp = 48" in notes[1] and "CNP" in notes[1]


@pytest.mark.parametrize("path", SHIPPED, ids=[f"{p.parent.name}/{p.name}" for p in SHIPPED])
def test_shipped_files_keep_clear_of_roce_code_points(path: Path) -> None:
    assert roce_notes(policyfile.load(path)) == []


def test_default_markings_keep_clear_of_roce_code_points() -> None:
    for hw_queues in range(1, policyfile.MAX_HW_QUEUES + 1):
        dscps = [m.dscp for m in policyfile.default_queue_markings(hw_queues)]
        assert not [d for d in dscps if 24 <= d <= 31 or 48 <= d <= 55], hw_queues


@pytest.mark.parametrize(("policy", "warned"), [("karuna", True), ("rmlq", False), ("pias", False)])
def test_check_warns_that_karuna_rate_caps_are_simulator_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], policy: str, warned: bool
) -> None:
    """Live, the agent applies a decision's level only: karuna's minimum-rate pacing
    (``Decision.rate``) exists in the simulator alone, so ``check`` says so (still exit 0)."""
    path = tmp_path / f"{policy}.toml"
    path.write_text(f'[policy]\nname = "{policy}"\n')
    assert main(["policy", "check", str(path)]) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if ": warning: " in line]
    assert len(warnings) == int(warned)
    if warned:
        assert warnings[0].startswith(f"{path}: warning: karuna")
        assert "simulator" in warnings[0] and "levels only" in warnings[0]


@pytest.mark.parametrize("path", SHIPPED, ids=[f"{p.parent.name}/{p.name}" for p in SHIPPED])
def test_shipped_files_get_no_live_warning(path: Path) -> None:
    assert live_warnings(policyfile.load(path)) == []
