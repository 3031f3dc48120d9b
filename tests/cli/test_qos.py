"""``flowsched qos``: the plan, the read-back parsers, and a real veth pair in two namespaces.

The namespace test sends UDP datagrams with every DSCP of the policy (IPv4 and IPv6, some with
ECN bits set) and checks with ``tc -s class show`` that each landed in its queue's class, that
applying twice changes nothing, that a changed policy converges, and that ``clear`` removes it.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path, PosixPath
from typing import IO

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flowsched import policyfile, qos
from flowsched.policyfile import LevelMarking
from flowsched.testbed.measure_lock import held_by_an_ancestor

ROOT = Path(__file__).resolve().parents[2]
LOCK = "/tmp/flowsched-measure.lock"
#: how long a test waits for another run's measurement (a benchmark holds the lock for minutes;
#: pytest-timeout ends a test after 300 s)
LOCK_WAIT = 240.0


def _markings(*dscps: int) -> list[LevelMarking]:
    return [LevelMarking(d, 0) for d in dscps]


# -- the plan ---------------------------------------------------------------------------------


def test_plan_has_one_strict_priority_class_per_queue() -> None:
    want = qos.plan("eth0", _markings(46, 34, 1), 200 * 10**6)
    leaves = {m: c for m, c in want.tree.classes.items() if c.parent is not None}
    assert want.tree.root == "htb f5:"
    assert want.tree.default == qos.UNMARKED_CLASS
    assert {m: c.prio for m, c in leaves.items()} == {0x2: 0, 0xF: 7, 0x10: 0, 0x11: 1, 0x12: 2}
    assert all(c.rate == 2 * 10**6 for c in leaves.values())
    assert {m: c.ceil for m, c in leaves.items()} == {
        0x2: 20 * 10**6,  # small packets: at most SMALL_CEIL_SHARE of the link
        **{m: 200 * 10**6 for m in (0xF, 0x10, 0x11, 0x12)},
    }
    assert want.queue_dscps == {0x10: 46, 0x11: 34, 0x12: 1}


@pytest.mark.parametrize(
    ("dscp", "v4_value", "v6_value"),
    [(46, 0x00B80000, 0x0B800000), (1, 0x00040000, 0x00400000), (63, 0x00FC0000, 0x0FC00000)],
)
def test_filters_match_the_dscp_bits_only(dscp: int, v4_value: int, v6_value: int) -> None:
    filters = qos.plan("eth0", _markings(dscp), 10**9).tree.filters
    assert qos.TcFilter(qos.PREF_DSCP_V4, "ip", v4_value, 0x00FC0000, 0, 0x10) in filters
    assert qos.TcFilter(qos.PREF_DSCP_V6, "ipv6", v6_value, 0x0FC00000, 0, 0x10) in filters


def _classify(tree: qos.Tree, header: bytes, protocol: str) -> int:
    """The class u32 gives a packet: the first matching filter by pref, else the default."""
    for f in sorted(tree.filters):
        word = int.from_bytes(header[f.offset : f.offset + 4], "big")
        if f.protocol == protocol and word & f.mask == f.value:
            return f.flowid
    assert tree.default is not None
    return tree.default


def _ipv4(tos: int, length: int) -> bytes:
    return bytes([0x45, tos]) + length.to_bytes(2, "big") + bytes(16)


def _ipv6(tclass: int, payload: int) -> bytes:
    first = (6 << 28) | (tclass << 20)
    return first.to_bytes(4, "big") + payload.to_bytes(2, "big") + bytes(34)


@given(
    queue=st.integers(0, 3),
    ecn=st.integers(0, 3),
    length=st.sampled_from([0, 40, 64, 127, 128, 1500, 9000, 65535]),
    v6=st.booleans(),
)
def test_a_queue_dscp_selects_its_class_whatever_the_size(
    queue: int, ecn: int, length: int, v6: bool
) -> None:
    # ACK-sized, jumbo and BIG TCP (length field 0) packets of a queue's DSCP all follow it
    tree = qos.plan("eth0", _markings(46, 34, 18, 1), 10**9).tree
    tos = ([46, 34, 18, 1][queue] << 2) | ecn
    header = _ipv6(tos, length) if v6 else _ipv4(tos, length)
    assert _classify(tree, header, "ipv6" if v6 else "ip") == qos.QUEUE_CLASS_BASE + queue


@pytest.mark.parametrize(
    ("header", "protocol", "minor"),
    [
        (_ipv4(0, 52), "ip", qos.SMALL_CLASS),  # a pure ACK of an unmarked socket
        (_ipv4(0, 1500), "ip", qos.UNMARKED_CLASS),
        (_ipv4(0, 0), "ip", qos.UNMARKED_CLASS),  # BIG TCP: not "small"
        (_ipv4(26 << 2, 64), "ip", qos.SMALL_CLASS),  # a DSCP no queue uses
        (_ipv4(26 << 2, 1500), "ip", qos.UNMARKED_CLASS),
        (_ipv6(0, 32), "ipv6", qos.SMALL_CLASS),
        (_ipv6(0, 0), "ipv6", qos.UNMARKED_CLASS),
        (_ipv6(3, 9000), "ipv6", qos.UNMARKED_CLASS),  # ECN bits alone are no DSCP
    ],
)
def test_traffic_without_a_queue_dscp(header: bytes, protocol: str, minor: int) -> None:
    tree = qos.plan("eth0", _markings(46, 34, 18, 1), 10**9).tree
    assert _classify(tree, header, protocol) == minor


def test_a_best_effort_queue_takes_the_unmarked_traffic() -> None:
    # the default class stays f5:f (htb cannot change its default in place): it is the queue
    want = qos.plan("eth0", _markings(46, 0), 10**9)
    assert want.tree.default == qos.UNMARKED_CLASS
    assert want.tree.classes[qos.UNMARKED_CLASS].prio == 1
    assert 0x11 not in want.tree.classes
    assert want.queue_dscps == {0x10: 46, qos.UNMARKED_CLASS: 0}
    only = qos.plan("eth0", _markings(0), 10**9)  # hw_queues = 1: everything best effort
    assert only.tree.classes[qos.UNMARKED_CLASS].prio == 0
    assert not any(f.pref in (qos.PREF_DSCP_V4, qos.PREF_DSCP_V6) for f in only.tree.filters)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"guarantee": 0.2}, "--guarantee"),
        ({"guarantee": 0.0}, "--guarantee"),
        ({"unmarked_prio": 8}, "--unmarked-prio"),
    ],
)
def test_plan_refuses_bad_options(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(qos.QosInputError, match=message):
        qos.plan("eth0", _markings(*range(8, 16)), 10**9, **kwargs)  # type: ignore[arg-type]


def test_unmarked_prio_is_refused_where_a_dscp_0_queue_carries_that_traffic() -> None:
    with pytest.raises(qos.QosInputError, match="queue 1 has DSCP 0"):
        qos.plan("eth0", _markings(46, 0), 10**9, unmarked_prio=3)


@pytest.mark.parametrize(
    ("text", "bits"),
    [("200mbit", 200 * 10**6), ("25Gbit", 25 * 10**9), ("1e9", 10**9), ("8kbit", 8000)],
)
def test_parse_rate(text: str, bits: int) -> None:
    assert qos.parse_rate(text) == bits


@pytest.mark.parametrize("text", ["", "fast", "10mbps", "1kbit", "-5mbit"])
def test_parse_rate_refuses(text: str) -> None:
    with pytest.raises(qos.QosInputError, match="--rate"):
        qos.parse_rate(text)


# -- reading back and converging --------------------------------------------------------------

CLASS_SHOW = """\
class htb f5:10 parent f5:1 prio 0 rate 2Mbit ceil 200Mbit burst 1600b cburst 1600b
class htb f5:1 root rate 200Mbit ceil 200Mbit burst 1600b cburst 1600b
class htb f5:f parent f5:1 leaf 8001: prio 7 rate 2500Kbit ceil 200Mbit burst 1600b cburst 1600b
class htb 1:3 root rate 1Gbit ceil 1Gbit burst 1600b cburst 1600b
"""


def test_parse_classes_of_the_tree_handle_only() -> None:
    classes = qos.parse_classes(CLASS_SHOW)
    assert set(classes) == {0x1, 0x10, 0xF}
    assert classes[0x1] == qos.TcClass(0x1, None, None, 200 * 10**6, 200 * 10**6)
    assert classes[0x10] == qos.TcClass(0x10, 0x1, 0, 2 * 10**6, 200 * 10**6)
    assert classes[0xF] == qos.TcClass(0xF, 0x1, 7, 2_500_000, 200 * 10**6)
    assert set(qos.parse_classes(CLASS_SHOW, 0x1)) == {0x3}


def test_parse_filters_keeps_single_key_u32_filters_to_a_class() -> None:
    entries = [
        {"parent": "f5:", "protocol": "ip", "pref": 1, "kind": "u32", "chain": 0},
        {"protocol": "ip", "pref": 1, "kind": "u32", "options": {"fh": "800:", "ht_divisor": 1}},
        {
            "protocol": "ip",
            "pref": 1,
            "kind": "u32",
            "options": {
                "fh": "800::800",
                "flowid": "f5:10",
                "match": {"value": "b80000", "mask": "fc0000", "offmask": "", "off": 0},
            },
        },
    ]
    assert qos.parse_filters(entries) == {qos.TcFilter(1, "ip", 0xB80000, 0xFC0000, 0, 0x10)}
    assert qos.parse_filters(entries, 0x1) == set()


def test_no_changes_when_the_device_already_has_the_plan() -> None:
    want = qos.plan("eth0", _markings(46, 1), 200 * 10**6)
    assert qos.changes(want, want.tree) == []


@pytest.mark.parametrize("root", ["none", "noqueue 0:", "pfifo_fast 0:", "mq 0:", "fq_codel 0:"])
def test_changes_from_a_kernel_default_root_build_everything(root: str) -> None:
    want = qos.plan("eth0", _markings(46, 1), 200 * 10**6)
    lines = qos.changes(want, qos.Tree(root, None))
    assert lines[0] == "qdisc replace dev eth0 root handle f5: htb default f"
    assert sum(line.startswith("class replace") for line in lines) == len(want.tree.classes)
    assert sum(line.startswith("filter add") for line in lines) == len(want.tree.filters)
    assert not any("del" in line for line in lines)


def _legacy_tree(signature: bool) -> qos.Tree:
    """An ``htb 1:`` tree, with or without the small-packet filter of an earlier release."""
    small = qos.TcFilter(1, "ip", 0, 0xFF80, 0, 0x2)
    dscp = qos.TcFilter(3, "ip", 46 << 18, 0xFC << 16, 0, 0x10)
    return qos.Tree("htb 1:", 0xF, {}, frozenset({small, dscp} if signature else {dscp}))


@pytest.mark.parametrize(
    ("have", "owner"),
    [
        (qos.Tree("htb f5:", 0xF), "ours"),
        (_legacy_tree(signature=True), "legacy"),
        (_legacy_tree(signature=False), "foreign"),  # the handle every htb tutorial uses
        (qos.Tree("tbf 5:", None), "foreign"),
        (qos.Tree("htb 2:", None), "foreign"),
        (qos.Tree("mq 0:", None), "kernel"),
        (qos.Tree("none", None), "kernel"),
    ],
)
def test_whose_root_it_is(have: qos.Tree, owner: str) -> None:
    assert have.owner == owner


@pytest.mark.parametrize("have", [qos.Tree("tbf 5:", None), _legacy_tree(signature=False)])
def test_a_foreign_root_is_refused_unless_forced(have: qos.Tree) -> None:
    want = qos.plan("eth0", _markings(46, 1), 200 * 10**6)
    with pytest.raises(qos.QosForeignRootError, match=f"root qdisc is {have.root}.*--force"):
        qos.changes(want, have)
    lines = qos.changes(want, have, force=True)
    assert lines[:2] == [
        "qdisc del dev eth0 root",
        "qdisc replace dev eth0 root handle f5: htb default f",
    ]


@pytest.mark.parametrize("root", ["tbf f5:", "htb 1:"])
def test_a_forced_apply_first_removes_the_foreign_tree_that_may_hold_our_handle(
    root: str,
) -> None:
    # "qdisc replace ... root handle f5: htb" fails when a qdisc of the foreign tree already
    # has the handle f5: (its root: "Invalid qdisc name"; a leaf: "Cannot move an existing
    # qdisc to a different parent"), and the tree it reads back shows the root only
    want = qos.plan("eth0", _markings(46, 1), 200 * 10**6)
    lines = qos.changes(want, qos.Tree(root, None), force=True)
    assert lines.index("qdisc del dev eth0 root") == 0
    assert lines[1] == "qdisc replace dev eth0 root handle f5: htb default f"


def test_an_earlier_release_tree_is_replaced_whole() -> None:
    want = qos.plan("eth0", _markings(46, 1), 200 * 10**6)
    lines = qos.changes(want, _legacy_tree(signature=True))
    assert lines[0] == "qdisc replace dev eth0 root handle f5: htb default f"
    assert not any("del" in line for line in lines)


def test_our_tree_with_another_default_is_rebuilt() -> None:
    want = qos.plan("eth0", _markings(46, 1), 200 * 10**6)
    have = qos.Tree("htb f5:", 0x11, want.tree.classes, want.tree.filters)
    lines = qos.changes(want, have)
    assert lines[:2] == [
        "qdisc del dev eth0 root",  # htb cannot change its default in place
        "qdisc replace dev eth0 root handle f5: htb default f",
    ]
    assert sum(line.startswith("class replace") for line in lines) == len(want.tree.classes)


def test_a_changed_policy_removes_stale_classes_and_rewrites_changed_prefs_only() -> None:
    old = qos.plan("eth0", _markings(46, 34, 18, 1), 200 * 10**6)
    new = qos.plan("eth0", _markings(46, 1), 200 * 10**6)
    lines = qos.changes(new, old.tree)
    assert lines[:2] == [
        "filter del dev eth0 parent f5: pref 1 protocol ip u32",
        "filter del dev eth0 parent f5: pref 2 protocol ipv6 u32",
    ]
    assert "class del dev eth0 classid f5:12" in lines
    assert "class del dev eth0 classid f5:13" in lines
    assert lines.index("class del dev eth0 classid f5:12") > 1  # after its filters went
    # the class that kept its place is not touched; f5:11 now carries DSCP 1 (same class spec)
    assert not any(line.startswith("class replace") for line in lines)
    added = [line for line in lines if line.startswith("filter add")]
    assert len(added) == 4 and all(" pref 1 " in line or " pref 2 " in line for line in added)


def test_an_operators_filter_on_the_tree_is_left_alone() -> None:
    want = qos.plan("eth0", _markings(46, 1), 200 * 10**6)
    ssh = qos.TcFilter(10, "ip", 22, 0xFFFF, 20, 0x10)
    stale = qos.TcFilter(qos.PREF_DSCP_V4, "ip", 34 << 18, 0xFC << 16, 0, 0x11)
    have = qos.Tree("htb f5:", 0xF, want.tree.classes, want.tree.filters | {ssh, stale})
    lines = qos.changes(want, have)
    assert lines[0] == "filter del dev eth0 parent f5: pref 1 protocol ip u32"
    assert not any("pref 10" in line for line in lines)


def test_a_changed_rate_replaces_the_classes_only() -> None:
    old = qos.plan("eth0", _markings(46, 1), 200 * 10**6)
    new = qos.plan("eth0", _markings(46, 1), 400 * 10**6)
    lines = qos.changes(new, old.tree)
    assert lines and all(line.startswith("class replace") for line in lines)


@pytest.mark.parametrize(("dev", "calls"), [("eth0", 1), ("h#x", 3)])
def test_a_hash_in_the_device_name_runs_tc_line_by_line(
    dev: str, calls: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # tc -batch reads "#" as the start of a comment
    runs: list[list[str]] = []
    monkeypatch.setattr(qos, "_tc", lambda args, stdin=None: runs.append(list(args)) or "")
    lines = [f"class del dev {dev} classid f5:{m}" for m in (10, 11, 12)]
    qos._run(lines)
    assert len(runs) == calls
    if calls == 3:
        assert runs[0] == ["class", "del", "dev", dev, "classid", "f5:10"]


def test_the_rate_advice_starts_above_10_gbit() -> None:
    assert qos.rate_advice(qos.plan("eth0", _markings(46), 10 * 10**9)) is None
    advice = qos.rate_advice(qos.plan("eth0", _markings(46), 100 * 10**9))
    assert advice is not None and "100Gbit" in advice and "DCB" in advice


@pytest.mark.parametrize("error", [errno.EROFS, errno.EACCES], ids=["EROFS", "EACCES"])
def test_a_lock_directory_it_cannot_create_takes_no_lock_and_stops_nothing(
    monkeypatch: pytest.MonkeyPatch, error: int
) -> None:
    """A read-only /run (a unit with ProtectSystem=strict and no RuntimeDirectory= for the
    locks, a container with a read-only root) or no right to create the lock: the apply goes
    on without it, rather than failing the agent's --qos-dev or the qos unit."""

    class Unwritable(PosixPath):
        def mkdir(self, mode: int = 0o777, parents: bool = False, exist_ok: bool = False) -> None:
            raise OSError(error, os.strerror(error), str(self))

    monkeypatch.setattr(qos, "LOCK_DIR", Unwritable("/run/flowsched-qos"))
    entered = []
    with qos.device_lock("lo"):
        entered.append(True)
    assert entered == [True]
    with pytest.raises(qos.QosInputError, match="--dev: nosuch0"), qos.device_lock("nosuch0"):
        pass


