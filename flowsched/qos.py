"""Host QoS: strict-priority egress classes selected by DSCP (``flowsched qos``).

The plugin marks each connection's packets with the DSCP of its level's hardware queue. This
module makes the host's own egress honour those marks, with the kernel features every Linux
host has (htb and u32; ``prio``/``mqprio`` are not available everywhere). The tree on ``DEV``::

    root qdisc htb f5: (default f5:f)
      class f5:1      the link rate (RATE)
        class f5:10+q hardware queue q of the policy, prio min(q, 7)
        class f5:2    small packets without a queue's DSCP (pure ACKs), prio 0, ceil 10 %
        class f5:f    everything else, prio 7 (--unmarked-prio), or the prio of the
                      policy's DSCP-0 queue, which it then carries

Every leaf has a small guaranteed rate (``guarantee`` x RATE) and may borrow up to RATE;
spare bandwidth goes to the lowest htb prio first, which makes the queues strictly ordered.
u32 filters, in this order: a queue's DSCP (IPv4 TOS byte, IPv6 traffic class, ECN bits
ignored), then a zero length field (a BIG TCP packet over 64 KiB) to the default class, then
small packets to f5:2. SO_PRIORITY is not used here: htb would read it only as a classid.

The handle ``f5:`` marks the tree as ours: :func:`apply` replaces the kernel's default root
qdisc (handle ``0:``) and the tree of an earlier release (``htb 1:`` with its small-packet
filter), and refuses any other root unless forced. It is idempotent: it reads the tree back
(``tc``), compares it with the plan and runs only the changes, under a per-device lock, so
applying a changed policy converges without dropping the qdisc and its queued packets. See
docs/qos.md.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import socket
import subprocess
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from flowsched.flocks import lock_within
from flowsched.policyfile import LevelMarking, PolicyConfig

#: the tree's qdisc handle (major): unusual enough to mark a tree as flowsched's
HANDLE = 0xF5
#: the handle, the small-packet filter and its class of an earlier release's tree
LEGACY_HANDLE = 0x1
LEGACY_SIGNATURE = ("ip", 0, 0xFF80, 0, 0x2)  # protocol, value, mask, offset, flowid
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
#: the small-packet class may take at most this share of RATE: pure ACKs of a node receiving at
#: line rate need 2-5 %, and a flood of small unmarked packets must not starve the queues
SMALL_CEIL_SHARE = 0.1
#: u32 filter preferences (evaluated in this order): the queues' DSCPs first, so that a marked
#: packet always follows its queue; then a zero length field (BIG TCP: a GSO packet over
#: 64 KiB carries 0) to the default class, before the small-packet test would take it
PREF_DSCP_V4, PREF_DSCP_V6, PREF_BIG_V4, PREF_BIG_V6, PREF_SMALL_V4, PREF_SMALL_V6 = range(1, 7)
#: packets below these sizes go to the small-packet class: IPv4 total length < 128 bytes,
#: IPv6 payload length < 64 bytes (u32 matches by mask, so powers of two)
SMALL_V4_MASK = 0xFF80
SMALL_V6_MASK = 0xFFC0
#: above this rate one htb (one qdisc lock for every CPU) is the bottleneck: see docs/qos.md
HTB_RATE_ADVICE = 10 * 10**9
TC_TIMEOUT = 10.0
#: per-device locks, so that two applies (two agents, an agent and an operator) take turns;
#: the systemd units (RuntimeDirectory=) and the DaemonSet (a hostPath) make it writable
LOCK_DIR = Path("/run/flowsched-qos")
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


class QosInputError(ValueError):
    """Bad input (unknown device, unreadable speed, bad rate): exit status 2."""


class QosError(RuntimeError):
    """``tc`` failed (no permission, no htb in this kernel): exit status 1."""


class QosForeignRootError(QosError):
    """The device's root qdisc is someone else's; replaced only when forced (exit status 1)."""


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
    flowid: int  # classid minor under the tree's handle


@dataclass(frozen=True, slots=True)
class Tree:
    """The part of a device's egress tree that :func:`apply` manages."""

    root: str  # e.g. "htb f5:", "noqueue 0:" (a kernel default) or "none"
    default: int | None
    classes: dict[int, TcClass] = field(default_factory=dict)
    filters: frozenset[TcFilter] = frozenset()

    @property
    def owner(self) -> str:
        """``ours``, ``legacy`` (an earlier release's), ``kernel`` (its default) or ``foreign``."""
        if self.root == ROOT_LABEL:
            return "ours"
        if self.root == f"htb {LEGACY_HANDLE:x}:" and any(
            (f.protocol, f.value, f.mask, f.offset, f.flowid) == LEGACY_SIGNATURE
            for f in self.filters
        ):
            return "legacy"
        if self.root == "none" or self.root.endswith(" 0:"):
            return "kernel"
        return "foreign"


