"""RDMA (RoCE / InfiniBand) queue-pair attributes for a flowsched level.

A level's marking becomes the GRH ``traffic_class`` of a RoCE QP (the IP TOS byte: DSCP << 2,
ECN bits zero) and a service level (SL, 0..15). By default the SL is the DSCP's class
selector (DSCP >> 3): a RoCE NIC that trusts PCP sends the SL's low three bits as the frame's
priority, and one that trusts DSCP maps DSCP to priority by that same rule unless configured
otherwise, so both put the level in one priority, and the policy file's default DSCPs keep
clear of the priorities RoCE fabrics reserve (3: lossless, 6: CNP). On InfiniBand the subnet
manager's SL -> VL map decides what an SL means. The mapping is pure and tested; building real
``pyverbs`` objects needs rdma-core's Python bindings and an RDMA device.

UNVERIFIED ON HARDWARE: the development machine has no RDMA support in its kernel (no rxe, siw
or /dev/infiniband), so no QP was ever created. :func:`build_qp_attr` is tested against
Debian's real pyverbs (``python3-pyverbs``, without a device) and :func:`discover_devices`
against a host without devices; the mapping functions are fully tested.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import logging
import sys
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

    ``service_levels`` optionally gives the SL of each level; without it, a level's SL is its
    DSCP's class selector (``dscp >> 3``), the priority its DSCP gets on a RoCE fabric
    (module docstring). Levels in one hardware queue share a DSCP, hence an SL.
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
        sl = dscp >> 3
    if not 0 <= sl <= MAX_SL:
        raise ValueError(f"service level {sl} not in 0..{MAX_SL}")
    return QpMarking(level, dscp << 2, sl)


def _pyverbs() -> Any:
    try:
        import pyverbs.addr
        import pyverbs.device
        import pyverbs.qp
    except ImportError as exc:
        raise RdmaUnavailable(_why_no_pyverbs(exc)) from None
    return pyverbs


def _why_no_pyverbs(exc: ImportError) -> str:
    """Absent, or present and not loading: rdma-core's bindings are compiled modules built for
    one Python (a distribution's, say), which another interpreter finds and cannot load."""
    try:
        spec = importlib.util.find_spec("pyverbs")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return f"pyverbs is not installed ({exc})"
    where = ", ".join(spec.submodule_search_locations or ()) or spec.origin or "?"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return (
        f"pyverbs at {where} does not load in this Python ({version}): {exc}; install "
        "rdma-core's bindings built for it"
    )


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

    ``dgid`` is the peer's GID in any IPv6 spelling (``"fe80::1"``), or an IPv4 address for a
    RoCEv2 peer (its GID is ``::ffff:a.b.c.d``). The caller fills the rest of the RTR
    attributes (``dest_qp_num``, ``rq_psn``, path MTU, ...) and modifies the QP.
    ``pyverbs`` replaces the imported package (tests).

    Raises:
        ValueError: ``dgid`` is not a GID.
        RdmaUnavailable: pyverbs is not installed.
    """
    gid = full_gid(dgid)
    pv = pyverbs if pyverbs is not None else _pyverbs()
    route = pv.addr.GlobalRoute(
        dgid=pv.addr.GID(gid),
        sgid_index=gid_index,
        hop_limit=hop_limit,
        traffic_class=marking.traffic_class,
    )
    ah = pv.addr.AHAttr(gr=route, is_global=1, sl=marking.service_level, port_num=port_num)
    attr = pv.qp.QPAttr(port_num=port_num)
    attr.ah_attr = ah
    return attr


def full_gid(text: str) -> str:
    """``text`` as pyverbs' ``GID`` parses it: eight groups of four hex digits (it refuses
    ``"fe80::1"``); an IPv4 address becomes its v4-mapped RoCEv2 GID.

    Raises:
        ValueError: naming ``dgid``.
    """
    try:
        address = ipaddress.ip_address(text.strip())
    except (ValueError, AttributeError):
        raise ValueError(
            f"dgid: expected a GID (an IPv6 address, or IPv4 for RoCEv2), got {text!r}"
        ) from None
    if isinstance(address, ipaddress.IPv6Address) and address.scope_id is not None:
        raise ValueError(f"dgid: a GID has no zone (%...), got {text!r}")
    if isinstance(address, ipaddress.IPv4Address):
        address = ipaddress.IPv6Address(f"::ffff:{address}")
    # from the bytes, not ``exploded``: Python 3.13 writes a v4-mapped address's last 32 bits
    # as a dotted quad there ("...:ffff:10.0.0.2"), which is no GID
    packed = address.packed
    return ":".join(packed[i : i + 2].hex() for i in range(0, 16, 2))


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
