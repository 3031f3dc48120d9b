"""``flowsched flows``: the NCCL connections of this node's flow table, as ``ss`` shows sockets.

One line per connection: its process, class, direction and peer, the level the agent wants and
the level (with its DSCP) on its sockets, bytes, and the rate (bits per second, as tc and ss
print it) between two looks ``--interval`` apart (0: one look, no rates). The header says
whether an agent owns the table and follows a coordinator. Read-only (see
:mod:`flowsched.shm.listing`); ``--json`` for scripts.

Below them, the flows applications opened through the SDK (:mod:`flowsched.client`), as the
agent lists them over its socket (:func:`flowsched.client.list_flows`): class, job, request,
deadline, level, bytes, and the table slots of the NCCL connections that carry each (those
connections say ``sdk ID``). Root and the agent's user see every user's; others their own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from typing import Any

from flowsched import client, rundir
from flowsched.cli._common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, fail
from flowsched.protocol.sdk import FlowInfo
from flowsched.shm.listing import (
    ConnectionRow,
    TableSummary,
    connections,
    read_config,
    summarize,
    with_rates,
)
from flowsched.shm.table import FlowTable, TableConfig, TableError

#: seconds the agent has to list its SDK flows
SDK_TIMEOUT = 2.0


def register(sub: Any) -> None:
    """Add the ``flows`` subcommand."""
    parser = sub.add_parser(
        "flows",
        help="list this node's NCCL connections (the flow table) and SDK flows, their levels "
        "and rates",
        description="List the connections in this node's flow table: process, class, the "
        "level the agent wants and the one on the sockets, DSCP, bytes and rate; then the SDK "
        "flows the agent holds (every user's for root and the agent's user, else your own). "
        "Read-only.",
    )
    parser.add_argument(
        "--table",
        metavar="PATH",
        help="the flow table (default: $FLOWSCHED_TABLE, else where the plugin looks for it: "
        "/run/flowsched/table for root, else this user's runtime directory, else "
        "/run/flowsched/table when there)",
    )
    parser.add_argument(
        "--interval",
        type=_interval,
        default=1.0,
        metavar="S",
        help="seconds between the two looks that give each connection's rate; 0: one look, "
        "no rates (default %(default)g)",
    )
    parser.add_argument(
        "--all", action="store_true", help="also closed connections the agent has not reaped"
    )
    parser.add_argument(
        "--socket",
        metavar="PATH",
        help="the agent's SDK socket, to list the SDK flows (default: $FLOWSCHED_SOCKET, else "
        "where the SDK looks for it)",
    )
    parser.add_argument(
        "--no-sdk", action="store_true", help="the flow table only: do not ask the agent"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="one JSON object: header and rows (no table: an empty one, the reason on stderr)",
    )
    parser.set_defaults(func=_run)


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not math.isfinite(value) or not 0 <= value <= 60:
        raise argparse.ArgumentTypeError(f"expected 0..60 seconds, got {text!r}")
    return value


def _run(args: argparse.Namespace) -> int:
    path = args.table or rundir.client_path(rundir.TABLE_NAME, "FLOWSCHED_TABLE")
    try:
        table = FlowTable.open(path)
        mapped = _file_id(path)
    except (TableError, OSError) as exc:  # a --table given is bad input; no table: none here
        return _fail(args, str(exc), EXIT_USAGE if args.table else EXIT_FAILURE)
    with table:
        config, problem = read_config(table)
        rows = connections(table, include_closed=args.all, config=config)
        summary = summarize(table, config_problem=problem)
    if args.interval > 0:
        started = time.monotonic()
        time.sleep(args.interval)
        try:
            if _file_id(path) != mapped:  # the agent re-created it (a resize): no second look
                raise TableError(f"flow table {path} was re-created during the {args.interval} s")
            with FlowTable.open(path) as table:
                after = connections(table, include_closed=args.all, config=config)
                summary = summarize(table, config_problem=problem)
        except (TableError, OSError) as exc:
            return _fail(args, f"{exc}; run it again", EXIT_FAILURE)
        rows = with_rates(rows, after, time.monotonic() - started)
    listing, problem = (None, "not asked (--no-sdk)") if args.no_sdk else _sdk_flows(args.socket)
    carried = _carriers(listing)
    rows = [
        dataclasses.replace(row, sdk_flow=carried.get((row.slot, row.claim_seq))) for row in rows
    ]
    if args.json:
        document = {
            "table": dataclasses.asdict(summary),
            # comm_id as hex: a 64-bit hash that JSON readers keeping doubles would round
            "connections": [
                {**dataclasses.asdict(row), "comm_id": f"{row.comm_id:#018x}"} for row in rows
            ],
            "sdk": _sdk_document(listing, problem),
        }
        print(json.dumps(document, indent=2))
    else:
        print(_header(summary, len(rows)))
        _print_rows(rows, rates=args.interval > 0)
        print()
        _print_sdk(listing, problem, config)
    return EXIT_OK


def _fail(args: argparse.Namespace, message: str, status: int) -> int:
    """Say why there is no listing on stderr and return ``status``; with ``--json``, stdout
    still gets a document of the usual shape, empty (a script's JSON parser would fail on
    nothing at all)."""
    if args.json:
        empty: dict[str, Any] = {
            "table": None,
            "connections": [],
            "sdk": _sdk_document(None, "not asked: no flow table listed"),
        }
        print(json.dumps(empty, indent=2))
    return fail("flowsched flows", message, status)


def _sdk_flows(path: str | None) -> tuple[client.FlowListing | None, str | None]:
    """The agent's SDK flows, or None and why they are not shown."""
    try:
        return client.list_flows(path, timeout=SDK_TIMEOUT), None
    except client.AgentUnavailable as exc:
        return None, str(exc)
    except TimeoutError:
        return None, f"the agent did not list its SDK flows within {SDK_TIMEOUT:g} s"


