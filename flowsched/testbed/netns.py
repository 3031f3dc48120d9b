"""A small cluster of network namespaces with strict-priority htb bottlenecks.

Layout (``P`` is the name prefix, e.g. ``fsE-``)::

    P h0 .. P h{n-1}   one namespace per host: data NIC ``P h{i}d`` (10.77.0.{i+1}/24, shaped
                       egress = the host's NIC egress) and management NIC ``P h{i}m``
                       (10.78.0.{i+1}/24, unshaped: control-plane traffic never competes)
    P sw               the switch: bridge ``P br`` joining the ports ``P h{i}s`` (shaped egress =
                       the switch port toward host i, i.e. the host's ingress link) and bridge
                       ``P mb`` joining the management ports, with address 10.78.0.254

Every shaped port carries the same htb tree: a parent class at the link rate, one child class
per distinct DSCP of the policy's level table served in strict priority (htb ``prio`` = level,
capped at 7) with a small guaranteed share so that a promoted flow's backlog drains quickly
(see the promotion-latency facts), a class for unmarked traffic at the lowest priority, and a
top class for small packets (pure ACKs and control messages) so that a receiver's ACKs are never
starved by its own high-priority sends. Classification is by u32 on the IP TOS byte with mask
0xfc, so ECN bits are ignored.

Everything is created inside the namespaces, so deleting the namespaces removes every link.
:func:`testbed` tears everything down also on exceptions, Ctrl-C, SIGTERM and SIGHUP;
:func:`cleanup` removes the leftovers of a run that was killed (it is called before every
build). A run holds
an exclusive ``flock`` on a per-prefix lock file (:func:`prefix_lock`) while it probes the
machine (:func:`probe`) and while its testbed is up, so a second run with the same prefix is
refused (:class:`TestbedBusy`) instead of taking the first run's live testbed for leftovers; the
kernel releases the lock when its holder dies, so a killed run's leftovers never block the next
run.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TypeVar

_T = TypeVar("_T")

DATA_NET = "10.77.0"
MGMT_NET = "10.78.0"
SWITCH_MGMT_IP = f"{MGMT_NET}.254"
MAX_IFNAME = 15
#: classid minor of the small-packet (ACK) class and of the unmarked-traffic class
ACK_CLASS = 0x2
UNMARKED_CLASS = 0xF
#: classid minor of the first level class; level class i is LEVEL_CLASS_BASE + i
LEVEL_CLASS_BASE = 0x10
#: IP total length below which a packet counts as an ACK/control packet
SMALL_PACKET_BYTES = 128
#: share of a shaped link's rate that carries TCP payload: htb counts whole Ethernet frames, and
#: a full 1,514-byte frame (MTU 1500 + 14) carries 1,448 bytes (IPv4 20, TCP 20, timestamps 12).
#: Measured: iperf3 through a 200 Mbit/s class moves 191.2 Mbit/s of payload (0.956x)
TCP_PAYLOAD_SHARE = (1500 - 20 - 20 - 12) / (1500 + 14)


#: programs that building the testbed runs (probe() checks that each is installed)
PROGRAMS = {"ip": "iproute2", "tc": "iproute2", "sysctl": "procps"}
#: where the per-prefix lock files live (root's; the testbed needs root anyway)
LOCK_DIR = Path("/run/flowsched-testbed")


class TestbedUnavailable(RuntimeError):
    """Raised when this machine cannot build the testbed (no root, no netns or no htb, a
    program missing, or the build failed): the benchmarks then run the simulator only."""


class TestbedLeftBehind(RuntimeError):
    """Raised when :func:`cleanup` could not remove part of a testbed (it names what and why),
    also by :func:`testbed`'s teardown, in place of the exception that ended the block (kept
    as its ``__context__``): a run must not end as if its testbed were gone."""


class TestbedBusy(RuntimeError):
    """Raised when another live process holds the testbed of this prefix: not a reason to fall
    back to the simulator, but to stop and say so."""


@dataclass(frozen=True, slots=True)
class TopologySpec:
    """What to build. ``rate_mbit`` is every link's capacity in both directions."""

    prefix: str = "fsE-"
    hosts: int = 4
    rate_mbit: float = 200.0
    #: guaranteed share of the link for every priority class (0 = pure strict priority)
    min_share: float = 0.02
    #: byte limit of each class queue on the switch ports (a shallow switch buffer)
    switch_queue_bytes: int = 256_000
    #: cap on GSO packet size at the hosts, bounds what a starved flow keeps queued
    gso_max_size: int = 16384
    #: minimum TCP retransmission timeout on the data network (ms)
    rto_min_ms: int = 10

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9-]{1,9}", self.prefix):
            raise ValueError(f"prefix {self.prefix!r}: 1-9 characters of [A-Za-z0-9-]")
        if not 2 <= self.hosts <= 16:
            raise ValueError(f"hosts: {self.hosts} is outside 2..16")
        if not 1.0 <= self.rate_mbit <= 10_000.0:
            raise ValueError(f"rate_mbit: {self.rate_mbit} is outside 1..10000")
        if not 0.0 <= self.min_share <= 0.2:
            raise ValueError(f"min_share: {self.min_share} is outside 0..0.2")
        if self.switch_queue_bytes < 1:
            raise ValueError(f"switch_queue_bytes: {self.switch_queue_bytes} is not positive")

    @property
    def rate_bytes(self) -> float:
        """Link capacity in bytes per second."""
        return self.rate_mbit * 1e6 / 8


