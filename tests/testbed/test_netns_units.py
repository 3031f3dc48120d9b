"""netns without namespaces: the probe and the teardown against fake commands and signals."""

from __future__ import annotations

import fcntl
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from flowsched import policies
from flowsched.metrics import RunRecords
from flowsched.testbed import bench, netns, replay
from flowsched.testbed.trace import ScenarioParams, Trace

HOSTS = ["sw", "h0", "h1", "h2", "h3"]


def _fake_teardown(
    monkeypatch: pytest.MonkeyPatch, signal_at: str | None, signum: int
) -> list[str]:
    """testbed() builds nothing; its final cleanup removes HOSTS one by one (slowly, like
    `ip netns del`) and is sent ``signum`` when it reaches ``signal_at``."""
    removed: list[str] = []
    calls = []

    def cleanup(prefix: str) -> list[str]:
        calls.append(prefix)
        if len(calls) == 1:  # the cleanup before the build
            return []
        for name in HOSTS:
            if name == signal_at:
                os.kill(os.getpid(), signum)
            time.sleep(0.02)
            removed.append(name)
        return removed

    monkeypatch.setattr(netns, "probe", lambda prefix="fsE-": None)
    monkeypatch.setattr(netns, "_build", lambda topo, dscp: None)
    monkeypatch.setattr(netns, "cleanup", cleanup)
    return removed


@pytest.mark.parametrize(
    ("first", "second", "raised"),
    [
        (signal.SIGTERM, signal.SIGTERM, netns.Terminated),
        (signal.SIGTERM, signal.SIGINT, KeyboardInterrupt),
        (signal.SIGINT, signal.SIGTERM, netns.Terminated),
        (None, signal.SIGTERM, netns.Terminated),
    ],
    ids=["term-then-term", "term-then-int", "int-then-term", "exit-then-term"],
)
def test_signal_during_teardown_waits_for_it(
    monkeypatch: pytest.MonkeyPatch,
    first: int | None,
    second: int,
    raised: type[BaseException],
) -> None:
    """A signal that arrives while the testbed is torn down acts only once the teardown is
    complete: every namespace is removed, then the signal is delivered as usual."""
    removed = _fake_teardown(monkeypatch, "h1", second)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with pytest.raises(raised), netns.testbed(netns.TopologySpec(prefix="fsU-")):
        if first is not None:
            os.kill(os.getpid(), first)
            time.sleep(1)
    assert removed == HOSTS
    assert {s: signal.getsignal(s) for s in before} == before


class FakeIp:
    """`ip netns add/del` and tc/ip batches, with namespaces that persist between calls."""

    def __init__(self, existing: Sequence[str]) -> None:
        self.namespaces = set(existing)

    def run(self, argv: Sequence[str], *, stdin: str | None = None, check: bool = True) -> str:
        if list(argv[:3]) == ["ip", "netns", "add"]:
            if argv[3] in self.namespaces:
                raise RuntimeError(f"ip netns add {argv[3]} failed (1): File exists")
            self.namespaces.add(argv[3])
        elif list(argv[:3]) == ["ip", "netns", "del"]:
            self.namespaces.discard(argv[3])
        return ""


@pytest.mark.parametrize("leftover", [[], ["fsU-probe"]], ids=["clean", "killed-probe-left"])
@pytest.mark.usefixtures("lock_dir")
def test_probe_survives_a_killed_probes_namespace(
    monkeypatch: pytest.MonkeyPatch, leftover: list[str]
) -> None:
    ip = FakeIp(leftover)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns, "_run", ip.run)
    assert netns.probe("fsU-") is None
    assert ip.namespaces == set()