def _carriers(listing: client.FlowListing | None) -> dict[tuple[int, int], int]:
    """(table slot, claim_seq) -> the SDK flow that connection carries."""
    if listing is None:
        return {}
    return {key: info.id for info in listing.flows for key in info.slots}


def _sdk_document(listing: client.FlowListing | None, problem: str | None) -> dict[str, Any]:
    if listing is None:
        return {"socket": None, "everyone": None, "problem": problem, "flows": []}
    flows = [
        {**dataclasses.asdict(info), "slots": [list(key) for key in info.slots]}
        for info in listing.flows
    ]
    return {"socket": listing.path, "everyone": listing.everyone, "problem": None, "flows": flows}


_SDK_COLUMNS = ("ID", "PID", "UID", "CLASS", "JOB", "REQUEST", "INDEX", "LEVEL", "DSCP", "SENT",
                "SIZE", "DEADLINE", "AGE", "SLOTS")  # fmt: skip


def _print_sdk(
    listing: client.FlowListing | None, problem: str | None, config: TableConfig | None
) -> None:
    if listing is None:
        print(f"SDK flows not shown: {problem}")
        return
    whose = "every user's" if listing.everyone else "this user's only"
    print(f"{listing.path}: {len(listing.flows)} SDK flows ({whose})")
    if listing.flows:
        now = time.time()
        _print_table(_SDK_COLUMNS, [_sdk_cells(info, config, now) for info in listing.flows])


def _sdk_cells(info: FlowInfo, config: TableConfig | None, now: float) -> tuple[str, ...]:
    dscp = None if info.level is None or config is None else config.marking(info.level).dscp
    slots = ",".join(str(index) for index, _ in info.slots)
    return (
        str(info.id),
        str(info.pid) if info.pid else "?",
        "?" if info.uid is None else str(info.uid),
        info.cls,
        info.job or "-",
        info.request or "-",
        "-" if info.consumer_index is None else str(info.consumer_index),
        "default" if info.level is None else str(info.level),
        "-" if dscp is None else str(dscp),
        _bytes(info.sent),
        "-" if info.size is None else _bytes(info.size),
        "-" if info.deadline is None else _in_seconds(info.deadline - now),
        _seconds(max(0.0, now - info.opened_at)),
        slots or "-",
    )


