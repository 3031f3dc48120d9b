"""NIC discovery and load from sysfs (``/sys/class/net/*/statistics``).

Load of a link = transmitted bytes per second / capacity, clamped to [0, 1]. Capacity comes
from ``/sys/class/net/IF/speed`` (Mbit/s) when the driver reports one, else from the
configured default (veth and loopback report none).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

SYSFS_NET = Path("/sys/class/net")


@dataclass(frozen=True, slots=True)
class LinkSample:
    """Capacity (bytes/s) and utilization (0..1) of one interface."""

    link: str
    interface: str
    bandwidth: float
    load: float


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def default_interfaces(root: Path = SYSFS_NET) -> tuple[str, ...]:
    """Interfaces that are up, loopback excluded (sorted); ``("lo",)`` if there is none."""
    found = []
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return ("lo",)
    for name in names:
        if name == "lo":
            continue
        state = (root / name / "operstate").read_text().strip() if (root / name).exists() else ""
        if state in ("up", "unknown"):
            found.append(name)
    return tuple(found) or ("lo",)


class NicMonitor:
    """Samples tx byte counters of ``interfaces`` and turns them into link loads."""

    def __init__(
        self,
        node: str,
        interfaces: tuple[str, ...],
        *,
        default_bandwidth: float,
        root: Path = SYSFS_NET,
    ) -> None:
        self.node = node
        self.interfaces = interfaces
        self._default_bw = default_bandwidth
        self._root = root
        self._last: dict[str, tuple[float, int]] = {}
        self.samples: dict[str, LinkSample] = {}

    def link_id(self, interface: str) -> str:
        """The cluster-wide link id of ``interface``: ``node/interface``."""
        return f"{self.node}/{interface}"

    @property
    def links(self) -> tuple[str, ...]:
        """Link ids of every monitored interface."""
        return tuple(self.link_id(i) for i in self.interfaces)

    def bandwidth(self, interface: str) -> float:
        """Capacity in bytes/s (sysfs speed, else the configured default)."""
        speed = _read_int(self._root / interface / "speed")
        return speed * 1e6 / 8 if speed and speed > 0 else self._default_bw

    def sample(self, now: float | None = None) -> list[LinkSample]:
        """Read the counters once; the first call per interface reports load 0."""
        now = time.monotonic() if now is None else now
        out = []
        for interface in self.interfaces:
            tx = _read_int(self._root / interface / "statistics" / "tx_bytes")
            if tx is None:
                continue
            bw = self.bandwidth(interface)
            prev = self._last.get(interface)
            self._last[interface] = (now, tx)
            load = 0.0
            if prev is not None and now > prev[0] and tx >= prev[1]:
                load = min(max((tx - prev[1]) / (now - prev[0]) / bw, 0.0), 1.0)
            sample = LinkSample(self.link_id(interface), interface, bw, load)
            self.samples[interface] = sample
            out.append(sample)
        return out
