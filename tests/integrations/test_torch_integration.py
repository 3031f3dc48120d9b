"""flowsched.torch: trafficClass detection, with fake torch modules and, if present, real torch."""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace
from typing import Any

import pytest

from flowsched import torch as fs_torch
from flowsched.model import FlowClass
from flowsched.testbed.daemons import free_ports


class _Config:
    def __init__(self) -> None:
        self.traffic_class = -1


class _OptionsWithConfig:
    def __init__(self) -> None:
        self.config = _Config()


class _OptionsWithoutTc:
    def __init__(self) -> None:
        self.config = SimpleNamespace()


NON_MEMBER = object()


def _fake_dist(options_cls: Any | None, group: Any = "group") -> Any:
    """A torch.distributed stand-in recording calls and FLOWSCHED_CLASS at each call."""
    calls: list[dict[str, Any]] = []
    env_at: dict[str, str | None] = {}

    def new_group(**kwargs: Any) -> Any:
        calls.append(kwargs)
        env_at["new_group"] = os.environ.get("FLOWSCHED_CLASS")
        return group

    def barrier(group: Any = None) -> None:
        env_at["barrier"] = os.environ.get("FLOWSCHED_CLASS")

    pg = SimpleNamespace(Options=options_cls) if options_cls is not None else None
    dist = SimpleNamespace(
        new_group=new_group,
        barrier=barrier,
        calls=calls,
        env_at=env_at,
        GroupMember=SimpleNamespace(NON_GROUP_MEMBER=NON_MEMBER),
    )
    if pg is not None:
        dist.ProcessGroupNCCL = pg
    return dist


def test_traffic_class_is_set_when_torch_supports_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLOWSCHED_CLASS", raising=False)
    dist = _fake_dist(_OptionsWithConfig)
    result = fs_torch.new_group("kv", ranks=[0, 1], traffic_class=7, dist=dist)
    assert result.method == fs_torch.METHOD_NCCL_CONFIG
    assert dist.calls[0]["pg_options"].config.traffic_class == 7
    assert "FLOWSCHED_CLASS" not in os.environ


def test_the_callers_pg_options_carry_the_traffic_class(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLOWSCHED_CLASS", raising=False)
    dist = _fake_dist(_OptionsWithConfig)
    mine = _OptionsWithConfig()
    result = fs_torch.new_group("kv", ranks=[0, 1], traffic_class=7, dist=dist, pg_options=mine)
    assert result.method == fs_torch.METHOD_NCCL_CONFIG
    assert dist.calls[0]["pg_options"] is mine and mine.config.traffic_class == 7


def test_the_callers_pg_options_without_the_field_go_on_unchanged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("FLOWSCHED_CLASS", raising=False)
    dist = _fake_dist(_OptionsWithConfig)
    mine = _OptionsWithoutTc()
    result = fs_torch.new_group("kv", traffic_class=7, dist=dist, pg_options=mine)
    assert result.method == fs_torch.METHOD_ENV
    assert dist.calls[0]["pg_options"] is mine
    assert dist.env_at == {"new_group": "kv", "barrier": "kv"}


@pytest.mark.parametrize("options", [None, _OptionsWithoutTc], ids=["no-pg-nccl", "no-tc-field"])
@pytest.mark.parametrize("before", [None, "kv"], ids=["unset-before", "set-before"])
def test_fallback_sets_flowsched_class_while_the_communicator_is_created(
    monkeypatch: pytest.MonkeyPatch, options: Any, before: str | None
) -> None:
    if before is None:
        monkeypatch.delenv("FLOWSCHED_CLASS", raising=False)
    else:
        monkeypatch.setenv("FLOWSCHED_CLASS", before)
    dist = _fake_dist(options)
    result = fs_torch.new_group(FlowClass.PARAM_SYNC, traffic_class=3, dist=dist)
    assert result.method == fs_torch.METHOD_ENV
    assert dist.env_at == {"new_group": "param_sync", "barrier": "param_sync"}
    assert os.environ.get("FLOWSCHED_CLASS") == before  # later groups do not inherit it
    assert "pg_options" not in dist.calls[0]


def test_fallback_on_a_non_member_creates_no_communicator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLOWSCHED_CLASS", raising=False)
    dist = _fake_dist(None, group=NON_MEMBER)
    result = fs_torch.new_group("kv", ranks=[1, 2], dist=dist)
    assert result.group is NON_MEMBER
    assert "barrier" not in dist.env_at and "FLOWSCHED_CLASS" not in os.environ


def test_fallback_restores_the_environment_when_new_group_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLOWSCHED_CLASS", "tp")

    def failing_new_group(**kwargs: Any) -> Any:
        raise RuntimeError("store timed out")

    dist = SimpleNamespace(new_group=failing_new_group)
    with pytest.raises(RuntimeError, match="store timed out"):
        fs_torch.new_group("bulk", dist=dist)
    assert os.environ["FLOWSCHED_CLASS"] == "tp"


def test_traffic_class_defaults_to_the_policy_map() -> None:
    from flowsched import policyfile

    cfg = policyfile.embedded_default()
    for cls in FlowClass:
        values = cfg.classes[cls].traffic_classes
        assert fs_torch.traffic_class_for(cls) == (values[0] if values else None)


needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None,
    reason="torch is not installed (pip install torch==2.13.0)",
)