@pytest.mark.parametrize(
    ("error", "status", "line"),
    [
        (qos.QosInputError("--dev: a0: No such device"), 2, "--qos-dev: a0: No such device"),
        (qos.QosError("tc refused: Operation not permitted"), 1, "--qos-dev: tc refused"),
    ],
    ids=["device-gone", "tc-refused"],
)
def test_the_agent_reports_a_qos_failure_at_start_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    error: Exception,
    status: int,
    line: str,
) -> None:
    """The --qos-dev device can vanish between the flag checks and the first apply: the agent
    then exits 2 with one line naming the flag, as for a device missing from the start."""
    from flowsched.cli import agent as agent_cli

    def failing_daemon(*_args: object) -> int:
        raise error

    monkeypatch.setattr(agent_cli, "setup_logging", lambda _level: None)
    monkeypatch.setattr(agent_cli, "config_from_args", lambda _args: object())
    monkeypatch.setattr(agent_cli, "run_daemon", failing_daemon)
    assert agent_cli._run(argparse.Namespace(log_level="warning", no_uvloop=True)) == status
    err = capsys.readouterr().err
    assert err.startswith(f"flowsched agent: {line}") and err.count("\n") == 1


# -- a real device ------------------------------------------------------------------------------


def _tc_has_htb() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs {tool} (iproute2)"
    return None


