"""``flowsched coordinator``: run the cluster coordinator."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable
from typing import Any

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
    parser.add_argument("--listen", default="127.0.0.1:7711", type=_host_port, metavar="HOST:PORT")
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


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
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
        print(f"flowsched coordinator: {exc}", file=sys.stderr)
        return 2
    with asyncio.Runner(loop_factory=_loop_factory(args.no_uvloop)) as runner:
        runner.run(serve(config))
    return 0


def _print_ready(addresses: Addresses) -> None:
    print(
        f"flowsched-coordinator listening on {addresses.host}:{addresses.port}"
        f" metrics {addresses.metrics_host}:{addresses.metrics_port}",
        flush=True,
    )


def _loop_factory(disabled: bool) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if disabled:
        return None
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory
