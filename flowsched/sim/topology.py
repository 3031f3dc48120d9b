"""Cluster links for the simulator: NIC egress/ingress per node, optional node uplinks.

Link ids are strings the policies see in ``Flow.links`` and ``Context``:
``"<node>.nic<i>.tx"`` / ``"<node>.nic<i>.rx"`` for NIC egress/ingress and ``"<node>.up"`` /
``"<node>.down"`` for an oversubscribed uplink between the node and the spine. A non-blocking
fabric (the paper's 1:1 fat-tree) has no uplinks: contention is only at the NICs.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class NodeGroup:
    """``count`` nodes named ``<prefix><i>`` with ``nics`` NICs of ``nic_gbps`` each."""

    prefix: str
    count: int
    nics: int
    nic_gbps: float


@dataclass(slots=True)
class Topology:
    """Link names and capacities (bytes/s) plus the path rule between NICs."""

    capacity: dict[str, float] = field(default_factory=dict)
    #: uplink oversubscription (node NIC bandwidth / uplink bandwidth); None = non-blocking
    oversubscription: float | None = None
    nodes: dict[str, int] = field(default_factory=dict)

    @classmethod
    def build(cls, groups: list[NodeGroup], oversubscription: float | None = None) -> Topology:
        """Create the links of every node of ``groups``."""
        topo = cls(oversubscription=oversubscription)
        for group in groups:
            for i in range(group.count):
                topo.add_node(f"{group.prefix}{i}", group.nics, group.nic_gbps)
        return topo

    def add_node(self, node: str, nics: int, nic_gbps: float) -> None:
        """Add ``node`` with its NIC links (and uplinks when oversubscribed)."""
        bandwidth = nic_gbps * 1e9 / 8
        self.nodes[node] = nics
        for nic in range(nics):
            self.capacity[f"{node}.nic{nic}.tx"] = bandwidth
            self.capacity[f"{node}.nic{nic}.rx"] = bandwidth
        if self.oversubscription:
            uplink = nics * bandwidth / self.oversubscription
            self.capacity[f"{node}.up"] = uplink
            self.capacity[f"{node}.down"] = uplink

    def path(self, src: str, src_nic: int, dst: str, dst_nic: int) -> tuple[str, ...]:
        """Links crossed from ``src``'s NIC ``src_nic`` to ``dst``'s NIC ``dst_nic``.

        Traffic inside a node (NVLink/NVSwitch) crosses no simulated link: it is treated as
        non-bottleneck, as in the paper's simulation setup.
        """
        if src == dst:
            return ()
        tx = f"{src}.nic{src_nic % self.nodes[src]}.tx"
        rx = f"{dst}.nic{dst_nic % self.nodes[dst]}.rx"
        if self.oversubscription:
            return (tx, f"{src}.up", f"{dst}.down", rx)
        return (tx, rx)
