"""PyTorch integration: process groups whose NCCL communicator carries a trafficClass.

NCCL (>= 2.26) hands each communicator's ``trafficClass`` to the net plugin, which maps it to a
flow class through the policy. Recent PyTorch builds expose it as
``ProcessGroupNCCL.Options().config.traffic_class``; this module detects that at run time with
``hasattr`` (no version is assumed) and otherwise falls back to ``FLOWSCHED_CLASS`` in the
environment, set only while the group's communicator is created (see :func:`new_group` for
what that covers on each NCCL). :class:`GroupResult` says which was used.

torch is imported lazily: importing this module never needs it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flowsched.model import FlowClass

log = logging.getLogger("flowsched.torch")

METHOD_NCCL_CONFIG = "nccl_config.traffic_class"
METHOD_ENV = "FLOWSCHED_CLASS"


@dataclass(frozen=True, slots=True)
class GroupResult:
    """The group and how its traffic is labelled (``method`` is one of the METHOD_* names)."""

    group: Any
    method: str
    detail: str


def _torch_distributed() -> Any:
    import torch.distributed

    return torch.distributed


def nccl_options_with_traffic_class(traffic_class: int, dist: Any = None) -> Any | None:
    """``ProcessGroupNCCL.Options`` with ``config.traffic_class`` set, or None if unsupported."""
    if dist is None:
        dist = _torch_distributed()
    pg_nccl = getattr(dist, "ProcessGroupNCCL", None)
    if pg_nccl is None or not hasattr(pg_nccl, "Options"):
        return None
    try:
        options = pg_nccl.Options()
    except Exception:  # built without NCCL, or a constructor we do not know
        return None
    return _set_traffic_class(options, traffic_class)


def _set_traffic_class(options: Any, traffic_class: int) -> Any | None:
    """``options`` with ``config.traffic_class`` set, or None when it has no such field."""
    config = getattr(options, "config", None)
    if config is None or not hasattr(config, "traffic_class"):
        return None
    config.traffic_class = traffic_class
    return options


def traffic_class_for(cls: FlowClass, policy: Any = None) -> int | None:
    """The first NCCL trafficClass the policy (default: the embedded one) maps to ``cls``."""
    if policy is None:
        from flowsched import policyfile

        policy = policyfile.embedded_default()
    values = policy.classes[cls].traffic_classes
    return int(values[0]) if values else None


def new_group(
    cls: FlowClass | str,
    *,
    ranks: Sequence[int] | None = None,
    traffic_class: int | None = None,
    backend: str = "nccl",
    dist: Any = None,
    **kwargs: Any,
) -> GroupResult:
    """Create a process group whose NCCL traffic is labelled as flow class ``cls``.

    ``traffic_class`` defaults to the value the embedded policy maps to ``cls``. Where the
    installed torch exposes ``NCCLConfig.traffic_class`` it is set on the group's options.
    Otherwise ``FLOWSCHED_CLASS`` is set while the group and its communicator are created,
    and restored afterwards, so that groups created later do not inherit it. torch creates a
    group's NCCL communicator lazily, at its first collective, unless the default group is
    bound to a device; a member therefore runs a ``barrier`` on the new group (a collective
    every member reaches, as each member calls ``new_group``) to create it now. With NCCL
    2.28+ (net plugin API v11+) the plugin takes the class at the communicator's init: every
    connection of the group carries it. Older NCCL has one plugin context per process, so
    the plugin reads the variable per connection: the connections made during the barrier
    carry the class; those NCCL makes later for this group (another algorithm, p2p) carry
    the process's own ``FLOWSCHED_CLASS`` (unset: the policy's fallback class).
    The variable is set and restored with ``os.environ`` (``setenv``), which is not
    thread-safe against ``getenv`` on other threads: NCCL's own threads read the environment,
    and with NCCL before 2.28 the plugin reads ``FLOWSCHED_CLASS`` at every connection setup.
    Do not call this while another communicator is being created or connected on another
    thread; keeping those apart is the caller's part.
    ``dist`` (default ``torch.distributed``) and ``kwargs`` go to ``new_group``; a
    ``pg_options`` among them is the one given to the group, with its
    ``config.traffic_class`` set (where it has one).
    """
    flow_class = FlowClass.parse(cls) if isinstance(cls, str) else FlowClass(cls)
    if dist is None:
        dist = _torch_distributed()
    tc = traffic_class if traffic_class is not None else traffic_class_for(flow_class)
    options = None
    if tc is not None and backend == "nccl":
        given = kwargs.pop("pg_options", None)  # the caller's own options carry the class
        if given is not None:
            options = _set_traffic_class(given, tc)
            if options is None:
                kwargs["pg_options"] = given  # passed on unchanged to the fallback
        else:
            options = nccl_options_with_traffic_class(tc, dist)
    if options is not None:
        group = dist.new_group(ranks=ranks, backend=backend, pg_options=options, **kwargs)
        detail = f"NCCL communicator trafficClass={tc} (class {flow_class.label})"
        result = GroupResult(group, METHOD_NCCL_CONFIG, detail)
    else:
        group = _new_group_under_env(dist, flow_class.label, ranks=ranks, backend=backend, **kwargs)
        detail = (
            f"this torch/NCCL cannot set a per-communicator trafficClass; "
            f"FLOWSCHED_CLASS={flow_class.label} was set while the group's communicator was created"
        )
        result = GroupResult(group, METHOD_ENV, detail)
    log.info("flowsched: %s", result.detail)
    return result


def _new_group_under_env(dist: Any, label: str, **kwargs: Any) -> Any:
    """``dist.new_group(**kwargs)`` and its communicator with ``FLOWSCHED_CLASS=label``, then
    the variable's previous value (or its absence) back."""
    previous = os.environ.get(METHOD_ENV)
    os.environ[METHOD_ENV] = label
    try:
        group = dist.new_group(**kwargs)
        if _is_member(dist, group):
            dist.barrier(group=group)  # creates the communicator now (torch's are lazy)
    finally:
        if previous is None:
            os.environ.pop(METHOD_ENV, None)
        else:
            os.environ[METHOD_ENV] = previous
    return group


def _is_member(dist: Any, group: Any) -> bool:
    """False for what ``new_group`` returns to a rank outside the group."""
    non_member = getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", None)
    return group is not None and not (non_member is not None and group is non_member)