@dataclass(frozen=True, slots=True)
class Host:
    """One host namespace and its links."""

    index: int
    name: str
    netns: str
    data_dev: str
    data_ip: str
    mgmt_dev: str
    mgmt_ip: str
    switch_port: str
    #: the switch's end of the management link (taking it down cuts the host off the control
    #: plane, silently, as a pulled cable does)
    mgmt_port: str


@dataclass(slots=True)
class Topology:
    """A built testbed: the hosts, the switch and the shaping on every port."""

    spec: TopologySpec
    hosts: list[Host]
    switch_ns: str
    switch_mgmt_ip: str = SWITCH_MGMT_IP
    #: DSCP -> htb classid minor, as last configured by :meth:`configure_classes`
    dscp_class: dict[int, int] = field(default_factory=dict)

    def host(self, name: str) -> Host:
        """The host called ``name`` (e.g. ``"h0"``)."""
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(f"no host {name!r} (hosts: {', '.join(h.name for h in self.hosts)})")

    def shaped_ports(self) -> list[tuple[str, str]]:
        """Every (namespace, device) whose egress is an htb bottleneck."""
        ports = [(h.netns, h.data_dev) for h in self.hosts]
        return ports + [(self.switch_ns, h.switch_port) for h in self.hosts]

    def set_control_link(self, name: str, up: bool) -> None:
        """Cut host ``name`` off the management network (the control plane: coordinator,
        agents) at the switch, silently, or connect it again; its data link stays."""
        state = "up" if up else "down"
        _ip_batch(self.switch_ns, [f"link set {self.host(name).mgmt_port} {state}"])

    def ns_command(self, netns: str, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside ``netns``."""
        return ["ip", "netns", "exec", netns, *argv]

    def configure_classes(self, dscp_by_level: Sequence[int]) -> None:
        """(Re)build the htb tree on every shaped port for a level -> DSCP table."""
        self.dscp_class = level_classes(dscp_by_level)
        for netns, dev in self.shaped_ports():
            on_switch = netns == self.switch_ns
            queue = self.spec.switch_queue_bytes if on_switch else None
            _run(["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"], check=False)
            _tc_batch(netns, htb_commands(dev, self.spec, dscp_by_level, queue))

    def class_bytes(self) -> dict[str, dict[int, int]]:
        """Bytes sent so far by each htb class, per ``"netns/dev"`` (from ``tc -s class``)."""
        return self._port_stats("class", parse_class_bytes)

    def dropped_packets(self) -> dict[str, int]:
        """Packets each shaped port's htb tree has dropped so far (its leaf queues' drops
        included), per ``"netns/dev"`` (from ``tc -s qdisc``)."""
        return self._port_stats("qdisc", parse_root_drops)

    def run_drops(self) -> int:
        """Packets dropped on every shaped port since :meth:`configure_classes` last rebuilt
        the qdiscs (and so reset their counters): a run's drops, read when it ends."""
        return sum(self.dropped_packets().values())

    def _port_stats(self, kind: str, parse: Callable[[str], _T]) -> dict[str, _T]:
        """``parse`` of ``tc -s <kind> show`` on every shaped port, per ``"netns/dev"``."""
        return {
            f"{netns}/{dev}": parse(_run(["tc", "-n", netns, "-s", kind, "show", "dev", dev]))
            for netns, dev in self.shaped_ports()
        }


