"""The C structs of the flow table agree with flowsched/shm/layout.py, field by field, the
plugin's compiled-in defaults agree with the shipped default policy, and its longest table
path with the agent's (flowsched/rundir.py)."""

from __future__ import annotations

import json
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest

from flowsched import rundir
from flowsched.model import FlowClass
from flowsched.shm import layout


@pytest.fixture(scope="module")
def c_view(layout_dump: Path) -> dict[str, Any]:
    out = subprocess.run([str(layout_dump)], check=True, capture_output=True, text=True).stdout
    view: dict[str, Any] = json.loads(out)
    return view


@pytest.mark.parametrize(
    "name,offset,fmt", layout.HEADER_FIELDS, ids=[f[0] for f in layout.HEADER_FIELDS]
)
def test_header_field(c_view: dict[str, Any], name: str, offset: int, fmt: str) -> None:
    assert c_view["header"][name] == [offset, struct.calcsize(fmt)]


@pytest.mark.parametrize(
    "name,offset,fmt", layout.SLOT_FIELDS, ids=[f[0] for f in layout.SLOT_FIELDS]
)
def test_slot_field(c_view: dict[str, Any], name: str, offset: int, fmt: str) -> None:
    assert c_view["slot"][name] == [offset, struct.calcsize(fmt)]


def test_every_field_is_covered(c_view: dict[str, Any]) -> None:
    assert set(c_view["header"]) == {f[0] for f in layout.HEADER_FIELDS}
    assert set(c_view["slot"]) == {f[0] for f in layout.SLOT_FIELDS}


def test_sizes_and_constants(c_view: dict[str, Any]) -> None:
    assert c_view["sizes"] == {
        "header": layout.HEADER_SIZE,
        "slot": layout.SLOT_SIZE,
        "class_map_entry": layout.CLASS_MAP_ENTRY.size,
        "level_marking_entry": layout.LEVEL_MARKING_ENTRY.size,
    }
    for name, value in c_view["constants"].items():
        assert getattr(layout, name) == value, name


def test_table_path_limit_matches_the_agent(c_view: dict[str, Any]) -> None:
    # the agent refuses a default table path the plugin would refuse (or truncate)
    assert c_view["limits"]["table_path"] == rundir.TABLE_PATH_MAX


def test_class_labels_match_flow_classes(c_view: dict[str, Any]) -> None:
    assert c_view["defaults"]["class_labels"] == [c.label for c in FlowClass]


def _shipped_default_policy() -> Any:
    policyfile = pytest.importorskip("flowsched.policyfile")
    try:
        return policyfile.embedded_default()
    except FileNotFoundError:
        pytest.skip("flowsched/data/policies/default.toml is not there yet")


def test_compiled_defaults_match_default_policy(c_view: dict[str, Any]) -> None:
    policy = _shipped_default_policy()
    defaults = c_view["defaults"]
    assert defaults["num_levels"] == policy.num_levels
    assert defaults["dscp"] == [m.dscp for m in policy.levels]
    assert defaults["so_priority"] == [m.so_priority for m in policy.levels]
    levels = [policy.classes[c].default_level for c in FlowClass]
    assert defaults["class_level"] == levels
    for cls in FlowClass:  # the compiled trafficClass map: value i selects class id i
        assert policy.class_for_traffic_class(int(cls)) == cls
