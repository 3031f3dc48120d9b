"""The coordinator service: accepts agents, runs the policy, pushes level changes.

Event handling is batched per event-loop turn: every decoded message updates the
:class:`~flowsched.coordinator.state.ClusterState` at once (cheap), and the first one after a
flush schedules the next flush with ``call_soon``. By then the loop has handled every read
that was ready in the same turn, so one policy run covers all of them and each agent gets at
most one ``levels`` frame per turn. A periodic timer (the policy's ``timer_period``) queues
every flow with a deadline for re-evaluation; per-flow policies take that sweep in chunks so
that an event never waits behind a whole pass over the table. When a sweep is still running at
the next tick, the tick is skipped (counted as an overrun): the effective period stretches.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable

from prometheus_client import CollectorRegistry

from flowsched.coordinator.config import Addresses, CoordinatorConfig
from flowsched.coordinator.connection import READ_SIZE, AgentConnection, TimedStreamReader
from flowsched.coordinator.exposition import start_metrics_server
from flowsched.coordinator.histogram import Histogram
from flowsched.coordinator.metrics import (
    LATENCY_BUCKETS,
    CoordinatorCollector,
    LiveCounters,
    register_standard_collectors,
)
from flowsched.coordinator.state import ClusterState
from flowsched.protocol import (
    Flows,
    Heartbeat,
    JobProgress,
    Levels,
    LevelUpdate,
    Message,
    NicLoad,
    Resync,
)
from flowsched.signals import wait_for_signal

log = logging.getLogger("flowsched.coordinator")

#: level updates per ``levels`` frame (keeps frames far below the 1 MiB default limit)
MAX_UPDATES_PER_FRAME = 8192
#: heartbeats go out to 1/HEARTBEAT_SLICES of the agents every interval/HEARTBEAT_SLICES
HEARTBEAT_SLICES = 10
#: seconds stop() waits for connections to close before cancelling them
STOP_TIMEOUT = 2.0


class Coordinator:
    """The running service. Use :func:`serve`, or ``start()``/``stop()`` in tests.

    Args:
        config: the configuration.
        registry: where the metrics collector is registered (a fresh registry when None).
    """

    def __init__(
        self, config: CoordinatorConfig, *, registry: CollectorRegistry | None = None
    ) -> None:
        self.config = config
        self.state = ClusterState(config.policy_factory(), per_flow=config.per_flow_decisions)
        self.live = LiveCounters(
            Histogram(LATENCY_BUCKETS), Histogram(LATENCY_BUCKETS), rejected=defaultdict(int)
        )
        self.registry = registry if registry is not None else CollectorRegistry()
        self.registry.register(CoordinatorCollector(self.state, self.live, self.agent_count))
        register_standard_collectors(self.registry)
        self.sessions: dict[str, AgentConnection] = {}
        self._expiry: dict[str, asyncio.TimerHandle] = {}
        self._arrivals: list[float] = []
        self._flush_scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._timers: list[asyncio.Future[None]] = []
        self._connections: set[AgentConnection] = set()
        self._servers: list[asyncio.Server] = []
        self.addresses: Addresses | None = None

    def agent_count(self) -> int:
        """Agents with an established connection now."""
        return len(self.sessions)

    def readiness(self) -> str | None:
        """None when ready to take agents (``/readyz``), else the reason why not."""
        return None if self.addresses is not None else "starting"

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> Addresses:
        """Bind the agent and metrics listeners and start the timers; return the addresses."""
        config = self.config
        loop = asyncio.get_running_loop()
        server = await loop.create_server(self._protocol, config.host, config.port)
        self._servers.append(server)
        host, port = server.sockets[0].getsockname()[:2]
        metrics_host = metrics_port = None
        if config.metrics_port is not None:
            metrics = await start_metrics_server(
                self.registry, config.metrics_host, config.metrics_port, ready=self.readiness
            )
            self._servers.append(metrics)
            metrics_host, metrics_port = metrics.sockets[0].getsockname()[:2]
        self._spawn(self._timer_loop())
        self._spawn(self._heartbeat_loop())
        self.addresses = Addresses(host, port, metrics_host, metrics_port)
        log.info("listening on %s:%s, metrics on %s:%s", host, port, metrics_host, metrics_port)
        return self.addresses

    async def stop(self) -> None:
        """Close the listeners and every connection; cancel the timers."""
        for server in self._servers:
            server.close()
        for timer in self._timers:
            timer.cancel()
        for connection in list(self._connections):
            connection.abort("shutdown", "coordinator shutting down")
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=STOP_TIMEOUT)
            for task in pending:
                task.cancel()
        await asyncio.gather(*self._timers, *self._tasks, return_exceptions=True)
        for handle in self._expiry.values():
            handle.cancel()

    def _spawn(self, coro: Awaitable[None]) -> None:
        self._timers.append(asyncio.ensure_future(coro))

    def _protocol(self) -> asyncio.StreamReaderProtocol:
        reader = TimedStreamReader(limit=2 * READ_SIZE)
        return asyncio.StreamReaderProtocol(reader, self._accept)

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = AgentConnection(self, reader, writer)
        task = asyncio.ensure_future(self._serve_connection(connection))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve_connection(self, connection: AgentConnection) -> None:
        self._connections.add(connection)
        try:
            await connection.run()
        finally:
            self._connections.discard(connection)

    # -- sessions ----------------------------------------------------------------------------

    def attach(self, connection: AgentConnection) -> None:
        """An agent finished its handshake; a previous connection of its node is replaced."""
        node = connection.node
        assert node is not None
        old = self.sessions.get(node)
        if old is not None:
            log.warning(
                "node %s: the connection from %s replaces the one from %s (if this repeats, "
                "two agents use the same --node name)",
                node, connection.peer, old.peer,
            )  # fmt: skip
            old.abort("replaced", "a newer connection from the same node took over", tell_peer=True)
        self.sessions[node] = connection
        handle = self._expiry.pop(node, None)
        if handle is not None:
            handle.cancel()
        log.info("agent %s connected from %s", node, connection.peer)

    def detach(self, connection: AgentConnection) -> None:
        """An established connection ended; its flows are kept for the grace period."""
        node = connection.node
        if node is None or self.sessions.get(node) is not connection:
            return
        del self.sessions[node]
        loop = asyncio.get_running_loop()
        self._expiry[node] = loop.call_later(self.config.grace_period, self._expire, node)

    def _expire(self, node: str) -> None:
        self._expiry.pop(node, None)
        if node not in self.sessions:
            log.info(
                "agent %s stayed away %g s: dropping its flows", node, self.config.grace_period
            )
            self.state.drop_node(node, time.time())

    def count_rejection(self, code: str) -> None:
        """Count a closed connection by reason code (exported as a metric)."""
        assert self.live.rejected is not None
        self.live.rejected[code] += 1

    # -- events ------------------------------------------------------------------------------

    def handle(self, node: str, message: Message, arrival: float) -> None:
        """Apply one message from ``node``'s agent (``arrival``: ``perf_counter()`` on read)."""
        self.live.frames_received += 1
        state = self.state
        kind = type(message)
        if kind is Flows:
            assert isinstance(message, Flows)
            self._flows(node, message)
        elif kind is Heartbeat:
            return
        elif kind is JobProgress:
            assert isinstance(message, JobProgress)
            state.job_progress(message)
        elif kind is NicLoad:
            assert isinstance(message, NicLoad)
            state.nic_load(message.entries)
        elif kind is Resync:
            assert isinstance(message, Resync)
            state.resync(node, message.opens, time.time())
        self._arrivals.append(arrival)
        if self.config.batching:
            self._schedule_flush()
        else:
            self._flush(sweep=False)  # the timer sweep still advances once per loop turn

    def _flows(self, node: str, message: Flows) -> None:
        state = self.state
        if message.opens:
            state.open_flows(node, message.opens, time.time())
        if message.progress:
            state.progress(node, message.progress)
        if message.closes:
            state.close_flows(node, message.closes, time.time())

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self, sweep: bool = True) -> None:
        if sweep:
            self._flush_scheduled = False
        started = time.perf_counter()
        outbox = self.state.flush(time.time(), self.config.sweep_budget if sweep else 0.0)
        for node, updates in outbox.items():
            connection = self.sessions.get(node)
            if connection is not None:
                self._send_levels(connection, list(updates.values()))
        done = time.perf_counter()
        self.live.flush_duration.observe(done - started)
        observe = self.live.decision_latency.observe
        for arrival in self._arrivals:
            observe(done - arrival)
        self._arrivals.clear()
        if self.state.pending:
            self._schedule_flush()  # the rest of a timer sweep, after the next reads

    @staticmethod
    def _send_levels(connection: AgentConnection, updates: list[LevelUpdate]) -> None:
        for start in range(0, len(updates), MAX_UPDATES_PER_FRAME):
            connection.send(Levels(tuple(updates[start : start + MAX_UPDATES_PER_FRAME])))

    # -- timers ------------------------------------------------------------------------------

    async def _timer_loop(self) -> None:
        # The next sweep waits for the timer period, and at least long enough that sweeping
        # takes no more than `sweep_duty` of the time (a policy period shorter than one pass
        # over the table would otherwise keep the coordinator permanently busy).
        duty = self.config.sweep_duty
        while True:
            gap = self.state.last_sweep_cost * (1.0 - duty) / duty
            await asyncio.sleep(max(self.config.timer_period, gap))
            if self.state.start_sweep():
                self._schedule_flush()

    async def _heartbeat_loop(self) -> None:
        # Spread over HEARTBEAT_SLICES ticks per interval: one burst to 1,000 agents would
        # hold the loop (and every decision waiting behind it) for milliseconds.
        tick = self.config.heartbeat_interval / HEARTBEAT_SLICES
        for slot in itertools.cycle(range(HEARTBEAT_SLICES)):
            await asyncio.sleep(tick)
            beat = Heartbeat(time.time())
            # a node keeps its slice while others come and go: one beat per interval each
            due = [c for n, c in self.sessions.items() if hash(n) % HEARTBEAT_SLICES == slot]
            for connection in due:
                connection.send(beat)


async def serve(
    config: CoordinatorConfig, *, shutdown_trigger: Callable[[], Awaitable[object]] | None = None
) -> None:
    """Run the coordinator until ``shutdown_trigger()`` returns (or SIGINT/SIGTERM).

    Signal handlers are installed only when no trigger is given. ``config.on_ready`` is
    called with the bound addresses once both listeners are up.
    """
    coordinator = Coordinator(config)
    addresses = await coordinator.start()
    if config.on_ready is not None:
        config.on_ready(addresses)
    try:
        await (shutdown_trigger or wait_for_signal)()
    finally:
        await coordinator.stop()