def level_classes(dscp_by_level: Sequence[int]) -> dict[int, int]:
    """DSCP -> classid minor, one class per distinct DSCP in order of urgency.

    Levels that share a DSCP (K levels compressed into fewer hardware queues) share a class;
    the i-th distinct DSCP gets class ``LEVEL_CLASS_BASE + i`` served at htb prio min(i, 7).
    """
    classes: dict[int, int] = {}
    for level, dscp in enumerate(dscp_by_level):
        if not 0 <= dscp <= 63:
            raise ValueError(f"levels[{level}].dscp: {dscp} is outside 0..63")
        classes.setdefault(dscp, LEVEL_CLASS_BASE + len(classes))
    return classes


def htb_commands(
    dev: str, spec: TopologySpec, dscp_by_level: Sequence[int], queue_bytes: int | None
) -> list[str]:
    """``tc -batch`` lines of the strict-priority htb tree on ``dev``."""
    rate = f"{spec.rate_mbit:g}mbit"
    guarantee = f"{max(spec.rate_mbit * spec.min_share, 0.1):g}mbit"
    lines = [
        f"qdisc add dev {dev} root handle 1: htb default {UNMARKED_CLASS:x}",
        f"class add dev {dev} parent 1: classid 1:1 htb rate {rate} ceil {rate}"
        " burst 32k cburst 32k",
    ]
    leaves = [(ACK_CLASS, 0), (UNMARKED_CLASS, 7)]
    leaves += [
        (minor, min(minor - LEVEL_CLASS_BASE, 7))
        for minor in sorted(set(level_classes(dscp_by_level).values()))
    ]
    for minor, prio in leaves:
        lines.append(
            f"class add dev {dev} parent 1:1 classid 1:{minor:x} htb rate {guarantee}"
            f" ceil {rate} prio {prio} burst 32k cburst 32k quantum 16000"
        )
        if queue_bytes is not None:
            lines.append(f"qdisc add dev {dev} parent 1:{minor:x} bfifo limit {queue_bytes}")
    lines.append(
        f"filter add dev {dev} parent 1: protocol ip prio 1 u32"
        f" match u16 0 0x{0x10000 - SMALL_PACKET_BYTES:x} at 2 flowid 1:{ACK_CLASS:x}"
    )
    for dscp, minor in level_classes(dscp_by_level).items():
        lines.append(
            f"filter add dev {dev} parent 1: protocol ip prio 2 u32"
            f" match ip tos 0x{dscp << 2:02x} 0xfc flowid 1:{minor:x}"
        )
    return lines


_CLASS_LINE = re.compile(r"^class htb 1:([0-9a-f]+) ")
_SENT_LINE = re.compile(r"^\s*Sent (\d+) bytes")
_ROOT_QDISC_LINE = re.compile(r"^qdisc htb 1: root ")
_DROPPED = re.compile(r"\(dropped (\d+),")


def parse_class_bytes(text: str) -> dict[int, int]:
    """classid minor -> bytes sent, from ``tc -s class show`` output (leaf and inner classes)."""
    counters: dict[int, int] = {}
    current: int | None = None
    for line in text.splitlines():
        if match := _CLASS_LINE.match(line):
            current = int(match.group(1), 16)
        elif (match := _SENT_LINE.match(line)) and current is not None:
            counters[current] = int(match.group(1))
            current = None
    return counters


def parse_root_drops(text: str) -> int:
    """Packets dropped by the root htb qdisc, from ``tc -s qdisc show`` output (0 if absent)."""
    in_root = False
    for line in text.splitlines():
        if line.startswith("qdisc "):
            in_root = bool(_ROOT_QDISC_LINE.match(line))
        elif in_root and (match := _DROPPED.search(line)):
            return int(match.group(1))
    return 0


# -- building and tearing down ------------------------------------------------------------


