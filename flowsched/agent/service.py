"""The node agent service: table, SDK socket, coordinator link, local fallback, metrics.

One asyncio loop runs everything, so the flow registry needs no locks:

* ``_poll_table`` scans the shared-memory table every few ms (plugin connections become flows,
  closed slots are reported and freed, slots of dead processes reaped);
* ``_uplink`` keeps the authenticated connection to the coordinator: after each (re)connect it
  sends a ``resync`` with the complete flow set (split into frames that fit the frame limit),
  then batches of opens/progress/closes, job progress, NIC load and heartbeats, and applies
  the ``levels`` it receives. After a failed or ended session it waits ``reconnect_interval``,
  doubling up to ``MAX_RECONNECT_BACKOFF``; no error of one session ends the loop;
* ``_fallback_watch`` runs the same policy locally (``make_policy()``) once nothing has been
  received from the coordinator for ``fallback_after`` seconds (a handshake alone does not
  count), and stops when the coordinator's next message arrives;
* the SDK server (:mod:`flowsched.agent.sdk_server`) opens and closes SDK flows.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from typing import Any

from flowsched import policyfile, qos, rdma
from flowsched.agent.config import AgentConfig, ReadyInfo
from flowsched.agent.flows import (
    MAX_JOBS,
    FlowRegistry,
    JobTable,
    SlotKey,
    resync_frames,
    split_batch,
)
from flowsched.agent.metrics import start_http
from flowsched.agent.nic import NicMonitor, default_interfaces
from flowsched.agent.policy_view import PolicyView
from flowsched.agent.resolver import NameCache
from flowsched.agent.sdk_server import SdkListener, SdkServer
from flowsched.agent.telemetry import SlotTelemetry, Telemetry
from flowsched.fdlimit import raise_fd_limit
from flowsched.lograte import RepeatLog, quoted
from flowsched.model import Context, Decision, Flow
from flowsched.policies.base import Policy
from flowsched.protocol import (
    JOB_END_VERSION,
    Heartbeat,
    JobProgress,
    Levels,
    NicLoad,
    NicLoadEntry,
    ProtocolError,
    load_token,
)
from flowsched.protocol.aio import AgentLink, HandshakeError, LinkClosed, connect_agent
from flowsched.shm import layout
from flowsched.shm.table import FlowTable, monotonic_ns
from flowsched.signals import wait_for_signal
from flowsched.tls import ReloadingContext, reloading_client

log = logging.getLogger("flowsched.agent")

HEARTBEAT_PERIOD = 0.1
REAP_PERIOD = 1.0
#: coordinator heartbeats missed before the agent drops the link (2 s at the default 0.2 s). A
#: coordinator accepting a burst of ~1,100 connections stalled its loop for more than 3 (0.6 s):
#: a healthy link must survive that. The local policy starts only once the link is down, at
#: ``fallback_after`` past the last message received: a silent coordinator's agents go local
#: when they drop the link (2 s), a killed coordinator's sooner, since it resets the link at once.
SILENCE_HEARTBEATS = 10
#: the local policy re-evaluates at the policy's timer period, but not more often than this
#: (one node's flows do not need a 1 ms sweep; events such as opens are handled at once)
MIN_LOCAL_PERIOD = 0.01
#: the pause between reconnects doubles after each failed or ended session up to this (s) ...
MAX_RECONNECT_BACKOFF = 1.0
#: ... and starts again at ``reconnect_interval`` after a session that lasted this long (s)
HEALTHY_SESSION = 5.0
#: every decided slot level and the marking table are compared with the table this often (s)
#: and rewritten where they differ: a process with write access to the table (a --group
#: member) that changes them is undone within this period (docs/security.md)
REASSERT_PERIOD = 1.0
#: reconnect pauses are spread over [1 - JITTER, 1 + JITTER] times their value, so that the
#: agents of a cluster do not reconnect in step after a coordinator restart
RECONNECT_JITTER = 0.5
#: the least pause after the coordinator refused the handshake (wrong token, version)
REFUSED_PAUSE = 1.0


class Agent:
    """One node agent. Use :func:`serve`, or ``start()`` / ``stop()`` in tests."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.view = _initial_view(config.policy_text)
        self.table: FlowTable | None = None
        self.registry: FlowRegistry | None = None
        self.nic = NicMonitor(
            config.node,
            config.interfaces or default_interfaces(),
            default_bandwidth=config.default_bandwidth,
            capacity=config.link_capacity,
        )
        self.connected = False
        #: a coordinator session took the flow set (its resync): from then on the registry's
        #: queued opens and closes are sent; without one they are dropped as they come
        self._reporting = False
        #: the levels the session's resync reported while the local policy ran (it runs on
        #: until the coordinator's first message): those it moves meanwhile are reported again
        self._resynced: dict[int, int] | None = None
        self.fallback: Policy | None = None
        #: a run of the local policy is queued for the loop's next turn (_reevaluate_soon)
        self._reevaluation_due = False
        self._admitted: set[int] = set()
        #: the local copy of the policy that gives SDK flows their first level while the
        #: coordinator is connected (``first_level_wait`` 0), and the flows it admitted
        self._first_policy: Policy | None = None
        self._first_admitted: set[int] = set()
        self._last_rx = time.monotonic()
        self._heartbeat_interval = 0.2
        self._job_updates: dict[str, JobProgress] = {}
        #: the latest progress per job, scoped to the client's uid, bounded, expiring
        self.jobs = JobTable()
        self._pending_nic: NicLoad | None = None
        #: set when an SDK flow opens or closes: the uplink sends its batch now instead of at
        #: the next report tick (an application waits for an open's first level)
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._qos_due = asyncio.Event()  # the policy changed: converge --qos-dev now
        self._servers: list[asyncio.AbstractServer | SdkListener] = []
        self.sdk: SdkServer | None = None
        self.stats: dict[str, float] = {
            "levels_written": 0,
            "promotions": 0,
            "batches_sent": 0,
            "fallback_switches": 0,
            "last_switch_delay": -1.0,
            "last_switch_wall": 0.0,
            "resyncs_sent": 0,
            "connects": 0,
            "reaped": 0,
            "tampered_repaired": 0,
            "connects_failed": 0,
            "handshakes_refused": 0,
            "deposed_refused": 0,
            "qos_repairs": 0,
        }
        self.ready: ReadyInfo | None = None
        self.telemetry = Telemetry()
        self.slot_telemetry = SlotTelemetry()
        #: slots holding a connection (ACTIVE or CLOSED) at the last table scan
        self.slots_used = 0
        self.rdma_devices: list[str] = []
        self._repeat_log = RepeatLog(log)
        self._rng = random.Random()  # reconnect jitter
        #: the coordinators' names, resolved at most once a second while none answers
        self._names = NameCache()
        self._token: bytes | None = None
        self._tls: ReloadingContext | None = None  # config.tls: the coordinator link's
        self._socket_bound = False
        #: (fencing scope, epoch) of the newest leader followed: fencing (docs/ha.md)
        self.leader_epoch = (0, 0)
        #: which of the coordinator addresses led last (tried first on reconnect)
        self._leader_index = 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> ReadyInfo:
        """Attach the table, open the SDK socket and metrics, start the loops."""
        cfg = self.config
        if cfg.coordinator is not None:
            self._token = load_token(cfg.token_file)  # refuse a missing or loose token first
            if cfg.tls:  # and unusable TLS files (TlsConfigError names the setting)
                self._tls = reloading_client(cfg.tls_ca, cfg.tls_cert, cfg.tls_key)
        if cfg.qos_dev is not None:  # asked for and impossible: refuse to start
            changed = self._apply_qos(self.view.cfg)
            log.info("host QoS on %s: %s", cfg.qos_dev,
                     f"{len(changed)} changes" if changed else "in place")  # fmt: skip
        self.rdma_devices = [d.name for d in rdma.discover_devices()]
        log.info("RDMA devices: %s", ", ".join(self.rdma_devices) or "none (or no pyverbs)")
        generation = self._attach_table()
        self.sdk = SdkServer(self, raise_fd_limit(log))
        self._servers.append(await self.sdk.start(cfg.socket_path, cfg.group))
        self._socket_bound = True
        metrics_addr = None
        if cfg.metrics_port is not None:
            server, metrics_addr = await start_http(self, cfg.metrics_host, cfg.metrics_port)
            self._servers.append(server)
        self.nic.sample()
        self._start_loops()
        self.ready = ReadyInfo(cfg.node, cfg.table_path, cfg.socket_path, metrics_addr, generation)
        return self.ready

    def _attach_table(self) -> int:
        cfg = self.config
        self.table, info = FlowTable.create_or_attach(
            cfg.table_path, num_slots=cfg.num_slots, group=cfg.group
        )
        state = "created" if info.created else "re-attached"
        log.info("%s flow table %s (generation %d, %d slots kept)", state, cfg.table_path,
                 info.generation, len(info.kept_slots))  # fmt: skip
        for repair in info.repaired:
            log.warning("flow table %s: repaired header field %s", cfg.table_path, repair)
        if info.num_slots != cfg.num_slots:
            log.warning(
                "flow table %s has %d slots, not the %d asked for (--slots): an existing table "
                "keeps its size. To resize it: stop the agent, remove the file, and start the "
                "agent with the new --slots (running jobs move their connections to the new "
                "table within a second while they send)",
                cfg.table_path, info.num_slots, cfg.num_slots,
            )  # fmt: skip
        self.table.write_config(self.view.table_config())
        self.registry = FlowRegistry(
            node=cfg.node,
            links=self.nic.links,
            links_to=self.nic.links_to,
            id_prefix=info.generation,
            default_deadline=lambda c: self.view.default_deadline(c),
            owner_key=self.table.owner_key,
        )
        return info.generation

    def _start_loops(self) -> None:
        loops: list[Callable[[], Coroutine[Any, Any, None]]] = [
            self._poll_table,
            self._heartbeat_table,
            self._fallback_watch,
            self._nic_loop,
        ]
        if self.config.qos_dev is not None:
            loops.append(self._qos_loop)
        if self.config.coordinator is not None:
            loops.append(self._uplink)
        self._tasks = [asyncio.create_task(loop()) for loop in loops]
        self._last_rx = time.monotonic()

    async def stop(self) -> None:
        """Stop the loops and servers; the table keeps its slots (and levels) for a successor."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for server in self._servers:
            server.close()
        if self.sdk is not None:
            await self.sdk.close()
        if self._socket_bound:  # never remove the socket of another agent we refused to replace
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.socket_path)
        if self.table is not None:
            self.table.detach()
            self.table.close()

    # ------------------------------------------------------------------ table
    async def _poll_table(self) -> None:
        next_reap = next_reassert = 0.0
        while True:
            try:
                self.scan_table()
                if time.monotonic() >= next_reap:
                    next_reap = time.monotonic() + REAP_PERIOD
                    self._reap()
                if time.monotonic() >= next_reassert:
                    next_reassert = time.monotonic() + REASSERT_PERIOD
                    self.reassert_levels()
                    self._forget_jobs(self.jobs.expire())
            except Exception:
                log.exception("table scan failed")
            await asyncio.sleep(self.config.poll_interval)

    def scan_table(self) -> None:
        """One scan: new, progressing and closed plugin connections."""
        assert self.table is not None and self.registry is not None
        busy = self.table.busy_slots()
        changed, ended = self.registry.observe_counts(
            busy, self.table.slot, time.time(), monotonic_ns()
        )
        self._slot_metrics(busy)
        for key in ended:
            self.table.release_slot(*key)
        self._after_registry_change()
        for key in changed:
            self.write_slot(key)

    def _slot_metrics(self, busy: list[tuple[int, int, int, int]]) -> None:
        assert self.table is not None and self.registry is not None
        self.slots_used = len(busy)
        if busy and self.slot_telemetry.due(time.monotonic()):
            columns = {name: self.table.slot_column(name) for name in SlotTelemetry.COLUMNS}
            self.slot_telemetry.scan(busy, columns, self.registry.slots)

    def readiness(self) -> str | None:
        """None when ready (``/readyz``): started and connected to a coordinator, or running
        the local policy on purpose (no ``--coordinator``); else the reason."""
        if self.ready is None:
            return "starting"
        if self.config.coordinator is None or self.connected:
            return None
        return "no coordinator connection" + (" (local policy running)" if self.fallback else "")

    def reassert_levels(self) -> int:
        """Rewrite the slot levels and the marking table where they differ from what this
        agent decided; return how many were repaired (logged at a falling rate)."""
        assert self.table is not None and self.registry is not None
        repaired = 0
        if self.registry.slots:
            levels, seqs = self.table.slot_column("level"), self.table.slot_column("claim_seq")
            for key in list(self.registry.slots):
                level = self._decided_level(key)
                if level is None or seqs[key[0]] != key[1]:
                    continue
                if levels[key[0]] != self.view.table_level(level):
                    self.write_slot(key)
                    repaired += 1
        wanted = self.view.table_config()
        if not self.table.config_matches(wanted):
            self.table.write_config(wanted)
            repaired += 1
        if repaired:
            self.stats["tampered_repaired"] += repaired
            self._repeat_log.log(
                "tampered", logging.WARNING,
                "rewrote %d slot levels or marking tables of %s that another process had "
                "changed (anyone with write access to the table: see docs/security.md)",
                repaired, self.config.table_path,
            )  # fmt: skip
        return repaired

    def _reap(self) -> None:
        assert self.table is not None
        if self.sdk is not None:
            self.sdk.close_exited(self.process_start)
        reaped = self.table.reap_dead()
        if reaped:
            self.stats["reaped"] += len(reaped)
            log.info("reaped %d slots of exited processes", len(reaped))
        found = self.table.last_reap
        for key, slots, what in (
            ("bad_pid", found.bad_pid, "held a pid no process can have (0 or >= 2^31)"),
            ("reused_pid", found.reused_pid, "named a pid now used by a later process"),
        ):
            if slots:
                self.stats[f"slots_{key}"] = self.stats.get(f"slots_{key}", 0) + len(slots)
                self._repeat_log.log(
                    f"reap:{key}", logging.WARNING,
                    "flow table %s: %d slots (first: %d) %s; reaped as dead",
                    self.config.table_path, len(slots), slots[0], what,
                )  # fmt: skip
        if found.unplaced:
            self._repeat_log.log(
                "reap:unplaced", logging.WARNING,
                "flow table %s: %d slots (first: %d) belong to processes of another pid "
                "namespace that /proc does not let the agent place (a plugin older than the "
                "agent, two processes with one pid there that started in the same clock tick, "
                "or /proc hidden); kept until they close",
                self.config.table_path, len(found.unplaced), found.unplaced[0],
            )  # fmt: skip
        for index, exc in found.errors[:1]:
            self.stats["reap_errors"] = self.stats.get("reap_errors", 0) + len(found.errors)
            self._repeat_log.log(
                "reap:error", logging.WARNING,
                "flow table %s: could not judge %d slots (first: slot %d: %r); the others "
                "were reaped", self.config.table_path, len(found.errors), index, exc,
            )  # fmt: skip

    async def _heartbeat_table(self) -> None:
        assert self.table is not None
        while True:
            self.table.heartbeat()
            await asyncio.sleep(HEARTBEAT_PERIOD)

    def _decided_level(self, key: SlotKey) -> int | None:
        """The level the slot's flow (or its SDK flow) has; None when none is decided yet."""
        assert self.registry is not None
        level = self.registry.level_of_slot(key)
        conn = self.registry.slots.get(key)
        if level is None and conn is not None and conn.linked_to is not None:
            level = self.view.default_level(conn.cls)
        return level

    def process_key(self, pid: int, shown_ns: int = 0) -> int:
        """The registry's name for our process ``pid`` (an SDK client that showed pid namespace
        ``shown_ns``, 0 = none): the number its NCCL connections' slots name it by
        (:meth:`flowsched.shm.pidns.PidNamespaces.key_of`)."""
        if self.table is None:
            return pid
        spaces = self.table.pid_namespaces
        key, hidden = spaces.client_key(pid, shown_ns)
        if hidden:
            self._repeat_log.log(
                "sdk:hidden", logging.WARNING,
                "SDK client pid %d runs in another pid namespace and did not show it (an SDK "
                "older than the agent): its flows are not linked to its NCCL connections", pid,
            )  # fmt: skip
        return key

    def process_start(self, pid: int) -> int:
        """When our process ``pid`` started, as the table's slots say it (``start_ticks``);
        0 when gone or unknown."""
        return 0 if self.table is None else self.table.pid_namespaces.start_of(pid)

    def write_slot(self, key: SlotKey) -> None:
        """Write the level the slot's flow (or its SDK flow) has into the slot."""
        assert self.table is not None
        level = self._decided_level(key)
        if level is None:
            return
        snap = self.table.slot(key[0])
        if snap is None or snap.claim_seq != key[1]:
            return  # the connection is gone; never touch its successor's slot
        self.table.set_level(key[0], self.view.table_level(level))
        self.stats["levels_written"] += 1

    def apply_levels(
        self,
        updates: Iterable[tuple[int, int]],
        decided: Mapping[int, tuple[float | None, int | None]] | None = None,
    ) -> None:
        """Record decided levels, write them into the slots, push them to SDK clients.

        ``decided`` maps a flow id to the coordinator's decision stamps (wall seconds,
        CLOCK_MONOTONIC ns), passed on to the SDK client with the level.
        """
        assert self.registry is not None
        for flow_id, level in updates:
            flow = self.registry.flows.get(flow_id)
            if flow is None:
                continue
            if 0 <= level < flow.level:
                self.stats["promotions"] += 1
            for key in self.registry.set_level(flow_id, level):
                self.write_slot(key)
            if flow_id in self.registry.sdk and self.sdk is not None:
                stamps = decided.get(flow_id) if decided is not None else None
                self.sdk.push_level(flow_id, level, *(stamps or (None, None)))

    # ------------------------------------------------------------------ coordinator link
    async def _uplink(self) -> None:
        interval = self.config.reconnect_interval
        backoff = interval
        while True:
            started = time.monotonic()
            pause: float | None = 0.0
            try:
                pause = await self._connect_and_serve()
            except Exception:  # a bug in one session must never end the uplink for good
                log.exception("coordinator session failed")
            if pause is None:  # no coordinator listening: retry at the plain interval, so a
                backoff = interval  # restarted coordinator gets its agents back at once
                await asyncio.sleep(self.jittered(interval))
                continue
            if time.monotonic() - started >= HEALTHY_SESSION:
                backoff = interval
            await asyncio.sleep(self.jittered(max(backoff, pause)))
            backoff = min(backoff * 2, max(MAX_RECONNECT_BACKOFF, interval))

    def jittered(self, pause: float) -> float:
        """``pause`` spread by :data:`RECONNECT_JITTER` (uniformly, mean unchanged)."""
        return pause * self._rng.uniform(1.0 - RECONNECT_JITTER, 1.0 + RECONNECT_JITTER)

    async def _connect_and_serve(self) -> float | None:
        """One connection attempt and, when the handshake succeeds, one session. Returns the
        least pause before the next attempt, or None when nothing answered (no coordinator
        listening, or only standbys naming a leader that did not answer either): sessions
        that end, refused handshakes, and standbys that know no leader back off; absence
        does not."""
        link, pause = await self._connect_leader()
        if link is None:
            return pause
        try:
            await self._session(link)
        except (LinkClosed, ProtocolError, OSError, TimeoutError) as exc:
            self._log_link_lost(exc)
        finally:
            self.connected = self._reporting = False
            self._resynced = None
            self.table_flag_connected(False if self.fallback is not None else None)
            await link.close()
        return 0.0

    async def _connect_leader(self) -> tuple[AgentLink | None, float | None]:
        """Connect to the elected coordinator: try the configured addresses in turn, starting
        with the last one that led, and follow a standby's redirect (docs/ha.md). A
        coordinator whose epoch is below one this agent already followed (a deposed leader)
        is refused: its decisions would race its successor's. Returns (link, None) or (None,
        the pause for :meth:`_connect_and_serve`)."""
        addresses = list(self.config.coordinator_addresses)
        assert addresses
        start = self._leader_index % len(addresses)
        queue = addresses[start:] + addresses[:start]
        tried: set[tuple[str, int]] = set()
        pause: float | None = None
        while queue:
            address = queue.pop(0)
            if address in tried:
                continue
            tried.add(address)
            try:
                link = await self._handshake(address)
            except HandshakeError as exc:
                redirect = _redirect(exc)
                if exc.code != "not_leader":  # a wrong token repeats: once, then less often
                    self.stats["handshakes_refused"] += 1
                    self._log_refusal(address, exc)
                    pause = REFUSED_PAUSE
                elif redirect is not None:
                    queue.insert(0, redirect)
                elif pause is None:
                    # it knows no leader (etcd unreachable from it, or it just started):
                    # nothing to chase, so back off
                    pause = 0.0
                continue
            except (OSError, TimeoutError) as exc:
                self._log_unreachable(address, exc)
                continue
            self._repeat_log.clear_matching(f"refused:{address}")
            self._repeat_log.clear_matching(f"unreachable:{address}")
            if self._is_deposed(link, address):
                await link.close()
                continue
            if address in addresses:
                self._leader_index = addresses.index(address)
            return link, None
        return None, pause

    def _log_refusal(self, address: tuple[str, int], exc: HandshakeError) -> None:
        """A refused handshake, once and then at a falling rate. What the coordinator said
        comes before it proved that it holds the token: anyone listening at the address
        (a local user while the coordinator restarts) chooses it. So its code and reason are
        logged quoted (control characters escaped: no forged lines) and cut, and one key per
        address spaces them out however the code changes; this agent's own refusals (a
        handful of codes) keep a key each."""
        if exc.by_agent:
            self._repeat_log.log(
                f"refused:{address}:{exc.code}", logging.ERROR,
                "refused coordinator %s:%d: %s", *address, exc,
            )  # fmt: skip
            return
        self._repeat_log.log(
            f"refused:{address}:by_coordinator", logging.ERROR,
            "coordinator %s:%d refused us: %s: %s", *address, quoted(exc.code, 64),
            quoted(exc.reason),
        )  # fmt: skip

    def _log_unreachable(self, address: tuple[str, int], exc: OSError | TimeoutError) -> None:
        """A failed connect, said as what it is, once and then at a falling rate."""
        self.stats["connects_failed"] += 1
        if isinstance(exc, ConnectionRefusedError):
            reason = "refused the connection (nothing listens there)"
        elif isinstance(exc, TimeoutError):
            reason = f"did not answer within {self.config.connect_timeout:g} s"
        else:
            reason = f"unreachable: {exc.strerror or exc}"
        self._repeat_log.log(
            f"unreachable:{address}:{type(exc).__name__}", logging.WARNING,
            "coordinator %s:%d %s; retrying", *address, reason,
        )  # fmt: skip

    async def _handshake(self, address: tuple[str, int]) -> AgentLink:
        """Connect to ``address`` and run the handshake, trying each address its name
        resolves to (:class:`~flowsched.agent.resolver.NameCache`) until one answers.

        Raises:
            HandshakeError: a coordinator refused, or was refused (the others are not tried).
            OSError, TimeoutError: no address answered; a timeout also drops the name's
                addresses, which may be stale.
        """
        token = self._token or load_token(self.config.token_file)
        config = self.config
        host, port = address
        error: OSError | None = None
        for ip in await self._names.addresses(host, port):
            try:
                return await connect_agent(
                    ip, port, node=config.node, token=token, timeout=config.connect_timeout,
                    tls=self._tls.current() if self._tls is not None else None,
                    server_hostname=config.tls_server_name or host,
                    allow_unproven=config.allow_unproven_coordinator,
                )  # fmt: skip
            except HandshakeError:  # (a ConnectionError) the coordinator answered
                raise
            except TimeoutError:
                self._names.forget(host, port)
                raise
            except OSError as exc:  # refused or unreachable: the next address
                error = exc
        assert error is not None  # a name resolves to one address at least
        raise error

    def _is_deposed(self, link: AgentLink, address: tuple[str, int]) -> bool:
        """Fencing: True (and logged) when ``link`` leads with an epoch below the highest this
        agent followed in the same etcd cluster; else that epoch becomes the highest."""
        assert link.welcome is not None
        cluster, epoch = link.welcome.cluster, link.welcome.epoch
        followed_cluster, followed = self.leader_epoch
        if cluster == followed_cluster and epoch < followed:
            self.stats["deposed_refused"] += 1
            log.warning(
                "coordinator %s:%d leads with epoch %d, below epoch %d already followed: "
                "a deposed leader, not followed", *address, epoch, followed,
            )  # fmt: skip
            return True
        self.leader_epoch = (cluster, epoch)
        return False

    def _log_link_lost(self, exc: Exception) -> None:
        error = exc.error if isinstance(exc, LinkClosed) else None
        if error is not None and error.code == "replaced":
            log.error(
                "the coordinator replaced this connection: another agent uses --node %s "
                "(every agent needs its own node name)",
                self.config.node,
            )
        elif isinstance(exc, ProtocolError):  # this end's check failed: say which (its code)
            log.warning("coordinator link lost: %s: %s", exc.code, exc)
        else:
            log.warning("coordinator link lost: %s", str(exc) or type(exc).__name__)

    async def _session(self, link: AgentLink) -> None:
        assert self.registry is not None and link.welcome is not None
        self._adopt_policy(link.welcome.policy_toml)
        self._heartbeat_interval = link.welcome.heartbeat_interval or 0.2
        await self._send_resync(link)
        self.stats["resyncs_sent"] += 1
        self.stats["connects"] += 1
        self.connected = True
        if self.fallback is None:
            self.table_flag_connected(True)
        # a running local policy stops with the coordinator's first message, not here: a
        # coordinator that ends every session right after the handshake must not stop it
        log.info(
            "connected to the coordinator (epoch %d) over %s; protocol version %d%s; resync sent"
            " (%d flows)", self.leader_epoch[1], link.cipher[1] if link.cipher else "plain TCP",
            link.version, ", frames sealed" if link.sealed else "", len(self.registry.flows),
        )  # fmt: skip
        receiver = asyncio.create_task(self._receive(link))
        sender = asyncio.create_task(self._send(link))
        try:
            done, _ = await asyncio.wait({receiver, sender}, return_when=asyncio.FIRST_EXCEPTION)
            for task in (receiver, sender):  # the receiver's first: the coordinator's words
                if task in done:  # (its error frame) before the sender's "link closed"
                    task.result()
        finally:
            receiver.cancel()
            sender.cancel()
            await asyncio.gather(receiver, sender, return_exceptions=True)

    async def _send_resync(self, link: AgentLink) -> None:
        """Send the flow set and the jobs' progress. Each frame must leave within the silence
        limit: a coordinator that stops reading would otherwise hold the uplink in drain()
        for as long as the connection lives. On TimeoutError the next attempt starts with the
        next coordinator address."""
        assert self.registry is not None
        limit = max(SILENCE_HEARTBEATS * self._heartbeat_interval, 0.3)
        loop = asyncio.get_running_loop()
        self._reporting = True
        if self.fallback is not None:  # the levels the resync reports
            self._resynced = self.registry.levels()
        opens = self.registry.resync_opens()
        frames = itertools.chain(resync_frames(opens), self._latest_jobs(link.version))
        try:
            async with asyncio.timeout(limit) as deadline:
                for message in frames:
                    await link.send(message)
                    deadline.reschedule(loop.time() + limit)
        except TimeoutError:
            self._leader_index += 1
            raise TimeoutError(
                f"the coordinator took no resync frame for {limit:g} s (not reading)"
            ) from None

    async def _receive(self, link: AgentLink) -> None:
        silence = SILENCE_HEARTBEATS * self._heartbeat_interval
        while True:
            message = await link.recv(timeout=max(silence, 0.3))
            self._last_rx = time.monotonic()
            if self.fallback is not None:
                self._leave_fallback()
            if isinstance(message, Levels) and message.epoch < self.leader_epoch[1]:
                self.stats["deposed_refused"] += 1
                raise LinkClosed(f"levels from a deposed leader (epoch {message.epoch})")
            if isinstance(message, Levels) and self.fallback is None:
                self.telemetry.level_updates += len(message.updates)
                decided = {u.id: (u.decided_at, u.decided_ns) for u in message.updates}
                self.apply_levels(((u.id, u.level) for u in message.updates), decided)

    async def _send(self, link: AgentLink) -> None:
        assert self.registry is not None
        next_beat = next_progress = 0.0
        while True:
            now = time.monotonic()
            with_progress = now >= next_progress
            if with_progress:
                next_progress = now + self.config.progress_interval
            batch = self.registry.take_batch(progress=with_progress)
            sent_any = False
            for part in split_batch(batch) if batch is not None else ():
                await link.send(part)
                self.stats["batches_sent"] += 1
                sent_any = True
            for update in self._take_job_updates(link.version):
                await link.send(update)
                sent_any = True
            if self._pending_nic is not None:
                nic, self._pending_nic = self._pending_nic, None
                await link.send(nic)
                sent_any = True
            if sent_any:
                # any frame tells the coordinator this agent is alive (its idle timer counts
                # every frame): a heartbeat is due only after an interval with nothing else
                next_beat = time.monotonic() + self._heartbeat_interval
            elif time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self._heartbeat_interval
                await link.send(Heartbeat(time.time()))
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow the task's own
            # cancellation when the wake event fires at that moment, and stop() then hangs
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.report_interval):
                    await self._wake.wait()
            self._wake.clear()

    def _adopt_policy(self, text: str) -> None:
        if self.view.text == text:
            return
        try:
            cfg = policyfile.loads(text, source="<coordinator welcome>")
        except Exception as exc:
            log.error("the coordinator's policy is invalid here, keeping ours: %s", exc)
            return
        self.view = PolicyView(cfg, text)
        self._first_policy = None  # the next first level comes from the new policy
        self._first_admitted.clear()
        if self.table is not None:
            self.table.write_config(self.view.table_config())
        if self.fallback is not None:
            # it runs on until the coordinator's first message, or again if none comes: as
            # the new policy, whose levels (their count too) the old one's may not be
            self.fallback = cfg.make_policy()
            self._admitted.clear()
            self._admit_new(keep_levels=False)
        log.info("policy from the coordinator: %s", cfg.summary())
        self._qos_due.set()

    def _apply_qos(self, cfg: policyfile.PolicyConfig) -> list[str]:
        """Converge ``--qos-dev``'s egress classes to the policy's hardware queues."""
        dev = self.config.qos_dev
        assert dev is not None
        want = qos.plan_for_policy(dev, cfg, self.config.qos_rate)
        if advice := qos.rate_advice(want):
            log.warning("%s", advice)
        return qos.apply(want)

    async def _qos_loop(self) -> None:
        """Keep ``--qos-dev``'s tree on the policy: at each policy change and every check.

        Another agent or an operator may change the device; a check that finds it changed
        restores the classes, logs it and counts it (``flowsched_agent_qos_repairs_total``).
        """
        dev = self.config.qos_dev
        while True:
            policy_changed = False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.qos_check_interval):
                    await self._qos_due.wait()
                    policy_changed = True
            self._qos_due.clear()
            try:  # a few tc calls (~10 ms), off the loop
                changed = await asyncio.to_thread(self._apply_qos, self.view.cfg)
            except (qos.QosError, qos.QosInputError) as exc:
                self._repeat_log.log(
                    "qos", logging.ERROR, "host QoS on %s not in place: %s", dev, exc
                )
                continue
            except Exception as exc:  # a bug here must never end the repairs for good
                self._repeat_log.log(
                    "qos:bug", logging.ERROR, "host QoS on %s: the check failed", dev,
                    exc_info=exc,
                )  # fmt: skip
                continue
            if policy_changed:
                log.info("host QoS on %s for the new policy: %d changes", dev, len(changed))
            elif changed:
                self.stats["qos_repairs"] += 1
                log.warning("host QoS on %s had been changed (by another agent or an operator?): "
                            "%d tc changes restored it", dev, len(changed))  # fmt: skip

    def job_progress(
        self,
        job: str,
        step: int,
        layer: int | None,
        *,
        owner: int | None = None,
        done: bool = False,
    ) -> None:
        """Record job progress (SDK); forwarded to the coordinator, fed to the local policy.

        ``owner`` (the SDK client's uid) scopes the name: ``"<uid>/<job>"`` (see
        :class:`~flowsched.agent.flows.JobTable`, which also bounds and expires the names).
        With ``done`` the job ended: it is forgotten here and, on a connection of protocol
        version 4 or later, at the coordinator (an older one forgets it after its TTL).
        """
        assert self.registry is not None
        if done:
            update = self.jobs.end(owner, job, step, layer)
            self._forget_jobs([update.job])
        else:
            update, dropped = self.jobs.record(owner, job, step, layer)
            self._forget_jobs(dropped)
            self.registry.job_progress(update.job, step, layer)
        if self.config.coordinator is not None:  # else nobody takes them
            self._queue_job_update(update)
        if self.fallback is not None:
            self._reevaluate_soon()

    def _reevaluate_soon(self) -> None:
        """Run the local policy over the node's flows once the reports of this loop turn are
        handled: one pass for all of them, not one per report (a user's share of a turn, 64
        reports, cost 64 passes over every user's flows)."""
        if not self._reevaluation_due:
            self._reevaluation_due = True
            asyncio.get_running_loop().call_soon(self._reevaluate_due)

    def _reevaluate_due(self) -> None:
        self._reevaluation_due = False
        if self.fallback is None:  # the coordinator came back meanwhile: its levels stand
            return
        try:
            self._reevaluate()
        except Exception:  # as in _fallback_watch: the next step tries again
            log.exception("local policy step failed")

    def _queue_job_update(self, update: JobProgress) -> None:
        """Queue ``update`` for the coordinator. Progress is queued for the jobs the job table
        keeps (MAX_JOBS at most); an end is kept until a session takes it, while the agent is
        cut off too, so MAX_JOBS ends at least and never many more, the oldest dropped (the
        coordinator forgets such a job at its TTL)."""
        updates = self._job_updates
        updates.pop(update.job, None)
        updates[update.job] = update
        if update.done and len(updates) > 2 * MAX_JOBS:  # progress entries are MAX_JOBS at most
            del updates[next(name for name, u in updates.items() if u.done)]

    def _forget_jobs(self, names: Iterable[str]) -> None:
        assert self.registry is not None
        for name in names:
            self._job_updates.pop(name, None)
            self.registry.job_index.pop(name, None)
            self.registry.job_index.pop(f"{name}/layer", None)

    def _take_job_updates(self, version: int) -> list[JobProgress]:
        """The job updates since the last call; a job's end only for a coordinator that
        understands it (:data:`~flowsched.protocol.JOB_END_VERSION`)."""
        updates = [
            u for u in self._job_updates.values() if not u.done or version >= JOB_END_VERSION
        ]
        self._job_updates.clear()
        return updates

    def _latest_jobs(self, version: int) -> list[JobProgress]:
        """Every job's latest progress (a resync), then the ends not sent yet: a coordinator
        that saw a job before this connection forgets it now rather than at its TTL."""
        ended = [u for u in self._job_updates.values() if u.done and version >= JOB_END_VERSION]
        self._job_updates.clear()
        return self.jobs.latest() + ended

    async def _nic_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.nic_interval)
            try:
                self._sample_nic()
            except Exception:
                log.exception("NIC sample failed")

    def _sample_nic(self) -> None:
        samples = self.nic.sample()
        if samples:
            entries = tuple(NicLoadEntry(s.link, s.bandwidth, s.load) for s in samples)
            self._pending_nic = NicLoad(entries)

    def table_flag_connected(self, on: bool | None) -> None:
        """Set FLAG_COORDINATOR_CONNECTED (None: leave it)."""
        if on is not None and self.table is not None:
            self.table.set_flag(layout.FLAG_COORDINATOR_CONNECTED, on)

    # ------------------------------------------------------------------ local fallback
    async def _fallback_watch(self) -> None:
        while True:
            try:
                pause = self._fallback_step()
            except Exception:  # one failing policy run must not end the fallback for good
                log.exception("local policy step failed")
                pause = max(self.view.cfg.timer_period, MIN_LOCAL_PERIOD)
            await asyncio.sleep(pause)

    def _fallback_step(self) -> float:
        """Start the local policy when the coordinator is silent, or run it once; returns the
        seconds until the next step."""
        local_period: float = max(self.view.cfg.timer_period, MIN_LOCAL_PERIOD)
        if self.fallback is not None:
            self._reevaluate()
            return local_period
        if self.connected:
            return 0.02
        if self.config.coordinator is None:  # no coordinator to wait for: local from the start
            self._enter_fallback(None)
            return local_period
        wait = self._last_rx + self.config.fallback_after - time.monotonic()
        if wait > 0:
            return min(wait, 0.05)
        self._enter_fallback(time.monotonic() - self._last_rx)
        return local_period

    def _context(self) -> Context:
        assert self.registry is not None
        samples = list(self.nic.samples.values())
        return Context(
            now=time.time(),
            job_index=dict(self.registry.job_index),
            link_bandwidth={s.link: s.bandwidth for s in samples},
            link_load={s.link: s.load for s in samples},
            default_bandwidth=self.config.default_bandwidth,
        )

    def _enter_fallback(self, silent_for: float | None) -> None:
        """Run the policy locally: the coordinator was silent for ``silent_for`` seconds, or
        (None) the agent has no coordinator configured."""
        assert self.registry is not None
        if self._reporting and self._resynced is None:
            # started while a session's resync was being sent (connected only once it is
            # all out): the levels it reported are the flows' levels now, and those the
            # local policy moves before the coordinator's first message are reported again
            self._resynced = self.registry.levels()
        self.fallback = self.view.cfg.make_policy()
        self._admitted.clear()
        self._admit_new()
        self._reevaluate()
        self.table_flag_connected(False)
        if silent_for is None:
            log.info("no coordinator configured: running %s locally", self.view.cfg.policy)
            return
        self.stats["fallback_switches"] += 1
        self.stats["last_switch_delay"] = silent_for
        self.stats["last_switch_wall"] = time.time()
        log.warning(
            "coordinator silent for %.3f s: running %s locally on %d flows",
            silent_for,
            self.view.cfg.policy,
            len(self.registry.flows),
        )

    def _leave_fallback(self) -> None:
        if self.fallback is not None:
            log.info("coordinator back: local policy stopped")
        self.fallback = None
        self._admitted.clear()
        self.table_flag_connected(True)
        resynced, self._resynced = self._resynced, None
        if resynced and self.registry is not None:
            # moved by the local policy after the resync: the coordinator, which sends only
            # the levels it changes, would leave them there
            flows = self.registry.flows
            for flow_id, level in resynced.items():
                flow = flows.get(flow_id)
                if flow is not None and flow.level != level:
                    self.registry.report_level(flow_id)
            self._wake.set()

    def _after_registry_change(self) -> None:
        assert self.registry is not None
        if not self._reporting:
            self.registry.drop_reports()
        closed = self.registry.drain_closed()
        now = time.time()
        for flow in closed:
            self.telemetry.completed(flow, now)
        ctx: Context | None = None
        first = self._first_policy
        if first is not None and closed:
            ctx = self._context()
            if _release_closed(first, self._first_admitted, closed, ctx):
                first.reevaluate([], ctx)  # only admit and release reach it: forget idle state
        if self.fallback is not None:
            _release_closed(self.fallback, self._admitted, closed, ctx or self._context())
            self._admit_new()

    def _admit_new(self, *, keep_levels: bool = True) -> None:
        """Admit the flows the local policy has not seen; a flow's level is its admission's
        unless it has one (the coordinator's) and ``keep_levels``."""
        assert self.registry is not None and self.fallback is not None
        new = [f for f in self.registry.flows.values() if f.flow_id not in self._admitted]
        if not new:
            return
        started = time.perf_counter()
        ctx = self._context()
        decisions: list[tuple[int, int]] = []
        for flow in new:
            self._admitted.add(flow.flow_id)
            decision = self.fallback.admit(flow, ctx)
            if flow.level < 0 or not keep_levels:  # else keep the coordinator's level
                decisions.append((flow.flow_id, decision.level))
        self.telemetry.decision_latency.observe(time.perf_counter() - started)
        self.apply_levels(decisions)

    def _reevaluate(self) -> None:
        assert self.registry is not None and self.fallback is not None
        self._admit_new()
        started = time.perf_counter()
        flows: list[Flow] = [f for f in self.registry.flows.values() if f.flow_id in self._admitted]
        changes: dict[int, Decision] = dict(self.fallback.reevaluate(flows, self._context()))
        self.telemetry.decision_latency.observe(time.perf_counter() - started)
        self.apply_levels((fid, d.level) for fid, d in changes.items())

    def decide_first_level(self, flow: Flow) -> None:
        """Give a just-opened SDK flow the level the local copy of the policy admits it at, so
        that it starts sending now; the coordinator's decision follows as a level push. A
        policy error leaves the flow without a level (it is answered with its class default)."""
        policy = self._first_policy
        if policy is None:
            policy = self._first_policy = self.view.cfg.make_policy()
        try:
            decision = policy.admit(flow, self._context())
        except Exception as exc:  # one flow the local copy cannot judge must not fail the open
            self._repeat_log.log(
                "first_level", logging.ERROR,
                "local policy could not admit flow %d: %s (answered with its class default)",
                flow.flow_id, exc, exc_info=exc,
            )  # fmt: skip
            return
        self._first_admitted.add(flow.flow_id)
        if 0 <= decision.level < self.view.num_levels:
            self.apply_levels([(flow.flow_id, decision.level)])

    def admit_now(self) -> None:
        """An SDK flow opened or closed: give just-opened flows their first level when the local
        policy is running, and report the change to the coordinator without waiting."""
        self._after_registry_change()
        self._wake.set()


