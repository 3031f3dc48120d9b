"""Topology build/teardown, crash cleanup and DSCP classification on real namespaces."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from flowsched.testbed import netns

pytestmark = [pytest.mark.netns, pytest.mark.usefixtures("netns_ok")]

_CHILD = textwrap.dedent(
    """
    import sys, time
    from flowsched.testbed import netns
    with netns.testbed(netns.TopologySpec(prefix=sys.argv[1], hosts=2)):
        print("up", flush=True)
        time.sleep(60)
    """
)


def test_up_down_leaves_nothing() -> None:
    prefix = "fsE-t1-"
    with netns.testbed(netns.TopologySpec(prefix=prefix, hosts=4), [46, 10]) as topo:
        assert sorted(netns.namespaces(prefix)) == sorted(
            [topo.switch_ns] + [h.netns for h in topo.hosts]
        )
    assert netns.leftovers(prefix) == []


def test_exception_inside_tears_down() -> None:
    prefix = "fsE-t2-"
    with (
        pytest.raises(RuntimeError, match="boom"),
        netns.testbed(netns.TopologySpec(prefix=prefix, hosts=2)),
    ):
        raise RuntimeError("boom")
    assert netns.leftovers(prefix) == []


def _start_child(prefix: str) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, prefix], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "up"
    return child


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_signalled_child_cleans_up_itself(signum: int) -> None:
    prefix = "fsE-t3-"
    child = _start_child(prefix)
    try:
        child.send_signal(signum)
        child.wait(timeout=20)
        assert netns.leftovers(prefix) == []
    finally:
        child.kill()
        netns.cleanup(prefix)


def test_killed_child_leftovers_removed_by_cleanup() -> None:
    prefix = "fsE-t4-"
    child = _start_child(prefix)
    try:
        child.kill()
        child.wait(timeout=10)
        assert netns.leftovers(prefix), "SIGKILL should leave the namespaces behind"
        removed = netns.cleanup(prefix)
        assert any(r.startswith("netns") for r in removed)
        assert netns.leftovers(prefix) == []
    finally:
        netns.cleanup(prefix)


def test_a_second_run_leaves_the_first_runs_testbed_alone() -> None:
    """A second testbed with the same prefix is refused while the first run lives (its
    namespaces and processes untouched); once the first run is killed, the next one starts
    and removes its leftovers."""
    prefix = "fsE-t6-"
    spec = netns.TopologySpec(prefix=prefix, hosts=2)
    child = _start_child(prefix)
    try:
        before = sorted(netns.namespaces(prefix))
        with pytest.raises(netns.TestbedBusy, match=f"pid {child.pid}"), netns.testbed(spec):
            pytest.fail("a second testbed was built")
        assert sorted(netns.namespaces(prefix)) == before
        assert child.poll() is None
        child.kill()
        child.wait(timeout=10)
        with netns.testbed(spec) as topo:
            assert sorted(netns.namespaces(prefix)) == sorted(
                [topo.switch_ns] + [h.netns for h in topo.hosts]
            )
        assert netns.leftovers(prefix) == []
    finally:
        child.kill()
        child.wait(timeout=10)
        netns.cleanup(prefix)


def test_a_probe_leaves_a_live_run_alone() -> None:
    """The probe makes its namespace under the prefix's lock: while another run holds the
    testbed it is refused, and neither makes nor deletes anything of that prefix."""
    prefix = "fsE-t7-"
    child = _start_child(prefix)
    try:
        before = sorted(netns.namespaces(prefix))
        with pytest.raises(netns.TestbedBusy, match=f"pid {child.pid}"):
            netns.probe(prefix)
        assert sorted(netns.namespaces(prefix)) == before
        assert child.poll() is None
    finally:
        child.kill()
        child.wait(timeout=10)
        netns.cleanup(prefix)


_SEND = textwrap.dedent(
    """
    import socket, sys
    s = socket.socket()
    s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, int(sys.argv[2]) << 2)
    s.connect((sys.argv[1], 5000))
    s.sendall(b"x" * int(sys.argv[3]))
    s.close()
    """
)
_RECV = textwrap.dedent(
    """
    import socket
    srv = socket.create_server(("0.0.0.0", 5000))
    print("ready", flush=True)
    conn, _ = srv.accept()
    while conn.recv(65536):
        pass
    """
)


@pytest.mark.parametrize("dscp", [46, 26, 0], ids=["ef", "af31", "unmarked"])
def test_dscp_reaches_its_htb_class(dscp: int) -> None:
    levels = [46, 34, 26]
    counters = _send_through_switch("fsE-t5-", levels, dscp, 300_000)
    expected = netns.level_classes(levels).get(dscp, netns.UNMARKED_CLASS)
    assert counters[expected] >= 300000
    others = {c: n for c, n in counters.items() if c not in (expected, 1, netns.ACK_CLASS)}
    assert all(n < 10000 for n in others.values()), others


def test_htb_counts_the_headers_tcp_payload_share_leaves_out() -> None:
    """The simulator's testbed replays move payload at TCP_PAYLOAD_SHARE of the link rate: the
    switch port's htb class counts that many wire bytes per payload byte."""
    size = 4_000_000
    counters = _send_through_switch("fsE-t6-", [46], 46, size)
    wire = counters[netns.level_classes([46])[46]]
    assert size / wire == pytest.approx(netns.TCP_PAYLOAD_SHARE, rel=0.005)


