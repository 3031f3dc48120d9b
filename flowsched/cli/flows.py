"""``flowsched flows``: the NCCL connections of this node's flow table, as ``ss`` shows sockets.

One line per connection: its process, class, direction and peer, the level the agent wants and
the level (with its DSCP) on its sockets, bytes, and the rate (bits per second, as tc and ss
print it) between two looks ``--interval`` apart (0: one look, no rates). The header says
whether an agent owns the table and follows a coordinator. Read-only (see
:mod:`flowsched.shm.listing`); ``--json`` for scripts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from typing import Any

from flowsched import rundir
from flowsched.cli._common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, fail
from flowsched.shm.listing import (
    ConnectionRow,
    TableSummary,
    connections,
    read_config,
    summarize,
    with_rates,
)
from flowsched.shm.table import FlowTable, TableError


def register(sub: Any) -> None:
    """Add the ``flows`` subcommand."""
    parser = sub.add_parser(
        "flows",
        help="list this node's NCCL connections, their levels and rates (the flow table)",
        description="List the connections in this node's flow table: process, class, the "
        "level the agent wants and the one on the sockets, DSCP, bytes and rate. Read-only.",
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
    parser.add_argument("--json", action="store_true", help="one JSON object: header and rows")
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
        return fail("flowsched flows", str(exc), EXIT_USAGE if args.table else EXIT_FAILURE)
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
            return fail("flowsched flows", f"{exc}; run it again", EXIT_FAILURE)
        rows = with_rates(rows, after, time.monotonic() - started)
    if args.json:
        document = {
            "table": dataclasses.asdict(summary),
            # comm_id as hex: a 64-bit hash that JSON readers keeping doubles would round
            "connections": [
                {**dataclasses.asdict(row), "comm_id": f"{row.comm_id:#018x}"} for row in rows
            ],
        }
        print(json.dumps(document, indent=2))
    else:
        print(_header(summary, len(rows)))
        _print_rows(rows, rates=args.interval > 0)
    return EXIT_OK


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
    table = [columns] + [_cells(row, rates) for row in rows]
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
