"""PolicyView: the table header the agent writes from a policy file."""

from __future__ import annotations

import pytest

from flowsched import policyfile
from flowsched.agent.policy_view import PolicyView, gate_fields
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


@pytest.mark.parametrize(
    ("min_share", "max_deferral", "window", "share_word", "defer_word", "window_word"),
    [
        # unset: the plugin's defaults
        (None, None, None, layout.GATE_UNSET, layout.GATE_UNSET, layout.GATE_UNSET),
        # 0 is the policy's own "no share guard" / "no age bound": written as 0
        (0.0, 0.0, 0.1, 0, 0, 100),
        # below half a unit: still a guard, the smallest one (0 would switch it off)
        (0.0004, 0.0004, 0.001, 1, 1, 1),
        (1e-9, 1e-9, 0.001, 1, 1, 1),
        # from half a unit on: rounded as before
        (0.0006, 0.0006, 0.0016, 1, 1, 2),
        (0.05, 0.05, 0.1, 50, 50, 100),
        (1.0, 65.534, 65.534, 1000, 65534, 65534),
    ],
)
def test_gate_words_keep_small_guards_on(
    min_share: float | None,
    max_deferral: float | None,
    window: float | None,
    share_word: int,
    defer_word: int,
    window_word: int,
) -> None:
    gating = policyfile.Gating(
        enabled=True, min_share=min_share, window=window, max_deferral=max_deferral
    )
    words = gate_fields(gating)
    assert words["gate_min_share"] == share_word
    assert words["gate_max_defer_ms"] == defer_word
    assert words["gate_window_ms"] == window_word


def test_a_sub_millisecond_max_deferral_from_a_policy_file_keeps_the_age_bound() -> None:
    text = (
        '[policy]\nname = "static"\n'
        "[gating]\nenabled = true\nmax_deferral = 0.0004\nmin_share = 0.0001\n"
    )
    cfg = policyfile.loads(text)
    table = PolicyView(cfg).table_config()
    assert table.gate_max_defer_ms == 1
    assert table.gate_min_share == 1
