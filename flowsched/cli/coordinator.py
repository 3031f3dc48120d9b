"""``flowsched coordinator``: run the cluster coordinator."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from flowsched.cli._common import host_port, loop_factory, setup_logging
from flowsched.coordinator import Addresses, CoordinatorConfig, serve
from flowsched.protocol import TokenFileError, load_token


def register(sub: Any) -> None:
    """Add the ``coordinator`` subcommand."""
    parser = sub.add_parser(
        "coordinator",
        help="run the cluster coordinator",
        description="Rank the cluster's flows with the policy and push level changes to agents.",
    )
    parser.add_argument("--policy", metavar="FILE", help="policy file (default: embedded default)")
    parser.add_argument("--listen", default="127.0.0.1:7711", type=host_port, metavar="HOST:PORT")
    parser.add_argument("--metrics-port", type=int, default=9711, metavar="N", help="0 = any")
    parser.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST")
    parser.add_argument("--token-file", metavar="F", help="default ~/.config/flowsched/token")
    parser.add_argument(
        "--idle-timeout", type=float, default=2.0, metavar="S",
        help="close an agent connection silent for S seconds (agents heartbeat every 0.2 s)",
    )  # fmt: skip
    parser.add_argument(
        "--handshake-timeout", type=float, default=5.0, metavar="S",
        help="seconds allowed for each handshake step of a new connection",
    )  # fmt: skip
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"])
    parser.add_argument(
        "--no-batch", action="store_true", help="run the policy per message (benchmark baseline)"
    )
    parser.add_argument(
        "--per-flow-policy", choices=["auto", "yes", "no"], default="auto",
        help="yes: the policy decides each flow on its own, so events re-evaluate only the flows"
        " they touch (true of rmlq with red_tiers = 1, sjf, fair, static); auto: ask the policy",
    )  # fmt: skip
    parser.add_argument("--no-uvloop", action="store_true", help="use the plain asyncio loop")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    try:
        token = load_token(args.token_file)
        host, port = args.listen
        config = CoordinatorConfig.from_policy_file(
            args.policy, token, host=host, port=port, metrics_host=args.metrics_host,
            metrics_port=args.metrics_port, batching=not args.no_batch, on_ready=_print_ready,
            idle_timeout=args.idle_timeout, handshake_timeout=args.handshake_timeout,
            per_flow_decisions={"auto": None, "yes": True, "no": False}[args.per_flow_policy],
        )  # fmt: skip
    except (TokenFileError, ValueError) as exc:
        print(f"flowsched coordinator: {_flag_named(str(exc))}", file=sys.stderr)
        return 2
    with asyncio.Runner(loop_factory=loop_factory(args.no_uvloop)) as runner:
        runner.run(serve(config))
    return 0


def _flag_named(message: str) -> str:
    """A config error names the field (``idle_timeout: ...``): name the flag instead."""
    field, sep, rest = message.partition(":")
    if sep and field in ("idle_timeout", "handshake_timeout"):
        return f"--{field.replace('_', '-')}:{rest}"
    return message


def _print_ready(addresses: Addresses) -> None:
    print(
        f"flowsched-coordinator listening on {addresses.host}:{addresses.port}"
        f" metrics {addresses.metrics_host}:{addresses.metrics_port}",
        flush=True,
    )
