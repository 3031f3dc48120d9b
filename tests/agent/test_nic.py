"""NIC load from (a fake) sysfs."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowsched.agent.nic import NicMonitor, default_interfaces


def _nic(root: Path, name: str, *, tx: int, speed: str = "1000", state: str = "up") -> None:
    (root / name / "statistics").mkdir(parents=True, exist_ok=True)
    (root / name / "statistics" / "tx_bytes").write_text(f"{tx}\n")
    (root / name / "speed").write_text(speed)
    (root / name / "operstate").write_text(state)


@pytest.mark.parametrize(
    ("interface", "speed", "tx", "bandwidth", "load"),
    [
        pytest.param("eth0", "1000", 62_500_000, 125e6, 0.5, id="half-of-sysfs-speed"),
        pytest.param("veth1", "-1", 5_000_000, 1e6, 1.0, id="default-capacity-clamped"),
    ],
)
def test_load_is_tx_rate_over_capacity(
    tmp_path: Path, interface: str, speed: str, tx: int, bandwidth: float, load: float
) -> None:
    _nic(tmp_path, interface, tx=0, speed=speed)
    mon = NicMonitor("n1", (interface,), default_bandwidth=1e6, root=tmp_path)
    assert [s.load for s in mon.sample(now=10.0)] == [0.0]
    _nic(tmp_path, interface, tx=tx, speed=speed)
    (sample,) = mon.sample(now=11.0)  # no rx_bytes in this fake tree: egress only
    assert (sample.link, sample.bandwidth, sample.load) == ("n1:tx", bandwidth, load)


def test_missing_interface_is_skipped(tmp_path: Path) -> None:
    mon = NicMonitor("n1", ("gone",), default_bandwidth=1e6, root=tmp_path)
    assert mon.sample() == []


def test_default_interfaces_skip_loopback_and_down(tmp_path: Path) -> None:
    _nic(tmp_path, "lo", tx=0, state="unknown")
    _nic(tmp_path, "eth0", tx=0)
    _nic(tmp_path, "eth1", tx=0, state="down")
    assert default_interfaces(tmp_path) == ("eth0",)
    assert default_interfaces(tmp_path / "none") == ("lo",)


def _rx(root: Path, name: str, rx: int) -> None:
    (root / name / "statistics" / "rx_bytes").write_text(f"{rx}\n")


def test_both_directions_are_reported_as_node_links(tmp_path: Path) -> None:
    """``<node>:tx`` from tx_bytes, ``<node>:rx`` from rx_bytes, summed over the interfaces."""
    _nic(tmp_path, "eth0", tx=0)
    _nic(tmp_path, "eth1", tx=0)
    _rx(tmp_path, "eth0", 0)
    _rx(tmp_path, "eth1", 0)
    mon = NicMonitor("n1", ("eth0", "eth1"), default_bandwidth=1e6, root=tmp_path)
    mon.sample(now=1.0)
    _nic(tmp_path, "eth0", tx=25_000_000)  # 2 x 125 MB/s: a quarter of the capacity
    _rx(tmp_path, "eth0", 100_000_000)
    _rx(tmp_path, "eth1", 25_000_000)
    second = {s.link: s for s in mon.sample(now=2.0)}
    assert set(second) == {"n1:tx", "n1:rx"}
    assert second["n1:tx"].bandwidth == 250e6 and second["n1:tx"].load == 0.1
    assert second["n1:rx"].load == 0.5 and second["n1:rx"].interface == "eth0,eth1"
    assert mon.samples["n1:rx"] is second["n1:rx"]


def test_interface_set_change_restarts_the_rate(tmp_path: Path) -> None:
    _nic(tmp_path, "eth0", tx=0)
    _nic(tmp_path, "eth1", tx=0)
    mon = NicMonitor("n1", ("eth0", "eth1"), default_bandwidth=1e6, root=tmp_path)
    mon.sample(now=1.0)
    (tmp_path / "eth1" / "statistics" / "tx_bytes").unlink()  # eth1 went away
    _nic(tmp_path, "eth0", tx=10)
    (only,) = mon.sample(now=2.0)  # no rx counters at all: only the egress link
    assert only.link == "n1:tx" and only.load == 0.0 and only.bandwidth == 125e6


@pytest.mark.parametrize(
    ("dst", "links"),
    [
        pytest.param(None, ("n1:tx",), id="unknown-destination"),
        pytest.param("n1", ("n1:tx",), id="own-node"),
        pytest.param("n2", ("n1:tx", "n2:rx"), id="remote-node"),
    ],
)
def test_links_of_a_flow(tmp_path: Path, dst: str | None, links: tuple[str, ...]) -> None:
    mon = NicMonitor("n1", ("eth0",), default_bandwidth=1e6, root=tmp_path)
    assert mon.links_to(dst) == links
    assert mon.links == ("n1:tx",)


def test_capacity_override_beats_sysfs_speed(tmp_path: Path) -> None:
    """A shaped veth reports 10 Gbit/s; the configured capacity is what the flows get."""
    _nic(tmp_path, "veth0", tx=0, speed="10000")
    mon = NicMonitor("n1", ("veth0",), default_bandwidth=1e6, root=tmp_path, capacity=25e6)
    mon.sample(now=1.0)
    _nic(tmp_path, "veth0", tx=12_500_000, speed="10000")
    (sample,) = mon.sample(now=2.0)
    assert sample.bandwidth == 25e6 and sample.load == 0.5


def test_an_interface_gone_since_the_listing_is_left_out(tmp_path: Path) -> None:
    for name, state in (("eth0", "up"), ("veth1", None)):  # veth1: its operstate is gone
        (tmp_path / name).mkdir()
        if state is not None:
            (tmp_path / name / "operstate").write_text(state + "\n")
    assert default_interfaces(tmp_path) == ("eth0",)
