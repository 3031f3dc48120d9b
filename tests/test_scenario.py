"""Scenario files: validation errors name the field path; traces are seeded and load-scaled."""

from __future__ import annotations

import dataclasses
from pathlib import Path

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
    (
        "zero-share",
        MINIMAL + "[sim]\npayload_share = 0\n",
        "sim.payload_share: 0.0 is out of range (expected >= 0.001 and <= 1)",
    ),
    # absurd finite values passed "> 0" and broke the run later: an OverflowError (int of an
    # infinite flow size, a squared sigma), a rate of 0 (ZeroDivisionError) or a run that
    # never ended (a 1e-300 Gb/s link, a 1e300 ms phase)
    (
        "huge-rl-rate",
        '[scenario]\nname = "x"\n[rl]\nnic_gbps = 1e300\n',
        "rl.nic_gbps: 1e+300 is out of range (expected >= 0.001 and <= 100000)",
    ),
    (
        "tiny-rate",
        MINIMAL + "nic_gbps = 1e-300\n",
        "serving.nic_gbps: 1e-300 is out of range (expected >= 0.001 and <= 100000)",
    ),
    (
        "huge-sigma",
        MINIMAL + "prompt_sigma = 1e200\n",
        "serving.prompt_sigma: 1e+200 is out of range (expected >= 0 and <= 10)",
    ),
    (
        "huge-prompts",
        MINIMAL + "mean_prompt_tokens = 1e300\n",
        "serving.mean_prompt_tokens: 1e+300 is out of range (expected >= 1 and <= 1e+08)",
    ),
    (
        "huge-phase",
        '[scenario]\nname = "x"\n[rl]\nphase_compute_ms = 1e300\n',
        "rl.phase_compute_ms: 1e+300 is out of range (expected >= 0 and <= 1e+07)",
    ),
    (
        "huge-int",
        MINIMAL + "kv_bytes_per_token_layer = 9223372036854775807\n",
        "serving.kv_bytes_per_token_layer: 9223372036854775807 is out of range "
        "(expected > 0 and <= 1073741824)",
    ),
    (
        "huge-levels",
        MINIMAL + "[sim]\nnum_levels = 1000000000\n",
        "sim.num_levels: 1000000000 is out of range (expected > 0 and <= 64)",
    ),
    ("nan-positive", MINIMAL + "gpu_tflops = nan\n", "serving.gpu_tflops: nan is out of range"),
    (
        "integer-past-a-floats-range",
        MINIMAL + "gpu_tflops = 1" + "0" * 400 + "\n",
        "serving.gpu_tflops: 1" + "0" * 400 + " is out of range (too large for a float)",
    ),
    ("inf-fraction", MINIMAL + "reuse_mean = inf\n", "serving.reuse_mean: inf is out of range"),
    ("rl-key", '[scenario]\nname = "x"\n[rl]\nsteps_per_iteration = 0\n', "rl.steps_per_iteration"),
    ("not-a-table", '[scenario]\nname = "x"\nserving = 3\n', "scenario.serving: unknown key"),
    ("bad-toml", "[scenario\n", "invalid TOML"),
    ("table-is-a-number", 'serving = 3\n[scenario]\nname = "x"\n', "serving: expected a table"),
    (
        "load-basis",
        MINIMAL + 'load_basis = "gpu"\n',
        "serving.load_basis: 'gpu' is not one of compute, network",
    ),
    (
        "router-load",
        MINIMAL + 'router_load = "running"\n',
        "serving.router_load: 'running' is not one of queued, outstanding",
    ),
    # warm-up and drain covering every iteration ran with an empty measured window and printed
    # an empty table
    (
        "rl-window-empty",
        '[scenario]\nname = "x"\n[rl]\niterations = 10\nwarmup_iterations = 9\n',
        "rl.iterations: 10 leave no measured iteration after rl.warmup_iterations (9, the "
        "pipeline fill) and rl.staleness (1, the drain); the first measured iteration is 9 "
        "(iteration 0 has no span): expected rl.iterations >= 11",
    ),
    (
        "rl-window-only-iteration-0",
        '[scenario]\nname = "x"\n[rl]\niterations = 3\nwarmup_iterations = 0\nstaleness = 2\n',
        "expected rl.iterations >= 4",
    ),
    ("store-missing", MINIMAL + "cached_groups = 2\n", "serving.cached_groups: the uncached"),
    (
        "cached-too-many",
        MINIMAL + "cached_groups = 20\nkv_store_nodes = 1\n",
        "serving.cached_groups: 20 is more than serving.prefix_groups (16)",
    ),
    # a node named by two roles gets one set of links: they must agree on its NICs (the NIC
    # count failed the run with a traceback, the rate silently took the first role's)
    (
        "shared-node-nics",
        MINIMAL + 'decode_prefix = "r"\ndecode_nics = 1\n[rl]\nrollout_prefix = "r"\n',
        "rl.rollout_prefix: node r0 is also named by serving.decode_prefix with 1 NIC(s) at "
        "100 Gb/s, here 2 at 100 Gb/s",
    ),
    (
        "shared-node-rate",
        MINIMAL + 'decode_prefix = "r"\n[rl]\nrollout_prefix = "r"\nnic_gbps = 200.0\n',
        "rl.rollout_prefix: node r0 is also named by serving.decode_prefix with 2 NIC(s) at "
        "100 Gb/s, here 2 at 200 Gb/s",
    ),
    (
        "prefill-is-decode",
        MINIMAL + 'decode_prefix = "p"\ndecode_nics = 1\n',
        "serving.decode_prefix: node p0 is also named by serving.prefill_prefix",
    ),
]


