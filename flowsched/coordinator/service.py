"""The coordinator service: accepts agents, runs the policy, pushes level changes.

Event handling is batched per event-loop turn: every decoded message updates the
:class:`~flowsched.coordinator.state.ClusterState` at once (cheap), and the first one after a
flush schedules the next flush with ``call_soon``. By then the loop has handled every read
that was ready in the same turn, so one policy run covers all of them and each agent gets one
``levels`` frame for the lot. A turn that finds hundreds of agents readable (a burst, or a
backlog after a busy spell) would hold its first frames' decisions until it has handled them
all, so a batch is also flushed once it has been collecting for ``max_batch_delay`` (1 ms by
default). A periodic timer (the policy's ``timer_period``) queues
every flow with a deadline for re-evaluation; per-flow policies take that sweep in chunks so
that an event never waits behind a whole pass over the table. When a sweep is still running at
the next tick, the tick is skipped (counted as an overrun): the effective period stretches.

Connections are bounded so that no flood locks agents or scrapes out: at start the open-file
limit is raised to the hard limit, and the agents' listener may use that budget minus a reserve
for the process and the metrics listener's own connections. Unauthenticated connections have a
smaller cap of their own; when either cap is reached, the oldest unauthenticated connection
makes room for the new one (a real agent authenticates within one round trip; a peer that
holds a connection without authenticating is the one that goes). Only established agents
filling the whole budget make a new connection be refused.

With ``tls_cert`` the listener speaks TLS (:mod:`flowsched.tls`): ``handshake_timeout`` then
counts from the accept and covers the TLS handshake and the agent's, and the caps above count
a connection from the end of the TLS handshake on.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import math
import socket
import time
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable

from prometheus_client import CollectorRegistry

from flowsched.coordinator import reach, tls_accept
from flowsched.coordinator.config import Addresses, CoordinatorConfig, host_port_text
from flowsched.coordinator.connection import (
    ESTABLISHED_CHUNK,
    HANDSHAKE_CHUNK,
    AgentConnection,
    BoundedReaderProtocol,
    TimedStreamReader,
    peer_text,
)
from flowsched.coordinator.election import Candidacy, EtcdElection, short_lease_warning
from flowsched.coordinator.exposition import MAX_CONNECTIONS, start_metrics_server
from flowsched.coordinator.histogram import Histogram
from flowsched.coordinator.metrics import (
    LATENCY_BUCKETS,
    CoordinatorCollector,
    LiveCounters,
    register_standard_collectors,
)
from flowsched.coordinator.state import MAX_JOBS_PER_NODE, ClusterState, node_links
from flowsched.fdlimit import raise_fd_limit
from flowsched.lograte import RepeatLog
from flowsched.protocol import (
    FlowOpen,
    Flows,
    Heartbeat,
    JobProgress,
    Levels,
    LevelUpdate,
    Message,
    NicLoad,
    NicLoadEntry,
    RemoteProtocolError,
    Resync,
    encode_frame,
)
from flowsched.protocol._codec import MAX_UPDATES
from flowsched.signals import wait_for_signal
from flowsched.tls import ReloadingContext, reloading_server

log = logging.getLogger("flowsched.coordinator")

#: level updates per ``levels`` frame (keeps frames far below the 1 MiB default limit; an
#: agent's decoder takes no more in one frame)
MAX_UPDATES_PER_FRAME = MAX_UPDATES
#: heartbeats go out to 1/HEARTBEAT_SLICES of the agents every interval/HEARTBEAT_SLICES
HEARTBEAT_SLICES = 10
#: pending connections the kernel queues for accept(): every agent reconnects at once after a
#: coordinator restart or takeover, and beyond asyncio's default of 100 the kernel drops the
#: SYNs, which clients retry only after 1 s, then 3 s (capped by net.core.somaxconn)
LISTEN_BACKLOG = 4096
#: a resync burst is re-evaluated once no resync came for this long (s) ...
RESYNC_QUIET = 0.02
#: ... or this long after its first resync (s), whichever is first
RESYNC_MAX_DEFER = 0.1
#: seconds stop() waits for connections to close before cancelling them
STOP_TIMEOUT = 2.0
#: seconds the TLS layer's own handshake timeout comes after the handshake deadline, which
#: ends a handshake first (as a timeout: the TLS layer's ends it as an abort)
TLS_TIMEOUT_MARGIN = 1.0
#: with promotion timers and none armed, the timer loop still looks again this often (s)
TIMER_IDLE_WAKE = 1.0
#: a job no agent reported progress for in this long is forgotten (s); checked every tenth
JOB_TTL = 600.0
#: file descriptors left to the process itself (listeners, epoll, logs, files it opens)
FD_RESERVE = 64
#: connections turned away at the caps that turned_away_lately remembers (it need only tell
#: none from some)
TURNED_AWAY_KEPT = 1024
#: concurrent connections of the metrics listener (scrapes); kept out of the agents' budget
METRICS_MAX_CONNECTIONS = MAX_CONNECTIONS


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
        self.state = ClusterState(
            config.policy_factory(),
            per_flow=config.per_flow_decisions,
            promotion=config.promotion,
            max_flows_per_node=config.max_flows_per_node,
            # a node's own egress and the ingress of every other node this coordinator serves
            max_link_names_per_node=config.max_connections + 1,
        )
        self.live = LiveCounters(
            Histogram(LATENCY_BUCKETS), Histogram(LATENCY_BUCKETS), rejected=defaultdict(int)
        )
        self.registry = registry if registry is not None else CollectorRegistry()
        self.registry.register(
            CoordinatorCollector(
                self.state,
                self.live,
                self.agent_count,
                lambda: (self.leading, self.epoch),
                lambda: self.candidacy.election.failures if self.candidacy is not None else {},
                lambda: self.sessions.keys(),
                lambda: self.candidacy.agents_cut_off() if self.candidacy is not None else None,
            )
        )
        register_standard_collectors(self.registry)
        self.sessions: dict[str, AgentConnection] = {}
        #: when connections were turned away at the caps lately (turned_away_lately)
        self._turned_away: deque[float] = deque(maxlen=TURNED_AWAY_KEPT)
        self._expiry: dict[str, asyncio.TimerHandle] = {}
        self._arrivals: list[float] = []
        #: perf_counter() when the first frame of the batch in ``_arrivals`` was handled
        self._batch_started = 0.0
        self._flush_scheduled = False
        #: promotion timers and quarantine retries: when the timer loop wakes next (monotonic;
        #: inf while it runs), and how a flush that armed an earlier one wakes it
        self._timer_wake = math.inf
        self._timer_armed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._timers: list[asyncio.Future[None]] = []
        self._connections: set[AgentConnection] = set()
        #: node -> the jobs it reported, least recently updated first (see _note_job)
        self._node_jobs: dict[str, dict[str, float]] = {}
        self._job_nodes: dict[str, set[str]] = {}
        self._next_job_expiry = 0.0
        #: connections still in their handshake, oldest first (the first to make room)
        self._unauthenticated: dict[AgentConnection, None] = {}
        self.max_connections = config.max_connections
        self.max_unauthenticated = min(config.max_unauthenticated, config.max_connections)
        self.repeat_log = RepeatLog(log)
        #: the listener's TLS context (None: plain TCP) and the TLS handshakes under way,
        #: oldest first, each with its task
        self._tls: ReloadingContext | None = None
        self._tls_pending: dict[asyncio.Transport, asyncio.Task[None]] = {}
        self._handshake_pace = tls_accept.HandshakePace()
        self._receive_buffer = bytearray(ESTABLISHED_CHUNK)  # shared by every connection
        self._servers: list[asyncio.Server] = []
        self.addresses: Addresses | None = None
        #: the pending re-evaluation of a resync burst, and when the burst began (loop time)
        self._resync_settle: asyncio.TimerHandle | None = None
        self._resync_burst: float | None = None
        #: the leader election (``config.etcd``); None: this coordinator always leads
        self.candidacy: Candidacy | None = None

    @property
    def leading(self) -> bool:
        """Whether this coordinator decides (the elected leader, or alone without etcd)."""
        return self.candidacy is None or self.candidacy.leadership is not None

    @property
    def epoch(self) -> int:
        """The fencing token stamped on every message to agents (0 without an election)."""
        return self.candidacy.epoch if self.candidacy is not None else 0

    def not_leader(self, node: str | None = None) -> str | None:
        """None while leading; else why an agent is refused (the leader's address, if known).
        ``node``: the agent's, once its handshake proved the token (a standby counts the
        nodes that cannot reach the leader: flowsched.coordinator.reach)."""
        return self.candidacy.refusal(node) if self.candidacy is not None else None

    def agent_count(self) -> int:
        """Agents with an established connection now."""
        return len(self.sessions)

    def readiness(self) -> str | None:
        """None when ready to take agents (``/readyz``), else the reason why not."""
        if self.addresses is None:
            return "starting"
        return None if self.leading else "standby: another coordinator is the elected leader"

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> Addresses:
        """Bind the agent and metrics listeners and start the timers; return the addresses."""
        config = self.config
        self._size_connection_caps(raise_fd_limit(log))
        loop = asyncio.get_running_loop()
        if config.tls_cert is not None and config.tls_key is not None:
            self._tls = reloading_server(config.tls_cert, config.tls_key, config.tls_client_ca)
        server = await loop.create_server(
            self._protocol, config.host, config.port, backlog=LISTEN_BACKLOG
        )
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
        if config.etcd is not None:
            advertise = config.advertise or advertised_address(host, port)
            self.candidacy = Candidacy(
                EtcdElection.from_config(config, advertise),
                lambda: (self.agent_count(), self.turned_away_lately()),
            )
            warning = short_lease_warning(config)
            if warning is not None:
                log.warning("%s", warning)
        self.addresses = Addresses(host, port, metrics_host, metrics_port)
        log.info("listening on %s, metrics %s", self.addresses.listen_text(),
                 self.addresses.metrics_text())  # fmt: skip
        return self.addresses

    async def stop(self) -> None:
        """Close the listeners and every connection; cancel the timers."""
        for server in self._servers:
            server.close()
        for timer in self._timers:
            timer.cancel()
        for connection in list(self._connections):
            connection.abort("shutdown", "coordinator shutting down")
        for raw, handshake in self._tls_pending.items():
            handshake.cancel()
            raw.abort()
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=STOP_TIMEOUT)
            for task in pending:
                task.cancel()
        await asyncio.gather(*self._timers, *self._tasks, return_exceptions=True)
        for handle in self._expiry.values():
            handle.cancel()

    def _size_connection_caps(self, fd_limit: int) -> None:
        budget = fd_limit - FD_RESERVE - METRICS_MAX_CONNECTIONS
        if budget < self.config.max_connections:
            log.warning(
                "open-file limit %d leaves room for %d agent connections (max_connections is "
                "%d); raise the hard limit (LimitNOFILE= in systemd) for more agents",
                fd_limit, max(budget, 1), self.config.max_connections,
            )  # fmt: skip
        self.max_connections = max(min(self.config.max_connections, budget), 1)
        self.max_unauthenticated = min(self.config.max_unauthenticated, self.max_connections)
        log.info(
            "connection caps: %d in all, %d unauthenticated, %d metrics",
            self.max_connections, self.max_unauthenticated, METRICS_MAX_CONNECTIONS,
        )  # fmt: skip

    def _spawn(self, coro: Awaitable[None]) -> None:
        self._timers.append(asyncio.ensure_future(coro))

    def _protocol(self) -> BoundedReaderProtocol:
        reader = TimedStreamReader(limit=HANDSHAKE_CHUNK)  # widened once authenticated

        def accept(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self._accept(protocol, writer)

        start_tls = self._start_tls if self._tls is not None else None
        protocol = BoundedReaderProtocol(reader, accept, self._receive_buffer, start_tls)
        return protocol

    def _start_tls(self, protocol: BoundedReaderProtocol, raw: asyncio.Transport) -> None:
        """Run a new connection's TLS handshake here rather than in the listener, so that a
        failure is logged with the peer's address and counted. Handshakes under way count as
        unauthenticated connections (see :meth:`_make_room`)."""
        if not self._make_room(peer_text(raw.get_extra_info("peername"))):
            raw.abort()
            return
        task = asyncio.ensure_future(self._tls_handshake(protocol, raw))
        self._tls_pending[raw] = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _tls_handshake(self, protocol: BoundedReaderProtocol, raw: asyncio.Transport) -> None:
        assert self._tls is not None
        peer = raw.get_extra_info("peername")
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.config.handshake_timeout
            protocol.handshake_deadline = deadline  # the agent's hello must come by then too
            async with asyncio.timeout_at(deadline):  # the hello, then a turn with room
                assert protocol.hello_ready is not None
                await protocol.hello_ready
                if protocol.lost_early:  # a port probe, or a peer past TLS_EARLY_LIMIT: no log
                    return
                await self._handshake_pace.turn()
            if protocol.lost_early:  # gone while it waited: start_tls would wait for good
                return
            timeout = deadline - loop.time()
            if timeout <= 0:
                raise TimeoutError
            # the deadline ends a handshake not done in time, before the TLS layer's own
            # timeout would: that one aborts it, which reads as the peer's doing
            async with asyncio.timeout_at(deadline):
                secure = await tls_accept.handshake(
                    raw, protocol, self._tls.current(), timeout + TLS_TIMEOUT_MARGIN,
                    self._handshake_pace,
                )  # fmt: skip
        except asyncio.CancelledError:
            raw.abort()
            raise
        except ConnectionError as exc:  # a port probe, or a client that refused us (its log)
            raw.abort()
            log.debug("TLS handshake with %s ended by the peer: %r", peer_text(peer), exc)
            return
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
            raw.abort()
            self.count_rejection("tls")
            if isinstance(exc, TimeoutError):  # reached us, not served in time: turned away
                self._note_turned_away()
            reason = tls_accept.failure_reason(exc)
            self.repeat_log.log(
                f"tls:{reason}", logging.WARNING,
                "TLS handshake with %s failed: %s", peer_text(peer), reason,
            )  # fmt: skip
            return
        finally:
            self._tls_pending.pop(raw, None)
        if secure is None or protocol.lost_early:  # gone, or cut off during the handshake
            if secure is not None:
                secure.abort()
            return
        protocol.secured(secure)

    def _accept(self, protocol: BoundedReaderProtocol, writer: asyncio.StreamWriter) -> None:
        connection = AgentConnection(self, protocol, writer)
        if not self._make_room(connection.peer):
            writer.close()
            return
        self._connections.add(connection)
        self._unauthenticated[connection] = None
        task = asyncio.ensure_future(self._serve_connection(connection))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _make_room(self, peer: str) -> bool:
        """Whether one more connection (from ``peer``) may be served: at a cap, the oldest TLS
        handshake under way, else the oldest unauthenticated connection, is closed for it;
        with neither (established agents fill the whole budget) the new one is refused."""
        if not self._at_a_cap():
            return True
        if self._tls_pending:
            handshake = next(iter(self._tls_pending))
            self._tls_pending.pop(handshake).cancel()
            handshake.abort()  # also when its task never ran
            self.count_rejection("evicted")
            return True
        if self._unauthenticated:
            oldest = next(iter(self._unauthenticated))
            self._forget(oldest)
            oldest.abort("evicted", "unauthenticated connections at their cap: oldest closed")
            self.repeat_log.log(
                "cap:unauthenticated", logging.WARNING,
                "unauthenticated connections at their cap (%d of %d, %d connections in all): "
                "closing the oldest (peer %s) for a new one",
                len(self._unauthenticated) + len(self._tls_pending) + 1, self.max_unauthenticated,
                len(self._connections) + 1, oldest.peer,
            )  # fmt: skip
            return True
        self.count_rejection("too_many_connections")
        self.repeat_log.log(
            "cap:connections", logging.WARNING,
            "connection limit reached (%d established agents): refusing %s",
            len(self._connections), peer,
        )  # fmt: skip
        return False

    def _at_a_cap(self) -> bool:
        """Whether one more connection would pass a cap. TLS handshakes under way count as
        connections and as unauthenticated ones: each holds a socket and buffers."""
        pending = len(self._tls_pending)
        return (
            len(self._connections) + pending >= self.max_connections
            or len(self._unauthenticated) + pending >= self.max_unauthenticated
        )

    def _forget(self, connection: AgentConnection) -> None:
        self._connections.discard(connection)
        self._unauthenticated.pop(connection, None)

    @property
    def unauthenticated_count(self) -> int:
        """Connections that have not finished their handshake."""
        return len(self._unauthenticated)

    @property
    def connection_count(self) -> int:
        """Connections served now (handshakes included)."""
        return len(self._connections)

    async def _serve_connection(self, connection: AgentConnection) -> None:
        try:
            await connection.run()
        finally:
            self._forget(connection)

    # -- sessions ----------------------------------------------------------------------------

    def attach(self, connection: AgentConnection) -> None:
        """An agent finished its handshake; a previous connection of its node is replaced."""
        node = connection.node
        assert node is not None
        self._unauthenticated.pop(connection, None)
        old = self.sessions.get(node)
        if old is not None and old.peer_closed:  # one agent back before its old link's end
            log.info(  # was handled (after a stall of this coordinator, say): not two agents
                "agent %s reconnected from %s (its connection from %s had ended)",
                node, connection.peer, old.peer,
            )  # fmt: skip
        elif old is not None:
            log.warning(
                "node %s: the connection from %s replaces the one from %s (if this repeats, "
                "two agents use the same --node name)",
                node, connection.peer, old.peer,
            )  # fmt: skip
        if old is not None:
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
            for job in list(self._node_jobs.get(node, ())):
                self._drop_node_job(node, job)
            if self.state.pending:  # the flows of the jobs forgotten with it, on other nodes
                self._schedule_flush()

    def _note_job(self, node: str, job: str) -> None:
        """Remember that ``node`` reports ``job``: bounded per node, expired by age, so that
        job names (200,000 of them cost 75 MB, resent after every reconnect) cannot grow the
        coordinator without bound."""
        jobs = self._node_jobs.setdefault(node, {})
        jobs.pop(job, None)
        if len(jobs) >= MAX_JOBS_PER_NODE:
            self._drop_node_job(node, next(iter(jobs)))
        jobs[job] = time.monotonic()
        self._job_nodes.setdefault(job, set()).add(node)
        self._expire_jobs_when_due()

    def _expire_jobs_when_due(self) -> None:
        """Forget the jobs no node reported for JOB_TTL, at most every tenth of it (called
        with each report and by the heartbeat loop: the last reports are followed by none)."""
        if time.monotonic() >= self._next_job_expiry:
            self._next_job_expiry = time.monotonic() + JOB_TTL / 10
            self._expire_jobs(time.monotonic() - JOB_TTL)
            if self.state.pending:  # the expired jobs' flows are re-evaluated
                self._schedule_flush()

    def _expire_jobs(self, older_than: float) -> None:
        for node, jobs in list(self._node_jobs.items()):
            stale = [job for job, seen in jobs.items() if seen < older_than]
            for job in stale:
                self._drop_node_job(node, job)

    def _drop_node_job(self, node: str, job: str) -> None:
        """``node`` no longer reports ``job``; the job is forgotten when no node does."""
        jobs = self._node_jobs.get(node, {})
        jobs.pop(job, None)
        if not jobs:
            self._node_jobs.pop(node, None)
        nodes = self._job_nodes.get(job)
        if nodes is not None:
            nodes.discard(node)
            if not nodes:
                del self._job_nodes[job]
                self.state.forget_job(job)

    def _forget_job(self, job: str) -> None:
        """``job`` ended (a ``done`` report): no node reports it any more."""
        for node in self._job_nodes.pop(job, ()):
            jobs = self._node_jobs.get(node, {})
            jobs.pop(job, None)
            if not jobs:
                self._node_jobs.pop(node, None)

    @property
    def job_count(self) -> int:
        """Job names the coordinator remembers."""
        return len(self._job_nodes)

    def count_rejection(self, code: str, *, in_handshake: bool = True) -> None:
        """Count a closed connection by reason code (exported as a metric); ``in_handshake``:
        it closed before its session was established."""
        assert self.live.rejected is not None
        self.live.rejected[code] += 1
        if code in ("evicted", "too_many_connections") or (in_handshake and code == "timeout"):
            self._note_turned_away()

    def _note_turned_away(self) -> None:
        self._turned_away.append(time.monotonic())

    def turned_away_lately(self) -> int:
        """Connections turned away in the last ``reach.KNOCK_GAP`` seconds: at the connection
        caps, or whose handshake (TLS included) did not finish in time (an overloaded
        coordinator). Agents that reach this coordinator and are not served: a standby must
        not count them as cut off from it (flowsched.coordinator.reach)."""
        horizon = time.monotonic() - reach.KNOCK_GAP
        while self._turned_away and self._turned_away[0] < horizon:
            self._turned_away.popleft()
        return len(self._turned_away)

    # -- events ------------------------------------------------------------------------------

    def handle(self, node: str, message: Message, arrival: float) -> None:
        """Apply one message from ``node``'s agent (``arrival``: ``perf_counter()`` on read).

        Raises:
            RemoteProtocolError: ``bad_field``: the message names a link ``node`` may not
                report or send on (see :func:`check_nic_load`, :func:`check_flow_links`);
                nothing of it was applied.
        """
        self.live.frames_received += 1
        state = self.state
        kind = type(message)
        if node in state.split_resyncs and kind is not Resync and not continues_resync(message):
            refused = state.end_resync(node, time.time())  # (a new resync replaces it instead)
            if refused:
                self._log_refused(node, refused)
            # what its end decided (held flows admitted, the rest re-ranked without the
            # dropped ones) goes out also when the frame is a heartbeat, which flushes nothing
            self._schedule_flush()
        if kind is Flows:
            assert isinstance(message, Flows)
            if message.opens:
                check_flow_links(node, message.opens, "flows.opens")
            self._flows(node, message)
        elif kind is Heartbeat:
            return
        elif kind is JobProgress:
            assert isinstance(message, JobProgress)
            if message.done:
                self._forget_job(message.job)
            else:
                self._note_job(node, message.job)
            state.job_progress(message)
        elif kind is NicLoad:
            assert isinstance(message, NicLoad)
            check_nic_load(node, message.entries)
            state.nic_load(message.entries)
        elif kind is Resync:
            assert isinstance(message, Resync)
            check_flow_links(node, message.opens, "resync.opens")
            refused = state.resync(
                node, message.opens, time.time(), defer=self.config.rebuild_batching
            )
            if refused:
                self._log_refused(node, refused)
            if self.config.rebuild_batching:
                self._settle_resyncs_soon()
        arrivals = self._arrivals
        if not self.config.batching:
            arrivals.append(arrival)
            self._flush(sweep=False)  # the timer sweep still advances once per loop turn
            return
        now = time.perf_counter()
        if not arrivals:
            self._batch_started = now
        arrivals.append(arrival)
        self._schedule_flush()
        if now - self._batch_started >= self.config.max_batch_delay:
            self._flush(sweep=False)  # a long turn: this batch's decisions go out now

    def _flows(self, node: str, message: Flows) -> None:
        state = self.state
        now = time.time()  # one instant for the frame's opens and closes
        if node in state.split_resyncs:  # (the rest of its resync: opens alone)
            refused = state.continue_resync(node, message.opens, now)
            if refused:
                self._log_refused(node, refused)
            if self.config.rebuild_batching:
                self._settle_resyncs_soon()
            return
        if message.opens:
            refused = state.open_flows(node, message.opens, now)
            if refused:
                self._log_refused(node, refused)
        if message.progress_ids:
            state.progress(node, message.progress_ids, message.progress_sent)
        if message.closes:
            state.close_flows(node, message.closes, now)

    def _log_refused(self, node: str, refused: int) -> None:
        state = self.state
        flows = len(state.by_node.get(node, ()))
        if flows < state.max_flows_per_node:  # refused for what they named
            names = state.node_names.get(node)
            self.repeat_log.log(
                "cap:node_names", logging.WARNING,
                "node %s: %d flow opens refused for their names (its %d open flows name %d "
                "distinct links, %d in all, and %d jobs; at most %d, %d and %d): they keep the "
                "agent's static levels",
                node, refused, flows, len(names.links) if names else 0,
                names.link_uses if names else 0, len(names.jobs) if names else 0,
                state.max_link_names_per_node, state.max_link_uses_per_node, MAX_JOBS_PER_NODE,
            )  # fmt: skip
            return
        self.repeat_log.log(
            "cap:node_flows", logging.WARNING,
            "node %s has %d flows open, the most one node may have (--max-flows-per-node): "
            "%d more refused; they keep the agent's static levels",
            node, flows, refused,
        )  # fmt: skip

    def _settle_resyncs_soon(self) -> None:
        # A resync burst (every agent of a new leader at once) is re-evaluated once it pauses
        # for RESYNC_QUIET, and at the latest RESYNC_MAX_DEFER after its first resync; the
        # flows already have their admission decisions meanwhile.
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._resync_burst is None:
            self._resync_burst = now
        if self._resync_settle is not None:
            self._resync_settle.cancel()
        due = min(now + RESYNC_QUIET, self._resync_burst + RESYNC_MAX_DEFER)
        self._resync_settle = loop.call_at(due, self._settle_resyncs)

    def _settle_resyncs(self) -> None:
        self._resync_settle = self._resync_burst = None
        self.state.settle_resyncs()
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self, sweep: bool = True) -> None:
        if sweep:
            self._flush_scheduled = False
        started = time.perf_counter()
        try:  # the policy's own failures are the state's (one flow each): this is a backstop
            outbox = self.state.flush(time.time(), self.config.sweep_budget if sweep else 0.0)
        except Exception as exc:
            self.repeat_log.log(
                "flush", logging.ERROR, "flush failed: sending the level updates queued so far",
                exc_info=exc,
            )  # fmt: skip
            outbox, self.state.outbox = self.state.outbox, {}
        for node, updates in outbox.items():
            connection = self.sessions.get(node)
            if connection is not None:
                self._send_levels(connection, list(updates.values()))
        if self._timer_wake != math.inf:
            due = self._next_timer()
            if due is not None and due < self._timer_wake:
                self._timer_armed.set()
        done = time.perf_counter()
        self.live.flush_duration.observe(done - started)
        observe = self.live.decision_latency.observe
        for arrival in self._arrivals:
            observe(done - arrival)
        self._arrivals.clear()
        if self.state.pending:
            self._schedule_flush()  # the rest of a timer sweep, after the next reads

    def _send_levels(self, connection: AgentConnection, updates: list[LevelUpdate]) -> None:
        for start in range(0, len(updates), MAX_UPDATES_PER_FRAME):
            part = tuple(updates[start : start + MAX_UPDATES_PER_FRAME])
            connection.send(Levels(part, self.epoch))

    # -- timers ------------------------------------------------------------------------------

    async def _timer_loop(self) -> None:
        # The next sweep waits for the timer period, and at least long enough that sweeping
        # takes no more than `sweep_duty` of the time (a policy period shorter than one pass
        # over the table would otherwise keep the coordinator permanently busy). With
        # promotion timers it waits for the earliest timer too: polling them every 1 ms kept
        # an idle coordinator at 7.6 % of a core.
        duty = self.config.sweep_duty
        timers = self.state.promotion == "timers"
        while True:
            gap = self.state.last_sweep_cost * (1.0 - duty) / duty
            earliest = time.monotonic() + max(self.config.timer_period, gap)
            if timers:
                await self._until_timer_due(earliest)
            else:
                await asyncio.sleep(earliest - time.monotonic())
            if self.state.start_sweep():
                self._schedule_flush()

    def _next_timer(self) -> float | None:
        """When (monotonic) the earliest promotion timer or quarantine retry is due, or None.
        A timer's time is the policy's, on the wall clock (deadlines are); a retry is a pure
        delay, on the monotonic clock, so that a wall clock stepped back does not hold it."""
        due, retry = self.state.next_due(), self.state.next_retry()
        if due is not None:
            due = time.monotonic() + (due - time.time())
        if retry is None or (due is not None and due < retry):
            return due
        return retry

    async def _until_timer_due(self, earliest: float) -> None:
        """Wait until the earliest promotion timer or quarantine retry is due, but not before
        ``earliest`` (monotonic); a flush that arms an earlier one wakes the wait (see
        ``_flush``)."""
        while True:
            due = self._next_timer()
            wake = max(earliest, (time.monotonic() + TIMER_IDLE_WAKE) if due is None else due)
            self._timer_wake = wake
            self._timer_armed.clear()
            try:
                async with asyncio.timeout(wake - time.monotonic()):
                    await self._timer_armed.wait()
            except TimeoutError:
                return
            finally:
                self._timer_wake = math.inf

    async def _heartbeat_loop(self) -> None:
        # Spread over HEARTBEAT_SLICES ticks per interval: one burst to 1,000 agents would
        # hold the loop (and every decision waiting behind it) for milliseconds. One frame
        # per tick, encoded once for every agent of the slice.
        tick = self.config.heartbeat_interval / HEARTBEAT_SLICES
        max_frame_size = self.config.max_frame_size
        slices: list[list[AgentConnection]] = []
        for slot in itertools.cycle(range(HEARTBEAT_SLICES)):
            if slot == 0:  # the agents, sliced once per interval (a newcomer waits for it)
                self._expire_jobs_when_due()
                slices = [[] for _ in range(HEARTBEAT_SLICES)]
                for node, connection in self.sessions.items():
                    # a node keeps its slice while others come and go: one visit per interval
                    slices[hash(node) % HEARTBEAT_SLICES].append(connection)
            await asyncio.sleep(tick)
            due = slices[slot]
            if not due:
                continue
            beat = encode_frame(Heartbeat(time.time(), self.epoch), max_frame_size)
            for connection in due:
                if connection.sent_since_beat:  # levels sent since the last visit say
                    connection.sent_since_beat = False  # "alive" just as well
                else:
                    connection.send_frame(Heartbeat.TYPE, beat)


def continues_resync(message: Message) -> bool:
    """Whether ``message`` may be more of a split resync: a ``flows`` frame of opens alone
    (ClusterState.resync). Any other frame ends the resync before it is applied."""
    return (
        type(message) is Flows
        and bool(message.opens)
        and not message.progress_ids
        and not message.closes
    )


def check_nic_load(node: str, entries: tuple[NicLoadEntry, ...]) -> None:
    """Refuse a ``nic_load`` entry for a link other than ``node``'s own (:func:`node_links`):
    an agent reports its own NIC only, and another node's capacity is not its to set. A link
    named twice in one frame is refused too: each entry re-evaluates the link's flows, so
    8,192 entries for one link would cost 8,192 times the node's flows.

    Raises:
        RemoteProtocolError: ``bad_field``, naming the entry.
    """
    own = node_links(node)
    seen: set[str] = set()
    for index, entry in enumerate(entries):
        if entry.link not in own:
            raise RemoteProtocolError(
                f"nic_load.entries[{index}].link: {entry.link!r} is not a link of node "
                f"{node!r} (an agent reports {own[0]!r} and {own[1]!r} only)",
                code="bad_field",
            )
        if entry.link in seen:
            raise RemoteProtocolError(
                f"nic_load.entries[{index}].link: {entry.link!r} is named twice (one entry "
                "per link and frame)",
                code="bad_field",
            )
        seen.add(entry.link)


def check_flow_links(node: str, opens: tuple[FlowOpen, ...], path: str) -> None:
    """Refuse a flow open whose links cannot be ``node``'s: an agent's flow crosses its node's
    egress ``<node>:tx`` and, when it names its destination, an ingress ``<dst>:rx``
    (flowsched.agent.flows).

    Raises:
        RemoteProtocolError: ``bad_field``, naming the open and the link.
    """
    egress = node_links(node)[0]
    for index, op in enumerate(opens):
        for link in op.links:
            if link != egress and not link.endswith(":rx"):
                raise RemoteProtocolError(
                    f"{path}[{index}].links: {link!r} is neither node {node!r}'s egress "
                    f"{egress!r} nor an ingress link '<node>:rx'",
                    code="bad_field",
                )


async def serve(
    config: CoordinatorConfig, *, shutdown_trigger: Callable[[], Awaitable[object]] | None = None
) -> None:
    """Run the coordinator until ``shutdown_trigger()`` returns (or SIGINT/SIGTERM).

    Signal handlers are installed only when no trigger is given. ``config.on_ready`` is
    called with the bound addresses once both listeners are up. With ``config.etcd`` the
    coordinator stands by until elected, leads, and resigns on shutdown.

    Raises:
        flowsched.coordinator.election.LeadershipLost: it led and lost the lease; it stopped
            serving so that it can never decide next to its successor (restart it: it comes
            back as a standby).
    """
    coordinator = Coordinator(config)
    addresses = await coordinator.start()
    # What is alive now (modules, the policy, the listeners) lives as long as the daemon: keep
    # it out of the collector's full passes, each of which holds every decision behind it.
    gc.collect()
    gc.freeze()
    if config.on_ready is not None:
        config.on_ready(addresses)
    try:
        trigger = (shutdown_trigger or wait_for_signal)()
        if coordinator.candidacy is None:
            await trigger
        else:  # a leader stops serving before it resigns: its successor may lead at once
            await coordinator.candidacy.run(trigger, coordinator.stop)
    finally:
        await coordinator.stop()  # (again after a resignation: it does nothing more then)


def advertised_address(host: str, port: int) -> str:
    """The address agents reach a coordinator bound to ``host``:``port`` at (a wildcard bind
    advertises this host's name)."""
    if host in ("", "0.0.0.0", "::"):
        host = socket.getfqdn()
    return host_port_text(host, port)