class LockWatchingIp(FakeIp):
    """:class:`FakeIp` that records, at each command, whether the prefix's lock is held."""

    def __init__(self, prefix: str) -> None:
        super().__init__([])
        self.prefix = prefix
        self.locked_at_each_command: list[bool] = []

    def run(self, argv: Sequence[str], *, stdin: str | None = None, check: bool = True) -> str:
        fd = os.open(netns.lock_path(self.prefix), os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.locked_at_each_command.append(False)
        except BlockingIOError:
            self.locked_at_each_command.append(True)
        finally:
            os.close(fd)  # (and with it a lock this took)
        return super().run(argv, stdin=stdin, check=check)


@pytest.mark.usefixtures("lock_dir")
def test_the_probe_holds_the_prefix_lock_while_its_namespace_exists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two runs with the same prefix probing at once, or a live run's cleanup, must not delete
    each other's probe namespace: the probe makes and removes it under the prefix's lock."""
    netns.lock_path("fsU-").parent.mkdir(parents=True)
    netns.lock_path("fsU-").touch()
    ip = LockWatchingIp("fsU-")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns, "_run", ip.run)
    assert netns.probe("fsU-") is None
    assert ip.locked_at_each_command and all(ip.locked_at_each_command)
    with netns.prefix_lock("fsU-"):  # released afterwards
        pass


@pytest.mark.usefixtures("lock_dir")
def test_a_probe_while_another_run_holds_the_prefix_is_busy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ip = FakeIp([])
    commands: list[Sequence[str]] = []

    def run(argv: Sequence[str], *, stdin: str | None = None, check: bool = True) -> str:
        commands.append(argv)
        return ip.run(argv, stdin=stdin, check=check)

    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns, "_run", run)
    with netns.prefix_lock("fsU-"), pytest.raises(netns.TestbedBusy, match=f"pid {os.getpid()}"):
        netns.probe("fsU-")
    assert commands == []  # the holder's namespaces were not touched


def test_a_testbed_run_probes_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """bench.run probes (to choose testbed or simulator only); testbed() does not again."""
    probes: list[str] = []

    def probe(prefix: str = "fsE-") -> None:
        probes.append(prefix)

    def simulated_testbed_run(
        topo: netns.Topology, trace: Trace, result: object, work: Path, options: object
    ) -> RunRecords:
        return replay.replay(trace, policies.create("fair", num_levels=8))

    monkeypatch.setattr(netns, "probe", probe)
    monkeypatch.setattr(netns, "_build", lambda topo, dscp: None)
    monkeypatch.setattr(netns, "cleanup", lambda prefix: [])
    monkeypatch.setattr(bench, "_testbed_run", simulated_testbed_run)
    options = bench.BenchOptions(
        out=tmp_path / "out",
        policies=("fair",),
        params=ScenarioParams(duration=1.0),
        seed=1,
        spec=netns.TopologySpec(prefix="fsU-"),
        calibrate=False,
    )
    results = bench.run(options, stream=io.StringIO())
    assert probes == ["fsU-"]
    assert results[0].testbed is not None


def test_cleanup_leaves_a_longer_prefixs_testbed_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The testbed of ``fsU-h1-`` (hosts ``fsU-h1-h0``..., switch ``fsU-h1-sw``) is not
    leftovers of ``fsU-``: cleaning up ``fsU-`` must not delete it under its live run."""
    theirs = ["fsU-h1-sw", "fsU-h1-h0", "fsU-h1-h1"]
    ours = ["fsU-sw", "fsU-h0", "fsU-h1"]
    links = ["fsU-h1-h0d", "fsU-h0d"]

    def run(argv: Sequence[str], *, stdin: str | None = None, check: bool = True) -> str:
        if list(argv) == ["ip", "netns", "list"]:
            return "".join(f"{name} (id: {i})\n" for i, name in enumerate(theirs + ours))
        if list(argv) == ["ip", "-o", "link", "show"]:
            return "".join(
                f"{i + 2}: {name}@if9: <BROADCAST> mtu 1500\n" for i, name in enumerate(links)
            )
        return ""

    monkeypatch.setattr(netns, "_run", run)
    assert sorted(netns.namespaces("fsU-")) == sorted(ours)
    assert netns.root_links("fsU-") == ["fsU-h0d"]
    assert sorted(netns.namespaces("fsU-h1-")) == sorted(theirs)


#: a fake `ip` for :func:`netns.veth_pair`: namespaces and links kept in the JSON file
#: $FAKE_IP_STATE ({"netns": [...], "links": {name: [namespace or "", peer]}}), the
#: $FAKE_IP_FAIL_AT-th command (1 = the first) failing as the kernel would refuse it
_FAKE_IP = """\
import json, os, sys
state_path = os.environ["FAKE_IP_STATE"]
state = json.load(open(state_path))
state["calls"] = calls = state.get("calls", 0) + 1
args = sys.argv[1:]
ns = ""
if args[0] == "-n":
    ns, args = args[1], args[2:]
links = state["links"]

def fail(why):
    print(why, file=sys.stderr)
    sys.exit(2)

def save():
    json.dump(state, open(state_path, "w"))

if calls == int(os.environ["FAKE_IP_FAIL_AT"]):
    save()
    fail("RTNETLINK answers: Operation not permitted")
def here(dev):
    if links.get(dev, [None])[0] != ns:
        fail(f'Cannot find device "{dev}"')
def delete(dev):
    peer = links.pop(dev)[1]
    links.pop(peer, None)
match args:
    case ["netns", "add", name]:
        if name in state["netns"]:
            fail("Cannot create namespace file: File exists")
        state["netns"].append(name)
    case ["netns", "del", name]:
        state["netns"].remove(name)
        for dev in [d for d, (where, _) in list(links.items()) if where == name]:
            if dev in links:
                delete(dev)
    case ["link", "add", a, "type", "veth", "peer", "name", b]:
        links[a], links[b] = [ns, b], [ns, a]
    case ["link", "set", dev, "netns", target]:
        here(dev)
        links[dev][0] = target
    case ["link", "del", dev]:
        here(dev)
        delete(dev)
    case ["addr", "add", _, "dev", dev] | ["link", "set", dev, "up"]:
        if dev != "lo":
            here(dev)
    case _:
        fail(f"fake ip: unknown command {args}")
save()
"""
#: the commands veth_pair runs: 3 to make the namespaces and the pair, 4 for each end
VETH_PAIR_STEPS = 3 + 2 * 4


@pytest.fixture
def fake_ip(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """:data:`_FAKE_IP` first on PATH; returns its state file (nothing made yet)."""
    (tmp_path / "bin").mkdir()
    ip = tmp_path / "bin" / "ip"
    ip.write_text(f"#!{sys.executable}\n{_FAKE_IP}")
    ip.chmod(0o755)
    state = tmp_path / "ip-state.json"
    state.write_text(json.dumps({"netns": [], "links": {}}))
    monkeypatch.setenv("PATH", f"{ip.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_IP_STATE", str(state))
    return state


@pytest.mark.parametrize("fail_at", range(1, VETH_PAIR_STEPS + 1))
def test_a_veth_pair_that_fails_half_way_leaves_nothing_behind(
    monkeypatch: pytest.MonkeyPatch, fake_ip: Path, fail_at: int
) -> None:
    """Whichever command fails, the namespaces veth_pair added and the pair (in the root
    namespace until each end is moved) are gone when it raises."""
    monkeypatch.setenv("FAKE_IP_FAIL_AT", str(fail_at))
    with pytest.raises(subprocess.CalledProcessError) as raised:
        netns.veth_pair(("fsU-a", "fsU-da", "10.9.0.1"), ("fsU-b", "fsU-db", "10.9.0.2"))
    assert "Operation not permitted" in raised.value.stderr
    state = json.loads(fake_ip.read_text())
    assert (state["netns"], state["links"]) == ([], {})


def test_a_veth_pair_leaves_a_namespace_it_did_not_make_alone(
    monkeypatch: pytest.MonkeyPatch, fake_ip: Path
) -> None:
    """A name already taken is someone else's namespace: the failed call must not delete it."""
    fake_ip.write_text(json.dumps({"netns": ["fsU-b"], "links": {}}))
    monkeypatch.setenv("FAKE_IP_FAIL_AT", "0")
    with pytest.raises(subprocess.CalledProcessError):
        netns.veth_pair(("fsU-a", "fsU-da", "10.9.0.1"), ("fsU-b", "fsU-db", "10.9.0.2"))
    state = json.loads(fake_ip.read_text())
    assert (state["netns"], state["links"]) == (["fsU-b"], {})


def test_a_veth_pair_that_succeeds_has_each_end_in_its_namespace(
    monkeypatch: pytest.MonkeyPatch, fake_ip: Path
) -> None:
    monkeypatch.setenv("FAKE_IP_FAIL_AT", "0")
    netns.veth_pair(("fsU-a", "fsU-da", "10.9.0.1"), ("fsU-b", "fsU-db", "10.9.0.2"))
    state = json.loads(fake_ip.read_text())
    assert state["calls"] == VETH_PAIR_STEPS
    assert state["netns"] == ["fsU-a", "fsU-b"]
    assert state["links"] == {"fsU-da": ["fsU-a", "fsU-db"], "fsU-db": ["fsU-b", "fsU-da"]}


class StubbornIp(FakeIp):
    """:class:`FakeIp` that lists its namespaces and cannot delete those in ``refused``: a
    failed ``ip`` (RuntimeError under ``check``, as netns._run raises it, else ignored) or
    an exception such as a timeout."""

    def __init__(self, existing: Sequence[str], refused: dict[str, str | Exception]) -> None:
        super().__init__(existing)
        self.refused = refused

    def run(self, argv: Sequence[str], *, stdin: str | None = None, check: bool = True) -> str:
        if list(argv) == ["ip", "netns", "list"]:
            return "".join(f"{name}\n" for name in sorted(self.namespaces))
        if list(argv[:3]) == ["ip", "netns", "del"] and argv[3] in self.refused:
            refusal = self.refused[argv[3]]
            if isinstance(refusal, Exception):
                raise refusal
            if check:
                raise RuntimeError(f"{' '.join(argv)} failed (1): {refusal}")
            return ""
        return super().run(argv, stdin=stdin, check=check)


@pytest.mark.parametrize(
    ("refusal", "reason"),
    [
        ("Device or resource busy", "ip netns del fsU-h1 failed (1): Device or resource busy"),
        (subprocess.TimeoutExpired(["ip"], 30), "Command '['ip']' timed out after 30 seconds"),
    ],
    ids=["fails", "hangs"],
)
def test_a_cleanup_that_cannot_remove_a_namespace_says_so_and_removes_the_rest(
    monkeypatch: pytest.MonkeyPatch, refusal: str | Exception, reason: str
) -> None:
    ip = StubbornIp(["fsU-sw", "fsU-h0", "fsU-h1", "fsU-h2"], {"fsU-h1": refusal})
    monkeypatch.setattr(netns, "_run", ip.run)
    monkeypatch.setattr(netns, "shm_files", lambda prefix: [])
    with pytest.raises(netns.TestbedLeftBehind) as raised:
        netns.cleanup("fsU-")
    assert str(raised.value).startswith(f"could not remove netns fsU-h1 ({reason}) of the testbed")
    assert ip.namespaces == {"fsU-h1"}


def test_a_cleanup_that_cannot_list_the_namespaces_does_not_take_it_for_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def run(argv: Sequence[str], *, stdin: str | None = None, check: bool = True) -> str:
        if check:
            raise RuntimeError(f"{' '.join(argv)} failed (1): Permission denied")
        return ""

    monkeypatch.setattr(netns, "_run", run)
    with pytest.raises(RuntimeError, match="ip netns list failed"):
        netns.cleanup("fsU-")


@pytest.mark.parametrize("ending", [None, ValueError("boom")], ids=["block-ends", "block-raises"])
@pytest.mark.usefixtures("lock_dir")
def test_a_teardown_that_leaves_a_namespace_behind_ends_the_run_saying_so(
    monkeypatch: pytest.MonkeyPatch, ending: Exception | None
) -> None:
    """Whatever ended the block, a run whose testbed could not be removed must not end as if
    it had been: TestbedLeftBehind names what is left (the block's exception is its context)."""
    ip = StubbornIp([], {"fsU-h1": "Device or resource busy"})

    def build(topo: netns.Topology, dscp: Sequence[int]) -> None:
        ip.namespaces.update([topo.switch_ns, *(h.netns for h in topo.hosts)])

    monkeypatch.setattr(netns, "_run", ip.run)
    monkeypatch.setattr(netns, "_build", build)
    monkeypatch.setattr(netns, "shm_files", lambda prefix: [])
    with (
        pytest.raises(netns.TestbedLeftBehind, match=r"netns fsU-h1 \(.*busy\)") as raised,
        netns.testbed(netns.TopologySpec(prefix="fsU-", hosts=2), probed=True),
    ):
        if ending is not None:
            raise ending
    assert raised.value.__context__ is ending
    assert ip.namespaces == {"fsU-h1"}


#: a process holding a fake testbed (nothing built, the teardown says when it runs) that
#: sends itself the signal named in argv[2] (with argv[3] "ignored": one it ignores, as under
#: nohup); argv[1]: the folder of the prefix locks
_SIGNALLED = """
import os, signal, sys, time
from pathlib import Path
from flowsched.testbed import netns
calls = []
def cleanup(prefix):
    calls.append(prefix)
    if len(calls) > 1:
        print("torn down", flush=True)
    return []
netns.probe = lambda prefix="fsE-": None
netns._build = lambda topo, dscp: None
netns.cleanup = cleanup
netns.LOCK_DIR = Path(sys.argv[1])
signum = getattr(signal, sys.argv[2])
if sys.argv[3:] == ["ignored"]:
    signal.signal(signum, signal.SIG_IGN)
try:
    with netns.testbed(netns.TopologySpec(prefix="fsU-")):
        os.kill(os.getpid(), signum)  # (a signal sent to itself is handled before this returns)
        if sys.argv[3:] != ["ignored"]:
            time.sleep(30)  # a bound: the handler raises at once
except netns.Terminated as exc:
    print(f"terminated: signal {exc.signum}", flush=True)
"""


@pytest.mark.parametrize(
    ("name", "ignored", "said"),
    [
        ("SIGTERM", False, f"torn down\nterminated: signal {signal.SIGTERM}\n"),
        ("SIGHUP", False, f"torn down\nterminated: signal {signal.SIGHUP}\n"),
        ("SIGHUP", True, "torn down\n"),
    ],
    ids=["sigterm", "sighup", "sighup-under-nohup"],
)
def test_a_hangup_tears_the_testbed_down_as_sigterm_does(
    tmp_path: Path, name: str, ignored: bool, said: str
) -> None:
    """A closed terminal or a dropped ssh session sends SIGHUP: it killed the run with its
    testbed up (namespaces, their processes and the agents' tables left until the next run).
    A run under nohup (SIGHUP ignored) goes on."""
    argv = [sys.executable, "-c", _SIGNALLED, str(tmp_path), name, *(["ignored"] * ignored)]
    child = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert (child.returncode, child.stdout) == (0, said), child.stderr


def test_the_tables_an_agent_was_building_are_the_testbeds_too() -> None:
    """An agent killed while it built its table (a run's SIGKILL, a crash) leaves the hidden
    file it built it in: cleanup never matched it, so it stayed in /dev/shm for good."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    prefix = f"fsU{os.getpid()}-"
    names = [
        f"{prefix}h1-table",
        f".{prefix}h2-table.k3j_x9ab.building",
        f".{prefix}h2-table.k3j_x9ab.tmp",  # not ours
        f"{prefix}h1-tablet",  # not ours
        f".{prefix}x-h2-table.ab12cd34.building",  # a longer prefix's
    ]
    try:
        for name in names:
            (shm / name).write_bytes(b"")
        assert [p.name for p in netns.shm_files(prefix)] == sorted(names[:2])
    finally:
        for name in names:
            (shm / name).unlink(missing_ok=True)
