"""RDMA (RoCE / InfiniBand) queue-pair attributes for a flowsched level.

A level's marking becomes the GRH ``traffic_class`` of a RoCE QP (the IP TOS byte: DSCP << 2,
ECN bits zero) and, for InfiniBand, a service level (SL, 0..15). The mapping is pure and
tested; building real ``pyverbs`` objects needs rdma-core's Python bindings and an RDMA device.

UNVERIFIED ON HARDWARE: the development machine has no RDMA support in its kernel (no rxe, siw
or /dev/infiniband), so :func:`build_qp_attr` and :func:`discover_devices` have only been run
against the pyverbs API's absence. The mapping functions are fully tested.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("flowsched.rdma")

MAX_SL = 15


class RdmaUnavailable(RuntimeError):
    """pyverbs is not installed, or no RDMA device can be used."""


@dataclass(frozen=True, slots=True)
class QpMarking:
    """What a QP needs to carry one level: GRH traffic class and IB service level."""

    level: int
    traffic_class: int
    service_level: int


def qp_marking(
    level: int,
    dscps: Sequence[int],
    *,
    service_levels: Sequence[int] | None = None,
) -> QpMarking:
    """The QP marking of ``level`` given the policy's per-level DSCPs.

    ``service_levels`` optionally gives the SL of each level (the fabric's SL -> VL map decides
    what an SL means); without it, level ``l`` uses SL ``min(l, 15)`` so that distinct levels
    stay distinct on fabrics with up to 16 SLs.
    """
    if not dscps:
        raise ValueError("dscps must name at least one level")
    if not 0 <= level < len(dscps):
        raise ValueError(f"level {level} not in 0..{len(dscps) - 1}")
    dscp = dscps[level]
    if not 0 <= dscp <= 63:
        raise ValueError(f"dscps[{level}] = {dscp} not in 0..63")
    if service_levels is not None:
        if len(service_levels) != len(dscps):
            raise ValueError("service_levels must have one entry per level")
        sl = service_levels[level]
    else:
        sl = min(level, MAX_SL)
    if not 0 <= sl <= MAX_SL:
        raise ValueError(f"service level {sl} not in 0..{MAX_SL}")
    return QpMarking(level, dscp << 2, sl)


def _pyverbs() -> Any:
    try:
        import pyverbs.addr
        import pyverbs.device
        import pyverbs.qp
    except ImportError as exc:
        raise RdmaUnavailable(f"pyverbs is not installed ({exc})") from None
    return pyverbs


def build_qp_attr(
    marking: QpMarking,
    dgid: str,
    *,
    gid_index: int = 0,
    port_num: int = 1,
    hop_limit: int = 64,
    pyverbs: Any = None,
) -> Any:
    """A ``pyverbs.qp.QPAttr`` whose address vector carries ``marking`` (for the RTR modify).

    ``dgid`` is the peer's GID (``"fe80:0000:...:0001"``). The caller fills the rest of the
    RTR attributes (``dest_qp_num``, ``rq_psn``, path MTU, ...) and modifies the QP. Raises
    :class:`RdmaUnavailable` without pyverbs. ``pyverbs`` replaces the imported package (tests).
    """
    pv = pyverbs if pyverbs is not None else _pyverbs()
    route = pv.addr.GlobalRoute(
        dgid=pv.addr.GID(dgid),
        sgid_index=gid_index,
        hop_limit=hop_limit,
        traffic_class=marking.traffic_class,
    )
    ah = pv.addr.AHAttr(gr=route, is_global=1, sl=marking.service_level, port_num=port_num)
    attr = pv.qp.QPAttr(port_num=port_num)
    attr.ah_attr = ah
    return attr


@dataclass(frozen=True, slots=True)
class RdmaDevice:
    """One RDMA device as pyverbs reports it."""

    name: str
    node_guid: str


def discover_devices() -> list[RdmaDevice]:
    """RDMA devices on this host; ``[]`` when pyverbs is missing or no device exists.

    (pyverbs raises instead of returning an empty list when there is no device.)
    """
    try:
        pv = _pyverbs()
        found = pv.device.get_device_list()
    except RdmaUnavailable as exc:
        log.debug("%s", exc)
        return []
    except Exception as exc:  # PyverbsRDMAError with no device / no kernel support
        log.debug("no RDMA devices: %s", exc)
        return []
    devices = []
    for dev in found:
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        devices.append(RdmaDevice(name, f"{getattr(dev, 'guid', 0):x}"))
    return devices
