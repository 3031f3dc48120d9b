"""``static``: a fixed level per flow class, whatever the flow's deadline or progress.

This is today's practice: each class travels in its own NCCL communicator (or transfer engine)
with a fixed ``trafficClass``/DSCP, and switches serve the classes by strict priority. It is the
strongest practical baseline (reference/peers.md section 6).

Default mapping (``levels`` argument overrides any subset): ``tp`` 0, ``kv`` 1, ``param_sync`` 2,
``kv_reuse`` 2, ``experience`` 3, ``bulk`` K-1; defaults are clamped to K-1 when K is small.

``drop_late = true`` adds the late-dropping rule (:class:`~flowsched.policies.common.LateDrop`):
a flow of ``drop_classes`` (default ``["kv"]``) past its deadline moves to level K-1.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from flowsched.model import Context, Decision, Flow, FlowClass
from flowsched.policies.argcheck import check_fields, class_map, integer
from flowsched.policies.base import FlowLocalDecisions
from flowsched.policies.common import (
    DROP_CLASSES,
    LATE_DROP_FIELDS,
    LateDrop,
    late_drop_fields,
    level_changes,
)

NAME = "static"

#: class -> level used when ``levels`` does not name the class (bulk: K-1)
DEFAULT_LEVELS = {
    FlowClass.TP: 0,
    FlowClass.KV: 1,
    FlowClass.PARAM_SYNC: 2,
    FlowClass.KV_REUSE: 2,
    FlowClass.EXPERIENCE: 3,
}


def default_level(cls: FlowClass, num_levels: int) -> int:
    """``cls``'s level in the default mapping, clamped to K-1 (``bulk``: K-1).

    Also the class defaults of policy files (``default_level``: the plugin's level without an
    agent), so that "no agent" and the ``static`` policy agree."""
    return min(DEFAULT_LEVELS.get(cls, num_levels - 1), num_levels - 1)


@dataclass(frozen=True, slots=True)
class Args:
    """Arguments of ``static``: ``levels`` maps class labels to levels (0 = most urgent);
    ``drop_late``/``drop_classes``: the late-dropping rule (module docstring)."""

    levels: Mapping[str, int] = field(default_factory=dict)
    drop_late: bool = False
    drop_classes: tuple[str, ...] = DROP_CLASSES


def validate(args: Mapping[str, Any], path: str) -> list[str]:
    """Field-path errors for ``args`` (empty when valid)."""
    return check_fields(args, path, {"levels": class_map(integer(0)), **LATE_DROP_FIELDS})


class StaticPolicy(FlowLocalDecisions):
    """Each class at its configured level (late flows on K-1 with ``drop_late``)."""

    name: ClassVar[str] = NAME
    #: each decision depends on one flow and the Context only (see policies.base)
    per_flow_decisions: ClassVar[bool] = True

    def __init__(self, args: Args, num_levels: int) -> None:
        self.num_levels = num_levels
        self._level: dict[FlowClass, int] = {}
        for cls in FlowClass:
            default = default_level(cls, num_levels)
            level = args.levels.get(cls.label, default)
            if not 0 <= level < num_levels:
                raise ValueError(
                    f"policy.args.levels.{cls.label}: {level} is outside 0..{num_levels - 1}"
                )
            self._level[cls] = level
        self._late = LateDrop(args.drop_late, args.drop_classes)

    def level_of(self, cls: FlowClass) -> int:
        """The configured level of ``cls``."""
        return self._level[cls]

    def describe_levels(self) -> list[str]:
        """The classes each level carries (for ``flowsched policy show``)."""
        lines = [
            ", ".join(c.label for c, lvl in self._level.items() if lvl == level) or "-"
            for level in range(self.num_levels)
        ]
        if self._late.enabled:
            lines[-1] = f"{lines[-1]}; late {self._late.describe()}".removeprefix("-; ")
        return lines

    def _decide(self, flow: Flow, now: float) -> int:
        return self.num_levels - 1 if self._late.dropped(flow, now) else self._level[flow.cls]

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        return Decision(self._decide(flow, ctx.now))

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        return level_changes(flows, lambda f: self._decide(f, ctx.now))

    def next_change(self, flow: Flow, ctx: Context) -> float | None:
        """When time alone changes ``flow``'s level: its deadline with ``drop_late``."""
        return self._late.next_change(flow, ctx.now)

    def release(self, flow: Flow, ctx: Context) -> None:
        return None


def new(args: Mapping[str, Any], *, num_levels: int) -> StaticPolicy:
    """Build a :class:`StaticPolicy` from validated ``args``."""
    return StaticPolicy(Args(**late_drop_fields(args)), num_levels)