ROOT_LABEL = f"htb {HANDLE:x}:"


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
    unmarked_prio: int | None = None,
) -> Plan:
    """The tree for a policy's hardware-queue table (``PolicyConfig.queues``) at ``rate``.

    ``unmarked_prio`` (default 7) is the htb prio of traffic with no queue's DSCP; a policy
    queue with DSCP 0 carries that traffic itself, at its own prio, and then refuses one.
    """
    if not 0 < guarantee * (len(queues) + 2) <= 1:
        raise QosInputError(
            f"--guarantee: {guarantee:g} x {len(queues) + 2} classes must be in (0, 1]"
        )
    if unmarked_prio is not None and not 0 <= unmarked_prio <= MAX_HTB_PRIO:
        raise QosInputError(f"--unmarked-prio: expected 0..7, got {unmarked_prio}")
    best_effort = [q for q, marking in enumerate(queues) if marking.dscp == 0]
    if best_effort and unmarked_prio is not None:
        raise QosInputError(
            f"--unmarked-prio: the policy's queue {best_effort[0]} has DSCP 0 and carries the "
            f"unmarked traffic at its own prio {min(best_effort[0], MAX_HTB_PRIO)}"
        )
    floor = max(round(rate * guarantee), 8000)
    classes = {PARENT_CLASS: TcClass(PARENT_CLASS, None, None, rate, rate)}
    small_ceil = max(floor, round(rate * SMALL_CEIL_SHARE))
    classes[SMALL_CLASS] = TcClass(SMALL_CLASS, PARENT_CLASS, 0, floor, small_ceil)
    unmarked = MAX_HTB_PRIO if unmarked_prio is None else unmarked_prio
    dscps: dict[int, int] = {}
    for q, marking in enumerate(queues):
        # the default class is fixed (htb cannot change it in place): a DSCP-0 queue is it
        minor = UNMARKED_CLASS if marking.dscp == 0 else QUEUE_CLASS_BASE + q
        dscps.setdefault(minor, marking.dscp)
        if minor == UNMARKED_CLASS:
            unmarked = min(unmarked, min(q, MAX_HTB_PRIO))
        else:
            classes[minor] = TcClass(minor, PARENT_CLASS, min(q, MAX_HTB_PRIO), floor, rate)
    classes[UNMARKED_CLASS] = TcClass(UNMARKED_CLASS, PARENT_CLASS, unmarked, floor, rate)
    filters = {
        TcFilter(PREF_BIG_V4, "ip", 0, 0xFFFF, 0, UNMARKED_CLASS),
        TcFilter(PREF_BIG_V6, "ipv6", 0, 0xFFFF << 16, 4, UNMARKED_CLASS),
        TcFilter(PREF_SMALL_V4, "ip", 0, SMALL_V4_MASK, 0, SMALL_CLASS),
        TcFilter(PREF_SMALL_V6, "ipv6", 0, SMALL_V6_MASK << 16, 4, SMALL_CLASS),
    }
    for minor, dscp in dscps.items():
        if dscp != 0:
            filters.add(TcFilter(PREF_DSCP_V4, "ip", dscp << 18, 0xFC << 16, 0, minor))
            filters.add(TcFilter(PREF_DSCP_V6, "ipv6", dscp << 22, 0xFC << 20, 0, minor))
    # ~1 ms of traffic per round, at least 32 KiB: a burst below rate/HZ caps the throughput
    burst = max(32 * 1024, rate // 8 // 1000)
    tree = Tree(ROOT_LABEL, UNMARKED_CLASS, classes, frozenset(filters))
    return Plan(dev, tree, dscps, burst)


def rate_advice(want: Plan) -> str | None:
    """A warning for a rate where one htb qdisc lock limits the host (None below it)."""
    rate = want.tree.classes[PARENT_CLASS].rate
    if rate <= HTB_RATE_ADVICE:
        return None
    return (
        f"{want.dev}: shaping at {format_rate(rate)} through one htb qdisc (one lock for every "
        "CPU); at this rate prefer the NIC's own priority queues (DCB/ETS) mapped from the same "
        "DSCPs, see docs/qos.md"
    )


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
    except OSError as exc:  # out of processes or memory (EAGAIN, ENOMEM), say
        raise QosError(f"tc {args[0]}: cannot run it: {exc}") from None
    if proc.returncode != 0:
        problem = " ".join(proc.stderr.split()) or f"exit status {proc.returncode}"
        if "Operation not permitted" in problem:
            problem += " (tc needs CAP_NET_ADMIN in the device's network namespace)"
        raise QosError(f"tc {args[0]}: {problem}")
    return proc.stdout


def observe(dev: str) -> Tree:
    """The device's current root qdisc and, under an htb root, its classes and u32 filters.

    Raises:
        QosError: tc failed, or printed what this cannot read (another iproute2's JSON).
    """
    try:
        return _observe(dev)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # JSONDecodeError too
        raise QosError(f"tc on {dev}: unexpected output ({type(exc).__name__}: {exc})") from None


def _observe(dev: str) -> Tree:
    roots = [
        q for q in json.loads(_tc(["-j", "qdisc", "show", "dev", dev]) or "[]") if q.get("root")
    ]
    if not roots:
        return Tree("none", None)
    root = roots[0]
    label = f"{root['kind']} {root.get('handle', '')}".strip()
    if root["kind"] != "htb" or label not in (ROOT_LABEL, f"htb {LEGACY_HANDLE:x}:"):
        return Tree(label, None)
    major = int(str(root["handle"]).rstrip(":"), 16)
    default = int(str(root.get("options", {}).get("default", "0")), 16)
    classes = parse_classes(_tc(["class", "show", "dev", dev]), major)
    entries = json.loads(_tc(["-j", "filter", "show", "dev", dev]) or "[]")
    return Tree(label, default, classes, frozenset(parse_filters(entries, major)))


def _class_pattern(major: int) -> re.Pattern[str]:
    return re.compile(
        rf"^class htb {major:x}:([0-9a-f]+) (?:root|parent {major:x}:([0-9a-f]+))(?: leaf \S+)?"
        r"(?: prio (\d+))? rate (\S+) ceil (\S+)"
    )


def parse_classes(text: str, major: int = HANDLE) -> dict[int, TcClass]:
    """htb classes of ``tc class show`` output under ``major:``, by classid minor."""
    classes, pattern = {}, _class_pattern(major)
    for line in text.splitlines():
        if match := pattern.match(line):
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


def parse_filters(entries: Sequence[dict[str, object]], major: int = HANDLE) -> set[TcFilter]:
    """Single-key u32 filters with a flowid under ``major:``, from ``tc -j filter show``."""
    found, prefix = set(), f"{major:x}:"
    for entry in entries:
        options = entry.get("options")
        if entry.get("kind") != "u32" or not isinstance(options, dict):
            continue
        match, flowid = options.get("match"), str(options.get("flowid", ""))
        if not isinstance(match, dict) or not flowid.startswith(prefix):
            continue
        found.add(
            TcFilter(
                int(str(entry["pref"])),
                str(entry["protocol"]),
                int(str(match["value"]), 16),
                int(str(match["mask"]), 16),
                int(str(match["off"])),
                int(flowid[len(prefix) :], 16),
            )
        )
    return found


# -- converging -----------------------------------------------------------------------------


def _same_class(have: TcClass | None, want: TcClass) -> bool:
    if have is None or (have.parent, have.prio) != (want.parent, want.prio):
        return False
    return all(abs(h - w) <= 0.01 * w for h, w in ((have.rate, want.rate), (have.ceil, want.ceil)))


#: the filter prefs this module manages; an operator's filters at other prefs are left alone
MANAGED_PREFS = frozenset(range(PREF_DSCP_V4, PREF_SMALL_V6 + 1))


def changes(want: Plan, have: Tree, *, force: bool = False) -> list[str]:
    """``tc -batch`` lines that turn ``have`` into ``want.tree`` (empty when they agree).

    Raises:
        QosForeignRootError: ``have`` is someone else's root qdisc and ``force`` is false.
    """
    dev, tree, lines = want.dev, want.tree, []
    owner = have.owner
    if owner == "foreign" and not force:
        raise QosForeignRootError(
            f"{dev}: the root qdisc is {have.root}, not flowsched's; `flowsched qos apply "
            f"--dev {dev} --force` replaces it (and `clear` then leaves the kernel's default)"
        )
    if owner == "ours" and have.default != tree.default:
        lines.append(f"qdisc del dev {dev} root")  # htb cannot change its default in place
        owner = "kernel"
    elif owner == "foreign":  # forced: a qdisc of that tree may hold the handle f5:, which
        lines.append(f"qdisc del dev {dev} root")  # "qdisc replace" cannot take over
        owner = "kernel"
    if owner != "ours":  # a new root: grafted over the old one, which the kernel destroys
        lines.append(
            f"qdisc replace dev {dev} root handle {HANDLE:x}: htb default {tree.default:x}"
        )
        have = Tree(tree.root, tree.default)
    have_at = _by_pref(f for f in have.filters if f.pref in MANAGED_PREFS)
    want_at = _by_pref(tree.filters)
    differ = sorted(k for k in have_at.keys() | want_at.keys() if have_at.get(k) != want_at.get(k))
    for pref, protocol in differ:  # before the classes they point to go
        if (pref, protocol) in have_at:
            lines.append(
                f"filter del dev {dev} parent {HANDLE:x}: pref {pref} protocol {protocol} u32"
            )
    for minor in sorted(tree.classes):  # parent first
        spec = tree.classes[minor]
        if not _same_class(have.classes.get(minor), spec):
            lines.append(_class_line(dev, spec, want.burst))
    stale = [m for m in have.classes if m not in tree.classes]
    for minor in sorted(stale, key=lambda m: have.classes[m].parent is None):  # leaves first
        lines.append(f"class del dev {dev} classid {HANDLE:x}:{minor:x}")
    for key in differ:
        lines += [_filter_line(dev, f) for f in sorted(want_at.get(key, ()))]
    return lines


def _by_pref(filters: Iterable[TcFilter]) -> dict[tuple[int, str], set[TcFilter]]:
    """Filters grouped by (pref, protocol), the unit ``tc filter del`` removes."""
    groups: dict[tuple[int, str], set[TcFilter]] = {}
    for f in filters:
        groups.setdefault((f.pref, f.protocol), set()).add(f)
    return groups


def _class_line(dev: str, spec: TcClass, burst: int) -> str:
    parent = f"{HANDLE:x}:" if spec.parent is None else f"{HANDLE:x}:{spec.parent:x}"
    prio = "" if spec.prio is None else f" prio {spec.prio}"
    # an explicit quantum: htb's rate/r2q default exceeds its 200000-byte cap at Gbit rates
    return (
        f"class replace dev {dev} parent {parent} classid {HANDLE:x}:{spec.minor:x} htb"
        f" rate {spec.rate}bit ceil {spec.ceil}bit burst {burst} cburst {burst}{prio}"
        " quantum 60000"
    )


def _filter_line(dev: str, spec: TcFilter) -> str:
    return (
        f"filter add dev {dev} parent {HANDLE:x}: protocol {spec.protocol} pref {spec.pref} u32"
        f" match u32 0x{spec.value:08x} 0x{spec.mask:08x} at {spec.offset}"
        f" flowid {HANDLE:x}:{spec.flowid:x}"
    )


@contextlib.contextmanager
def device_lock(dev: str) -> Iterator[None]:
    """Hold ``dev``'s lock (per network namespace and ifindex) while reading and changing it.

    Without the right to create the lock (not root) it holds none: tc refuses the change then.
    Nor where ``LOCK_DIR`` is on a read-only file system (a sandbox that does not give it the
    directory, such as a container with a read-only root): the lock only orders two applies,
    so its absence must not stop the one that runs (the shipped units and DaemonSet give it).

    Raises:
        QosError: another holder kept the device for over ``TC_TIMEOUT`` seconds.
    """
    try:
        name = f"{os.stat('/proc/self/ns/net').st_ino}-{socket.if_nametoindex(dev)}.lock"
        LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(LOCK_DIR / name, flags, 0o600)
    except OSError as exc:
        if not isinstance(exc, PermissionError) and exc.errno != errno.EROFS:
            raise QosInputError(f"--dev: {dev}: {exc.strerror}") from None
        yield
        return
    try:
        if not lock_within(fd, TC_TIMEOUT):
            raise QosError(
                f"{dev}: another `flowsched qos` change held the device for over {TC_TIMEOUT:g} s"
            )
        yield
    finally:
        os.close(fd)


def _run(lines: Sequence[str]) -> None:
    if any("#" in line for line in lines):  # tc -batch reads "#" as a comment: one call each
        for line in lines:  # (a device name holds no whitespace)
            _tc(line.split())
    else:
        _tc(["-batch", "-"], stdin="\n".join(lines) + "\n")


def apply(want: Plan, *, dry_run: bool = False, force: bool = False) -> list[str]:
    """Converge the device to ``want``; return the ``tc`` lines run (empty: already in place).

    Replaces the kernel's default root qdisc and an earlier release's tree; another root only
    with ``force``.

    Raises:
        QosForeignRootError: someone else's root qdisc, and not ``force``.
        QosError: ``tc`` failed (no CAP_NET_ADMIN, no htb or u32 in this kernel).
    """
    if dry_run:
        return changes(want, observe(want.dev), force=force)
    with device_lock(want.dev):
        lines = changes(want, observe(want.dev), force=force)
        if lines:
            _run(lines)
    return lines


def clear(dev: str) -> Tree:
    """Remove flowsched's tree (or an earlier release's) from ``dev``, nothing else.

    Returns the tree found: its ``owner`` says whether it was removed (``ours``, ``legacy``).
    """
    check_device(dev)
    with device_lock(dev):
        tree = observe(dev)
        if tree.owner in ("ours", "legacy"):
            _tc(["qdisc", "del", "dev", dev, "root"])
    return tree


# -- showing --------------------------------------------------------------------------------

_SENT = re.compile(r"^\s*Sent (\d+) bytes (\d+) pkt \(dropped (\d+)")


def class_counters(dev: str) -> dict[int, tuple[int, int, int]]:
    """classid minor -> (bytes, packets, drops) sent by each htb class of the tree."""
    counters: dict[int, tuple[int, int, int]] = {}
    current, pattern = None, _class_pattern(HANDLE)
    for line in _tc(["-s", "class", "show", "dev", dev]).splitlines():
        if match := pattern.match(line):
            current = int(match.group(1), 16)
        elif (match := _SENT.match(line)) and current is not None:
            counters[current] = (int(match.group(1)), int(match.group(2)), int(match.group(3)))
            current = None
    return counters


def describe(dev: str) -> list[str]:
    """Human-readable lines: each class, the DSCPs that select it, its counters."""
    check_device(dev)
    tree = observe(dev)
    if tree.owner == "legacy":
        return [f"{dev}: the tree of an earlier flowsched release ({tree.root}); "
                "`flowsched qos apply` replaces it"]  # fmt: skip
    if tree.owner != "ours":
        return [f"{dev}: no flowsched classes (root qdisc: {tree.root})"]
    dscps: dict[int, list[str]] = {}
    for f in sorted(tree.filters):
        if f.pref == PREF_DSCP_V4 and f.protocol == "ip":
            dscps.setdefault(f.flowid, []).append(str(f.value >> 18))
        elif f.pref == PREF_SMALL_V4:
            dscps.setdefault(f.flowid, []).append("small packets")
    counters = class_counters(dev)
    lines = [f"{dev}: {tree.root}, unmarked traffic -> {HANDLE:x}:{tree.default:x}"]
    lines.append("class   prio       rate      ceil     sent_bytes    packets  drops  selected by")
    for minor, spec in sorted(tree.classes.items()):
        sent, packets, drops = counters.get(minor, (0, 0, 0))
        what = ", ".join(dscps.get(minor, [])) or ("unmarked" if minor == tree.default else "-")
        if what[0].isdigit():
            what = f"DSCP {what}"
        prio = "-" if spec.prio is None else str(spec.prio)
        lines.append(
            f"{HANDLE:x}:{minor:<4x} {prio:>4}  {format_rate(spec.rate):>9}"
            f" {format_rate(spec.ceil):>9} {sent:>14} {packets:>10} {drops:>6}  {what}"
        )
    return lines


def format_rate(bits: int) -> str:
    """bit/s in tc's units: ``200Mbit``, ``2.5Gbit``."""
    for unit, scale in (("Tbit", 10**12), ("Gbit", 10**9), ("Mbit", 10**6), ("Kbit", 10**3)):
        if bits >= scale:
            return f"{bits / scale:.4g}{unit}"
    return f"{bits}bit"
