"""The agent's unix-socket server for the application SDK (:mod:`flowsched.client`).

The socket is created mode 0600 (0660 with a configured group) inside a directory of the
agent's own (:func:`flowsched.rundir.prepare_private_dir`: created 0700, or 0750 with the
group; one owned by another user or writable by others is refused). The process id of a
client comes from ``SO_PEERCRED``; the server reads a client's first bytes itself, with the pid
namespace descriptor they may carry (:mod:`flowsched.protocol.sdk`), before a stream takes
the connection over. A malformed frame gets an ``error`` frame and closes that
client only; its flows are closed (as are those of a client that disconnects).

Limits (docs/security.md): open flows per uid (all of its connections together) and per node;
connections per uid and in total (the total below the open-file limit, so that accepts do not
fail); a connection with no open flow that sends nothing for :data:`IDLE_TIMEOUT` is closed
(one holding flows never is: applications keep a flow open for minutes). A refused connection
or flow gets an ``error`` frame that the client logs. A client that does not read what it
asked for is dropped once :data:`MAX_CLIENT_BACKLOG` bytes wait for it: its connection is
aborted, queue and all; any other close gives the client :data:`LINGER_TIMEOUT` to take what
is queued (a closed connection counts toward no cap, so it must not outlive that). Each uid
has its share of every loop turn (:mod:`flowsched.agent.turns`): a user sending thousands of
messages at once, over as many connections as it may hold, does not hold up another user's
clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import grp
import logging
import os
import socket
import stat
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from flowsched import rundir
from flowsched.agent.closer import DescriptorCloser
from flowsched.agent.flows import JobTable, SlotKey
from flowsched.agent.sdk_conn import SCM_MAX_FD, ClientConnection
from flowsched.agent.turns import UidTurns
from flowsched.lograte import RepeatLog
from flowsched.model import Flow, FlowClass
from flowsched.protocol import sdk
from flowsched.shm.pidns import namespace_inode

if TYPE_CHECKING:
    from flowsched.agent.service import Agent

log = logging.getLogger("flowsched.agent.sdk")

MAX_CLIENT_BACKLOG = 1 << 20  # bytes queued to one client before it is dropped
READ_SIZE = 65536
#: connections the kernel queues for the accept loop (it caps this at net.core.somaxconn,
#: 4096 by default since Linux 5.4): as many as the agent serves at once, far above one uid's
#: cap. A client that finds the backlog full fails at once (EAGAIN) and runs on static
#: defaults; at 128, one user's connections made at once (all it may hold) could fill it
LISTEN_BACKLOG = 4096
#: seconds the accept loop pauses after a failed accept (out of descriptors or memory, say)
ACCEPT_RETRY_DELAY = 1.0
#: open SDK flows of one uid, all of its connections together (a user cannot grow the agent's
#: memory, nor the coordinator's, without bound by opening more connections)
MAX_FLOWS_PER_UID = 4096
#: open SDK flows on the node, every user together
MAX_FLOWS = 16384
#: SDK connections of one uid (a process keeps one per socket path)
MAX_CONNECTIONS_PER_UID = 256
#: SDK connections in total; lowered to the open-file limit minus :data:`FD_RESERVE`
MAX_CONNECTIONS = 4096
#: descriptors left to the agent itself (table, coordinator link, metrics, NIC counters)
FD_RESERVE = 128
#: descriptors waiting for the closer (flowsched.agent.closer) at which the agent stops
#: accepting connections until it catches up: a close can be held up for as long as the
#: client that passed the descriptor likes. It bounds the closer's threads too (one per uid
#: with descriptors waiting: see there)
MAX_UNCLOSED = 512
#: descriptors of one uid waiting for the closer at which its new connections are refused and
#: its connections are no longer read (a read may bring SCM_MAX_FD more)
MAX_UNCLOSED_PER_UID = 256
#: seconds a connection without open flows may stay silent before it is closed
IDLE_TIMEOUT = 300.0
#: seconds :meth:`SdkServer.close` waits for the aborted connections' handlers to end
CLOSE_TIMEOUT = 1.0
#: seconds a closed connection may take to hand the client what is queued for it (the
#: ``error`` frame saying why) before it is aborted
LINGER_TIMEOUT = 1.0
#: characters of a bad frame's description that are logged (it may quote the client's text)
LOGGED_TEXT = 200
#: ``list`` pages per second a user who sees only its own flows may ask for, all of its
#: connections together, and the burst it may spend at once (a page of 4,096 flows, the most
#: a user may hold, takes about 60): each page costs the agent's loop up to ~3 ms
LIST_PAGES_PER_SECOND = 50.0
LIST_BURST = 100.0
#: per-uid list budgets kept before those that are full again (worth no more than a fresh
#: one) are dropped: a budget outlives the user's connections (reconnecting must not refill
#: it), so without this every uid that ever listed would keep one
LIST_BUDGETS_KEPT = 1024


class SocketPathError(RuntimeError):
    """The SDK socket path cannot be used (another agent, not a socket, ...)."""


class SdkServer:
    """Serves SDK clients for one :class:`~flowsched.agent.service.Agent`."""

    def __init__(self, agent: Agent, fd_limit: int | None = None) -> None:
        self.agent = agent
        self._owner: dict[int, ClientConnection] = {}
        self._writers: set[ClientConnection] = set()
        #: closes client sockets and the descriptors clients pass, off the loop's thread
        self.closer = DescriptorCloser()
        self.clients_total = 0
        self.errors_total = 0
        self.refused_total = 0
        self.max_connections = MAX_CONNECTIONS
        if fd_limit is not None:
            spare = fd_limit - FD_RESERVE - MAX_UNCLOSED - SCM_MAX_FD
            self.max_connections = max(min(MAX_CONNECTIONS, spare), 1)
        self.max_connections_per_uid = MAX_CONNECTIONS_PER_UID
        self.max_flows_per_uid = MAX_FLOWS_PER_UID
        self.max_flows = MAX_FLOWS
        self.idle_timeout = IDLE_TIMEOUT
        self._connections_of: Counter[int | None] = Counter()
        self._flows_of: Counter[int | None] = Counter()
        self._flows = 0
        self._repeat_log = RepeatLog(log)
        #: each uid's share of the loop's turns: one user's flood does not hold up another's
        self.turns = UidTurns()
        self.requests: Counter[str] = Counter()
        self._first_level: dict[int, asyncio.Future[int]] = {}
        #: each open SDK flow's opener (pid, uid) and its open request, for ``list``
        self._opened: dict[int, tuple[int, int | None, sdk.Open]] = {}
        #: the ids in ``_opened`` per uid (opening order): a user's ``list`` walks its own
        #: flows only, not every user's on the node
        self._opened_of: dict[int | None, dict[int, None]] = {}
        #: per uid: the ``list`` pages it may still ask for now, and when that was counted
        self._list_budget: dict[int | None, tuple[float, float]] = {}
        #: opens waiting for the coordinator's first level before they are answered
        self._answering: set[asyncio.Future[None]] = set()
        #: the handler task of each client connection (close() waits for them to end)
        self._connections: set[asyncio.Task[None]] = set()
        #: each admitted client connection's pid and when that process started (0: unknown)
        self._client_of: dict[ClientConnection, tuple[int, int]] = {}
        #: connections whose first bytes have not come yet
        self._greeting: set[ClientConnection] = set()
        self._accepting: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def clients(self) -> int:
        """Connected SDK clients."""
        return len(self._writers)

    async def start(self, path: str, group: str | None) -> SdkListener:
        """Bind the socket (private permissions) and start serving.

        Raises:
            SocketPathError: the path is taken or its directory is unsafe (see the module
                docstring).
        """
        gid = grp.getgrnam(group).gr_gid if group is not None else None
        _prepare_path(path, gid)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            listener.bind(path)
            listener.listen(LISTEN_BACKLOG)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        finally:
            os.umask(old)
        if gid is not None:
            os.chown(path, -1, gid)
            os.chmod(path, 0o660)
        self._accepting = asyncio.create_task(self._accept(listener))
        return SdkListener(self._accepting)

    async def close(self) -> None:
        """Disconnect every client and return once their connections have ended.

        Their flows are left as they are, in the registry and in the table's slots: the clients
        re-open them with the next agent. The connections are aborted (a client that does not
        read cannot hold the shutdown up with unsent bytes), so each handler sees end-of-file and
        returns; one that has not after :data:`CLOSE_TIMEOUT` is cancelled.
        """
        self._closing = True
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
        for task in list(self._answering):
            task.cancel()
        for conn in list(self._greeting):
            conn.abort()  # its first read ends at once
        for writer in list(self._writers):
            writer.abort()
        if self._connections:
            _, late = await asyncio.wait(set(self._connections), timeout=CLOSE_TIMEOUT)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late)
        await asyncio.to_thread(self.closer.stop, CLOSE_TIMEOUT)

    def push_level(
        self,
        flow_id: int,
        level: int,
        decided_at: float | None = None,
        decided_ns: int | None = None,
    ) -> None:
        """Tell the owner of SDK flow ``flow_id`` its new level and marking (and when the
        coordinator decided it, when known)."""
        first = self._first_level.get(flow_id)
        if first is not None and not first.done():
            first.set_result(level)
        writer = self._owner.get(flow_id)
        if writer is None:
            return
        mark = self.agent.view.marking(level)
        message = sdk.Level(flow_id, level, mark.dscp, mark.so_priority, decided_at, decided_ns)
        self._write(writer, message)

    def _write(self, writer: ClientConnection, message: sdk.SdkMessage) -> None:
        if writer.is_closing():
            return
        if writer.get_write_buffer_size() > MAX_CLIENT_BACKLOG:
            self._repeat_log.log(
                "not_reading", logging.WARNING,
                "SDK client is not reading (over %d bytes queued); dropping it",
                MAX_CLIENT_BACKLOG,
            )  # fmt: skip
            # aborted, not closed: a close waits for the client to read what is queued, and
            # one that never does would keep its socket and the queue for as long as it likes
            writer.abort()
            return
        writer.write(sdk.encode(message))

    async def _accept(self, listener: socket.socket) -> None:
        """Accept clients until cancelled, each served by a task of its own."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                if self.closer.waiting >= MAX_UNCLOSED:  # the clients wait in the backlog
                    self._repeat_log.log(
                        "closer", logging.WARNING,
                        "%d descriptors SDK clients passed wait to be closed; not accepting "
                        "connections until fewer do", self.closer.waiting,
                    )  # fmt: skip
                    await asyncio.sleep(ACCEPT_RETRY_DELAY)
                    continue
                try:
                    sock, _ = await loop.sock_accept(listener)
                except OSError as exc:
                    self._repeat_log.log(
                        "accept", logging.WARNING, "cannot accept an SDK connection: %s", exc
                    )
                    if exc.errno != errno.ECONNABORTED:  # out of descriptors or memory, say
                        await asyncio.sleep(ACCEPT_RETRY_DELAY)  # the clients wait in the backlog
                    continue
                task = asyncio.create_task(self._serve(sock))
                self._connections.add(task)
                task.add_done_callback(self._connections.discard)
        finally:
            # closing the listener releases the connections in its backlog, and with them
            # what their clients passed already
            self.closer.close_later([listener.detach()], None)

    async def _serve(self, sock: socket.socket) -> None:
        pid, uid = _peer_cred(sock)
        # read at once: the connection may outlive its process (handed to a child, or passed
        # on), and a later process may be given the same pid
        started = self.agent.process_start(pid) if pid > 0 else 0
        conn = ClientConnection(sock, self.closer, uid, lambda: self._may_read(uid))
        refusal = self._refusal(uid)
        if refusal is not None:
            self._refuse(conn, pid, uid, refusal)
            return
        self._connections_of[uid] += 1
        try:
            await self._serve_admitted(conn, pid, uid, started)
        finally:
            self._connections_of[uid] -= 1
            if self._connections_of[uid] <= 0:
                del self._connections_of[uid]

    async def _serve_admitted(
        self, conn: ClientConnection, pid: int, uid: int | None, started: int
    ) -> None:
        self._greeting.add(conn)
        try:
            first, shown_ns = await self._first_read(conn, uid)
        except (TimeoutError, OSError, asyncio.CancelledError) as exc:
            conn.abort()
            if isinstance(exc, asyncio.CancelledError) and not self._closing:
                raise
            return
        finally:
            self._greeting.discard(conn)
        if not first or self._closing:
            conn.abort()
            return
        _refuse_passed_descriptors(conn.sock)
        writer = conn
        # the registry names processes as the flow table's slots do (a job in a pid namespace
        # of its own writes its pids there: flowsched.shm.pidns); pid stays for the logs
        key = self.agent.process_key(pid, shown_ns)
        owned: set[int] = set()
        self._writers.add(writer)
        self._client_of[writer] = (pid, started)
        self.clients_total += 1
        decoder = sdk.SdkDecoder("agent")
        try:
            data = first
            while data:
                decoder.feed(data)
                await self._handle_fed(decoder, (key, uid), writer, owned, pid)
                if writer.is_closing():  # dropped (not reading): the rest is not served
                    break
                data = await self._read(conn, uid, idle=not owned)
        except sdk.SdkProtocolError as exc:
            self.errors_total += 1
            # once per user, then at a falling rate: a client reconnecting to send bad frames
            # (up to 64 KiB of its own text each) must not fill the disk with the log
            self._repeat_log.log(
                f"bad_frame:{uid}", logging.WARNING,
                "SDK client pid %d (uid %s) sent a bad frame: %s", pid, uid, _cut(str(exc)),
            )  # fmt: skip
            with contextlib.suppress(Exception):
                writer.write(sdk.encode(sdk.Error("bad_frame", str(exc)[:4000])))
        except TimeoutError:
            log.debug("SDK client pid %d: idle for %g s without open flows; closed", pid,
                      self.idle_timeout)  # fmt: skip
        except (ConnectionError, OSError):
            pass
        except asyncio.CancelledError:
            if not self._closing:
                raise
            # close() gave up waiting: end quietly (Python 3.11's stream server logs a
            # traceback for a connection task that ends cancelled)
        finally:
            self._client_of.pop(writer, None)
            if self._closing:
                self._writers.discard(writer)
            else:
                self._disconnect(key, uid, writer, owned)

    async def _handle_fed(
        self,
        decoder: sdk.SdkDecoder,
        cred: tuple[int, int | None],
        writer: ClientConnection,
        owned: set[int],
        pid: int,
    ) -> None:
        """Handle the messages ``decoder`` holds, in the uid's shares of the loop's turns
        (:mod:`flowsched.agent.turns`): a user whose connections sent thousands at once no
        longer holds the loop while another user's client waits. Stops at a client dropped
        for not reading (the rest of what it sent is not served)."""
        uid = cred[1]
        message = decoder.next_message()
        while message is not None:
            share = await self.turns.share(uid)
            try:
                while share and message is not None and not writer.is_closing():
                    self._handle(message, cred, writer, owned, pid)
                    share -= 1
                    message = None if writer.is_closing() else decoder.next_message()
            finally:
                self.turns.give_back(uid, share)
            if writer.is_closing():
                return

    async def _first_read(self, conn: ClientConnection, uid: int | None) -> tuple[bytes, int]:
        """The client's first bytes (b"": it left) and the pid namespace it showed with them,
        a descriptor of its ``/proc/self/ns/pid`` (0: none). Waits :attr:`idle_timeout` at
        most (TimeoutError)."""
        async with asyncio.timeout(self.idle_timeout):
            data, fds = await conn.read(READ_SIZE)
        try:
            return data, _shown_namespace(fds)
        finally:
            self.closer.close_later(fds, uid)

    async def _read(self, conn: ClientConnection, uid: int | None, *, idle: bool) -> bytes:
        """The next bytes; a connection without open flows (``idle``) waits at most
        :attr:`idle_timeout` (TimeoutError), one with flows as long as it likes. Descriptors
        may come with the first frame only: any passed later end the connection
        (SdkProtocolError)."""
        async with asyncio.timeout(self.idle_timeout if idle else None):
            data, fds = await conn.read(READ_SIZE)
        if fds:
            self.closer.close_later(fds, uid)
            raise sdk.SdkProtocolError("descriptors may be passed with the first frame only")
        return data

    def close_exited(self, start_of: Callable[[int], int]) -> int:
        """Close the connections whose process has exited (``start_of``: when a pid's process
        started, 0 when gone or unknown), with their flows; return how many. A connection can
        outlive its process (handed to a child, or passed on): its flows would otherwise stay
        open in the name of a pid that a later process may be given."""
        exited = [
            conn
            for conn, (pid, started) in self._client_of.items()
            if started and start_of(pid) != started
        ]
        for conn in exited:
            pid = self._client_of.pop(conn)[0]
            log.debug("SDK client pid %d has exited; its connection and flows are closed", pid)
            conn.abort()  # its handler reads the end and closes its flows
        return len(exited)

    def _may_read(self, uid: int | None) -> bool:
        """Whether a connection of ``uid`` may be read (a read may bring SCM_MAX_FD more
        descriptors): not while too many of the user's wait for the closer already."""
        waiting = self.closer.waiting_of(uid)
        if waiting < MAX_UNCLOSED_PER_UID:
            return True
        self._repeat_log.log(
            f"unclosed:{uid}", logging.WARNING,
            "%d descriptors of uid %s wait to be closed; closing its connections", waiting, uid,
        )  # fmt: skip
        return False

    def _refusal(self, uid: int | None) -> tuple[str, str] | None:
        """(the cap, why) when a new connection of ``uid`` is refused, else None. Connections
        still waiting for their first bytes count."""
        if len(self._connections) > self.max_connections:  # this one is among them
            return "all", f"the agent serves at most {self.max_connections} SDK connections"
        if self._connections_of[uid] >= self.max_connections_per_uid:
            return f"uid:{uid}", f"at most {self.max_connections_per_uid} SDK connections per user"
        if self.closer.waiting_of(uid) >= MAX_UNCLOSED_PER_UID:
            return f"unclosed:{uid}", "too many of this user's descriptors wait to be closed"
        return None

    def _refuse(
        self, conn: ClientConnection, pid: int, uid: int | None, cap: tuple[str, str]
    ) -> None:
        """Tell the client why, close, and log it at a falling rate."""
        key, reason = cap
        self.refused_total += 1
        self._repeat_log.log(
            f"refused:{key}", logging.WARNING,
            "SDK connection of pid %d (uid %s) refused: %s", pid, uid, reason,
        )  # fmt: skip
        # a fresh socket's buffer takes one small frame: sent now, or not at all
        conn.write(sdk.encode(sdk.Error("too_many_connections", reason)))
        conn.abort()

    def _disconnect(
        self, key: int, uid: int | None, writer: ClientConnection, owned: set[int]
    ) -> None:
        self._writers.discard(writer)
        registry = self.agent.registry
        now = time.time()
        for flow_id in owned:
            self._owner.pop(flow_id, None)
            self._forget_opened(flow_id, uid)
            self._count_flow(uid, -1)
            if registry is not None:
                for slot in registry.close_sdk(flow_id, key, None, now):
                    self.agent.write_slot(slot)
        self.agent.admit_now()
        _close_soon(writer)

    def _count_flow(self, uid: int | None, delta: int) -> None:
        self._flows += delta
        self._flows_of[uid] += delta
        if self._flows_of[uid] <= 0:
            del self._flows_of[uid]

    def _handle(
        self,
        message: sdk.SdkMessage,
        cred: tuple[int, int | None],
        writer: ClientConnection,
        owned: set[int],
        pid: int,
    ) -> None:
        key, uid = cred  # the client's process key (PidNamespaces.process_key), its uid
        registry = self.agent.registry
        assert registry is not None
        self.requests[message.TYPE] += 1
        if isinstance(message, sdk.Open):
            self._open(message, cred, writer, owned, pid)
        elif isinstance(message, sdk.Progress) and message.id in owned:
            registry.sdk_progress(message.id, key, message.sent)
        elif isinstance(message, sdk.Close) and message.id in owned:
            owned.discard(message.id)
            self._owner.pop(message.id, None)
            self._forget_opened(message.id, uid)
            self._count_flow(uid, -1)
            for slot in registry.close_sdk(message.id, key, message.sent, time.time()):
                self.agent.write_slot(slot)
            self.agent.admit_now()
        elif isinstance(message, sdk.JobProgress):
            # scoped to the client's uid: no other user can set this job's step
            self.agent.job_progress(
                message.job, message.step, message.layer, owner=uid, done=bool(message.done)
            )
        elif isinstance(message, sdk.ListFlows) and not writer.is_closing():
            # (a client that sends many and reads none is dropped at MAX_CLIENT_BACKLOG: the
            # rest of what it sent costs nothing)
            if self._may_list(uid):
                self._write(writer, self.flow_page(uid, message.after))
            else:
                reason = f"at most {LIST_PAGES_PER_SECOND:g} flow listing pages a second per user"
                self._write(writer, sdk.Error("too_many_requests", reason))

    def _may_list(self, uid: int | None) -> bool:
        """Whether ``uid`` may have one more ``list`` page now (a token bucket per uid; root
        and the agent's own user, who may stop the agent anyway, are not limited)."""
        if _sees_everyone(uid):
            return True
        now = time.monotonic()
        if len(self._list_budget) >= LIST_BUDGETS_KEPT and uid not in self._list_budget:
            self._forget_full_budgets(now)
        tokens, since = self._list_budget.get(uid, (LIST_BURST, now))
        tokens = min(LIST_BURST, tokens + (now - since) * LIST_PAGES_PER_SECOND)
        if tokens < 1.0:
            self._list_budget[uid] = (tokens, now)
            return False
        self._list_budget[uid] = (tokens - 1.0, now)
        return True

    def _forget_full_budgets(self, now: float) -> None:
        """Drop the list budgets that have filled up again (a fresh one is the same)."""
        full = [
            uid
            for uid, (tokens, since) in self._list_budget.items()
            if tokens + (now - since) * LIST_PAGES_PER_SECOND >= LIST_BURST
        ]
        for uid in full:
            del self._list_budget[uid]

    def _forget_opened(self, flow_id: int, uid: int | None) -> None:
        self._opened.pop(flow_id, None)
        own = self._opened_of.get(uid)
        if own is not None:
            own.pop(flow_id, None)
            if not own:
                del self._opened_of[uid]

    def flow_page(self, uid: int | None, after: int | None) -> sdk.FlowList:
        """The open SDK flows with ids above ``after`` that ``uid`` may see, oldest first, as
        many as fit one frame: root and the agent's own user see every user's flows (like
        ``ss``, the operator's view of the node), any other user its own only (their job and
        request names are nobody else's business)."""
        everyone = _sees_everyone(uid)
        budget = sdk.MAX_SDK_FRAME - 1024  # the frame's own fields and length prefix
        page: list[sdk.FlowInfo] = []
        # opening order, which is id order (ids only grow); another user's flows are never
        # looked at for a user who may not see them
        ids = self._opened if everyone else self._opened_of.get(uid, {})
        for flow_id in ids:
            if after is not None and flow_id <= after:
                continue
            info = self._flow_info(flow_id)
            if info is None:
                continue
            budget -= sdk.encoded_size(info)
            if budget < 0:
                return sdk.FlowList(tuple(page), more=True, everyone=everyone)
            page.append(info)
        return sdk.FlowList(tuple(page), more=False, everyone=everyone)

    def _flow_info(self, flow_id: int) -> sdk.FlowInfo | None:
        registry = self.agent.registry
        flow = None if registry is None else registry.flows.get(flow_id)
        record = None if registry is None else registry.sdk.get(flow_id)
        if flow is None or record is None:
            return None
        pid, uid, asked = self._opened[flow_id]
        slots = sorted(record.slots)[: sdk.MAX_LISTED_SLOTS]
        return sdk.FlowInfo(
            id=flow_id,
            cls=asked.cls,
            pid=max(pid, 0),
            opened_at=flow.opened_at,
            sent=record.sent(),
            uid=uid,
            level=flow.level if flow.level >= 0 else None,
            size=asked.size,
            deadline=flow.deadline,
            consumer_index=asked.consumer_index,
            job=asked.job,
            request=asked.request,
            peer=asked.peer,
            dst_node=asked.dst_node,
            slots=tuple(slots),
        )

    def _open(
        self,
        message: sdk.Open,
        cred: tuple[int, int | None],
        writer: ClientConnection,
        owned: set[int],
        pid: int,
    ) -> None:
        uid = cred[1]
        if self._flows_of[uid] >= self.max_flows_per_uid:
            reason = f"at most {self.max_flows_per_uid} open SDK flows per user on a node"
        elif self._flows >= self.max_flows:
            reason = f"at most {self.max_flows} open SDK flows on this node"
        else:
            reason = None
        if reason is not None:
            self._write(writer, sdk.Error("too_many_flows", reason, message.ref))
            return
        flow, linked = self._register(message, *cred, self._client_of.get(writer, (0, 0))[1])
        owned.add(flow.flow_id)
        self._opened[flow.flow_id] = (pid, uid, message)
        self._opened_of.setdefault(uid, {})[flow.flow_id] = None
        self._count_flow(uid, 1)
        self.agent.admit_now()
        for key in linked:
            self.agent.write_slot(key)
        if flow.level < 0 and self.agent.connected and self.agent.config.first_level_wait:
            # answered once the coordinator's first level comes (or the wait ends), in a task
            # of its own: the connection's other messages, other opens too, are not held up
            task = asyncio.ensure_future(self._answer_after_first_level(message, flow, writer))
            self._answering.add(task)
            task.add_done_callback(self._answering.discard)
            return
        if flow.level < 0:  # it sends at once; the coordinator's level follows, if connected
            self.agent.decide_first_level(flow)
        self._answer_open(message, flow, writer)

    async def _answer_after_first_level(
        self, message: sdk.Open, flow: Flow, writer: ClientConnection
    ) -> None:
        await self._await_first_level(flow.flow_id)
        if not writer.is_closing():  # else the client is gone, and its flows closed with it
            self._answer_open(message, flow, writer)

    def _answer_open(self, message: sdk.Open, flow: Flow, writer: ClientConnection) -> None:
        view = self.agent.view
        level = flow.level if flow.level >= 0 else view.default_level(flow.cls)
        mark = view.marking(level)
        tc = view.nccl_traffic_class(flow.cls)
        opened = sdk.Opened(message.ref, flow.flow_id, level, mark.dscp, mark.so_priority, tc)
        self._write(writer, opened)
        # level pushes start only now: one sent before ``opened`` named a flow id the client
        # did not know yet (and was dropped); ``opened`` carries every level decided so far.
        # Not for a flow closed while its answer waited (its id can be listed, or guessed):
        # nothing would take the entry out again
        if not writer.is_closing() and flow.flow_id in self._opened:
            self._owner[flow.flow_id] = writer

    def _register(
        self, message: sdk.Open, key: int, uid: int | None, started: int
    ) -> tuple[Flow, list[SlotKey]]:
        registry = self.agent.registry
        assert registry is not None
        return registry.open_sdk(
            key,
            FlowClass.parse(message.cls),
            time.time(),
            size=message.size,
            deadline=message.deadline,
            consumer_index=message.consumer_index,
            # both scoped to the client's uid: another user can neither prune this user's
            # request (the policy keys pruning by request) nor set its job's step
            job=None if message.job is None else JobTable.scoped(uid, message.job),
            request=None if message.request is None else JobTable.scoped(uid, message.request),
            peer=message.peer,
            dst_node=message.dst_node,
            start_ticks=started,
        )

    async def _await_first_level(self, flow_id: int) -> None:
        """Wait up to ``first_level_wait`` for the coordinator's first (deferred) level, so that
        the flow starts where the coordinator puts it rather than at its class's default."""
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._first_level[flow_id] = future
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow this task's
            # cancellation when the future completes at that moment
            async with asyncio.timeout(self.agent.config.first_level_wait):
                await future
        except TimeoutError:
            log.debug("no level from the coordinator yet for flow %d", flow_id)
        finally:
            self._first_level.pop(flow_id, None)


