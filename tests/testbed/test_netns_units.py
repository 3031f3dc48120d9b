"""netns without namespaces: the probe and the teardown against fake commands and signals."""

from __future__ import annotations

import fcntl
import io
import os
import signal
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
