"""``flowsched flows`` run in process: the two looks of a rate, and a table re-created between
them (the agent resizing it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from flowsched import client
from flowsched.cli import flows, main
from flowsched.protocol import sdk
from flowsched.shm.table import EmulatedPluginSlot, FlowTable


@pytest.fixture
def table(tmp_path: Path) -> FlowTable:
    created, _ = FlowTable.create_or_attach(str(tmp_path / "run" / "table"), num_slots=4)
    return created


def test_the_rate_is_the_bytes_sent_between_the_two_looks(
    table: FlowTable, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    conn = EmulatedPluginSlot(table, class_id=2)
    clock = iter([100.0, 102.0])
    monkeypatch.setattr(flows.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(flows.time, "sleep", lambda _: conn.send(1000))  # 1 kB in the 2 s
    assert main(["flows", "--table", table.path, "--interval", "2", "--json", "--no-sdk"]) == 0
    [row] = json.loads(capsys.readouterr().out)["connections"]
    assert (row["cls"], row["bytes"], row["rate"]) == ("param_sync", 1000, 500.0)


def test_a_table_re_created_between_the_looks_is_said_not_measured(
    table: FlowTable, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    EmulatedPluginSlot(table).send(10)

    def recreate(_: float) -> None:  # as the agent does to resize it: another file at the path
        built = table.path + ".new"
        FlowTable.create_or_attach(built, num_slots=8)[0].close()
        os.replace(built, table.path)  # the old file lives on while it is mapped (here: table)

    monkeypatch.setattr(flows.time, "sleep", recreate)
    assert main(["flows", "--table", table.path, "--interval", "0.5"]) == 1
    err = capsys.readouterr().err
    assert "was re-created during the 0.5 s" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("where", "status"),
    [("missing-table-given", 2), ("missing-default-table", 1), ("re-created", 1)],
)
def test_json_without_a_table_is_an_empty_document_and_the_reason_on_stderr(
    where: str,
    status: int,
    table: FlowTable,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--json printed nothing on stdout when there was no table to list (a script's parser
    failed on it); the exit status stays the one the table listing has."""
    argv = ["flows", "--json", "--no-sdk", "--interval", "0"]
    if where == "missing-table-given":
        argv += ["--table", str(tmp_path / "nowhere")]
    elif where == "missing-default-table":
        monkeypatch.setenv("FLOWSCHED_TABLE", str(tmp_path / "nowhere"))
    else:

        def recreate(_: float) -> None:
            built = table.path + ".new"
            FlowTable.create_or_attach(built, num_slots=8)[0].close()
            os.replace(built, table.path)

        monkeypatch.setattr(flows.time, "sleep", recreate)
        argv = [*argv[:-1], "0.5", "--table", table.path]
    assert main(argv) == status
    out, err = capsys.readouterr()
    assert json.loads(out) == {
        "table": None,
        "connections": [],
        "sdk": {
            "socket": None,
            "everyone": None,
            "problem": "not asked: no flow table listed",
            "flows": [],
        },
    }
    assert err.startswith("flowsched flows: ") and len(err.strip().splitlines()) == 1


def test_a_connection_is_marked_with_the_sdk_flow_it_carries_only_while_its_claim_lasts(
    table: FlowTable, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    carried = EmulatedPluginSlot(table, class_id=2)
    reclaimed = EmulatedPluginSlot(table, class_id=2)
    ended_claim = (reclaimed.index, reclaimed.claim_seq - 1)
    infos = (
        sdk.FlowInfo(41, "param_sync", 1, 0.0, 0, slots=((carried.index, carried.claim_seq),)),
        # the agent listed a claim of this slot that has ended since: another connection now
        sdk.FlowInfo(42, "param_sync", 1, 0.0, 0, slots=(ended_claim,)),
    )
    listing = client.FlowListing("/run/agent.sock", infos, everyone=True)
    monkeypatch.setattr(flows.client, "list_flows", lambda path, timeout: listing)
    assert main(["flows", "--table", table.path, "--interval", "0", "--json"]) == 0
    rows = {row["slot"]: row for row in json.loads(capsys.readouterr().out)["connections"]}
    assert rows[carried.index]["sdk_flow"] == 41
    assert rows[reclaimed.index]["sdk_flow"] is None
