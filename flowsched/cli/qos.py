"""``flowsched qos apply|show|clear``: the host's egress classes for the policy's DSCPs.

``apply`` installs (or converges to) one strict-priority htb class per hardware queue of the
policy file, selected by DSCP; running it again changes nothing. It replaces the kernel's
default root qdisc, and another one only with ``--force``. ``show`` prints the classes with
the DSCPs that select them and their counters; ``clear`` removes flowsched's tree and nothing
else. Needs CAP_NET_ADMIN in the device's network namespace. See :mod:`flowsched.qos`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from flowsched import policyfile, qos


def register(sub: Any) -> None:
    """Add the ``qos`` subcommand and its ``apply``/``show``/``clear`` actions."""
    parser = sub.add_parser(
        "qos",
        help="strict-priority egress classes by DSCP on a host interface (tc htb)",
        description="Make this host's egress honour the DSCP marks of the policy's hardware "
        "queues: one htb class per queue in strict priority, selected by u32 filters on the "
        "DSCP of IPv4 and IPv6 packets. Idempotent; replaces the kernel's default root qdisc "
        "(another only with --force); needs CAP_NET_ADMIN.",
    )
    actions = parser.add_subparsers(dest="qos_action", metavar="ACTION", required=True)
    apply = actions.add_parser("apply", help="install or update the classes (idempotent)")
    apply.add_argument("--dev", required=True, metavar="IFACE", help="egress interface")
    apply.add_argument("--policy", metavar="FILE", help="policy file (default: embedded)")
    apply.add_argument(
        "--rate",
        type=_rate,
        metavar="RATE",
        help="shape at this rate, e.g. 25gbit (default: the link speed from sysfs)",
    )
    apply.add_argument(
        "--guarantee",
        type=float,
        default=qos.DEFAULT_GUARANTEE,
        metavar="FRACTION",
        help="rate guaranteed to every class, as a fraction of RATE (default %(default)g)",
    )
    apply.add_argument(
        "--unmarked-prio",
        type=int,
        default=None,
        metavar="0-7",
        help="htb prio of traffic with no scheduled DSCP (default 7: last; a policy queue with "
        "DSCP 0 carries it at its own prio instead)",
    )
    apply.add_argument(
        "--force",
        action="store_true",
        help="replace a root qdisc that is not the kernel's default nor flowsched's",
    )
    apply.add_argument(
        "--dry-run", action="store_true", help="print the tc commands, change nothing"
    )
    apply.set_defaults(func=run_apply)
    show = actions.add_parser("show", help="print the classes, their DSCPs and counters")
    show.add_argument("--dev", required=True, metavar="IFACE")
    show.set_defaults(func=run_show)
    clear = actions.add_parser(
        "clear", help="remove flowsched's classes (the kernel default returns), nothing else"
    )
    clear.add_argument("--dev", required=True, metavar="IFACE")
    clear.set_defaults(func=run_clear)


def _rate(text: str) -> int:
    try:
        return qos.parse_rate(text)
    except qos.QosInputError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--rate: ")) from None


def run_apply(args: argparse.Namespace) -> int:
    """Converge the device to the policy's classes; print what changed."""
    try:
        config = policyfile.load(args.policy) if args.policy else policyfile.embedded_default()
        want = qos.plan_for_policy(
            args.dev,
            config,
            args.rate,
            guarantee=args.guarantee,
            unmarked_prio=args.unmarked_prio,
        )
        lines = qos.apply(want, dry_run=args.dry_run, force=args.force)
    except policyfile.PolicyFileError as exc:
        print(f"flowsched qos: {policyfile.problem('--policy', args.policy, exc)}", file=sys.stderr)
        return 2
    except qos.QosInputError as exc:
        print(f"flowsched qos: {_one_line(exc)}", file=sys.stderr)
        return 2
    except qos.QosError as exc:
        print(f"flowsched qos: {exc}", file=sys.stderr)
        return 1
    if advice := qos.rate_advice(want):
        print(f"flowsched qos: note: {advice}", file=sys.stderr)
    if args.dry_run:
        print("\n".join(lines) if lines else f"# {args.dev}: already in place")
    elif lines:
        print(f"{args.dev}: {len(want.queue_dscps)} queue classes applied ({len(lines)} changes)")
    else:
        print(f"{args.dev}: unchanged")
    return 0


def run_show(args: argparse.Namespace) -> int:
    """Print the device's classes with their DSCPs and counters."""
    return _guarded(lambda: print("\n".join(qos.describe(args.dev))))


def run_clear(args: argparse.Namespace) -> int:
    """Remove the tree; succeed also when there is none."""

    def clear() -> None:
        found = qos.clear(args.dev)
        if found.owner in ("ours", "legacy"):
            print(f"{args.dev}: cleared")
        elif found.owner == "foreign":
            print(f"{args.dev}: nothing to clear (root qdisc {found.root} is not flowsched's)")
        else:
            print(f"{args.dev}: nothing to clear")

    return _guarded(clear)


def _guarded(action: Any) -> int:
    try:
        action()
    except qos.QosInputError as exc:
        print(f"flowsched qos: {exc}", file=sys.stderr)
        return 2
    except qos.QosError as exc:
        print(f"flowsched qos: {exc}", file=sys.stderr)
        return 1
    return 0


def _one_line(exc: Exception) -> str:
    return "; ".join(str(exc).splitlines())
