"""Host QoS: strict-priority egress classes selected by DSCP (``flowsched qos``).

The plugin marks each connection's packets with the DSCP of its level's hardware queue. This
module makes the host's own egress honour those marks, with the kernel features every Linux
host has (htb and u32; ``prio``/``mqprio`` are not available everywhere). The tree on ``DEV``::

    root qdisc htb 1: (default 1:f)
      class 1:1      the link rate (RATE)
        class 1:2    small packets (pure ACKs, control messages), prio 0
        class 1:10+q hardware queue q of the policy, prio min(q, 7)
        class 1:f    unmarked traffic, prio 7 (or --unmarked-prio)

Every leaf has a small guaranteed rate (``guarantee`` x RATE) and may borrow up to RATE;
spare bandwidth goes to the lowest htb prio first, which makes the queues strictly ordered.
u32 filters select the class from the DSCP of IPv4 (TOS byte) and IPv6 (traffic class),
ignoring the ECN bits. SO_PRIORITY is not used here: htb would read it only as a classid.

:func:`apply` is idempotent: it reads the device's tree back (``tc``), compares it with the
plan and runs only the changes (nothing when they agree), so applying a changed policy
converges without dropping the qdisc and its queued packets. See docs/qos.md.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from flowsched.policyfile import LevelMarking, PolicyConfig

#: classid minors of the fixed classes; queue q is QUEUE_CLASS_BASE + q
PARENT_CLASS = 0x1
SMALL_CLASS = 0x2
UNMARKED_CLASS = 0xF
QUEUE_CLASS_BASE = 0x10
#: htb knows priorities 0 (served first) .. 7
MAX_HTB_PRIO = 7
#: default guaranteed share of the link per class (a larger one drains a promoted flow's
#: backlog faster but weakens strict priority: see docs/qos.md)
DEFAULT_GUARANTEE = 0.01
#: u32 filter preferences (evaluated in this order)
PREF_SMALL_V4, PREF_SMALL_V6, PREF_DSCP_V4, PREF_DSCP_V6 = 1, 2, 3, 4
#: packets below these sizes go to the small-packet class: IPv4 total length < 128 bytes,
#: IPv6 payload length < 64 bytes (u32 matches by mask, so powers of two)
SMALL_V4_MASK = 0xFF80
SMALL_V6_MASK = 0xFFC0
TC_TIMEOUT = 10.0
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


class QosInputError(ValueError):
    """Bad input (unknown device, unreadable speed, bad rate): exit status 2."""


class QosError(RuntimeError):
    """``tc`` failed (no permission, no htb in this kernel): exit status 1."""


@dataclass(frozen=True, slots=True)
class TcClass:
    """One htb class as planned or as read back."""

    minor: int
    parent: int | None  # None = the root class
    prio: int | None  # None = inner class
    rate: int  # bit/s
    ceil: int  # bit/s


@dataclass(frozen=True, slots=True, order=True)
class TcFilter:
    """One single-key u32 filter as ``tc -j filter show`` reports it."""

    pref: int
    protocol: str
    value: int
    mask: int
    offset: int
    flowid: int  # classid minor under 1:


@dataclass(frozen=True, slots=True)
class Tree:
    """The part of a device's egress tree that :func:`apply` manages."""

    root: str  # e.g. "htb 1:" or "noqueue"
    default: int | None
    classes: dict[int, TcClass] = field(default_factory=dict)
    filters: frozenset[TcFilter] = frozenset()


@dataclass(frozen=True, slots=True)
class Plan:
    """The desired tree plus what each queue class carries (for ``show``)."""

    dev: str
    tree: Tree
    queue_dscps: dict[int, int]  # classid minor -> DSCP
    burst: int  # bytes


def parse_rate(text: str) -> int:
    """``200mbit``, ``25Gbit``, ``1e9`` (bit/s) -> bit/s; raises QosInputError."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not match or match.group(2) not in ("", *_UNITS):
        raise QosInputError(f"--rate: expected a rate like 200mbit or 25gbit, got {text!r}")
    bits = round(float(match.group(1)) * _UNITS.get(match.group(2), 1))
    if bits < 8000:
        raise QosInputError(f"--rate: {text!r} is below 8kbit")
    return bits


def link_speed(dev: str) -> int | None:
    """The device's line rate in bit/s from sysfs, or None when the driver reports none."""
    try:
        mbit = int(Path(f"/sys/class/net/{dev}/speed").read_text().strip())
    except (OSError, ValueError):
        return None
    return mbit * 10**6 if mbit > 0 else None