def _in_seconds(delta: float) -> str:
    """A deadline ``delta`` seconds away: ``in 1.2s``, or ``0.3s ago`` once passed."""
    return f"in {_seconds(delta)}" if delta >= 0 else f"{_seconds(-delta)} ago"


def _file_id(path: str) -> tuple[int, int]:
    """The device and inode ``path`` names now (a re-created table is another file)."""
    info = os.stat(path)
    return info.st_dev, info.st_ino


def _header(summary: TableSummary, shown: int) -> str:
    if summary.agent_alive:
        decides = "a coordinator" if summary.coordinator_connected else "its local policy"
        agent = f"agent pid {summary.agent_pid}, {decides} decides"
    elif summary.agent_pid and summary.heartbeat_age_s is not None:
        agent = (
            f"no live agent (pid {summary.agent_pid} last beat {summary.heartbeat_age_s:.0f} s ago)"
        )
    else:
        agent = "no agent attached: no level changes"
    line = (
        f"{summary.path}: {shown} connections in {summary.num_slots} slots, "
        f"{summary.num_levels} levels, generation {summary.generation}; {agent}"
    )
    if summary.config_problem is not None:
        line += f"\nno DSCPs shown: {summary.config_problem}"
    return line


_COLUMNS = ("SLOT", "PID", "COMMAND", "CLASS", "DIR", "PEER", "WANT", "LEVEL", "DSCP", "BYTES",
            "RATE", "AGE", "IDLE", "NOTE")  # fmt: skip


def _print_rows(rows: list[ConnectionRow], *, rates: bool) -> None:
    columns: tuple[str, ...] = _COLUMNS
    if rates:  # the busiest first, as one looks for who holds the link
        rows = sorted(rows, key=lambda row: -(row.rate or 0.0))
    else:
        columns = tuple(name for name in _COLUMNS if name != "RATE")
    _print_table(columns, [_cells(row, rates) for row in rows])


def _print_table(columns: tuple[str, ...], lines: list[tuple[str, ...]]) -> None:
    table = [columns, *lines]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    for line in table:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        )


def _cells(row: ConnectionRow, rates: bool) -> tuple[str, ...]:
    pid = str(row.pid)
    if row.host_pid is not None:
        pid = f"{row.host_pid} ({row.pid} in its ns)"
    elif row.other_namespace:
        pid = f"{row.pid} (other ns)"
    flags = (("closed", row.state == "closed"), ("moved", row.moved))
    notes = [word for word, on in flags if on]
    if row.process != "running":
        notes.append(f"process {row.process}")
    if row.sdk_flow is not None:
        notes.append(f"sdk {row.sdk_flow}")
    return (
        str(row.slot),
        pid,
        row.command or "?",
        row.cls,
        row.direction,
        "-" if row.peer_rank is None else str(row.peer_rank),
        "default" if row.level is None else str(row.level),
        "-" if row.applied_level is None else str(row.applied_level),
        "-" if row.dscp is None else str(row.dscp),
        _bytes(row.bytes),
        *([_bits_per_second(row.rate)] if rates else []),
        _seconds(row.age_s),
        _seconds(row.idle_s),
        ",".join(notes),
    )


def _bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def _bits_per_second(rate: float | None) -> str:
    """``rate`` (bytes/s) in bits per second, as tc and ss print rates."""
    if rate is None:
        return "-"
    bits = rate * 8
    for unit in ("bit", "Kbit", "Mbit", "Gbit"):
        if bits < 1000 or unit == "Gbit":
            return f"{bits:.0f} {unit}/s" if unit == "bit" else f"{bits:.1f} {unit}/s"
        bits /= 1000
    raise AssertionError("unreachable")


def _seconds(value: float) -> str:
    if value < 120:
        return f"{value:.1f}s"
    if value < 7200:
        return f"{value / 60:.0f}m"
    return f"{value / 3600:.0f}h"