@pytest.mark.parametrize(
    ("text", "expected"), [c[1:] for c in BAD_FILES], ids=[c[0] for c in BAD_FILES]
)
def test_bad_files_name_the_field(text: str, expected: str) -> None:
    errors = _errors(text)
    assert any(expected in e for e in errors), errors


@pytest.mark.parametrize(
    "section", [scenario.SimSection, scenario.ServingSection, scenario.RlSection]
)
def test_every_numeric_field_has_an_upper_bound(section: type) -> None:
    """A field with no maximum takes 1e300 and overflows in the run (a new field needs one)."""
    numeric = [f.name for f in dataclasses.fields(section) if f.type in ("int", "float")]
    unbounded = [
        n for n in numeric if n not in scenario._MAXIMA | dict.fromkeys(scenario._FRACTIONS)
    ]
    assert numeric and not unbounded


@pytest.mark.parametrize(
    ("warmup", "staleness", "iterations"), [(0, 1, 3), (1, 1, 3), (0, 2, 4), (3, 1, 5)]
)
def test_the_smallest_measured_rl_window_is_accepted(
    warmup: int, staleness: int, iterations: int
) -> None:
    text = (
        f'[scenario]\nname = "x"\n[rl]\niterations = {iterations}\n'
        f"warmup_iterations = {warmup}\nstaleness = {staleness}\n"
    )
    assert scenario.parse(text).rl is not None


def test_all_errors_are_reported_together() -> None:
    errors = _errors(MINIMAL + "layers = 0\nbogus = 2\n[rl]\niterations = -1\n")
    assert len(errors) == 3


@pytest.mark.parametrize("name", ["pd-serving", "rl-disaggregated", "mixed", "pd-serving-paper"])
def test_bundled_scenarios_parse(name: str) -> None:
    scen = scenario.load(name)
    assert scen.scenario.name == name
    assert scen.kind == name.removesuffix("-paper")


def test_unknown_scenario_name_lists_the_bundled_ones() -> None:
    with pytest.raises(ScenarioError, match="pd-serving"):
        scenario.resolve("no-such-scenario")


@pytest.mark.parametrize("content", [None, b"\xff\xfe[scenario]\n"], ids=["directory", "not-utf8"])
def test_an_unreadable_file_is_a_scenario_error_naming_it(
    tmp_path: Path, content: bytes | None
) -> None:
    path = tmp_path / "scen.toml"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    with pytest.raises(ScenarioError, match=f"{path}: cannot read"):
        scenario.load(str(path))


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


def test_network_load_offers_the_bottleneck_its_share() -> None:
    """load_basis = network: at load x the busiest link group is offered x of its capacity,
    measured on the trace's own bytes (P2D into the decode NICs here)."""
    cfg = dataclasses.replace(
        scenario.ServingSection(),
        requests=6000,
        warmup_requests=0,
        decode_servers=1,
        decode_nics=1,
        load_basis="network",
    )
    groups = scenario.network_utilization(cfg)
    assert max(groups, key=lambda g: groups[g]) == "decode ingress"
    trace = scenario.serving_trace(cfg, 0.6, seed=2)
    p2d_bytes = sum(r.prompt_tokens for r in trace) * cfg.kv_bytes_per_token_layer * cfg.layers
    capacity = cfg.nic_gbps * 1e9 / 8
    assert p2d_bytes / trace[-1].arrival / capacity == pytest.approx(0.6, rel=0.06)


def test_store_held_prefixes_are_fetched_in_the_isolated_ttft() -> None:
    cfg = dataclasses.replace(scenario.ServingSection(), kv_store_nodes=1, cached_groups=2)
    assert not scenario.store_held(cfg, 1) and scenario.store_held(cfg, 2)
    local = scenario.isolated_ttft(cfg, 2000, 700)
    fetched = scenario.isolated_ttft(cfg, 2000, 700, remote_tokens=1300)
    nic = cfg.nic_gbps * 1e9 / 8
    assert fetched - local >= 1300 * cfg.kv_bytes_per_token_layer / nic
    trace = scenario.serving_trace(cfg, 0.5, seed=4)
    for request in trace[:50]:
        remote = request.reused_tokens if request.prefix_group >= 2 else 0
        alone = scenario.isolated_ttft(cfg, request.prompt_tokens, request.new_tokens, remote)
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


@pytest.mark.parametrize("load", [0.0, -0.5, float("nan"), float("inf"), 1e300, 100.0, 1e-300])
def test_a_load_without_a_meaning_is_refused(load: float) -> None:
    """Load 0 divided by zero deep in the trace generator (flowsched bench serving --loads 0)."""
    scen = scenario.load("pd-serving")
    assert scen.serving is not None
    with pytest.raises(ValueError, match="load: expected a finite number > 0"):
        scenario.serving_trace(scen.serving, load, 1)
    rl = scenario.load("rl-disaggregated").rl
    assert rl is not None
    with pytest.raises(ValueError, match="load: expected a finite number > 0"):
        scenario.rl_plan(rl, load)


def test_a_scenario_saved_with_a_byte_order_mark_loads(tmp_path: Path) -> None:
    bundled = scenario.resolve("pd-serving")
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf" + bundled.read_bytes())
    loaded, bundled_scenario = scenario.load(str(path)), scenario.load("pd-serving")
    assert dataclasses.replace(loaded, path=bundled_scenario.path) == bundled_scenario
