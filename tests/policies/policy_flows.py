"""Flow factory shared by the policy tests (a plain module: importing from conftest is fragile)."""

from __future__ import annotations

from typing import Any

from flowsched.model import Flow, FlowClass


def build_flow(flow_id: int = 1, cls: FlowClass | str = FlowClass.TP, **fields: Any) -> Flow:
    """A Flow with ``opened_at=0`` unless given; ``cls`` may be a label."""
    if isinstance(cls, str):
        cls = FlowClass.parse(cls)
    fields.setdefault("opened_at", 0.0)
    return Flow(flow_id=flow_id, cls=cls, **fields)