class SdkListener:
    """The SDK socket's accept loop, as the agent stops it: :meth:`close` ends accepting (the
    connections go on until :meth:`SdkServer.close`)."""

    def __init__(self, accepting: asyncio.Task[None]) -> None:
        self._accepting = accepting

    def close(self) -> None:
        """Stop accepting; the listening socket closes as the accept loop ends."""
        self._accepting.cancel()


def _sees_everyone(uid: int | None) -> bool:
    """Root and the agent's own user (who may stop the agent anyway) list every user's flows,
    unlimited."""
    return uid == 0 or uid == os.geteuid()


def _cut(text: str, limit: int = LOGGED_TEXT) -> str:
    """``text`` cut to ``limit`` characters for a log line (saying how long it was)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _close_soon(writer: ClientConnection) -> None:
    """Close a client's connection, letting it take what is queued for it for
    :data:`LINGER_TIMEOUT` seconds at most, then abort: the connection no longer counts
    toward any cap, so a client that never reads must not keep its socket and its queued
    answers."""
    writer.close(linger=LINGER_TIMEOUT)


def _peer_cred(conn: socket.socket) -> tuple[int, int | None]:
    """The client's (pid, uid) from SO_PEERCRED; (0, None) when unknown."""
    credentials = rundir.peer_credentials(conn)
    return (0, None) if credentials is None else credentials


