"""NIC load from (a fake) sysfs."""

from __future__ import annotations

from pathlib import Path

from flowsched.agent.nic import NicMonitor, default_interfaces


def _nic(root: Path, name: str, *, tx: int, speed: str = "1000", state: str = "up") -> None:
    (root / name / "statistics").mkdir(parents=True, exist_ok=True)
    (root / name / "statistics" / "tx_bytes").write_text(f"{tx}\n")
    (root / name / "speed").write_text(speed)
    (root / name / "operstate").write_text(state)


def test_load_is_tx_rate_over_capacity(tmp_path: Path) -> None:
    _nic(tmp_path, "eth0", tx=0)
    _nic(tmp_path, "veth1", tx=0, speed="-1")
    mon = NicMonitor("n1", ("eth0", "veth1"), default_bandwidth=1e6, root=tmp_path)
    first = mon.sample(now=10.0)
    assert [s.load for s in first] == [0.0, 0.0]
    _nic(tmp_path, "eth0", tx=62_500_000)  # 125 MB/s link, half of it for 1 s
    _nic(tmp_path, "veth1", tx=5_000_000, speed="-1")  # over the default capacity: clamped
    second = {s.interface: s for s in mon.sample(now=11.0)}
    assert second["eth0"].bandwidth == 125e6 and second["eth0"].load == 0.5
    assert second["veth1"].bandwidth == 1e6 and second["veth1"].load == 1.0
    assert second["eth0"].link == "n1/eth0"


def test_missing_interface_is_skipped(tmp_path: Path) -> None:
    mon = NicMonitor("n1", ("gone",), default_bandwidth=1e6, root=tmp_path)
    assert mon.sample() == []


def test_default_interfaces_skip_loopback_and_down(tmp_path: Path) -> None:
    _nic(tmp_path, "lo", tx=0, state="unknown")
    _nic(tmp_path, "eth0", tx=0)
    _nic(tmp_path, "eth1", tx=0, state="down")
    assert default_interfaces(tmp_path) == ("eth0",)
    assert default_interfaces(tmp_path / "none") == ("lo",)