def _release_closed(policy: Policy, admitted: set[int], closed: list[Flow], ctx: Context) -> bool:
    """Release from ``policy`` the ``closed`` flows it admitted (ids in ``admitted``, which
    loses them); whether there was any."""
    released = False
    for flow in closed:
        if flow.flow_id in admitted:
            admitted.discard(flow.flow_id)
            policy.release(flow, ctx)
            released = True
    return released


def _initial_view(text: str | None) -> PolicyView:
    if text is None:
        return PolicyView(policyfile.embedded_default(), None)
    return PolicyView(policyfile.loads(text, source="--policy"), text)


async def serve(
    config: AgentConfig, *, shutdown_trigger: Callable[[], Awaitable[object]] | None = None
) -> None:
    """Run a node agent until ``shutdown_trigger()`` returns (or SIGINT/SIGTERM).

    Signal handlers are installed only when no trigger is given; ``config.on_ready`` is called
    with a :class:`ReadyInfo` once the table, the SDK socket and the metrics endpoint are up.
    """
    agent = Agent(config)
    try:
        info = await agent.start()
        if config.on_ready is not None:
            config.on_ready(info)
        await (shutdown_trigger or wait_for_signal)()
    finally:
        await agent.stop()


def _redirect(refusal: HandshakeError) -> tuple[str, int] | None:
    """The leader's address from a standby's ``not_leader`` refusal (``leader=HOST:PORT
    epoch=N``), None when it names none."""
    for word in refusal.reason.split():
        if word.startswith("leader="):
            host, sep, port = word[len("leader=") :].rpartition(":")
            if sep and host and port.isdigit() and 0 < int(port) <= 65535:
                return host.strip("[]"), int(port)
    return None
