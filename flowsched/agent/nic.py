"""NIC discovery and load from sysfs (``/sys/class/net/*/statistics``).

The agent reports two node-level links, one per direction, aggregated over its monitored
interfaces:

* ``<node>:tx`` (egress): bytes transmitted (``tx_bytes``) summed over the interfaces;
* ``<node>:rx`` (ingress): bytes received (``rx_bytes``) summed over the interfaces.

Without ``--interface`` the agent monitors the hardware NICs that are up
(:func:`default_interfaces`). Capacity of either = the sum of the interfaces' capacities: a
configured override when given (``capacity``: links shaped below their line rate, e.g. by htb,
or veth pairs, which report 10 Gbit/s whatever shapes them), else
``/sys/class/net/IF/speed`` (Mbit/s) when the driver reports one, else the configured default
(loopback reports none).
Load = bytes per second over the sampling interval / capacity, clamped to [0, 1].

Node-level ids let an agent name the ingress link of ANOTHER node (a flow's destination) without
knowing that node's interface names: a flow from ``a`` to ``b`` crosses ``a:tx`` and ``b:rx``
(:func:`flow_links`), and ``b``'s agent reports the load of ``b:rx``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

SYSFS_NET = Path("/sys/class/net")
TX, RX = "tx", "rx"


def egress_link(node: str) -> str:
    """The link id of ``node``'s outgoing direction: ``<node>:tx``."""
    return f"{node}:{TX}"


def ingress_link(node: str) -> str:
    """The link id of ``node``'s incoming direction: ``<node>:rx``."""
    return f"{node}:{RX}"


def flow_links(node: str, dst_node: str | None = None) -> tuple[str, ...]:
    """Links a flow sent by ``node`` crosses: its egress, and the destination's ingress."""
    if dst_node is None or dst_node == node:
        return (egress_link(node),)
    return (egress_link(node), ingress_link(dst_node))


@dataclass(frozen=True, slots=True)
class LinkSample:
    """Capacity (bytes/s) and utilization (0..1) of one node link (``interface``: the
    comma-separated interfaces it aggregates)."""

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
    """The hardware NICs that are up (sorted); without any, every interface that is up but
    loopback; ``("lo",)`` if there is none.

    A hardware NIC (PCI, virtio, ...) has a ``device`` link in sysfs; virtual interfaces
    (veth, bridge, vxlan, bond, dummy) have none. In the host's network namespace, where the
    DaemonSet runs the agent, every pod adds a veth and the CNI a bridge or tunnels: they
    carry pod traffic the NIC carries too, and their speeds (or the default capacity) would
    swell the node's capacity, so the NIC's load would read a fraction of what it is. A
    bond's ports carry its bytes. In a pod's or a testbed's namespace there are only veths.
    """
    up, hardware = [], []
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return ("lo",)
    for name in names:
        if name == "lo":
            continue
        try:
            state = (root / name / "operstate").read_text().strip()
        except OSError:  # gone since the listing (a container's veth, say), or no operstate
            continue
        if state in ("up", "unknown"):
            up.append(name)
            if (root / name / "device").exists():
                hardware.append(name)
    return tuple(hardware or up) or ("lo",)


class NicMonitor:
    """Samples the byte counters of ``interfaces`` and turns them into the node's link loads."""

    def __init__(
        self,
        node: str,
        interfaces: tuple[str, ...],
        *,
        default_bandwidth: float,
        root: Path = SYSFS_NET,
        capacity: float | None = None,
    ) -> None:
        self.node = node
        self.interfaces = interfaces
        self._default_bw = default_bandwidth
        self._capacity = capacity if capacity is not None and capacity > 0 else None
        self._root = root
        #: direction -> (time, byte total, interfaces that made the total)
        self._last: dict[str, tuple[float, int, tuple[str, ...]]] = {}
        #: link id -> latest sample
        self.samples: dict[str, LinkSample] = {}

    @property
    def links(self) -> tuple[str, ...]:
        """The links of this node's own flows: its egress link."""
        return flow_links(self.node)

    def links_to(self, dst_node: str | None) -> tuple[str, ...]:
        """The links of a flow from this node to ``dst_node`` (None: unknown destination)."""
        return flow_links(self.node, dst_node)

    def bandwidth(self, interface: str) -> float:
        """Capacity of one interface in bytes/s: the override, else the sysfs speed, else the
        configured default."""
        if self._capacity is not None:
            return self._capacity
        speed = _read_int(self._root / interface / "speed")
        return speed * 1e6 / 8 if speed and speed > 0 else self._default_bw

    def sample(self, now: float | None = None) -> list[LinkSample]:
        """Read the counters once: ``[<node>:tx, <node>:rx]`` (none when no interface can be
        read). The first sample of a direction, or one after the set of readable interfaces
        changed, reports load 0."""
        now = time.monotonic() if now is None else now
        out = []
        for direction, link in ((TX, egress_link(self.node)), (RX, ingress_link(self.node))):
            sample = self._sample_direction(direction, link, now)
            if sample is not None:
                self.samples[link] = sample
                out.append(sample)
        return out

    def _sample_direction(self, direction: str, link: str, now: float) -> LinkSample | None:
        counters = {
            name: value
            for name in self.interfaces
            if (value := _read_int(self._root / name / "statistics" / f"{direction}_bytes"))
            is not None
        }
        if not counters:
            return None
        names = tuple(counters)
        total = sum(counters.values())
        bandwidth = sum(self.bandwidth(name) for name in names)
        prev = self._last.get(direction)
        self._last[direction] = (now, total, names)
        load = 0.0
        if prev is not None and prev[2] == names and now > prev[0] and total >= prev[1]:
            load = min(max((total - prev[1]) / (now - prev[0]) / bandwidth, 0.0), 1.0)
        return LinkSample(link, ",".join(names), bandwidth, load)
