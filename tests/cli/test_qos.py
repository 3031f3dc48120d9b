"""``flowsched qos``: the plan, the read-back parsers, and a real veth pair in two namespaces.

The namespace test sends UDP datagrams with every DSCP of the policy (IPv4 and IPv6, some with
ECN bits set) and checks with ``tc -s class show`` that each landed in its queue's class, that
applying twice changes nothing, that a changed policy converges, and that ``clear`` removes it.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

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
    assert want.tree.default == qos.UNMARKED_CLASS
    assert {m: c.prio for m, c in leaves.items()} == {0x2: 0, 0xF: 7, 0x10: 0, 0x11: 1, 0x12: 2}
    assert all(c.rate == 2 * 10**6 and c.ceil == 200 * 10**6 for c in leaves.values())
    assert want.queue_dscps == {0x10: 46, 0x11: 34, 0x12: 1}


@pytest.mark.parametrize(
    ("dscp", "v4_value", "v6_value"),
    [(46, 0x00B80000, 0x0B800000), (1, 0x00040000, 0x00400000), (63, 0x00FC0000, 0x0FC00000)],
)
def test_filters_match_the_dscp_bits_only(dscp: int, v4_value: int, v6_value: int) -> None:
    filters = qos.plan("eth0", _markings(dscp), 10**9).tree.filters
    assert qos.TcFilter(qos.PREF_DSCP_V4, "ip", v4_value, 0x00FC0000, 0, 0x10) in filters
    assert qos.TcFilter(qos.PREF_DSCP_V6, "ipv6", v6_value, 0x0FC00000, 0, 0x10) in filters


def test_a_best_effort_queue_takes_the_unmarked_traffic() -> None:
    want = qos.plan("eth0", _markings(0), 10**9)  # hw_queues = 1: everything best effort
    assert want.tree.default == 0x10
    assert qos.UNMARKED_CLASS not in want.tree.classes
    assert all(f.pref in (qos.PREF_SMALL_V4, qos.PREF_SMALL_V6) for f in want.tree.filters)


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
class htb 1:10 parent 1:1 prio 0 rate 2Mbit ceil 200Mbit burst 1600b cburst 1600b
class htb 1:1 root rate 200Mbit ceil 200Mbit burst 1600b cburst 1600b
class htb 1:f parent 1:1 leaf 8001: prio 7 rate 2500Kbit ceil 200Mbit burst 1600b cburst 1600b
"""


def test_parse_classes() -> None:
    classes = qos.parse_classes(CLASS_SHOW)
    assert classes[0x1] == qos.TcClass(0x1, None, None, 200 * 10**6, 200 * 10**6)
    assert classes[0x10] == qos.TcClass(0x10, 0x1, 0, 2 * 10**6, 200 * 10**6)
    assert classes[0xF] == qos.TcClass(0xF, 0x1, 7, 2_500_000, 200 * 10**6)


def test_parse_filters_keeps_single_key_u32_filters_to_a_class() -> None:
    entries = [
        {"parent": "1:", "protocol": "ip", "pref": 3, "kind": "u32", "chain": 0},
        {"protocol": "ip", "pref": 3, "kind": "u32", "options": {"fh": "800:", "ht_divisor": 1}},
        {
            "protocol": "ip",
            "pref": 3,
            "kind": "u32",
            "options": {
                "fh": "800::800",
                "flowid": "1:10",
                "match": {"value": "b80000", "mask": "fc0000", "offmask": "", "off": 0},
            },
        },
    ]
    assert qos.parse_filters(entries) == {qos.TcFilter(3, "ip", 0xB80000, 0xFC0000, 0, 0x10)}


def test_no_changes_when_the_device_already_has_the_plan() -> None:
    want = qos.plan("eth0", _markings(46, 1), 200 * 10**6)
    assert qos.changes(want, want.tree) == []


def test_changes_from_a_bare_device_build_everything() -> None:
    want = qos.plan("eth0", _markings(46, 1), 200 * 10**6)
    lines = qos.changes(want, qos.Tree("noqueue 0:", None))
    assert lines[0] == "qdisc replace dev eth0 root handle 1: htb default f"
    assert sum(line.startswith("class replace") for line in lines) == len(want.tree.classes)
    assert sum(line.startswith("filter add") for line in lines) == len(want.tree.filters)
    assert not any("del" in line for line in lines)


def test_a_changed_policy_removes_stale_classes_and_rewrites_filters() -> None:
    old = qos.plan("eth0", _markings(46, 34, 18, 1), 200 * 10**6)
    new = qos.plan("eth0", _markings(46, 1), 200 * 10**6)
    lines = qos.changes(new, old.tree)
    assert lines[0] == "filter del dev eth0 parent 1:"
    assert "class del dev eth0 classid 1:12" in lines
    assert "class del dev eth0 classid 1:13" in lines
    # the class that kept its place is not touched; 1:11 now carries DSCP 1 (same class spec)
    assert not any(line.startswith("class replace") for line in lines)
    assert sum(line.startswith("filter add") for line in lines) == len(new.tree.filters)


def test_a_changed_rate_replaces_the_classes_only() -> None:
    old = qos.plan("eth0", _markings(46, 1), 200 * 10**6)
    new = qos.plan("eth0", _markings(46, 1), 400 * 10**6)
    lines = qos.changes(new, old.tree)
    assert lines and all(line.startswith("class replace") for line in lines)


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
    family, tos = spec.split(":")
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
        s.sendto(bytes(1000), dest)
    s.close()
