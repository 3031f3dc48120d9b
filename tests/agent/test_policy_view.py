"""PolicyView: the table header the agent writes from a policy file."""

from __future__ import annotations

from flowsched import policyfile
from flowsched.agent.policy_view import PolicyView
from flowsched.model import FlowClass
from flowsched.shm import layout


def test_table_config_from_the_embedded_default() -> None:
    cfg = policyfile.embedded_default()
    view = PolicyView(cfg)
    table = view.table_config()
    assert table.num_levels == cfg.num_levels
    for level, mark in enumerate(cfg.levels):
        assert (table.markings[level].dscp, table.markings[level].so_priority) == (
            mark.dscp,
            mark.so_priority,
        )
    for cls, rule in cfg.classes.items():
        assert table.default_level(int(cls)) == rule.default_level
        for tc in rule.traffic_classes:
            assert table.class_for_traffic_class(tc) == int(cls)
    assert table.fallback_class == int(FlowClass.TP)


def test_more_levels_than_the_table_holds_are_written_by_queue() -> None:
    text = '[policy]\nname = "rmlq"\nnum_levels = 24\nhw_queues = 4\n'
    cfg = policyfile.loads(text)
    view = PolicyView(cfg)
    assert cfg.num_levels > layout.MAX_LEVELS
    table = view.table_config()
    assert table.num_levels == cfg.hw_queues
    assert view.table_level(cfg.num_levels - 1) == cfg.level_queue[-1] < cfg.hw_queues
