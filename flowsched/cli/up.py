"""``flowsched up``: a coordinator and a local agent on one machine, until Ctrl-C.

Uses the embedded default policy (or ``--policy``), creates the token file (mode 0600) when it
is missing, and prints the environment that NCCL processes on this machine should export.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shlex
import socket
import sys
from pathlib import Path
from typing import Any

from flowsched.agent import AgentConfig, ReadyInfo, default_table_path
from flowsched.agent import serve as serve_agent
from flowsched.agent.config import AgentConfigError
from flowsched.cli._common import host_port, loop_factory, setup_logging
from flowsched.client import default_socket_path
from flowsched.coordinator import Addresses, CoordinatorConfig
from flowsched.coordinator import serve as serve_coordinator
from flowsched.protocol import DEFAULT_TOKEN_PATH, TokenFileError, load_token, write_token
from flowsched.signals import wait_for_signal


def register(sub: Any) -> None:
    """Add the ``up`` subcommand."""
    parser = sub.add_parser(
        "up",
        help="run a coordinator and a local agent on this machine",
        description="Start a coordinator and a node agent with the embedded default policy and "
        "print the environment to export for NCCL. Runs until Ctrl-C.",
    )
    parser.add_argument("--policy", metavar="FILE", help="policy file (default: embedded)")
    parser.add_argument("--listen", default="127.0.0.1:7711", type=host_port, metavar="HOST:PORT")
    parser.add_argument(
        "--metrics-port", type=int, default=9711, metavar="N", help="coordinator metrics (0 = any)"
    )
    parser.add_argument("--agent-metrics-port", type=int, default=0, metavar="N")
    parser.add_argument("--node", default=socket.gethostname())
    parser.add_argument(
        "--token-file",
        default=None,
        metavar="F",
        help=f"created if missing (default {DEFAULT_TOKEN_PATH})",
    )
    parser.add_argument("--table", default=None, metavar="PATH")
    parser.add_argument("--socket", default=None, metavar="PATH")
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING"])
    parser.add_argument("--no-uvloop", action="store_true")
    parser.set_defaults(func=_run)


def ensure_token(path: str | None) -> str:
    """The token file path, creating a fresh token (mode 0600) if the file does not exist."""
    resolved = Path(os.path.expanduser(path or str(DEFAULT_TOKEN_PATH)))
    if not resolved.exists():
        resolved.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_token(resolved)
    load_token(resolved)  # refuses loose permissions
    return str(resolved)


def plugin_path() -> str | None:
    """The NCCL plugin library path, when the plugin package provides one."""
    try:
        from flowsched import nccl  # type: ignore[attr-defined]

        found = nccl.plugin_path()
    except Exception:
        return None
    return str(found) if found else None


def environment(table: str, sock: str) -> list[str]:
    """The ``export`` lines for NCCL processes on this machine."""
    lines = []
    path = plugin_path()
    if path:
        lines.append(f"export NCCL_NET_PLUGIN={shlex.quote(path)}")
    else:
        lines.append("# NCCL_NET_PLUGIN: the plugin library is not built (see `make plugin`)")
    lines += [
        "export NCCL_NET=flowsched",
        f"export FLOWSCHED_TABLE={shlex.quote(table)}",
        f"export FLOWSCHED_SOCKET={shlex.quote(sock)}",
    ]
    return lines


def _run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    host, port = args.listen
    try:
        token_file = ensure_token(args.token_file)
        coord = CoordinatorConfig.from_policy_file(
            args.policy, load_token(token_file), host=host, port=port,
            metrics_port=args.metrics_port,
        )  # fmt: skip
        agent_cfg = _agent_config(args, token_file, coord.policy_text or None)
    except AgentConfigError as exc:
        print(f"flowsched up: --{exc.field}: {exc.problem}", file=sys.stderr)
        return 2
    except (TokenFileError, ValueError, OSError) as exc:
        print(f"flowsched up: {exc}", file=sys.stderr)
        return 2
    with asyncio.Runner(loop_factory=loop_factory(args.no_uvloop)) as runner:
        runner.run(_up(coord, agent_cfg))
    return 0


def _agent_config(args: argparse.Namespace, token_file: str, policy: str | None) -> AgentConfig:
    # checked before anything starts; the coordinator's address is filled in once it listens
    return AgentConfig(
        node=args.node,
        socket_path=args.socket or default_socket_path(),
        table_path=args.table or default_table_path(),
        token_file=token_file,
        policy_text=policy,
        metrics_port=args.agent_metrics_port,
    )


async def _up(coord: CoordinatorConfig, agent_cfg: AgentConfig) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = asyncio.create_task(wait_for_signal())
    signals.add_done_callback(lambda _: stop.set())
    ready: asyncio.Future[Addresses] = loop.create_future()
    coord.on_ready = ready.set_result
    coordinator = asyncio.create_task(serve_coordinator(coord, shutdown_trigger=stop.wait))
    addresses = await asyncio.wait_for(ready, 10)
    agent_cfg = dataclasses.replace(
        agent_cfg,
        coordinator=(addresses.host, addresses.port),
        on_ready=lambda info: _print(addresses, info),
    )
    agent = asyncio.create_task(serve_agent(agent_cfg, shutdown_trigger=stop.wait))
    done, _ = await asyncio.wait({coordinator, agent}, return_when=asyncio.FIRST_COMPLETED)
    stop.set()  # one ended (Ctrl-C, or a failure): stop the other cleanly too
    signals.cancel()
    await asyncio.gather(coordinator, agent, signals, return_exceptions=True)
    for task in done:
        task.result()


def _print(addresses: Addresses, info: ReadyInfo) -> None:
    metrics = (
        f" metrics {addresses.metrics_host}:{addresses.metrics_port}"
        if addresses.metrics_port
        else ""
    )
    agent_metrics = f" metrics {info.metrics[0]}:{info.metrics[1]}" if info.metrics else ""
    print(
        f"flowsched up: coordinator {addresses.host}:{addresses.port}{metrics}; "
        f"agent node={info.node}{agent_metrics}",
        flush=True,
    )
    print("# environment for NCCL processes on this machine:", flush=True)
    for line in environment(info.table, info.socket):
        print(line, flush=True)
    print("# Ctrl-C stops both.", flush=True)