def _run(argv: Sequence[str], *, stdin: str | None = None, check: bool = True) -> str:
    proc = subprocess.run(
        list(argv), input=stdin, capture_output=True, text=True, timeout=30, check=False
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def _ip_batch(netns: str | None, lines: Sequence[str]) -> None:
    ns = ["-n", netns] if netns else []
    _run(["ip", *ns, "-batch", "-"], stdin="\n".join(lines) + "\n")


def _tc_batch(netns: str, lines: Sequence[str]) -> None:
    _run(["tc", "-n", netns, "-batch", "-"], stdin="\n".join(lines) + "\n")


def _sysctl(netns: str, settings: dict[str, str]) -> None:
    args = [f"{key}={value}" for key, value in settings.items()]
    _run(["ip", "netns", "exec", netns, "sysctl", "-q", "-w", *args])


def plan(spec: TopologySpec) -> Topology:
    """Names and addresses of the testbed for ``spec`` (nothing is created)."""
    p = spec.prefix
    hosts = []
    for i in range(spec.hosts):
        name = f"h{i}"
        host = Host(
            index=i,
            name=name,
            netns=f"{p}{name}",
            data_dev=f"{p}{name}d",
            data_ip=f"{DATA_NET}.{i + 1}",
            mgmt_dev=f"{p}{name}m",
            mgmt_ip=f"{MGMT_NET}.{i + 1}",
            switch_port=f"{p}{name}s",
            mgmt_port=f"{p}{name}n",
        )
        for dev in (host.data_dev, host.mgmt_dev, host.switch_port, host.mgmt_port):
            if len(dev) > MAX_IFNAME:
                raise ValueError(f"interface name {dev!r} is longer than {MAX_IFNAME}")
        hosts.append(host)
    return Topology(spec=spec, hosts=hosts, switch_ns=f"{p}sw")


def _build(topo: Topology, dscp_by_level: Sequence[int]) -> None:
    p, sw = topo.spec.prefix, topo.switch_ns
    for netns in [sw, *(h.netns for h in topo.hosts)]:
        _run(["ip", "netns", "add", netns])
        _ip_batch(netns, ["link set lo up"])
        _sysctl(
            netns,
            {"net.ipv6.conf.all.disable_ipv6": "1", "net.ipv6.conf.default.disable_ipv6": "1"},
        )
    _ip_batch(
        sw,
        [
            f"link add {p}br type bridge stp_state 0 forward_delay 0",
            f"link add {p}mb type bridge stp_state 0 forward_delay 0",
            f"addr add {SWITCH_MGMT_IP}/24 dev {p}mb",
            f"link set {p}br up",
            f"link set {p}mb up",
        ],
    )
    for host in topo.hosts:
        _link_host(topo, host)
    topo.configure_classes(dscp_by_level)


def _link_host(topo: Topology, host: Host) -> None:
    p, sw, ns = topo.spec.prefix, topo.switch_ns, host.netns
    _ip_batch(
        ns,
        [
            f"link add {host.data_dev} type veth peer name {host.switch_port} netns {sw}",
            f"link add {host.mgmt_dev} type veth peer name {host.mgmt_port} netns {sw}",
            f"link set {host.data_dev} gso_max_size {topo.spec.gso_max_size}",
            f"addr add {host.data_ip}/24 dev {host.data_dev}",
            f"addr add {host.mgmt_ip}/24 dev {host.mgmt_dev}",
            f"link set {host.data_dev} up",
            f"link set {host.mgmt_dev} up",
            # a datacenter-style minimum RTO: a flow starved in a low class loses packets at the
            # switch; with Linux's 200 ms default it would sit in timeout long after a promotion
            f"route replace {DATA_NET}.0/24 dev {host.data_dev} rto_min {topo.spec.rto_min_ms}ms",
        ],
    )
    _ip_batch(
        sw,
        [
            f"link set {host.switch_port} master {p}br",
            f"link set {host.mgmt_port} master {p}mb",
            f"link set {host.switch_port} up",
            f"link set {host.mgmt_port} up",
        ],
    )


def _ours(prefix: str, *, shm: bool = False) -> re.Pattern[str]:
    """Names a testbed with ``prefix`` creates (and nothing of a longer prefix's testbed):
    namespaces and links, or with ``shm`` the agents' tables (:func:`runner.table_path`).

    The two are kept apart: a namespace or link pattern that took a table's ``h<N>-`` form
    would claim ``fsE-h1-h0`` and ``fsE-h1-sw``, the whole testbed of the prefix ``fsE-h1-``.
    """
    names = r"h\d+-table" if shm else r"h\d+[dmsn]?|sw|br|mb|probe"
    return re.compile(re.escape(prefix) + f"({names})")


def namespaces(prefix: str, *, check: bool = False) -> list[str]:
    """Network namespaces that a testbed with ``prefix`` creates (``check``: RuntimeError when
    ``ip`` cannot list them, rather than none)."""
    out = _run(["ip", "netns", "list"], check=check)
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [name for name in names if _ours(prefix).fullmatch(name)]


def root_links(prefix: str, *, check: bool = False) -> list[str]:
    """Links in the root namespace whose name starts with ``prefix`` (``check``: as for
    :func:`namespaces`)."""
    out = _run(["ip", "-o", "link", "show"], check=check)
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    return [name for name in names if _ours(prefix).fullmatch(name)]


def shm_files(prefix: str) -> list[Path]:
    """Files under /dev/shm whose name starts with ``prefix`` (agent tables of a run), and the
    hidden files an agent builds a table in (``.<table>.<random>.building``: one killed while
    it built its table leaves its file behind)."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return []
    table = _ours(prefix, shm=True).pattern
    building = re.compile(rf"\.{table}\.\w+\.building")
    found = [p for p in shm.glob(f"{prefix}*") if _ours(prefix, shm=True).fullmatch(p.name)]
    found += [p for p in shm.glob(f".{prefix}*") if building.fullmatch(p.name)]
    return sorted(found)


def _kill_namespace_processes(netns: str) -> None:
    """SIGKILL the processes still running inside ``netns`` (all started by a testbed run)."""
    out = _run(["ip", "netns", "pids", netns])
    for token in out.split():
        with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
            os.kill(int(token), signal.SIGKILL)


def cleanup(prefix: str) -> list[str]:
    """Remove every namespace, root link and /dev/shm file named ``prefix*``; return them.

    Every removal is tried, also after one failed; :class:`TestbedLeftBehind` then names each
    one that failed and why (the testbed's teardown must not pass for complete when it is not,
    nor a failed ``ip netns list`` for "nothing left").
    """
    if not prefix.strip("-"):
        raise ValueError("cleanup needs a non-empty prefix")
    removed: list[str] = []
    failed: list[str] = []
    for netns in namespaces(prefix, check=True):
        try:
            _kill_namespace_processes(netns)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            # they would keep the namespace, and its links, alive after its name is gone
            failed.append(f"the processes in netns {netns} ({exc})")
        _remove(f"netns {netns}", ["ip", "netns", "del", netns], removed, failed)
    for link in root_links(prefix, check=True):
        _remove(f"link {link}", ["ip", "link", "del", link], removed, failed)
    for path in shm_files(prefix):
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            failed.append(f"file {path} ({exc})")
            continue
        removed.append(f"file {path}")
    if failed:
        raise TestbedLeftBehind(
            f"could not remove {'; '.join(failed)} of the testbed {prefix}*; remove them by hand"
            f" (ip netns del / ip link del / rm) or run flowsched.testbed.netns.cleanup({prefix!r})"
            " again"
        )
    return removed


def _remove(what: str, argv: list[str], removed: list[str], failed: list[str]) -> None:
    """Run ``argv`` to remove ``what``: into ``removed``, or into ``failed`` with the reason."""
    try:
        _run(argv)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        failed.append(f"{what} ({exc})")
        return
    removed.append(what)


def leftovers(prefix: str) -> list[str]:
    """What :func:`cleanup` would remove (empty when nothing is left behind)."""
    found = [f"netns {n}" for n in namespaces(prefix)]
    found += [f"link {link}" for link in root_links(prefix)]
    return found + [f"file {path}" for path in shm_files(prefix)]


def missing_programs() -> list[str]:
    """``program (package)`` for each program of :data:`PROGRAMS` not on PATH."""
    return [f"{name} ({package})" for name, package in PROGRAMS.items() if not shutil.which(name)]


def probe(prefix: str = "fsE-") -> str | None:
    """None when this machine can build the testbed, else the reason it cannot.

    The trial namespace ``P probe`` exists only while this holds the prefix's lock
    (:func:`prefix_lock`; :class:`TestbedBusy` when another run holds it): a second run with the
    same prefix probing at the same moment, or a live run's :func:`cleanup`, would delete it
    half-way and the probe would report a missing kernel feature.
    """
    if os.geteuid() != 0:
        return "not running as root (network namespaces and tc need CAP_NET_ADMIN)"
    missing = missing_programs()
    if missing:
        return f"missing {', '.join(missing)}: the testbed's build runs them"
    with prefix_lock(prefix):
        return _probe_namespace(f"{prefix}probe")


def _probe_namespace(netns: str) -> str | None:
    """Build ``netns`` with a veth and an htb qdisc with a u32 filter, and remove it; None when
    that worked, else why not."""
    # a probe killed half-way leaves its namespace behind, and `ip netns add` would then fail
    _run(["ip", "netns", "del", netns], check=False)
    try:
        _run(["ip", "netns", "add", netns])
        _ip_batch(netns, ["link add probe0 type veth peer name probe1", "link set probe0 up"])
        _tc_batch(
            netns,
            [
                "qdisc add dev probe0 root handle 1: htb default 1",
                "class add dev probe0 parent 1: classid 1:1 htb rate 10mbit",
                "filter add dev probe0 parent 1: protocol ip prio 1 u32"
                " match ip tos 0x00 0xfc flowid 1:1",
            ],
        )
        _sysctl(netns, {"net.ipv6.conf.all.disable_ipv6": "1"})
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return f"cannot build a network namespace with an htb qdisc: {exc}"
    finally:
        _run(["ip", "netns", "del", netns], check=False)
    return None


def veth_pair(*ends: tuple[str, str, str]) -> None:
    """Two new namespaces joined by a veth pair: ``ends`` is (namespace, device, IPv4 address)
    for each side, the address a /24; the devices and each namespace's ``lo`` come up.
    Raises :class:`subprocess.CalledProcessError` (its ``stderr`` says why) on any failure, or
    :class:`subprocess.TimeoutExpired` for a command that hangs, once what it made is removed:
    the namespaces it added and the pair while it is still in the root namespace."""
    (ns_a, dev_a, _), (ns_b, dev_b, _) = ends
    undo: list[list[str]] = []

    def run(*argv: str, undone_by: list[str] | None = None) -> None:
        subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)
        if undone_by is not None:
            undo.append(undone_by)

    try:
        run("ip", "netns", "add", ns_a, undone_by=["ip", "netns", "del", ns_a])
        run("ip", "netns", "add", ns_b, undone_by=["ip", "netns", "del", ns_b])
        veth = ["ip", "link", "add", dev_a, "type", "veth", "peer", "name", dev_b]
        run(*veth, undone_by=["ip", "link", "del", dev_a])
        # once dev_a is in ns_a, deleting ns_a deletes the pair only when the kernel destroys
        # the namespace, later: dev_b, still in the root namespace, would outlive the call
        undo.append(["ip", "link", "del", dev_b])
        for ns, dev, addr in ends:
            run("ip", "link", "set", dev, "netns", ns)
            run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            run("ip", "-n", ns, "link", "set", dev, "up")
            run("ip", "-n", ns, "link", "set", "lo", "up")
    except BaseException:
        for argv in reversed(undo):
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                subprocess.run(argv, capture_output=True, timeout=30, check=False)
        raise


class Terminated(BaseException):
    """Raised in the main thread by SIGTERM or SIGHUP (:data:`TERMINATING_SIGNALS`) so that
    ``finally`` blocks tear the testbed down; ``signum`` is the signal's number."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


#: signals whose default action would end a run with its testbed up: a stop (SIGTERM) and a
#: closed terminal or dropped ssh session (SIGHUP)
TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    def handler(signum: int, frame: FrameType | None) -> None:
        raise Terminated(signum)

    try:
        previous = {
            signum: signal.signal(signum, handler)
            for signum in TERMINATING_SIGNALS
            if signal.getsignal(signum) != signal.SIG_IGN  # (nohup: a hangup must not stop it)
        }
    except ValueError:  # not the main thread: the caller handles signals
        yield
        return
    try:
        yield
    finally:
        for signum, handler_before in previous.items():
            signal.signal(signum, handler_before)


#: signals held back while the testbed is torn down
_TEARDOWN_SIGNALS = (*TERMINATING_SIGNALS, signal.SIGINT)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGTERM and SIGINT until the block ends, then deliver them as usual.

    The teardown runs in here: a second Ctrl-C or SIGTERM (an impatient user, a supervisor
    escalating) must not cut it short and leave namespaces behind. Outside the main thread
    nothing is needed: Python runs signal handlers, and so raises, in the main thread only.
    """
    held: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        held.append(signum)

    try:
        previous = {signum: signal.signal(signum, hold) for signum in _TEARDOWN_SIGNALS}
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        for sig, handler in previous.items():
            # None: a handler set outside Python, which cannot be put back
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        for pending in dict.fromkeys(held):  # once each, in order of arrival
            signal.raise_signal(pending)


def lock_path(prefix: str) -> Path:
    """The lock file of the testbed with ``prefix`` (under :data:`LOCK_DIR`)."""
    return LOCK_DIR / f"{prefix}.lock"


@contextlib.contextmanager
def prefix_lock(prefix: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on :func:`lock_path` for the block; :class:`TestbedBusy`
    (naming the holder's pid) when another live process holds it.

    The lock belongs to the open file, which is close-on-exec, so the processes a run starts do
    not keep it; the kernel drops it when the holder exits or is killed, so a stale file of a
    dead run never blocks.
    """
    with _exclusive(lock_path(prefix), f"is using the testbed {prefix}*", "stop it"):
        yield


#: the lock file of :func:`benchmark_lock`, under :data:`LOCK_DIR`
BENCHMARK_LOCK = "benchmark.lock"


@contextlib.contextmanager
def benchmark_lock() -> Iterator[None]:
    """Hold the machine's testbed-benchmark lock for the block, as :func:`prefix_lock` holds
    a prefix's; :class:`TestbedBusy` (naming the holder's pid) when another benchmark holds it.

    Benchmarks with different prefixes (``bench contention``'s ``fsE-``, ``bench serving``'s
    ``fsv``) can build their testbeds side by side, but they share the CPUs, and each one's
    timings then measure the other's load too: one testbed benchmark at a time.
    """
    doing = "is running a testbed benchmark on this machine (two spoil each other's timings)"
    with _exclusive(LOCK_DIR / BENCHMARK_LOCK, doing, "stop it"):
        yield


@contextlib.contextmanager
def _exclusive(path: Path, doing: str, advice: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` for the block; TestbedBusy saying that another
    run (pid) ``doing``, to wait for it to end or ``advice``."""
    try:
        fd = _open_lock(path)
    except PermissionError:  # not root (only a test's fake testbed gets here): a private folder
        if os.geteuid() == 0:
            raise
        path = Path(tempfile.gettempdir()) / f"flowsched-testbed-{os.getuid()}" / path.name
        fd = _open_lock(path)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise TestbedBusy(
                f"another run (pid {holder}) {doing} (lock {path}); "
                f"wait for it to end or {advice}, then run again"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def _open_lock(path: Path) -> int:
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)


@contextlib.contextmanager
def testbed(
    spec: TopologySpec, dscp_by_level: Sequence[int] = (0,), *, probed: bool = False
) -> Iterator[Topology]:
    """Build the testbed for ``spec``, yield it, and always remove everything it made.

    Another live run with the same prefix: :class:`TestbedBusy`, and nothing of that run is
    touched. Otherwise leftovers of an earlier crashed run with the same prefix are removed
    first. A build that fails is a :class:`TestbedUnavailable` (what it made is removed).
    SIGTERM and SIGHUP are turned into an exception while the testbed is up (main thread only),
    so Ctrl-C, SIGTERM, a hangup and errors all run the teardown, and signals that arrive during
    the teardown wait for its end. A teardown that leaves something behind raises
    :class:`TestbedLeftBehind` (naming it), in place of whatever ended the block.
    ``probed=True`` skips :func:`probe` when the caller has just run it (and it succeeded).
    """
    reason = None if probed else probe(spec.prefix)
    if reason is not None:
        raise TestbedUnavailable(reason)
    with prefix_lock(spec.prefix):
        cleanup(spec.prefix)
        topo = plan(spec)
        with _sigterm_raises():
            try:
                try:
                    _build(topo, dscp_by_level)
                except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                    raise TestbedUnavailable(f"cannot build the testbed: {exc}") from exc
                yield topo
            finally:
                with _signals_deferred():
                    cleanup(spec.prefix)