@pytest.fixture
def veth_pair() -> Iterator[tuple[str, str]]:
    """Namespaces A (veth a0, 10.231.0.1, fd31::1) and B (b0): A's egress is shaped."""
    reason = _tc_has_htb()
    if reason:
        pytest.skip(reason)
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b = f"fsq{tag}a", f"fsq{tag}b"
    with open(LOCK, "a") as lock:
        _wait_for_lock(lock)  # no overlap with other measurements and namespaces
        try:
            made = subprocess.run(["ip", "netns", "add", ns_a], capture_output=True, text=True)
            if made.returncode != 0:
                pytest.skip(f"cannot create a network namespace: {made.stderr.strip()}")
            for command in (
                f"netns add {ns_b}",
                f"-n {ns_a} link add a0 type veth peer name b0 netns {ns_b}",
                f"-n {ns_a} addr add 10.231.0.1/24 dev a0",
                f"-n {ns_b} addr add 10.231.0.2/24 dev b0",
                f"-n {ns_a} addr add fd31::1/64 dev a0 nodad",
                f"-n {ns_b} addr add fd31::2/64 dev b0 nodad",
                f"-n {ns_a} link set a0 up",
                f"-n {ns_b} link set b0 up",
            ):
                subprocess.run(["ip", *command.split()], check=True, capture_output=True)
            # Static neighbours: a burst sent before ARP/ND resolves overflows the kernel's
            # queue of unresolved packets (about 90 datagrams here) and is dropped unseen.
            mac = json.loads(
                subprocess.run(
                    ["ip", "-n", ns_b, "-j", "link", "show", "b0"],
                    check=True, capture_output=True, text=True,
                ).stdout
            )[0]["address"]  # fmt: skip
            for peer in ("10.231.0.2", "fd31::2"):
                subprocess.run(
                    ["ip", "-n", ns_a, "neigh", "replace", peer, "lladdr", mac,
                     "dev", "a0", "nud", "permanent"],
                    check=True, capture_output=True,
                )  # fmt: skip
            probe = subprocess.run(
                ["tc", "-n", ns_a, "qdisc", "add", "dev", "a0", "root", "handle", "9:", "htb"],
                capture_output=True, text=True,
            )  # fmt: skip
            if probe.returncode != 0:
                pytest.skip(f"no htb qdisc in this kernel: {probe.stderr.strip()}")
            subprocess.run(["tc", "-n", ns_a, "qdisc", "del", "dev", "a0", "root"], check=True)
            yield ns_a, ns_b
        finally:
            for ns in (ns_a, ns_b):
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _wait_for_lock(lock: IO[str], timeout: float = LOCK_WAIT) -> None:
    """Take the measurement lock, unless this run's caller holds it (``flock FILE pytest``)."""
    if held_by_an_ancestor(Path(LOCK)):
        return
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                pytest.skip(f"{LOCK} held by another measurement for over {timeout:g} s")
            time.sleep(0.2)