def check_device(dev: str) -> None:
    """Raise QosInputError unless ``dev`` is an interface of this network namespace."""
    try:
        socket.if_nametoindex(dev)
    except OSError:
        raise QosInputError(f"--dev: no network interface named {dev!r}") from None


def plan(
    dev: str,
    queues: Sequence[LevelMarking],
    rate: int,
    *,
    guarantee: float = DEFAULT_GUARANTEE,
    unmarked_prio: int = MAX_HTB_PRIO,
) -> Plan:
    """The tree for a policy's hardware-queue table (``PolicyConfig.queues``) at ``rate``."""
    if not 0 < guarantee * (len(queues) + 2) <= 1:
        raise QosInputError(
            f"--guarantee: {guarantee:g} x {len(queues) + 2} classes must be in (0, 1]"
        )
    if not 0 <= unmarked_prio <= MAX_HTB_PRIO:
        raise QosInputError(f"--unmarked-prio: expected 0..7, got {unmarked_prio}")
    floor = max(round(rate * guarantee), 8000)
    classes = {PARENT_CLASS: TcClass(PARENT_CLASS, None, None, rate, rate)}
    dscps: dict[int, int] = {}
    default = UNMARKED_CLASS
    leaves = [(SMALL_CLASS, 0)]
    for q, marking in enumerate(queues):
        minor = QUEUE_CLASS_BASE + q
        leaves.append((minor, min(q, MAX_HTB_PRIO)))
        dscps[minor] = marking.dscp
        if marking.dscp == 0:  # this queue is best effort: unmarked traffic belongs to it
            default = minor
    if default == UNMARKED_CLASS:
        leaves.append((UNMARKED_CLASS, unmarked_prio))
    for minor, prio in leaves:
        classes[minor] = TcClass(minor, PARENT_CLASS, prio, floor, rate)
    filters = {
        TcFilter(PREF_SMALL_V4, "ip", 0, SMALL_V4_MASK, 0, SMALL_CLASS),
        TcFilter(PREF_SMALL_V6, "ipv6", 0, SMALL_V6_MASK << 16, 4, SMALL_CLASS),
    }
    for minor, dscp in dscps.items():
        if dscp != 0:
            filters.add(TcFilter(PREF_DSCP_V4, "ip", dscp << 18, 0xFC << 16, 0, minor))
            filters.add(TcFilter(PREF_DSCP_V6, "ipv6", dscp << 22, 0xFC << 20, 0, minor))
    # ~1 ms of traffic per round, at least 32 KiB: a burst below rate/HZ caps the throughput
    burst = max(32 * 1024, rate // 8 // 1000)
    return Plan(dev, Tree("htb 1:", default, classes, frozenset(filters)), dscps, burst)


def plan_for_policy(
    dev: str, config: PolicyConfig, rate: int | None = None, **options: float
) -> Plan:
    """:func:`plan` for a validated policy file; ``rate`` None reads the line rate from sysfs."""
    check_device(dev)
    if rate is None:
        rate = link_speed(dev)
        if rate is None:
            raise QosInputError(f"--rate: {dev} reports no link speed; give the rate to shape at")
    return plan(dev, config.queues, rate, **options)  # type: ignore[arg-type]


# -- reading the device's tree back -------------------------------------------------------------


def _tc(args: Sequence[str], *, stdin: str | None = None) -> str:
    try:
        proc = subprocess.run(
            ["tc", *args], input=stdin, capture_output=True, text=True, timeout=TC_TIMEOUT
        )
    except FileNotFoundError:
        raise QosError("tc not found (install iproute2)") from None
    except subprocess.TimeoutExpired:
        raise QosError(f"tc {' '.join(args)}: no answer within {TC_TIMEOUT:g} s") from None
    if proc.returncode != 0:
        problem = " ".join(proc.stderr.split()) or f"exit status {proc.returncode}"
        if "Operation not permitted" in problem:
            problem += " (tc needs CAP_NET_ADMIN in the device's network namespace)"
        raise QosError(f"tc {args[0]}: {problem}")
    return proc.stdout


def observe(dev: str) -> Tree:
    """The device's current root qdisc, htb classes and u32 filters under ``1:``."""
    roots = [
        q for q in json.loads(_tc(["-j", "qdisc", "show", "dev", dev]) or "[]") if q.get("root")
    ]
    if not roots:
        return Tree("none", None)
    root = roots[0]
    label = f"{root['kind']} {root.get('handle', '')}".strip()
    if label != "htb 1:":
        return Tree(label, None)
    default = int(str(root.get("options", {}).get("default", "0")), 16)
    classes = parse_classes(_tc(["class", "show", "dev", dev]))
    filters = parse_filters(json.loads(_tc(["-j", "filter", "show", "dev", dev]) or "[]"))
    return Tree(label, default, classes, frozenset(filters))


_CLASS = re.compile(
    r"^class htb 1:([0-9a-f]+) (?:root|parent 1:([0-9a-f]+))(?: leaf \S+)?"
    r"(?: prio (\d+))? rate (\S+) ceil (\S+)"
)


def parse_classes(text: str) -> dict[int, TcClass]:
    """htb classes of ``tc class show`` output, by classid minor."""
    classes = {}
    for line in text.splitlines():
        if match := _CLASS.match(line):
            minor, parent, prio, rate, ceil = match.groups()
            classes[int(minor, 16)] = TcClass(
                int(minor, 16),
                None if parent is None else int(parent, 16),
                None if prio is None else int(prio),
                _printed_rate(rate),
                _printed_rate(ceil),
            )
    return classes


def _printed_rate(text: str) -> int:
    match = re.fullmatch(r"([0-9.]+)([KMGT]?)bit", text)
    if not match:
        return -1
    return round(
        float(match.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}[match.group(2)]
    )


def parse_filters(entries: Sequence[dict[str, object]]) -> set[TcFilter]:
    """Single-key u32 filters with a flowid under ``1:``, from ``tc -j filter show``."""
    found = set()
    for entry in entries:
        options = entry.get("options")
        if entry.get("kind") != "u32" or not isinstance(options, dict):
            continue
        match, flowid = options.get("match"), str(options.get("flowid", ""))
        if not isinstance(match, dict) or not flowid.startswith("1:"):
            continue
        found.add(
            TcFilter(
                int(str(entry["pref"])),
                str(entry["protocol"]),
                int(str(match["value"]), 16),
                int(str(match["mask"]), 16),
                int(str(match["off"])),
                int(flowid[2:], 16),
            )
        )
    return found


# -- converging -----------------------------------------------------------------------------


def _same_class(have: TcClass | None, want: TcClass) -> bool:
    if have is None or (have.parent, have.prio) != (want.parent, want.prio):
        return False
    return all(abs(h - w) <= 0.01 * w for h, w in ((have.rate, want.rate), (have.ceil, want.ceil)))


def changes(want: Plan, have: Tree) -> list[str]:
    """``tc -batch`` lines that turn ``have`` into ``want.tree`` (empty when they agree)."""
    dev, tree, lines = want.dev, want.tree, []
    if (have.root, have.default) != (tree.root, tree.default):
        # replace keeps the classes of an htb 1: (a change of its default) and swaps any other
        lines.append(f"qdisc replace dev {dev} root handle 1: htb default {tree.default:x}")
        if have.root != "htb 1:":
            have = Tree(tree.root, tree.default)
    filters_differ = have.filters != tree.filters
    if filters_differ and have.filters:
        lines.append(f"filter del dev {dev} parent 1:")
    for minor in sorted(tree.classes):  # parent first
        spec = tree.classes[minor]
        if not _same_class(have.classes.get(minor), spec):
            lines.append(_class_line(dev, spec, want.burst))
    stale = [m for m in have.classes if m not in tree.classes]
    for minor in sorted(stale, key=lambda m: have.classes[m].parent is None):  # leaves first
        lines.append(f"class del dev {dev} classid 1:{minor:x}")
    if filters_differ:
        lines += [_filter_line(dev, f) for f in sorted(tree.filters)]
    return lines


def _class_line(dev: str, spec: TcClass, burst: int) -> str:
    parent = "1:" if spec.parent is None else f"1:{spec.parent:x}"
    prio = "" if spec.prio is None else f" prio {spec.prio} quantum 60000"
    return (
        f"class replace dev {dev} parent {parent} classid 1:{spec.minor:x} htb"
        f" rate {spec.rate}bit ceil {spec.ceil}bit burst {burst} cburst {burst}{prio}"
    )


def _filter_line(dev: str, spec: TcFilter) -> str:
    return (
        f"filter add dev {dev} parent 1: protocol {spec.protocol} pref {spec.pref} u32"
        f" match u32 0x{spec.value:08x} 0x{spec.mask:08x} at {spec.offset}"
        f" flowid 1:{spec.flowid:x}"
    )


def apply(want: Plan, *, dry_run: bool = False) -> list[str]:
    """Converge the device to ``want``; return the ``tc`` lines run (empty: already in place).

    Raises:
        QosError: ``tc`` failed (no CAP_NET_ADMIN, no htb or u32 in this kernel).
    """
    lines = changes(want, observe(want.dev))
    if lines and not dry_run:
        _tc(["-batch", "-"], stdin="\n".join(lines) + "\n")
    return lines


def clear(dev: str) -> bool:
    """Remove the htb tree that :func:`apply` installed; False when there was none."""
    check_device(dev)
    if observe(dev).root != "htb 1:":
        return False
    _tc(["qdisc", "del", "dev", dev, "root"])
    return True


# -- showing --------------------------------------------------------------------------------

_SENT = re.compile(r"^\s*Sent (\d+) bytes (\d+) pkt \(dropped (\d+)")


def class_counters(dev: str) -> dict[int, tuple[int, int, int]]:
    """classid minor -> (bytes, packets, drops) sent by each htb class under ``1:``."""
    counters: dict[int, tuple[int, int, int]] = {}
    current = None
    for line in _tc(["-s", "class", "show", "dev", dev]).splitlines():
        if match := _CLASS.match(line):
            current = int(match.group(1), 16)
        elif (match := _SENT.match(line)) and current is not None:
            counters[current] = (int(match.group(1)), int(match.group(2)), int(match.group(3)))
            current = None
    return counters


def describe(dev: str) -> list[str]:
    """Human-readable lines: each class, the DSCPs that select it, its counters."""
    check_device(dev)
    tree = observe(dev)
    if tree.root != "htb 1:":
        return [f"{dev}: no flowsched classes (root qdisc: {tree.root})"]
    dscps: dict[int, list[str]] = {}
    for f in sorted(tree.filters):
        if f.pref in (PREF_DSCP_V4, PREF_DSCP_V6) and f.protocol == "ip":
            dscps.setdefault(f.flowid, []).append(str(f.value >> 18))
        elif f.pref == PREF_SMALL_V4:
            dscps.setdefault(f.flowid, []).append("small packets")
    counters = class_counters(dev)
    lines = [f"{dev}: htb 1:, unmarked traffic -> 1:{tree.default:x}"]
    lines.append("class  prio       rate      ceil     sent_bytes    packets  drops  selected by")
    for minor, spec in sorted(tree.classes.items()):
        sent, packets, drops = counters.get(minor, (0, 0, 0))
        what = ", ".join(dscps.get(minor, [])) or ("unmarked" if minor == tree.default else "-")
        if what[0].isdigit():
            what = f"DSCP {what}"
        prio = "-" if spec.prio is None else str(spec.prio)
        lines.append(
            f"1:{minor:<4x} {prio:>4}  {format_rate(spec.rate):>9} {format_rate(spec.ceil):>9}"
            f" {sent:>14} {packets:>10} {drops:>6}  {what}"
        )
    return lines


def format_rate(bits: int) -> str:
    """bit/s in tc's units: ``200Mbit``, ``2.5Gbit``."""
    for unit, scale in (("Tbit", 10**12), ("Gbit", 10**9), ("Mbit", 10**6), ("Kbit", 10**3)):
        if bits >= scale:
            return f"{bits / scale:.4g}{unit}"
    return f"{bits}bit"