@needs_torch
def test_detection_agrees_with_the_installed_torch() -> None:
    import torch.distributed as dist

    pg = getattr(dist, "ProcessGroupNCCL", None)
    try:
        config = pg.Options().config if pg is not None else None
    except Exception:
        config = None
    supported = config is not None and hasattr(config, "traffic_class")
    options = fs_torch.nccl_options_with_traffic_class(5)
    assert (options is not None) == supported
    if options is not None:
        assert options.config.traffic_class == 5


@needs_torch
def test_real_gloo_group_falls_back_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    monkeypatch.delenv("FLOWSCHED_CLASS", raising=False)
    seen: list[tuple[str, str | None]] = []

    def spy(name: str) -> None:
        real = getattr(dist, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            seen.append((name, os.environ.get("FLOWSCHED_CLASS")))
            return real(*args, **kwargs)

        monkeypatch.setattr(dist, name, call)

    spy("new_group")
    spy("barrier")
    (port,) = free_ports(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        result = fs_torch.new_group("experience", backend="gloo")
        assert result.method == fs_torch.METHOD_ENV
        assert seen == [("new_group", "experience"), ("barrier", "experience")]
        assert "FLOWSCHED_CLASS" not in os.environ  # restored once the group exists
        import torch

        tensor = torch.ones(2)
        dist.all_reduce(tensor, group=result.group)  # the group works after the barrier
        assert tensor.tolist() == [1.0, 1.0]
        later = dist.new_group(backend="gloo")
        assert seen[-1] == ("new_group", None)  # a later group does not inherit the class
        assert later is not None
    finally:
        dist.destroy_process_group()


@needs_torch
def test_the_readmes_new_group_call_gives_a_group_torch_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The README's ``flowsched.torch.new_group(...)`` expression, as a user copies it, gives
    what ``torch.distributed`` collectives take as ``group=`` (gloo here: no NCCL on CPU)."""
    import re
    from pathlib import Path

    import torch
    import torch.distributed as dist

    import flowsched.torch

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("### Enable it for a torch job") :]
    found = re.search(r"`(flowsched\.torch\.new_group\([^`]*)`", section)
    assert found is not None, "the README no longer shows flowsched.torch.new_group"
    monkeypatch.setitem(flowsched.torch.new_group.__kwdefaults__, "backend", "gloo")
    monkeypatch.delenv("FLOWSCHED_CLASS", raising=False)
    (port,) = free_ports(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        group = eval(found.group(1), {"flowsched": flowsched, "ranks": [0]})
        tensor = torch.ones(2)
        dist.all_reduce(tensor, group=group)
        assert tensor.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()