def _send_through_switch(prefix: str, levels: list[int], dscp: int, size: int) -> dict[int, int]:
    """Send ``size`` bytes h0 -> h1 marked ``dscp``; the switch port toward h1's class bytes."""
    with netns.testbed(netns.TopologySpec(prefix=prefix, hosts=2), levels) as topo:
        a, b = topo.hosts
        rx = subprocess.Popen(
            topo.ns_command(b.netns, [sys.executable, "-c", _RECV]),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert rx.stdout is not None and rx.stdout.readline().strip() == "ready"
        subprocess.run(
            topo.ns_command(
                a.netns, [sys.executable, "-c", _SEND, b.data_ip, str(dscp), str(size)]
            ),
            check=True,
            timeout=30,
        )
        rx.wait(timeout=30)
        return topo.class_bytes()[f"{topo.switch_ns}/{b.switch_port}"]


#: `ip` or `tc` that counts its calls in $FAILING_COUNT and fails the $FAILING_AT-th one,
#: running the real program otherwise
_FAILING = """#!/bin/sh
n=$(( $(cat "$FAILING_COUNT") + 1 )); echo "$n" > "$FAILING_COUNT"
if [ "$n" -eq "$FAILING_AT" ]; then echo "injected failure of call $n" >&2; exit 2; fi
exec REAL "$@"
"""


@pytest.fixture
def failing_ip(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Callable[[int], int]:
    """``ip`` and ``tc`` first on PATH, failing at the call given to the returned function
    (0: none), which returns how many calls were made since it was last called."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for program in ("ip", "tc"):
        real = shutil.which(program)
        assert real is not None
        (folder / program).write_text(_FAILING.replace("REAL", real))
        (folder / program).chmod(0o755)
    count = tmp_path / "count"
    count.write_text("0")
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAILING_COUNT", str(count))

    def fail_at(call: int) -> int:
        calls = int(count.read_text())
        count.write_text("0")
        monkeypatch.setenv("FAILING_AT", str(call))
        return calls

    fail_at(0)
    return fail_at


def test_a_build_that_fails_at_any_step_leaves_nothing(failing_ip: Callable[[int], int]) -> None:
    """Whichever `ip` or `tc` command of the build fails, the run is told why
    (TestbedUnavailable) and no namespace or link of the testbed is left (its qdiscs are on
    its links); only the `tc qdisc del` before each port's tree may fail (no tree yet)."""
    prefix = "fsE-t9-"
    spec = netns.TopologySpec(prefix=prefix, hosts=2)
    with netns.testbed(spec, probed=True) as topo:
        build = failing_ip(0)  # the cleanup before the build, then the build's commands
    failing_ip(0)
    netns.cleanup(prefix)
    cleanup_before = failing_ip(0)
    built_anyway = []
    try:
        for step in range(cleanup_before + 1, build + 1):
            failing_ip(step)
            try:
                with netns.testbed(spec, probed=True):
                    built_anyway.append(step)
            except netns.TestbedUnavailable as exc:
                assert f"injected failure of call {step}" in str(exc)
            failing_ip(0)
            assert netns.leftovers(prefix) == [], f"call {step} failed"
    finally:
        netns.cleanup(prefix)
    assert len(built_anyway) == len(topo.shaped_ports())


def test_a_veth_pair_that_fails_at_any_step_leaves_nothing(
    failing_ip: Callable[[int], int],
) -> None:
    ends = (("fsE-t9-h0", "fsE-t9-h0d", "10.231.9.1"), ("fsE-t9-h1", "fsE-t9-h1d", "10.231.9.2"))
    netns.veth_pair(*ends)
    steps = failing_ip(0)
    netns.cleanup("fsE-t9-")
    try:
        for step in range(1, steps + 1):
            failing_ip(step)
            with pytest.raises(subprocess.CalledProcessError) as raised:
                netns.veth_pair(*ends)
            assert f"injected failure of call {step}" in raised.value.stderr
            failing_ip(0)
            assert netns.leftovers("fsE-t9-") == [], f"call {step} failed"
    finally:
        netns.cleanup("fsE-t9-")
