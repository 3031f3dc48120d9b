"""``flowsched coordinator``: run the cluster coordinator."""

from __future__ import annotations

import argparse
from typing import Any

from flowsched import policyfile
from flowsched.cli._common import (
    COORDINATOR_METRICS_PORT,
    EXIT_FAILURE,
    add_metrics_flags,
    check_bindable,
    check_distinct_ports,
    fail,
    host_port,
    metrics_address,
    metrics_port_flag,
    run_daemon,
    setup_logging,
)
from flowsched.coordinator import Addresses, CoordinatorConfig, serve
from flowsched.coordinator.election import ElectionError, EtcdElection, LeadershipLost
from flowsched.policyfile import PolicyFileError
from flowsched.protocol import (
    FRAME_MAC_VERSION,
    MIN_PROTOCOL_VERSION,
    TokenFileError,
    load_token,
)
from flowsched.tls import server_context


def register(sub: Any) -> None:
    """Add the ``coordinator`` subcommand."""
    parser = sub.add_parser(
        "coordinator",
        help="run the cluster coordinator",
        description="Rank the cluster's flows with the policy and push level changes to agents.",
    )
    parser.add_argument("--policy", metavar="FILE", help="policy file (default: embedded default)")
    parser.add_argument("--listen", default="127.0.0.1:7711", type=host_port, metavar="HOST:PORT")
    add_metrics_flags(parser, COORDINATOR_METRICS_PORT)
    parser.add_argument("--token-file", metavar="F", help="default ~/.config/flowsched/token")
    parser.add_argument(
        "--idle-timeout", type=float, default=2.0, metavar="S",
        help="close an agent connection silent for S seconds (agents heartbeat every 0.2 s)",
    )  # fmt: skip
    parser.add_argument(
        "--handshake-timeout", type=float, default=5.0, metavar="S",
        help="seconds a new connection has for its whole handshake (with TLS, the TLS"
        " handshake included)",
    )  # fmt: skip
    parser.add_argument(
        "--min-agent-version", type=int, default=MIN_PROTOCOL_VERSION, metavar="V",
        help="refuse agents that offer a lower protocol version (default %(default)s: every"
        f" release); {FRAME_MAC_VERSION} once every agent is of this release, so that no"
        " unsealed session can open in a node's name (docs/protocol.md)",
    )  # fmt: skip
    parser.add_argument(
        "--max-unauthenticated", type=int, default=2048, metavar="N",
        help="connections (TLS handshakes included) allowed before they authenticate; at the cap"
        " the oldest goes (default 2048: every agent of a large cluster reconnecting at once;"
        " with TLS each costs up to ~360 KiB, docs/security.md)",
    )  # fmt: skip
    parser.add_argument(
        "--max-flows-per-node", type=int, default=65536, metavar="N",
        help="open flows one agent may have; its opens beyond are refused, logged and counted"
        " (default 65536: real nodes have tens)",
    )  # fmt: skip
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"])
    parser.add_argument(
        "--no-batch", action="store_true", help="run the policy per message (benchmark baseline)"
    )
    parser.add_argument(
        "--max-batch-delay", type=float, default=0.001, metavar="S",
        help="flush a batch of events once it has been collecting for S seconds, even within"
        " one event-loop turn (default 0.001; inf: once per turn, the benchmark baseline)",
    )  # fmt: skip
    parser.add_argument(
        "--per-flow-policy", choices=["auto", "yes", "no"], default="auto",
        help="yes: the policy decides each flow on its own, so events re-evaluate only the flows"
        " they touch (true of fair, static, sjf, pias, karuna, and rmlq unless red_tiers > 1 or"
        ' feasibility_check = "mlu"; not of edf, llf); auto: ask the policy',
    )  # fmt: skip
    parser.add_argument(
        "--promotion", choices=["timers", "sweep"], default="timers",
        help="timers: re-evaluate a flow when its next promotion time (from the policy) comes;"
        " sweep: re-evaluate every deadline flow each timer period (benchmark baseline)",
    )  # fmt: skip
    parser.add_argument(
        "--no-rebuild-batching", action="store_true",
        help="re-evaluate resynced flows every loop turn (benchmark baseline of bench/takeover.py)",
    )  # fmt: skip
    ha = parser.add_argument_group(
        "high availability", "several coordinators elect one leader through etcd (docs/ha.md)"
    )
    ha.add_argument(
        "--etcd", metavar="URLS",
        help="etcd client URLs, one per member, comma-separated, e.g. "
        "http://10.0.0.5:2379,http://10.0.0.6:2379,http://10.0.0.7:2379",
    )  # fmt: skip
    ha.add_argument(
        "--etcd-cacert", metavar="FILE",
        help="PEM CA bundle verifying etcd's server certificate (https; default: the system "
        "trust store)",
    )  # fmt: skip
    ha.add_argument(
        "--etcd-cert", metavar="FILE",
        help="PEM client certificate for etcd's --client-cert-auth (with --etcd-key)",
    )  # fmt: skip
    ha.add_argument("--etcd-key", metavar="FILE", help="its PEM private key (unencrypted)")
    ha.add_argument(
        "--election-name", default="flowsched", metavar="NAME",
        help="coordinators of one cluster share it (default: flowsched)",
    )  # fmt: skip
    ha.add_argument(
        "--lease-ttl", type=int, metavar="S",
        help="leader lease TTL in whole seconds (default 2 with one --etcd URL, 10 with several:"
        " outlasting a change of etcd's own leader; a silent leader host is replaced after "
        "about this long, a crashed leader process within a few hundred ms)",
    )  # fmt: skip
    ha.add_argument(
        "--advertise", metavar="HOST:PORT",
        help="address agents and standbys reach this coordinator at (default: --listen, or "
        "this host's name for a wildcard address)",
    )  # fmt: skip
    tls = parser.add_argument_group(
        "TLS", "serve agents over TLS (agents then need --tls or --tls-ca; docs/deploy.md)"
    )
    tls.add_argument("--tls-cert", metavar="FILE", help="certificate (chain), PEM")
    tls.add_argument("--tls-key", metavar="FILE", help="its unencrypted private key, PEM")
    tls.add_argument(
        "--tls-client-ca", metavar="FILE",
        help="require every agent to present a client certificate signed by this CA (mutual TLS)",
    )  # fmt: skip
    tls.add_argument(
        "--tls-client-names", choices=("node", "any"), default="node",
        help="with --tls-client-ca: 'node' (default) admits an agent only as a node its "
        "certificate names (subjectAltName DNS or CN); 'any' lets any certificate the CA "
        "signed log in as any node",
    )  # fmt: skip
    parser.add_argument("--no-uvloop", action="store_true", help="use the plain asyncio loop")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    try:
        token = load_token(args.token_file)
        host, port = args.listen
        metrics_host, metrics_port = metrics_address(args) or ("127.0.0.1", None)
        config = CoordinatorConfig.from_policy_file(
            args.policy, token, host=host, port=port, metrics_host=metrics_host,
            metrics_port=metrics_port, batching=not args.no_batch, on_ready=_print_ready,
            max_batch_delay=args.max_batch_delay, max_unauthenticated=args.max_unauthenticated,
            min_agent_version=args.min_agent_version,
            max_flows_per_node=args.max_flows_per_node,
            idle_timeout=args.idle_timeout, handshake_timeout=args.handshake_timeout,
            per_flow_decisions={"auto": None, "yes": True, "no": False}[args.per_flow_policy],
            promotion=args.promotion, rebuild_batching=not args.no_rebuild_batching,
            etcd=args.etcd, etcd_cacert=args.etcd_cacert, etcd_cert=args.etcd_cert,
            etcd_key=args.etcd_key, election_name=args.election_name, lease_ttl=args.lease_ttl,
            advertise=args.advertise, tls_cert=args.tls_cert, tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca, tls_client_names=args.tls_client_names,
        )  # fmt: skip
        preflight(config, metrics_port_flag(args))
    except PolicyFileError as exc:
        return fail("flowsched coordinator", policyfile.problem("--policy", args.policy, exc))
    except (TokenFileError, ValueError) as exc:  # UsageError too
        return fail("flowsched coordinator", _flag_named(str(exc)))
    except ElectionError as exc:
        return fail("flowsched coordinator", str(exc))
    try:
        return run_daemon("flowsched coordinator", lambda: serve(config), args.no_uvloop)
    except LeadershipLost as exc:  # it stopped deciding; restarted, it comes back as a standby
        return fail("flowsched coordinator", f"{exc}: exiting", EXIT_FAILURE)


