"""Scenarios shared by the simulator tests."""

#: a small rl-disaggregated: 2 + 2 nodes, 5 iterations (the first warm-up), 4 chunks
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
