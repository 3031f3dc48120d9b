"""What the agent needs from a policy file: table config, level markings, class defaults.

The table holds at most ``layout.MAX_LEVELS`` (16) levels. A policy with more levels K is
written to the table by hardware queue instead: the slot's level word carries the queue of the
level (``level_queue``) and the marking table holds the queues' markings.
"""

from __future__ import annotations

from typing import Any

from flowsched.model import FlowClass
from flowsched.shm import layout
from flowsched.shm.table import LevelMarking, TableConfig


def _table_units(value: float | None, per_unit: int) -> int:
    """``value`` in the table's integer unit (``per_unit`` of them in 1.0), GATE_UNSET for None.

    A positive value is at least one unit: to the plugin 0 means "no age bound"
    (``gate_max_defer_ms``) or "no share guard" (``gate_min_share``), the opposite of a small
    bound, so rounding 0.0004 s down to 0 ms would switch the guard off.
    """
    if value is None:
        return layout.GATE_UNSET
    units = round(value * per_unit)
    return max(units, 1) if value > 0 else units


def gate_fields(gating: Any) -> dict[str, int]:
    """The table's ``gate_*`` words for a policy's :class:`flowsched.policyfile.Gating`."""

    def millis(seconds: float | None) -> int:
        return _table_units(seconds, 1000)

    mode = {None: layout.GATE_MODE_TUNED, False: layout.GATE_MODE_OFF, True: layout.GATE_MODE_ON}
    given = any(v is not None for v in (gating.enabled, gating.min_share, gating.window))
    given = given or gating.max_deferral is not None
    share = gating.min_share
    return {
        "gate_mode": mode[gating.enabled] if given else layout.GATE_MODE_DEFAULT,
        "gate_min_share": _table_units(share, 1000),  # per mille
        "gate_window_ms": millis(gating.window),
        "gate_max_defer_ms": millis(gating.max_deferral),
    }


class PolicyView:
    """Read-only helpers over a :class:`flowsched.policyfile.PolicyConfig`."""

    def __init__(self, cfg: Any, text: str | None = None) -> None:
        self.cfg = cfg
        self.text = text
        self.num_levels: int = cfg.num_levels
        self._by_queue = self.num_levels > layout.MAX_LEVELS

    def table_level(self, level: int) -> int:
        """The value to store in a slot's ``level`` word for policy level ``level``."""
        level = min(max(level, 0), self.num_levels - 1)
        if self._by_queue:
            return int(self.cfg.level_queue[level])
        return level

    def marking(self, level: int) -> LevelMarking:
        """DSCP and SO_PRIORITY of policy level ``level``."""
        mark = self.cfg.levels[min(max(level, 0), self.num_levels - 1)]
        return LevelMarking(int(mark.dscp), int(mark.so_priority))

    def default_level(self, cls: FlowClass) -> int:
        """The class's static default level."""
        rule = self.cfg.classes.get(cls)
        return int(rule.default_level) if rule is not None else self.num_levels - 1

    def default_deadline(self, cls: FlowClass) -> float | None:
        """The class's default relative deadline in seconds (explicit-deadline classes)."""
        rule = self.cfg.classes.get(cls)
        return None if rule is None or rule.deadline is None else float(rule.deadline)

    def nccl_traffic_class(self, cls: FlowClass) -> int | None:
        """The first NCCL trafficClass the policy maps to ``cls``."""
        rule = self.cfg.classes.get(cls)
        return int(rule.traffic_classes[0]) if rule is not None and rule.traffic_classes else None

    def table_config(self) -> TableConfig:
        """The header config: class map, fallback class, defaults and markings."""
        class_map = tuple(
            (int(tc), int(cls))
            for cls, rule in sorted(self.cfg.classes.items())
            for tc in rule.traffic_classes
        )[: layout.MAX_CLASS_MAP]
        defaults = tuple(self.table_level(self.default_level(cls)) for cls in FlowClass)
        if self._by_queue:
            markings = tuple(LevelMarking(int(m.dscp), int(m.so_priority)) for m in self.cfg.queues)
        else:
            markings = tuple(self.marking(level) for level in range(self.num_levels))
        return TableConfig(
            num_levels=len(markings),
            markings=markings,
            class_map=class_map,
            fallback_class=int(FlowClass.TP),
            default_levels=defaults,
            **gate_fields(self.cfg.gating),
        )
