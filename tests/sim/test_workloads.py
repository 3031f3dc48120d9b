"""Workload dependencies on the engine: serving (stages 1-3) and RL (steps, sync, generation)."""

from __future__ import annotations

import dataclasses

import pytest
from sim_helpers import SMALL_RL

from flowsched import scenario
from flowsched.scenario import Request
from flowsched.sim.run import PolicySpec, build_topology, run

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


def test_kv_reuse_fetches_feed_the_layers_that_read_them() -> None:
    """Requests routed away from the instance holding their prefix fetch it (Stage 1), one flow
    per layer, from the holder to the serving instance; a layer computes only after its fetch."""
    text = SMALL_SERVING.format(instances=2, requests=30) + "router_max_wait_tokens = 0\n"
    scen = scenario.parse(text)
    result = run(scen, PolicySpec("fair"), load=0.9)
    records = result.records
    assert all(r.finished is not None for r in records.requests)
    reuse = [f for f in records.flows if f.cls == "kv_reuse"]
    fetched = {f.request for f in reuse}
    assert fetched, "some requests must be served away from their prefix holder"
    assert scen.serving is not None
    trace = {r.request_id: r for r in scenario.serving_trace(scen.serving, 0.9, 1)}
    for request in fetched:
        flows = [f for f in reuse if f.request == request]
        assert len(flows) == scen.serving.layers
        expected = trace[str(request)].reused_tokens * scen.serving.kv_bytes_per_token_layer
        assert all(f.size == expected for f in flows)
    # layer l's KV leaves when layer l has computed, which needs layer l's fetches: by then the
    # fetches of layers 0..l of every remote request of the batch have arrived
    for job in {f.job for f in reuse}:
        remote = len({f.request for f in reuse if f.job == job})
        layer_ends = sorted({f.opened for f in records.flows if f.cls == "kv" and f.job == job})
        assert len(layer_ends) == scen.serving.layers
        for layer, end in enumerate(layer_ends):
            arrived = sum(f.finished <= end for f in reuse if f.job == job)
            assert arrived >= (layer + 1) * remote, (job, layer)


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


def test_param_sync_slack_stays_below_one_generation() -> None:
    """Closed form: iteration i ends one train step after generation i does (that step needs
    the generation's last chunk), and its sync is due when generation i + 1 + staleness starts,
    i.e. when generation i + staleness ends. With staleness 1 and a light network the slack at
    completion is therefore one generation period minus at least the last step's compute."""
    cfg = scenario.parse(SMALL_RL)
    assert cfg.rl is not None
    fast_trainer = dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, phase_compute_ms=5.0))
    assert fast_trainer.rl is not None
    result = run(fast_trainer, PolicySpec("fair"), load=0.3)
    generation = fast_trainer.rl.generation_ms / 1e3
    last_step = fast_trainer.rl.phases_per_step * fast_trainer.rl.phase_compute_ms / 1e3
    syncs = result.records.deadlines
    assert len(syncs) == fast_trainer.rl.iterations
    for sync in syncs:
        assert sync.finished is not None
        slack = sync.deadline - sync.finished
        assert 0 < slack <= generation - last_step, (sync, slack)


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


def test_store_held_prefixes_are_fetched_from_the_kv_store() -> None:
    """Prefixes no instance caches come from the KV store node, for every request that reuses
    one, wherever the router puts it; cached prefixes never touch the store."""
    text = (
        SMALL_SERVING.format(instances=2, requests=30) + "kv_store_nodes = 1\ncached_groups = 1\n"
    )
    scen = scenario.parse(text)
    assert scen.serving is not None
    seen: dict[str, set[str]] = {}

    def observe(sim: object) -> None:
        for state in sim.active.values():  # type: ignore[attr-defined]
            if state.flow.cls.label == "kv_reuse":
                seen.setdefault(state.flow.request, set()).add(state.flow.links[0].split(".")[0])

    result = run(scen, PolicySpec("fair"), load=0.5, observer=observe)
    trace = {r.request_id: r for r in scenario.serving_trace(scen.serving, 0.5, 1)}
    stored = {rid for rid, r in trace.items() if r.prefix_group >= 1}
    assert stored, "the trace must reuse store-held prefixes"
    reuse = [f for f in result.records.flows if f.cls == "kv_reuse"]
    for rid in stored:
        assert sum(f.request == rid for f in reuse) == scen.serving.layers
        assert seen[rid] == {"s0"}
    assert all(
        sources <= {"p0", "p1", "p2", "p3"} for r, sources in seen.items() if r not in stored
    )


# (label, router_load, trace as (arrival s, prompt tokens, prefix group), instance of each)
ROUTING_CASES = [
    # a store-held request goes to the idle instance, not behind the running batch
    ("idle beats busy", "outstanding", [(0.0, 4000, 0), (0.001, 1000, 5)], [0, 1]),
    # counting queues only, both look empty: the first instance takes it, behind its batch
    ("queued only", "queued", [(0.0, 4000, 0), (0.001, 1000, 5)], [0, 0]),
    # both busy: to the instance whose running batch has less left to compute
    (
        "less left to compute",
        "outstanding",
        [(0.0, 8000, 0), (0.0, 4000, 1), (0.002, 1000, 5)],
        [0, 1, 1],
    ),
    # a short queue behind a nearly done batch beats a long batch with nothing queued
    (
        "queued plus running",
        "outstanding",
        [(0.0, 2000, 0), (0.0, 8000, 1), (0.0002, 400, 0), (0.0005, 1000, 5)],
        [0, 1, 0, 0],
    ),
    # a cached prefix stays on its holder while little waits there, even when it is busy
    ("prefix affinity", "outstanding", [(0.0, 4000, 0), (0.001, 1000, 0)], [0, 0]),
]


@pytest.mark.parametrize(
    ("router_load", "trace", "expected"),
    [c[1:] for c in ROUTING_CASES],
    ids=[c[0] for c in ROUTING_CASES],
)
def test_router_weighs_instances_by_their_load(
    router_load: str, trace: list[tuple[float, int, int]], expected: list[int]
) -> None:
    """The KV-aware router sends a request it cannot keep on its prefix holder to the instance
    with the least queued new tokens, plus (``router_load = "outstanding"``) what its running
    batch still has to compute."""
    text = SMALL_SERVING.format(instances=2, requests=len(trace)) + (
        f'kv_store_nodes = 1\ncached_groups = 2\nrouter_load = "{router_load}"\n'
    )
    scen = scenario.parse(text)
    assert scen.serving is not None
    requests = [
        Request(f"r{i}", arrival, prompt, prompt // 2, group, 1.0, False)
        for i, (arrival, prompt, group) in enumerate(trace)
    ]
    flows = run(scen, PolicySpec("fair"), load=1.0, trace=requests).records.flows
    served = {f.request: int(f.job.split("/")[0][1:]) for f in flows if f.cls == "kv"}
    assert [served[f"r{i}"] for i in range(len(trace))] == expected


def test_a_mixed_scenario_whose_shared_nodes_agree_runs_on_one_set_of_links() -> None:
    """Roles naming the same node with the same NICs share its links (mixed.toml's rule)."""
    scen = scenario.parse(
        '[scenario]\nname = "m"\n[serving]\nrequests = 2\nwarmup_requests = 0\n'
        'decode_prefix = "r"\n[rl]\nrollout_prefix = "r"\niterations = 3\nwarmup_iterations = 1\n'
    )
    topo = build_topology(scen)
    assert [n for n in topo.nodes if n.startswith("r")] == ["r0", "r1", "r2", "r3"]
