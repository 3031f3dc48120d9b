"""The agent's local policy (default rmlq) prunes a request as the coordinator does."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from agent_helpers import agent_config, wait_until

from flowsched import client
from flowsched.agent.threaded import AgentThread


def test_a_pruned_request_moves_every_flow_to_the_scavenger(tmp_path: Path) -> None:
    """At 1e9 B/s r1 needs 1.5 s by +3 and r2's big flow 2.7 s by +3.6: Algorithm 1 prunes
    r2, and r2's small flow (no deadline pressure of its own) goes to level 7 with it."""
    config = agent_config(tmp_path, fallback_after=0.1, default_bandwidth=1e9)
    running = AgentThread(config)
    running.start()
    try:
        assert running.ready is not None
        wait_until(lambda: running.agent.fallback is not None)
        scavenger = running.agent.view.num_levels - 1
        sock = running.ready.socket
        now = time.time()
        with contextlib.ExitStack() as stack:
            r1 = stack.enter_context(
                client.flow(
                    "kv", bytes=1_500_000_000, deadline=now + 3.0, request="r1", socket_path=sock
                )
            )
            small = stack.enter_context(
                client.flow(
                    "kv", bytes=1_000_000, deadline=now + 10.0, request="r2", socket_path=sock
                )
            )
            assert small.level < scavenger
            big = stack.enter_context(
                client.flow(
                    "kv", bytes=2_700_000_000, deadline=now + 3.6, request="r2", socket_path=sock
                )
            )
            wait_until(lambda: big.level == scavenger and small.level == scavenger, timeout=2.0)
            assert r1.level < scavenger
    finally:
        for conn in list(client._connections.values()):
            conn.close()
        client._connections.clear()
        running.stop()