def _shown_namespace(fds: list[int]) -> int:
    """The inode of the pid namespace a client passed a descriptor of (0: none, or not a pid
    namespace). The descriptors stay open: the caller hands them to the closer."""
    for fd in fds:
        with contextlib.suppress(OSError):
            shown = namespace_inode(os.readlink(f"/proc/self/fd/{fd}"))
            if shown:
                return shown
    return 0


def _refuse_passed_descriptors(sock: socket.socket) -> None:
    """Where the kernel can (``SO_PASSRIGHTS``, Linux 6.16, when Python knows the constant),
    make the client's sends with descriptors fail after its first frame, the one that may
    carry them. Only a shortcut: a read that brings descriptors ends the connection anyway."""
    option = getattr(socket, "SO_PASSRIGHTS", None)
    if option is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, 0)


def _prepare_path(path: str, gid: int | None) -> None:
    try:
        rundir.prepare_private_dir(os.path.dirname(os.path.abspath(path)), gid)
    except rundir.RuntimeDirError as exc:
        raise SocketPathError(f"SDK socket {path}: {exc}") from None
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketPathError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(0.5)
        probe.connect(path)
    except OSError:
        os.unlink(path)  # stale socket of an agent that died
        return
    finally:
        probe.close()
    raise SocketPathError(f"another agent is already serving {path}")