"""


def _send(ns: str, count: int, specs: list[str]) -> None:
    subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", SENDER, str(count), *specs],
        check=True, timeout=60,
    )  # fmt: skip


def _packets_by_class(ns: str, dev: str) -> dict[int, int]:
    out = subprocess.run(
        ["tc", "-n", ns, "-s", "class", "show", "dev", dev],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    counts, current = {}, None
    for line in out.splitlines():
        if line.startswith("class htb 1:"):
            current = int(line.split()[2][2:], 16)
        elif line.strip().startswith("Sent") and current is not None:
            counts[current] = int(line.split()[3])
            current = None
    return counts


def _wait_for(predicate: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_marked_traffic_lands_in_its_queue_class(veth_pair: tuple[str, str]) -> None:
    ns_a, _ = veth_pair
    first = _flowsched(ns_a, "qos", "apply", "--dev", "a0", "--rate", "200mbit")
    assert first.returncode == 0, first.stderr
    assert "applied" in first.stdout
    again = _flowsched(ns_a, "qos", "apply", "--dev", "a0", "--rate", "200mbit")
    assert (again.returncode, again.stdout.strip()) == (0, "a0: unchanged")

    queues = policyfile.embedded_default().queues
    specs = [f"4:{m.dscp << 2}" for m in queues] + [f"6:{m.dscp << 2}" for m in queues]
    specs += [f"4:{(queues[0].dscp << 2) | 1}", "4:0"]  # ECN bits ignored; unmarked
    before = _packets_by_class(ns_a, "a0")
    _send(ns_a, 20, specs)

    def sent(minor: int) -> int:
        return _packets_by_class(ns_a, "a0").get(minor, 0) - before.get(minor, 0)

    _wait_for(lambda: sent(qos.QUEUE_CLASS_BASE) >= 60)
    for q in range(len(queues)):
        expected = 60 if q == 0 else 40  # IPv4 + IPv6 (+ the ECN-marked IPv4 for queue 0)
        assert sent(qos.QUEUE_CLASS_BASE + q) == expected, f"queue {q}"
    assert sent(qos.UNMARKED_CLASS) >= 20  # plus ARP, which is not IP

    shown = _flowsched(ns_a, "qos", "show", "--dev", "a0")
    assert shown.returncode == 0, shown.stderr
    assert f"DSCP {queues[0].dscp}" in shown.stdout and "unmarked" in shown.stdout


def test_a_changed_policy_converges_and_clear_removes_it(
    veth_pair: tuple[str, str], tmp_path: Path
) -> None:
    ns_a, _ = veth_pair
    assert _flowsched(ns_a, "qos", "apply", "--dev", "a0", "--rate", "200mbit").returncode == 0
    small = ROOT / "policies" / "static-classes.toml"
    changed = _flowsched(ns_a, "qos", "apply", "--dev", "a0", "--rate", "200mbit",
                         "--policy", str(small))  # fmt: skip
    assert changed.returncode == 0, changed.stderr
    dry = _flowsched(ns_a, "qos", "apply", "--dev", "a0", "--rate", "200mbit",
                     "--policy", str(small), "--dry-run")  # fmt: skip
    assert dry.stdout.strip() == "# a0: already in place"
    classes = _packets_by_class(ns_a, "a0")
    queues = policyfile.load(small).queues
    assert sorted(classes) == sorted(
        [1, qos.SMALL_CLASS, qos.UNMARKED_CLASS] + [0x10 + q for q in range(len(queues))]
    )
    for _ in range(2):  # idempotent too
        cleared = _flowsched(ns_a, "qos", "clear", "--dev", "a0")
        assert cleared.returncode == 0, cleared.stderr
    assert "no flowsched classes" in _flowsched(ns_a, "qos", "show", "--dev", "a0").stdout


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [
        (["apply", "--dev", "nosuchdev0"], 2, "no network interface named 'nosuchdev0'"),
        (["apply", "--dev", "lo"], 2, "lo reports no link speed"),
        (["apply", "--dev", "lo", "--rate", "1gbit", "--policy", "/nonexistent.toml"], 2,
         "cannot read"),
        (["show", "--dev", "nosuchdev0"], 2, "no network interface"),
    ],
)  # fmt: skip
def test_bad_input_exits_2_with_one_line(args: list[str], status: int, message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "flowsched", "qos", *args],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == status
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_the_agent_applies_the_classes_at_start(veth_pair: tuple[str, str], tmp_path: Path) -> None:
    ns_a, _ = veth_pair
    agent = subprocess.Popen(
        ["ip", "netns", "exec", ns_a, sys.executable, "-m", "flowsched", "agent",
         "--qos-dev", "a0", "--qos-rate", "200mbit", "--table", str(tmp_path / "table"),
         "--socket", str(tmp_path / "agent.sock"), "--metrics-port", "-1", "--no-uvloop"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        assert agent.stdout is not None
        assert agent.stdout.readline().startswith("flowsched-agent ready"), agent.stderr
        classes = _packets_by_class(ns_a, "a0")
        queues = policyfile.embedded_default().queues
        assert {qos.QUEUE_CLASS_BASE + q for q in range(len(queues))} <= set(classes)
    finally:
        agent.terminate()
        agent.wait(timeout=30)