def preflight(config: CoordinatorConfig, metrics_flag: str = "--metrics-port") -> None:
    """Refuse a taken, privileged or foreign address, or unusable etcd settings (TLS files
    loaded), before anything starts (UsageError, ElectionError)."""
    check_bindable("--listen", config.host, config.port)
    if config.metrics_port is not None:
        check_distinct_ports(
            [
                ("--listen", config.host, config.port),
                (metrics_flag, config.metrics_host, config.metrics_port),
            ]
        )
    if config.tls_cert is not None and config.tls_key is not None:  # TlsConfigError
        server_context(config.tls_cert, config.tls_key, config.tls_client_ca)
    if config.etcd is not None:  # URL, TTL, name, TLS files, etcd3gw package (ElectionError)
        EtcdElection.from_config(config, config.advertise or "")
    if config.metrics_port is not None:
        check_bindable(metrics_flag, config.metrics_host, config.metrics_port, "--metrics-bind")


#: CoordinatorConfig fields whose errors the CLI reports under the flag's name
_FLAG_FIELDS = (
    "idle_timeout", "handshake_timeout", "max_batch_delay", "max_unauthenticated",
    "max_flows_per_node", "min_agent_version", "tls_client_names",
    "tls_cert", "tls_key", "tls_client_ca", "etcd_cacert", "etcd_cert", "etcd_key",
)  # fmt: skip


def _flag_named(message: str) -> str:
    """A config error names the field (``idle_timeout: ...``): name the flag instead."""
    field, sep, rest = message.partition(":")
    if sep and field in _FLAG_FIELDS:
        return f"--{field.replace('_', '-')}:{rest}"
    return message


def _print_ready(addresses: Addresses) -> None:
    print(
        f"flowsched-coordinator listening on {addresses.listen_text()} metrics "
        f"{addresses.metrics_text()}",
        flush=True,
    )