def _flowsched(ns: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-m", "flowsched", *args],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip


SENDER = """
import socket, sys
count = int(sys.argv[1])
for spec in sys.argv[2:]:
    family, tos, size = (spec.split(":") + ["1000"])[:3]
    tos = int(tos)
    if family == "4":
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
        dest = ("10.231.0.2", 9)
    else:
        s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS, tos)
        dest = ("fd31::2", 9)
    for _ in range(count):
        s.sendto(bytes(int(size)), dest)
    s.close()
"""


def _send(ns: str, count: int, specs: list[str]) -> None:
    """``count`` UDP datagrams per spec ``FAMILY:TOS[:SIZE]`` (4 or 6, default 1000 bytes)."""
    subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", SENDER, str(count), *specs],
        check=True, timeout=60,
    )  # fmt: skip


def _packets_by_class(ns: str, dev: str, column: int = 3) -> dict[int, int]:
    """classid minor -> packets (column 3 of "Sent B bytes P pkt") or bytes (column 1)."""
    out = subprocess.run(
        ["tc", "-n", ns, "-s", "class", "show", "dev", dev],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    counts, current = {}, None
    for line in out.splitlines():
        if line.startswith("class htb f5:"):
            current = int(line.split()[2][3:], 16)
        elif line.strip().startswith("Sent") and current is not None:
            counts[current] = int(line.split()[column])
            current = None
    return counts


def _root(ns: str, dev: str) -> str:
    out = subprocess.run(
        ["tc", "-n", ns, "-j", "qdisc", "show", "dev", dev],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    root = next(q for q in json.loads(out) if q.get("root"))
    return f"{root['kind']} {root['handle']}"


def _wait_for(predicate: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


@pytest.mark.netns
def test_marked_traffic_lands_in_its_queue_class(veth_pair: tuple[str, str]) -> None:
    ns_a, _ = veth_pair
    first = _flowsched(ns_a, "qos", "apply", "--dev", "a0", "--rate", "200mbit")
    assert first.returncode == 0, first.stderr
    assert "applied" in first.stdout
    again = _flowsched(ns_a, "qos", "apply", "--dev", "a0", "--rate", "200mbit")
    assert (again.returncode, again.stdout.strip()) == (0, "a0: unchanged")

    queues = policyfile.embedded_default().queues
    last = len(queues) - 1
    specs = [f"4:{m.dscp << 2}" for m in queues] + [f"6:{m.dscp << 2}" for m in queues]
    specs += [f"4:{(queues[0].dscp << 2) | 1}", "4:0"]  # ECN bits ignored; unmarked
    specs += [f"4:{queues[last].dscp << 2}:16", f"6:{queues[last].dscp << 2}:16"]  # small, marked
    specs += ["4:0:16", "6:0:16"]  # small, unmarked
    before = _packets_by_class(ns_a, "a0")
    _send(ns_a, 20, specs)

    def sent(minor: int) -> int:
        return _packets_by_class(ns_a, "a0").get(minor, 0) - before.get(minor, 0)

    _wait_for(lambda: sent(qos.QUEUE_CLASS_BASE) >= 60)
    _wait_for(lambda: sent(qos.SMALL_CLASS) >= 40)
    for q in range(len(queues)):
        # IPv4 + IPv6 (+ the ECN-marked IPv4 for queue 0, + the small ones for the last)
        expected = 60 if q == 0 else 80 if q == last else 40
        assert sent(qos.QUEUE_CLASS_BASE + q) == expected, f"queue {q}"
    assert sent(qos.SMALL_CLASS) >= 40  # plus neighbour discovery
    assert sent(qos.UNMARKED_CLASS) >= 20  # plus ARP, which is not IP

    shown = _flowsched(ns_a, "qos", "show", "--dev", "a0")
    assert shown.returncode == 0, shown.stderr
    assert f"DSCP {queues[0].dscp}" in shown.stdout and "unmarked" in shown.stdout


def _best_effort_policy(tmp_path: Path) -> Path:
    """static-classes.toml with its last queue unmarked (DSCP 0): the default class is it."""
    text = (ROOT / "policies" / "static-classes.toml").read_text()
    path = tmp_path / "best-effort.toml"
    path.write_text(text.replace("dscp = 1 ", "dscp = 0 "))
    assert policyfile.load(path).queues[-1].dscp == 0
    return path


@pytest.mark.netns
def test_a_changed_policy_converges_and_clear_removes_it(
    veth_pair: tuple[str, str], tmp_path: Path
) -> None:
    ns_a, _ = veth_pair
    rate = ("--dev", "a0", "--rate", "200mbit")
    assert _flowsched(ns_a, "qos", "apply", *rate).returncode == 0
    small = ROOT / "policies" / "static-classes.toml"
    best_effort = _best_effort_policy(tmp_path)
    # a DSCP-0 queue and back: the default class stays, htb cannot change it in place
    for policy in (small, best_effort, None, best_effort, small):
        args = ("--policy", str(policy)) if policy else ()
        changed = _flowsched(ns_a, "qos", "apply", *rate, *args)
        assert changed.returncode == 0, (policy, changed.stderr)
        dry = _flowsched(ns_a, "qos", "apply", *rate, *args, "--dry-run")
        assert dry.stdout.strip() == "# a0: already in place", policy
    classes = _packets_by_class(ns_a, "a0")
    queues = policyfile.load(small).queues
    assert sorted(classes) == sorted(
        [1, qos.SMALL_CLASS, qos.UNMARKED_CLASS] + [0x10 + q for q in range(len(queues))]
    )
    for _ in range(2):  # idempotent too
        cleared = _flowsched(ns_a, "qos", "clear", "--dev", "a0")
        assert cleared.returncode == 0, cleared.stderr
    assert "no flowsched classes" in _flowsched(ns_a, "qos", "show", "--dev", "a0").stdout


@pytest.mark.netns
def test_someone_elses_root_is_left_alone_unless_forced(veth_pair: tuple[str, str]) -> None:
    ns_a, _ = veth_pair
    tbf = "tc -n {} qdisc add dev a0 root handle 5: tbf rate 1gbit burst 100k latency 10ms"
    subprocess.run(tbf.format(ns_a).split(), check=True)
    refused = _flowsched(ns_a, "qos", "apply", "--dev", "a0", "--rate", "200mbit")
    assert refused.returncode == 1
    assert "root qdisc is tbf 5:, not flowsched's" in refused.stderr
    cleared = _flowsched(ns_a, "qos", "clear", "--dev", "a0")
    assert "root qdisc tbf 5: is not flowsched's" in cleared.stdout
    assert _root(ns_a, "a0") == "tbf 5:"
    forced = _flowsched(ns_a, "qos", "apply", "--dev", "a0", "--rate", "200mbit", "--force")
    assert forced.returncode == 0, forced.stderr
    assert _root(ns_a, "a0") == "htb f5:"


@pytest.mark.netns
def test_an_earlier_release_tree_is_replaced(veth_pair: tuple[str, str]) -> None:
    ns_a, _ = veth_pair
    for command in (  # the tree an earlier release installed: htb 1: and its small filter
        "qdisc add dev a0 root handle 1: htb default f",
        "class add dev a0 parent 1: classid 1:1 htb rate 200mbit",
        "class add dev a0 parent 1:1 classid 1:2 htb rate 2mbit ceil 200mbit prio 0",
        "filter add dev a0 parent 1: protocol ip pref 1 u32"
        " match u32 0x00000000 0x0000ff80 at 0 flowid 1:2",
    ):
        subprocess.run(["tc", "-n", ns_a, *command.split()], check=True)
    assert "earlier flowsched release" in _flowsched(ns_a, "qos", "show", "--dev", "a0").stdout
    applied = _flowsched(ns_a, "qos", "apply", "--dev", "a0", "--rate", "200mbit")
    assert applied.returncode == 0, applied.stderr
    assert _root(ns_a, "a0") == "htb f5:"


RECEIVER = """
import socket, sys
server = socket.create_server(("fd31::2", 0), family=socket.AF_INET6)
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
while conn.recv(1 << 20):
    pass
"""

BULK = """
import socket, sys
s = socket.create_connection(("fd31::2", int(sys.argv[1])), timeout=30)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS, int(sys.argv[2]))
chunk = bytes(1 << 20)
for _ in range(int(sys.argv[3])):
    s.sendall(chunk)
s.close()
"""


@pytest.mark.netns
def test_big_tcp_packets_keep_their_queue(veth_pair: tuple[str, str]) -> None:
    # a GSO packet over 64 KiB carries payload length 0, which the small-packet test matches
    ns_a, ns_b = veth_pair
    big = subprocess.run(
        ["ip", "-n", ns_a, "link", "set", "dev", "a0", "gso_max_size", "185000"],
        capture_output=True, text=True,
    )  # fmt: skip
    if big.returncode != 0:
        pytest.skip(f"no BIG TCP on this kernel: {big.stderr.strip()}")
    assert _flowsched(ns_a, "qos", "apply", "--dev", "a0", "--rate", "10gbit").returncode == 0
    receiver = subprocess.Popen(
        ["ip", "netns", "exec", ns_b, sys.executable, "-c", RECEIVER],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert receiver.stdout is not None
        port = receiver.stdout.readline().strip()
        scavenger = policyfile.embedded_default().queues[-1].dscp
        subprocess.run(
            ["ip", "netns", "exec", ns_a, sys.executable, "-c", BULK, port,
             str(scavenger << 2), "256"],
            check=True, timeout=120,
        )  # fmt: skip
    finally:
        receiver.kill()
        receiver.wait(timeout=10)
    sent = _packets_by_class(ns_a, "a0", column=1)
    queue = qos.QUEUE_CLASS_BASE + len(policyfile.embedded_default().queues) - 1
    assert sent[queue] > 250 << 20, sent
    assert sent.get(qos.SMALL_CLASS, 0) < 1 << 20, sent


@pytest.mark.netns
def test_concurrent_applies_leave_one_whole_tree(veth_pair: tuple[str, str]) -> None:
    ns_a, _ = veth_pair
    small = str(ROOT / "policies" / "static-classes.toml")
    base = ["ip", "netns", "exec", ns_a, sys.executable, "-m", "flowsched", "qos", "apply",
            "--dev", "a0", "--rate", "200mbit"]  # fmt: skip
    for _ in range(3):
        subprocess.run(["tc", "-n", ns_a, "qdisc", "del", "dev", "a0", "root"], capture_output=True)
        procs = [
            subprocess.Popen([*base, *extra], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
            for extra in ([], ["--policy", small])
        ]  # fmt: skip
        for proc in procs:
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
        in_place = [
            _flowsched(ns_a, "qos", "apply", "--dev", "a0", "--rate", "200mbit", *extra,
                       "--dry-run").stdout.strip() == "# a0: already in place"
            for extra in ([], ["--policy", small])
        ]  # fmt: skip
        assert in_place.count(True) == 1, in_place


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [
        (["apply", "--dev", "nosuchdev0"], 2, "no network interface named 'nosuchdev0'"),
        (["apply", "--dev", "lo"], 2, "lo reports no link speed"),
        (["apply", "--dev", "lo", "--rate", "1gbit", "--policy", "/nonexistent.toml"], 2,
         "--policy /nonexistent.toml: cannot read"),
        (["apply", "--dev", "lo", "--rate", "1gbit", "--policy", "{bad}"], 2,
         "--policy {bad}: classes.kv.deadline"),
        (["show", "--dev", "nosuchdev0"], 2, "no network interface"),
    ],
)  # fmt: skip
def test_bad_input_exits_2_with_one_line(
    args: list[str], status: int, message: str, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.toml"  # a policy file with an error
    bad.write_text("[policy]\nname = 'rmlq'\n[classes.kv]\ndeadline = -1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "flowsched", "qos", *[a.replace("{bad}", str(bad)) for a in args]],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == status
    assert message.replace("{bad}", str(bad)) in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.netns
def test_the_agent_applies_the_classes_and_restores_them(
    veth_pair: tuple[str, str], tmp_path: Path
) -> None:
    ns_a, _ = veth_pair
    log = tmp_path / "agent.log"
    with log.open("w") as sink:
        agent = subprocess.Popen(
            ["ip", "netns", "exec", ns_a, sys.executable, "-m", "flowsched", "agent",
             "--qos-dev", "a0", "--qos-rate", "200mbit", "--qos-check-interval", "0.2",
             "--table", str(tmp_path / "table"), "--socket", str(tmp_path / "agent.sock"),
             "--metrics-port", "-1", "--no-uvloop"],
            stdout=subprocess.PIPE, stderr=sink, text=True, cwd=ROOT,
        )  # fmt: skip
    try:
        assert agent.stdout is not None
        assert agent.stdout.readline().startswith("flowsched-agent ready"), log.read_text()
        classes = _packets_by_class(ns_a, "a0")
        queues = policyfile.embedded_default().queues
        assert {qos.QUEUE_CLASS_BASE + q for q in range(len(queues))} <= set(classes)
        # an operator (or another agent) takes it away: the next check puts it back
        assert "cleared" in _flowsched(ns_a, "qos", "clear", "--dev", "a0").stdout
        _wait_for(lambda: qos.QUEUE_CLASS_BASE in _packets_by_class(ns_a, "a0"))
        assert _root(ns_a, "a0") == "htb f5:"
        # the repair runs in a worker thread: its classes show before the agent logs it, and
        # a SIGTERM in between would cancel the log line
        _wait_for(lambda: "had been changed" in log.read_text())
    finally:
        agent.terminate()
        agent.communicate(timeout=30)
    err = log.read_text()
    assert "had been changed" in err
