"""``flowsched agent``: run the node agent."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Any

from flowsched import qos, rundir
from flowsched.agent import AgentConfig, ReadyInfo, default_table_path, serve
from flowsched.agent.config import AgentConfigError, default_socket_path
from flowsched.agent.sdk_server import SocketPathError
from flowsched.cli._common import (
    AGENT_METRICS_PORT,
    EXIT_FAILURE,
    ResolverUnavailable,
    UsageError,
    add_metrics_flags,
    check_bindable,
    check_group,
    check_interface,
    check_parent_dir,
    check_socket_path,
    check_table_path,
    fail,
    host_port,
    metrics_address,
    metrics_port_flag,
    positive_int,
    resolve,
    run_daemon,
    setup_logging,
)
from flowsched.protocol import TokenFileError, load_token
from flowsched.qos import link_speed
from flowsched.shm import layout
from flowsched.shm.table import TableError
from flowsched.tls import TlsConfigError, client_context


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
        type=host_ports,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="coordinator address, or the addresses of an etcd-elected group (the agent follows"
        " the leader; docs/ha.md); omit to run the policy locally only",
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
        help="flow table (default $FLOWSCHED_TABLE, else 'table' in /run/flowsched for root, "
        "$XDG_RUNTIME_DIR/flowsched otherwise, /tmp/flowsched-<uid> without it)",
    )
    parser.add_argument(
        "--socket",
        default=None,
        metavar="PATH",
        help="SDK socket (default $FLOWSCHED_SOCKET, else 'agent.sock' in the agent's runtime "
        "directory of --table's default, where the SDK looks; a --table or $FLOWSCHED_TABLE "
        "elsewhere does not move it)",
    )
    parser.add_argument(
        "--group",
        default=None,
        help="group allowed to use the table and the socket (directory 0750, files 0660). "
        "Trust: every member controls every level on this node, like the docker group; "
        "the agent repairs tampered slots within a second (docs/security.md)",
    )
    parser.add_argument(
        "--slots",
        type=positive_int,
        default=layout.DEFAULT_NUM_SLOTS,
        metavar="N",
        help="flow table slots: plugin connections at once (default %(default)s). Used when "
        "the table is created; an existing table keeps its size (a warning says so; "
        "docs/deploy.md says how to resize)",
    )
    add_metrics_flags(parser, AGENT_METRICS_PORT)
    parser.add_argument("--fallback-after", type=float, default=1.0, metavar="SECONDS")
    parser.add_argument(
        "--first-level-wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="how long an SDK open waits for the coordinator's first level (default 0: "
        "answered at once with the local policy's level, the coordinator's follows)",
    )
    parser.add_argument(
        "--interface",
        action="append",
        default=[],
        metavar="IF",
        help="NIC to monitor (repeatable; default: the hardware NICs that are up, so not pods' "
        "veths nor CNI bridges; where there is none, every interface that is up but loopback)",
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
    parser.add_argument(
        "--qos-dev",
        metavar="IFACE",
        help="install the policy's strict-priority egress classes on IFACE at start and on every "
        "policy change (as `flowsched qos apply`; needs CAP_NET_ADMIN)",
    )
    parser.add_argument(
        "--qos-rate",
        type=qos_rate,
        metavar="RATE",
        help="rate those classes shape at, e.g. 25gbit (default: IFACE's link speed)",
    )
    parser.add_argument(
        "--qos-check-interval",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="how often to check that IFACE's classes are in place and restore them "
        "(default %(default)g)",
    )
    add_tls_flags(parser)
    parser.add_argument(
        "--allow-unproven-coordinator",
        action="store_true",
        help="accept a coordinator of an older release over plain TCP (protocol below 5: it "
        "does not seal frames, and below 3 cannot prove that it holds the token): only while "
        "upgrading agents before coordinators (docs/protocol.md); TLS with a verified "
        "certificate needs no flag",
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"])
    parser.add_argument("--no-uvloop", action="store_true", help="use the plain asyncio loop")
    parser.set_defaults(func=_run)


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    """The agent's flags for a coordinator that serves TLS (``--tls-cert``)."""
    tls = parser.add_argument_group(
        "TLS to the coordinator", "needed when it serves TLS; any of these turns TLS on"
    )
    tls.add_argument(
        "--tls", action="store_true",
        help="connect over TLS, verifying the coordinator against the system's CAs",
    )  # fmt: skip
    tls.add_argument("--tls-ca", metavar="FILE", help="verify the coordinator against this CA")
    tls.add_argument(
        "--tls-cert", metavar="FILE",
        help="client certificate (PEM), for a coordinator started with --tls-client-ca",
    )  # fmt: skip
    tls.add_argument("--tls-key", metavar="FILE", help="its unencrypted private key (PEM)")
    tls.add_argument(
        "--tls-server-name", metavar="NAME",
        help="name the coordinator's certificate must carry (default: the host dialled)",
    )  # fmt: skip


def host_ports(text: str) -> list[tuple[str, int]]:
    """argparse type for ``HOST:PORT[,HOST:PORT...]`` (several: an HA coordinator group)."""
    return [host_port(part.strip()) for part in text.split(",")]


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    """Build the agent's config; raises ValueError / TokenFileError with a clear message."""
    if args.coordinator is not None:
        load_token(args.token_file)  # refuse a missing or loose token file before starting
    policy_text = None
    if args.policy:
        from flowsched import policyfile

        try:
            policy_text = policyfile.read_text(args.policy)
            policyfile.loads(policy_text, source=args.policy)
        except policyfile.PolicyFileError as exc:
            raise UsageError(policyfile.problem("--policy", args.policy, exc)) from None
    overrides = {
        name: getattr(args, name)
        for name in ("link_capacity", "nic_interval")
        if getattr(args, name) is not None
    }
    try:
        config = _config(args, policy_text, overrides)
    except AgentConfigError as exc:  # name the flag, not the config field
        raise ValueError(f"{_FLAGS.get(exc.field, exc.field)}: {exc.problem}") from None
    preflight(config, metrics_port_flag(args))
    return config


