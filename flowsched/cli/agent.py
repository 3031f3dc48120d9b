"""``flowsched agent``: run the node agent."""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
from pathlib import Path
from typing import Any

from flowsched.agent import AgentConfig, ReadyInfo, default_table_path, serve
from flowsched.agent.config import AgentConfigError
from flowsched.cli._common import host_port, loop_factory, setup_logging
from flowsched.client import default_socket_path
from flowsched.protocol import TokenFileError, load_token
from flowsched.shm import layout


def register(sub: Any) -> None:
    """Add the ``agent`` subcommand."""
    parser = sub.add_parser(
        "agent",
        help="run the node agent",
        description="Own the node's flow table, serve the SDK, report flows to the coordinator "
        "and apply the levels it decides (or run the policy locally while it is unreachable).",
    )
    parser.add_argument(
        "--coordinator",
        type=host_port,
        metavar="HOST:PORT",
        help="coordinator address (omit to run the policy locally only)",
    )
    parser.add_argument("--node", default=socket.gethostname(), help="node name (default: host)")
    parser.add_argument("--token-file", metavar="F", help="default ~/.config/flowsched/token")
    parser.add_argument(
        "--policy",
        metavar="FILE",
        help="policy until the coordinator sends one (default: embedded)",
    )
    parser.add_argument(
        "--table",
        default=None,
        metavar="PATH",
        help="flow table (default $FLOWSCHED_TABLE or /dev/shm/flowsched-table)",
    )
    parser.add_argument(
        "--socket",
        default=None,
        metavar="PATH",
        help="SDK socket (default $FLOWSCHED_SOCKET or a per-user path)",
    )
    parser.add_argument("--group", default=None, help="group allowed to use table and socket")
    parser.add_argument("--slots", type=int, default=layout.DEFAULT_NUM_SLOTS, metavar="N")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        metavar="N",
        help="0 = any free port, -1 = no metrics",
    )
    parser.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST")
    parser.add_argument("--fallback-after", type=float, default=1.0, metavar="SECONDS")
    parser.add_argument(
        "--interface",
        action="append",
        default=[],
        metavar="IF",
        help="NIC to monitor (repeatable; default: every interface that is up)",
    )
    parser.add_argument(
        "--link-bandwidth",
        type=float,
        default=25e9,
        metavar="BYTES_PER_S",
        help="capacity of links whose driver reports no speed",
    )
    parser.add_argument(
        "--link-capacity",
        type=float,
        default=None,
        metavar="BYTES_PER_S",
        help="node link capacity, overriding the sysfs speed (e.g. a shaped or virtual NIC; "
        "default $FLOWSCHED_LINK_CAPACITY, else sysfs)",
    )
    parser.add_argument(
        "--nic-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="NIC counter sampling period (default $FLOWSCHED_NIC_INTERVAL, else 1 s)",
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"])
    parser.add_argument("--no-uvloop", action="store_true", help="use the plain asyncio loop")
    parser.set_defaults(func=_run)


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    """Build the agent's config; raises ValueError / TokenFileError with a clear message."""
    if args.coordinator is not None:
        load_token(args.token_file)  # refuse a missing or loose token file before starting
    policy_text = None
    if args.policy:
        policy_text = Path(args.policy).read_text(encoding="utf-8")
        from flowsched import policyfile

        policyfile.loads(policy_text, source=args.policy)
    overrides = {
        name: getattr(args, name)
        for name in ("link_capacity", "nic_interval")
        if getattr(args, name) is not None
    }
    try:
        return _config(args, policy_text, overrides)
    except AgentConfigError as exc:  # name the flag, not the config field
        raise ValueError(f"{_FLAGS.get(exc.field, exc.field)}: {exc.problem}") from None


#: AgentConfig fields set from flags whose names differ
_FLAGS = {
    "node": "--node",
    "fallback_after": "--fallback-after",
    "default_bandwidth": "--link-bandwidth",
    "link_capacity": "--link-capacity",
    "nic_interval": "--nic-interval",
}


def _config(
    args: argparse.Namespace, policy_text: str | None, overrides: dict[str, float]
) -> AgentConfig:
    return AgentConfig(
        node=args.node,
        socket_path=args.socket or default_socket_path(),
        table_path=args.table or default_table_path(),
        coordinator=args.coordinator,
        token_file=args.token_file,
        policy_text=policy_text,
        metrics_host=args.metrics_host,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        fallback_after=args.fallback_after,
        num_slots=args.slots,
        group=args.group,
        interfaces=tuple(args.interface),
        default_bandwidth=args.link_bandwidth,
        on_ready=print_ready,
        **overrides,  # type: ignore[arg-type]
    )


def print_ready(info: ReadyInfo) -> None:
    """The one line printed once the agent is ready."""
    metrics = f"{info.metrics[0]}:{info.metrics[1]}" if info.metrics else "off"
    print(
        f"flowsched-agent ready node={info.node} table={info.table} socket={info.socket} "
        f"metrics={metrics}",
        flush=True,
    )


def _run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    try:
        config = config_from_args(args)
    except (TokenFileError, ValueError, OSError) as exc:
        print(f"flowsched agent: {exc}", file=sys.stderr)
        return 2
    try:
        with asyncio.Runner(loop_factory=loop_factory(args.no_uvloop)) as runner:
            runner.run(serve(config))
    except Exception as exc:  # startup failures (table, socket) end with a clear message
        from flowsched.agent.sdk_server import SocketPathError
        from flowsched.shm.table import TableError

        if not isinstance(exc, TableError | SocketPathError | PermissionError):
            raise
        print(f"flowsched agent: {exc}", file=sys.stderr)
        return 2
    return 0
