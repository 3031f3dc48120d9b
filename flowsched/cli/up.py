"""``flowsched up``: a coordinator and a local agent on one machine, until Ctrl-C.

Uses the embedded default policy (or ``--policy``), creates the token file (mode 0600) when it
is missing, and prints the environment that NCCL processes on this machine should export.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import os
import shlex
import socket
from pathlib import Path
from typing import Any

from flowsched import policyfile, rundir
from flowsched.agent import AgentConfig, ReadyInfo, default_table_path
from flowsched.agent import serve as serve_agent
from flowsched.agent.config import AgentConfigError, default_socket_path
from flowsched.agent.sdk_server import SocketPathError
from flowsched.cli._common import (
    AGENT_METRICS_PORT,
    COORDINATOR_METRICS_PORT,
    UsageError,
    check_bindable,
    check_distinct_ports,
    fail,
    host_port,
    port,
    run_daemon,
    setup_logging,
)
from flowsched.cli.agent import preflight as agent_preflight
from flowsched.coordinator import Addresses, CoordinatorConfig
from flowsched.coordinator import serve as serve_coordinator
from flowsched.policyfile import PolicyFileError
from flowsched.protocol import DEFAULT_TOKEN_PATH, TokenFileError, load_token, write_token
from flowsched.shm.table import TableError
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
        "--metrics-port",
        type=port,
        default=COORDINATOR_METRICS_PORT,
        metavar="N",
        help="coordinator metrics on 127.0.0.1 (0 = any free port)",
    )
    parser.add_argument(
        "--agent-metrics-port",
        type=port,
        default=AGENT_METRICS_PORT,
        metavar="N",
        help="agent metrics on 127.0.0.1 (0 = any free port)",
    )
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
    """The token file path, creating a fresh token (mode 0600) if the file does not exist.

    Raises:
        UsageError: it cannot be created (a file where a directory should be, no permission).
    """
    resolved = Path(os.path.expanduser(path or str(DEFAULT_TOKEN_PATH)))
    if not resolved.exists():
        try:
            resolved.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_token(resolved)
        except OSError as exc:  # mkdir says "File exists" of a file among the parents
            reason = "a parent is not a directory" if exc.errno == errno.EEXIST else exc.strerror
            raise UsageError(f"--token-file {resolved}: cannot create it ({reason})") from None
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
    host, listen_port = args.listen
    try:
        check_bindable("--listen", host, listen_port)  # before the token file is created
        check_bindable("--metrics-port", "127.0.0.1", args.metrics_port)
        check_distinct_ports(
            [
                ("--listen", host, listen_port),
                ("--metrics-port", "127.0.0.1", args.metrics_port),
                ("--agent-metrics-port", "127.0.0.1", args.agent_metrics_port),
            ]
        )
        token_file = ensure_token(args.token_file)
        coord = CoordinatorConfig.from_policy_file(
            args.policy, load_token(token_file), host=host, port=listen_port,
            metrics_port=args.metrics_port,
        )  # fmt: skip
        agent_cfg = _agent_config(args, token_file, coord.policy_text or None)
        agent_preflight(agent_cfg, metrics_flag="--agent-metrics-port")
    except AgentConfigError as exc:
        return fail(PROG, f"--{exc.field.replace('_', '-')}: {exc.problem}")
    except PolicyFileError as exc:
        return fail(PROG, policyfile.problem("--policy", args.policy, exc))
    except (TokenFileError, ValueError, OSError, rundir.RuntimeDirError) as exc:
        return fail(PROG, str(exc))
    try:
        return run_daemon(PROG, lambda: _up(coord, agent_cfg), args.no_uvloop)
    except (TableError, SocketPathError, PermissionError) as exc:  # as flowsched agent does:
        return fail(PROG, str(exc))  # a table or socket in the way, found as the agent starts


PROG = "flowsched up"


def _agent_config(args: argparse.Namespace, token_file: str, policy: str | None) -> AgentConfig:
    # checked before anything starts; the coordinator's address is filled in once it listens
    return AgentConfig(
        node=args.node,
        # absolute: they go into the exports, which jobs in other directories paste
        socket_path=os.path.abspath(args.socket or default_socket_path()),
        table_path=os.path.abspath(args.table or default_table_path()),
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
    started: set[asyncio.Future[Any]] = {ready, coordinator}
    await asyncio.wait(started, return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():  # the coordinator ended before it listened: its error, at once
        signals.cancel()
        await asyncio.gather(signals, return_exceptions=True)
        coordinator.result()
        return
    addresses = ready.result()
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
