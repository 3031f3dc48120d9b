"""Scenario files: validation errors name the field path; traces are seeded and load-scaled."""

from __future__ import annotations

import dataclasses

import pytest

from flowsched import scenario
from flowsched.scenario import ScenarioError

MINIMAL = """
[scenario]
name = "t"
[serving]
requests = 10
"""


def _errors(text: str) -> list[str]:
    with pytest.raises(ScenarioError) as info:
        scenario.parse(text)
    return info.value.errors


BAD_FILES = [
    ("unknown-key", MINIMAL + "bogus = 1\n", "serving.bogus: unknown key"),
    (
        "wrong-type",
        MINIMAL.replace("requests = 10", 'requests = "ten"'),
        "serving.requests: expected int",
    ),
    (
        "float-for-int",
        MINIMAL.replace("requests = 10", "requests = 1.5"),
        "serving.requests: expected int",
    ),
    ("zero-layers", MINIMAL + "layers = 0\n", "serving.layers: 0 is out of range"),
    (
        "fraction",
        MINIMAL + "reuse_mean = 1.5\n",
        "serving.reuse_mean: 1.5 is out of range (expected 0..1)",
    ),
    ("negative", MINIMAL + "lookahead = -1\n", "serving.lookahead: -1 is out of range"),
    ("bool-is-not-int", MINIMAL + "layers = true\n", "serving.layers: expected int"),
    ("unknown-table", MINIMAL + "[network]\nx = 1\n", "network: unknown table"),
    ("missing-scenario", "[serving]\n", "scenario: missing table"),
    ("missing-name", "[scenario]\nseed = 1\n[rl]\n", "scenario.name: missing required key"),
    ("no-workload", '[scenario]\nname = "x"\n', "serving: a scenario needs"),
    ("sim-key", MINIMAL + "[sim]\ntimer_ms = -2.0\n", "sim.timer_ms: -2.0 is out of range"),
    ("nan-positive", MINIMAL + "gpu_tflops = nan\n", "serving.gpu_tflops: nan is out of range"),
    ("inf-fraction", MINIMAL + "reuse_mean = inf\n", "serving.reuse_mean: inf is out of range"),
    ("rl-key", '[scenario]\nname = "x"\n[rl]\nsteps_per_iteration = 0\n', "rl.steps_per_iteration"),
    ("not-a-table", '[scenario]\nname = "x"\nserving = 3\n', "scenario.serving: unknown key"),
    ("bad-toml", "[scenario\n", "invalid TOML"),
    ("table-is-a-number", 'serving = 3\n[scenario]\nname = "x"\n', "serving: expected a table"),
]


@pytest.mark.parametrize(
    ("text", "expected"), [c[1:] for c in BAD_FILES], ids=[c[0] for c in BAD_FILES]
)
def test_bad_files_name_the_field(text: str, expected: str) -> None:
    errors = _errors(text)
    assert any(expected in e for e in errors), errors


def test_all_errors_are_reported_together() -> None:
    errors = _errors(MINIMAL + "layers = 0\nbogus = 2\n[rl]\niterations = -1\n")
    assert len(errors) == 3


@pytest.mark.parametrize("name", ["pd-serving", "rl-disaggregated", "mixed"])
def test_bundled_scenarios_parse(name: str) -> None:
    scen = scenario.load(name)
    assert scen.scenario.name == name
    assert scen.kind == name


def test_unknown_scenario_name_lists_the_bundled_ones() -> None:
    with pytest.raises(ScenarioError, match="pd-serving"):
        scenario.resolve("no-such-scenario")


def test_trace_is_seeded_and_only_arrivals_scale_with_load() -> None:
    cfg = scenario.parse(MINIMAL).serving
    assert cfg is not None
    low = scenario.serving_trace(cfg, 0.2, seed=7)
    high = scenario.serving_trace(cfg, 0.8, seed=7)
    assert low == scenario.serving_trace(cfg, 0.2, seed=7)
    assert [r.prompt_tokens for r in low] == [r.prompt_tokens for r in high]
    assert high[-1].arrival == pytest.approx(low[-1].arrival / 4)
    assert [r.prompt_tokens for r in scenario.serving_trace(cfg, 0.2, seed=8)] != [
        r.prompt_tokens for r in low
    ]
    assert sum(r.warmup for r in low) == cfg.warmup_requests


def test_trace_statistics_follow_the_notes() -> None:
    cfg = dataclasses.replace(
        scenario.ServingSection(), requests=4000, warmup_requests=0, max_prompt_tokens=10**6
    )
    trace = scenario.serving_trace(cfg, 0.5, seed=1)
    mean_prompt = sum(r.prompt_tokens for r in trace) / len(trace)
    reuse = sum(r.reused_tokens / r.prompt_tokens for r in trace) / len(trace)
    assert mean_prompt == pytest.approx(1000, rel=0.1)
    assert reuse == pytest.approx(0.65, abs=0.03)
    rate = len(trace) / trace[-1].arrival
    assert rate == pytest.approx(scenario.serving_arrival_rate(cfg, 0.5), rel=0.1)


def test_slo_is_the_factor_times_the_isolated_ttft() -> None:
    cfg = scenario.ServingSection()
    request = scenario.serving_trace(cfg, 0.5, seed=3)[0]
    alone = scenario.isolated_ttft(cfg, request.prompt_tokens, request.new_tokens)
    assert request.slo == pytest.approx(cfg.slo_factor * alone)


@pytest.mark.parametrize("load", [0.3, 0.8, 1.0])
def test_rl_plan_scales_to_the_requested_load(load: float) -> None:
    cfg = scenario.RlSection()
    plan = scenario.rl_plan(cfg, load)
    scaled = dataclasses.replace(
        cfg, param_bytes=plan.param_bytes, experience_bytes=plan.experience_bytes
    )
    assert scenario.rl_nominal_load(scaled) == pytest.approx(load)
    assert plan.experience_bytes / plan.param_bytes == pytest.approx(
        cfg.experience_bytes / cfg.param_bytes
    )
