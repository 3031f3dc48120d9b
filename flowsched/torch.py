"""PyTorch integration: process groups whose NCCL communicator carries a trafficClass.

NCCL (>= 2.26) hands each communicator's ``trafficClass`` to the net plugin, which maps it to a
flow class through the policy. Recent PyTorch builds expose it as
``ProcessGroupNCCL.Options().config.traffic_class``; this module detects that at run time with
``hasattr`` (no version is assumed) and otherwise falls back to ``FLOWSCHED_CLASS`` in the
environment, which the plugin reads once per process (so it labels every communicator the
process creates afterwards, not just this one). :class:`GroupResult` says which was used.

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
    installed torch exposes ``NCCLConfig.traffic_class`` it is set on the group's options;
    otherwise ``FLOWSCHED_CLASS`` is set in this process's environment before the group is
    created. ``dist`` (default ``torch.distributed``) and ``kwargs`` go to ``new_group``.
    """
    flow_class = FlowClass.parse(cls) if isinstance(cls, str) else FlowClass(cls)
    if dist is None:
        dist = _torch_distributed()
    tc = traffic_class if traffic_class is not None else traffic_class_for(flow_class)
    options = nccl_options_with_traffic_class(tc, dist) if tc is not None else None
    if options is not None and backend == "nccl":
        group = dist.new_group(ranks=ranks, backend=backend, pg_options=options, **kwargs)
        detail = f"NCCL communicator trafficClass={tc} (class {flow_class.label})"
        result = GroupResult(group, METHOD_NCCL_CONFIG, detail)
    else:
        os.environ["FLOWSCHED_CLASS"] = flow_class.label
        group = dist.new_group(ranks=ranks, backend=backend, **kwargs)
        detail = (
            f"this torch/NCCL cannot set a per-communicator trafficClass; "
            f"FLOWSCHED_CLASS={flow_class.label} labels this process's connections"
        )
        result = GroupResult(group, METHOD_ENV, detail)
    log.info("flowsched: %s", result.detail)
    return result
