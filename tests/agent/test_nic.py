"""NIC load from (a fake) sysfs."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowsched.agent.nic import NicMonitor, default_interfaces


def _nic(
    root: Path, name: str, *, tx: int, speed: str = "1000", state: str = "up", device: bool = False
) -> None:
    """A fake /sys/class/net entry; ``device``: a hardware NIC's (PCI, virtio), which sysfs
    links to its bus device; virtual ones (veth, bridge, vxlan, bond) have no such link."""
    (root / name / "statistics").mkdir(parents=True, exist_ok=True)
    (root / name / "statistics" / "tx_bytes").write_text(f"{tx}\n")
    (root / name / "speed").write_text(speed)
    (root / name / "operstate").write_text(state)
    if device:
        (root / name / "device").mkdir(exist_ok=True)


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


#: (name, operstate, has a bus device) of each interface of a node's /sys/class/net
_NODES = {
    # a Kubernetes node with flannel: the CNI bridge, the overlay and one veth per pod
    "flannel": [("eth0", "up", True), ("cni0", "up", False), ("flannel.1", "unknown", False),
                ("veth1a2b3c", "up", False), ("veth4d5e6f", "up", False)],
    # calico with two data NICs: a veth per pod (cali*), its tunnels, kube-proxy's dummy
    "calico": [("ens1f0", "up", True), ("ens1f1", "up", True), ("cali0a1b2c", "up", False),
               ("tunl0", "unknown", False), ("vxlan.calico", "unknown", False),
               ("nodelocaldns", "unknown", False)],
    # a bond over two ports: the ports carry the bond's bytes
    "bond": [("bond0", "up", False), ("eth0", "up", True), ("eth1", "up", True)],
    # a pod's or a testbed's network namespace: veths only, so those are the node's
    "netns": [("eth0", "up", False), ("veth1", "up", False)],
    # the hardware NIC is down: what is up is all there is
    "nic-down": [("eth0", "down", True), ("docker0", "up", False)],
}  # fmt: skip


@pytest.mark.parametrize(
    ("node", "want"),
    [
        pytest.param("flannel", ("eth0",), id="kubernetes-flannel"),
        pytest.param("calico", ("ens1f0", "ens1f1"), id="kubernetes-calico"),
        pytest.param("bond", ("eth0", "eth1"), id="bond-ports"),
        pytest.param("netns", ("eth0", "veth1"), id="virtual-only"),
        pytest.param("nic-down", ("docker0",), id="hardware-down"),
    ],
)
def test_default_interfaces_are_the_hardware_nics_when_any_is_up(
    tmp_path: Path, node: str, want: tuple[str, ...]
) -> None:
    # the DaemonSet runs the agent in the host's network namespace without --interface: pods'
    # veths, CNI bridges and tunnels are up there too, and carry pod traffic the NIC carries
    for name, state, device in _NODES[node]:
        _nic(tmp_path, name, tx=0, state=state, device=device)
    assert default_interfaces(tmp_path) == want


def test_pod_interfaces_do_not_dilute_the_node_nics_load(tmp_path: Path) -> None:
    # a 100 Gbit/s NIC sending at line rate on a flannel node is a full egress link
    for name, state, device in _NODES["flannel"]:
        speed = "100000" if device else "10000"
        _nic(tmp_path, name, tx=0, speed=speed, state=state, device=device)
    mon = NicMonitor("n1", default_interfaces(tmp_path), default_bandwidth=25e9, root=tmp_path)
    mon.sample(now=1.0)
    _nic(tmp_path, "eth0", tx=12_500_000_000, speed="100000", device=True)
    (sample,) = mon.sample(now=2.0)
    assert (sample.bandwidth, sample.load) == (12.5e9, 1.0)


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
