"""Workload dependencies on the engine: serving (stages 1-3) and RL (steps, sync, generation)."""

from __future__ import annotations

import dataclasses

import pytest

from flowsched import scenario
from flowsched.sim.run import PolicySpec, run

SMALL_SERVING = """
[scenario]
name = "small"
[sim]
timer_ms = 1.0
[serving]
instances = {instances}
layers = 4
requests = {requests}
warmup_requests = 0
"""

SMALL_RL = """
[scenario]
name = "small-rl"
[rl]
trainer_nodes = 2
rollout_nodes = 2
iterations = 5
warmup_iterations = 1
steps_per_iteration = 2
phases_per_step = 2
phase_compute_ms = 20.0
generation_ms = 200.0
generation_chunks = 4
"""


def test_single_request_ttft_matches_the_isolated_estimate() -> None:
    scen = scenario.parse(SMALL_SERVING.format(instances=1, requests=1))
    result = run(scen, PolicySpec("fair"), load=0.01)
    (request,) = result.records.requests
    assert scen.serving is not None
    trace = scenario.serving_trace(scen.serving, 0.01, scen.scenario.seed)[0]
    alone = scenario.isolated_ttft(scen.serving, trace.prompt_tokens, trace.new_tokens)
    assert request.ttft == pytest.approx(alone, rel=0.25)
    assert request.met


def test_serving_flows_follow_the_layer_dag() -> None:
    scen = scenario.parse(SMALL_SERVING.format(instances=2, requests=30))
    result = run(scen, PolicySpec("fair"), load=0.7)
    records = result.records
    assert all(r.finished is not None for r in records.requests)
    kv = [f for f in records.flows if f.cls == "kv"]
    assert len(kv) == 30 * 4, "one P2D flow per request per layer"
    for request in records.requests:
        assert request.prefill_done is not None and request.started is not None
        # the last layer's KV leaves when its compute ends, in parallel with its all-to-all
        assert request.arrival <= request.started < request.prefill_done
        assert request.started < request.finished
        last_kv = max(f.finished for f in kv if f.request == request.request)
        assert request.finished == last_kv
    # each collective (one per batch-layer) has 8 flows (2 servers x 2 NICs each way)
    assert len([f for f in records.flows if f.cls == "tp"]) == 8 * len(records.spans)
    # a remote prefix is fetched once per layer per request, never for a local one
    reuse = [f for f in records.flows if f.cls == "kv_reuse"]
    assert len(reuse) % 4 == 0


def test_rl_runs_at_generation_pace_when_the_network_is_light() -> None:
    scen = scenario.parse(SMALL_RL)
    result = run(scen, PolicySpec("fair"), load=0.2)
    m = result.metrics
    assert m.iterations == 3
    assert m.iteration_mean == pytest.approx(0.2, rel=0.1)
    assert m.deadline_miss_rate == 0.0
    assert len([d for d in result.records.deadlines if d.finished is not None]) == 5


def test_rl_generation_waits_for_a_late_param_sync() -> None:
    scen = scenario.parse(SMALL_RL)
    light = run(scen, PolicySpec("fair"), load=0.2).metrics
    heavy = run(scen, PolicySpec("fair"), load=3.0).metrics
    assert heavy.deadline_miss_rate is not None and heavy.deadline_miss_rate > 0.5
    assert heavy.iteration_mean is not None and light.iteration_mean is not None
    assert heavy.iteration_mean > 1.5 * light.iteration_mean


def test_rl_step_waits_for_its_experience() -> None:
    cfg = scenario.parse(SMALL_RL)
    assert cfg.rl is not None
    slow_nic = dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, nic_gbps=1.0))
    result = run(slow_nic, PolicySpec("fair"), load=0.2)
    experience = [f for f in result.records.flows if f.cls == "experience"]
    # with 1 Gb/s NICs the trainer cannot start before its experience is in
    first_tp = min(f.opened for f in result.records.flows if f.cls == "tp" and f.job == "trainer")
    first_batch = [f for f in experience if f.opened < 0.06]
    assert first_tp >= max(f.finished for f in first_batch)