def check_coordinators_resolve(hosts: list[str]) -> None:
    """UsageError when no coordinator name resolves; a warning on stderr for each of several
    that does not (a replica's name exists only while its pod does, e.g. during a rollout:
    the agent connects to the others and retries it). A name the resolver could not answer
    for (no DNS server reachable: a node's boot, a cluster's cold start before its DNS pods
    run) is a warning too: the agent starts, runs the local policy and retries it, as it
    does when DNS fails later."""
    unresolved, unanswered = [], []
    for host in hosts:
        try:
            resolve("--coordinator", host)
        except ResolverUnavailable as exc:
            unanswered.append(str(exc))
        except UsageError as exc:
            unresolved.append(str(exc))
    if len(unresolved) == len(hosts):
        if len(hosts) == 1:
            raise UsageError(unresolved[0])
        raise UsageError(f"{unresolved[0]}; no other --coordinator resolves either")
    for problem in unanswered:
        print(f"{PROG}: warning: {problem}; starting, and retrying it", file=sys.stderr)
    for problem in unresolved:
        print(f"{PROG}: warning: {problem}; trying the others", file=sys.stderr)


def preflight(config: AgentConfig, metrics_flag: str = "--metrics-port") -> None:
    """Refuse, before anything starts, what would make the agent fail: raises UsageError."""
    if not _is_default_table(config.table_path):  # the default directory is the agent's own
        check_table_path("--table", config.table_path)
        check_parent_dir("--table", config.table_path)
    elif os.environ.get("FLOWSCHED_TABLE"):  # the jobs' FLOWSCHED_TABLE too: the same limit
        check_table_path("FLOWSCHED_TABLE", config.table_path)
    check_socket_path("--socket", config.socket_path)
    for name in config.interfaces:
        check_interface("--interface", name)
    if config.qos_dev is not None:
        check_interface("--qos-dev", config.qos_dev)
        if config.qos_rate is None and link_speed(config.qos_dev) is None:
            raise UsageError(f"--qos-rate: {config.qos_dev} reports no link speed; give one")
    if config.group is not None:
        check_group("--group", config.group)
    if config.coordinator is not None:
        check_coordinators_resolve([host for host, _ in (config.coordinator, *config.coordinators)])
        if config.tls:
            try:
                client_context(config.tls_ca, config.tls_cert, config.tls_key)
            except TlsConfigError as exc:
                raise UsageError(f"{_FLAGS[exc.field]}: {exc.problem}") from None
    if config.metrics_port is not None:
        check_bindable(metrics_flag, config.metrics_host, config.metrics_port, "--metrics-bind")


def _is_default_table(path: str) -> bool:
    try:
        return os.path.abspath(path) == os.path.abspath(default_table_path())  # up's is absolute
    except rundir.RuntimeDirError:
        return False  # there is no usable default (a long XDG_RUNTIME_DIR): the path was given


#: AgentConfig fields set from flags whose names differ
_FLAGS = {
    "node": "--node",
    "fallback_after": "--fallback-after",
    "first_level_wait": "--first-level-wait",
    "default_bandwidth": "--link-bandwidth",
    "link_capacity": "--link-capacity",
    "nic_interval": "--nic-interval",
    "qos_check_interval": "--qos-check-interval",
    "num_slots": "--slots",
    "tls_ca": "--tls-ca",
    "tls_cert": "--tls-cert",
    "tls_key": "--tls-key",
}


def _config(
    args: argparse.Namespace, policy_text: str | None, overrides: dict[str, float]
) -> AgentConfig:
    metrics = metrics_address(args)
    return AgentConfig(
        node=args.node,
        socket_path=args.socket or default_socket_path(),
        table_path=args.table or default_table_path(),
        coordinator=args.coordinator[0] if args.coordinator else None,
        coordinators=tuple(args.coordinator[1:]) if args.coordinator else (),
        token_file=args.token_file,
        tls=args.tls,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_server_name=args.tls_server_name,
        allow_unproven_coordinator=args.allow_unproven_coordinator,
        policy_text=policy_text,
        metrics_host=metrics[0] if metrics else "127.0.0.1",
        metrics_port=metrics[1] if metrics else None,
        fallback_after=args.fallback_after,
        first_level_wait=args.first_level_wait,
        num_slots=args.slots,
        group=args.group,
        interfaces=tuple(args.interface),
        default_bandwidth=args.link_bandwidth,
        qos_dev=args.qos_dev,
        qos_rate=args.qos_rate,
        qos_check_interval=args.qos_check_interval,
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
    except (TokenFileError, ValueError, OSError, rundir.RuntimeDirError) as exc:
        return fail(PROG, str(exc))
    try:
        return run_daemon(PROG, lambda: serve(config), args.no_uvloop)
    except (TableError, SocketPathError, PermissionError) as exc:  # table or socket in the way
        return fail(PROG, str(exc))
    except qos.QosError as exc:  # --qos-dev asked for and tc refused
        return fail(PROG, f"--qos-dev: {exc}", EXIT_FAILURE)
    except qos.QosInputError as exc:  # the device went away after config_from_args checked it
        return fail(PROG, str(exc).replace("--dev:", "--qos-dev:", 1))


PROG = "flowsched agent"


def qos_rate(text: str) -> int:
    """argparse type for ``--qos-rate``."""
    try:
        return qos.parse_rate(text)
    except qos.QosInputError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--rate: ")) from None
