"""``static``: a fixed level per flow class, whatever the flow's deadline or progress.

This is today's practice: each class travels in its own NCCL communicator (or transfer engine)
with a fixed ``trafficClass``/DSCP, and switches serve the classes by strict priority. It is the
strongest practical baseline (reference/peers.md section 6).

Default mapping (``levels`` argument overrides any subset): ``tp`` 0, ``kv`` 1, ``param_sync`` 2,
``kv_reuse`` 2, ``experience`` 3, ``bulk`` K-1; defaults are clamped to K-1 when K is small.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from flowsched.model import Context, Decision, Flow, FlowClass
from flowsched.policies.argcheck import check_fields, class_map, integer
from flowsched.policies.common import level_changes

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
    """Arguments of ``static``: ``levels`` maps class labels to levels (0 = most urgent)."""

    levels: Mapping[str, int] = field(default_factory=dict)


def validate(args: Mapping[str, Any], path: str) -> list[str]:
    """Field-path errors for ``args`` (empty when valid)."""
    return check_fields(args, path, {"levels": class_map(integer(0))})


class StaticPolicy:
    """Each class at its configured level; a flow's level never changes."""

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

    def level_of(self, cls: FlowClass) -> int:
        """The configured level of ``cls``."""
        return self._level[cls]

    def describe_levels(self) -> list[str]:
        """The classes each level carries (for ``flowsched policy show``)."""
        return [
            ", ".join(c.label for c, lvl in self._level.items() if lvl == level) or "-"
            for level in range(self.num_levels)
        ]

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        return Decision(self._level[flow.cls])

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        return level_changes(flows, lambda f: self._level[f.cls])

    def release(self, flow: Flow, ctx: Context) -> None:
        return None


def new(args: Mapping[str, Any], *, num_levels: int) -> StaticPolicy:
    """Build a :class:`StaticPolicy` from validated ``args``."""
    return StaticPolicy(Args(**args), num_levels)
