"""The agent's unix-socket server for the application SDK (:mod:`flowsched.client`).

The socket is created mode 0600 (0660 with a configured group) inside a directory of the
agent's own (:func:`flowsched.rundir.prepare_private_dir`: created 0700, or 0750 with the
group; one owned by another user or writable by others is refused). The process id of a
client comes from ``SO_PEERCRED``. A malformed frame gets an ``error`` frame and closes that
client only; its flows are closed (as are those of a client that disconnects).

Limits (docs/security.md): open flows per uid (all of its connections together) and per node;
connections per uid and in total (the total below the open-file limit, so that accepts do not
fail); a connection with no open flow that sends nothing for :data:`IDLE_TIMEOUT` is closed
(one holding flows never is: applications keep a flow open for minutes). A refused connection
or flow gets an ``error`` frame that the client logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import os
import socket
import stat
import struct
import time
from collections import Counter
from typing import TYPE_CHECKING

from flowsched import rundir
from flowsched.agent.flows import JobTable, SlotKey
from flowsched.lograte import RepeatLog
from flowsched.model import Flow, FlowClass
from flowsched.protocol import sdk

if TYPE_CHECKING:
    from flowsched.agent.service import Agent

log = logging.getLogger("flowsched.agent.sdk")

MAX_CLIENT_BACKLOG = 1 << 20  # bytes queued to one client before it is dropped
READ_SIZE = 65536
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
#: seconds a connection without open flows may stay silent before it is closed
IDLE_TIMEOUT = 300.0
#: seconds :meth:`SdkServer.close` waits for the aborted connections' handlers to end
CLOSE_TIMEOUT = 1.0


class SocketPathError(RuntimeError):
    """The SDK socket path cannot be used (another agent, not a socket, ...)."""


class SdkServer:
    """Serves SDK clients for one :class:`~flowsched.agent.service.Agent`."""

    def __init__(self, agent: Agent, fd_limit: int | None = None) -> None:
        self.agent = agent
        self._owner: dict[int, asyncio.StreamWriter] = {}
        self._writers: set[asyncio.StreamWriter] = set()
        self.clients_total = 0
        self.errors_total = 0
        self.refused_total = 0
        self.max_connections = MAX_CONNECTIONS
        if fd_limit is not None:
            self.max_connections = max(min(MAX_CONNECTIONS, fd_limit - FD_RESERVE), 1)
        self.max_connections_per_uid = MAX_CONNECTIONS_PER_UID
        self.max_flows_per_uid = MAX_FLOWS_PER_UID
        self.max_flows = MAX_FLOWS
        self.idle_timeout = IDLE_TIMEOUT
        self._connections_of: Counter[int | None] = Counter()
        self._flows_of: Counter[int | None] = Counter()
        self._flows = 0
        self._repeat_log = RepeatLog(log)
        self.requests: Counter[str] = Counter()
        self._first_level: dict[int, asyncio.Future[int]] = {}
        #: opens waiting for the coordinator's first level before they are answered
        self._answering: set[asyncio.Future[None]] = set()
        #: the handler task of each client connection (close() waits for them to end)
        self._connections: set[asyncio.Task[None]] = set()
        self._closing = False

    @property
    def clients(self) -> int:
        """Connected SDK clients."""
        return len(self._writers)

    async def start(self, path: str, group: str | None) -> asyncio.AbstractServer:
        """Bind the socket (private permissions) and start serving.

        Raises:
            SocketPathError: the path is taken or its directory is unsafe (see the module
                docstring).
        """
        gid = grp.getgrnam(group).gr_gid if group is not None else None
        _prepare_path(path, gid)
        old = os.umask(0o177)
        try:
            server = await asyncio.start_unix_server(self._serve, path=path)
        finally:
            os.umask(old)
        if gid is not None:
            os.chown(path, -1, gid)
            os.chmod(path, 0o660)
        return server

    async def close(self) -> None:
        """Disconnect every client and return once their connections have ended.

        Their flows are left as they are, in the registry and in the table's slots: the clients
        re-open them with the next agent. The connections are aborted (a client that does not
        read cannot hold the shutdown up with unsent bytes), so each handler sees end-of-file and
        returns; one that has not after :data:`CLOSE_TIMEOUT` is cancelled.
        """
        self._closing = True
        for task in list(self._answering):
            task.cancel()
        for writer in list(self._writers):
            writer.transport.abort()
        if self._connections:
            _, late = await asyncio.wait(set(self._connections), timeout=CLOSE_TIMEOUT)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late)

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

    def _write(self, writer: asyncio.StreamWriter, message: sdk.SdkMessage) -> None:
        if writer.transport.get_write_buffer_size() > MAX_CLIENT_BACKLOG:
            log.warning("SDK client is not reading; dropping it")
            writer.close()
            return
        writer.write(sdk.encode(message))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pid, uid = _peer_cred(writer)
        if not self._admit_connection(pid, uid, writer):
            return
        # the registry names processes as the flow table's slots do (a job in a pid namespace
        # of its own writes its pids there: flowsched.shm.pidns); pid stays for the logs
        key = self.agent.process_key(pid)
        owned: set[int] = set()
        connection = asyncio.current_task()
        assert connection is not None  # the stream server runs each connection as a task
        self._connections.add(connection)
        self._writers.add(writer)
        self._connections_of[uid] += 1
        self.clients_total += 1
        decoder = sdk.SdkDecoder("agent")
        try:
            while data := await self._read(reader, idle=not owned):
                decoder.feed(data)
                while (message := decoder.next_message()) is not None:
                    self._handle(message, (key, uid), writer, owned)
        except sdk.SdkProtocolError as exc:
            self.errors_total += 1
            log.warning("SDK client pid %d sent a bad frame: %s", pid, exc)
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
            self._connections.discard(connection)
            if self._closing:
                self._writers.discard(writer)
            else:
                self._disconnect(key, uid, writer, owned)

    async def _read(self, reader: asyncio.StreamReader, *, idle: bool) -> bytes:
        """The next bytes; a connection without open flows (``idle``) waits at most
        :attr:`idle_timeout` (TimeoutError), one with flows as long as it likes."""
        async with asyncio.timeout(self.idle_timeout if idle else None):
            return await reader.read(READ_SIZE)

    def _admit_connection(self, pid: int, uid: int | None, writer: asyncio.StreamWriter) -> bool:
        """False (the client told why, the refusal logged at a falling rate) when the
        connection caps are reached."""
        if len(self._writers) >= self.max_connections:
            key, reason = "all", f"the agent serves at most {self.max_connections} SDK connections"
        elif self._connections_of[uid] >= self.max_connections_per_uid:
            key = f"uid:{uid}"
            reason = f"at most {self.max_connections_per_uid} SDK connections per user"
        else:
            return True
        self.refused_total += 1
        self._repeat_log.log(
            f"refused:{key}", logging.WARNING,
            "SDK connection of pid %d (uid %s) refused: %s", pid, uid, reason,
        )  # fmt: skip
        with contextlib.suppress(Exception):
            writer.write(sdk.encode(sdk.Error("too_many_connections", reason)))
        writer.close()
        return False

    def _disconnect(
        self, key: int, uid: int | None, writer: asyncio.StreamWriter, owned: set[int]
    ) -> None:
        self._writers.discard(writer)
        self._connections_of[uid] -= 1
        if self._connections_of[uid] <= 0:
            del self._connections_of[uid]
        registry = self.agent.registry
        now = time.time()
        for flow_id in owned:
            self._owner.pop(flow_id, None)
            self._count_flow(uid, -1)
            if registry is not None:
                for slot in registry.close_sdk(flow_id, key, None, now):
                    self.agent.write_slot(slot)
        self.agent.admit_now()
        writer.close()

    def _count_flow(self, uid: int | None, delta: int) -> None:
        self._flows += delta
        self._flows_of[uid] += delta
        if self._flows_of[uid] <= 0:
            del self._flows_of[uid]

    def _handle(
        self,
        message: sdk.SdkMessage,
        cred: tuple[int, int | None],
        writer: asyncio.StreamWriter,
        owned: set[int],
    ) -> None:
        key, uid = cred  # the client's process key (PidNamespaces.process_key), its uid
        registry = self.agent.registry
        assert registry is not None
        self.requests[message.TYPE] += 1
        if isinstance(message, sdk.Open):
            self._open(message, cred, writer, owned)
        elif isinstance(message, sdk.Progress) and message.id in owned:
            registry.sdk_progress(message.id, key, message.sent)
        elif isinstance(message, sdk.Close) and message.id in owned:
            owned.discard(message.id)
            self._owner.pop(message.id, None)
            self._count_flow(uid, -1)
            for slot in registry.close_sdk(message.id, key, message.sent, time.time()):
                self.agent.write_slot(slot)
            self.agent.admit_now()
        elif isinstance(message, sdk.JobProgress):
            # scoped to the client's uid: no other user can set this job's step
            self.agent.job_progress(
                message.job, message.step, message.layer, owner=uid, done=bool(message.done)
            )

    def _open(
        self,
        message: sdk.Open,
        cred: tuple[int, int | None],
        writer: asyncio.StreamWriter,
        owned: set[int],
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
        flow, linked = self._register(message, *cred)
        owned.add(flow.flow_id)
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
        self, message: sdk.Open, flow: Flow, writer: asyncio.StreamWriter
    ) -> None:
        await self._await_first_level(flow.flow_id)
        if not writer.is_closing():  # else the client is gone, and its flows closed with it
            self._answer_open(message, flow, writer)

    def _answer_open(self, message: sdk.Open, flow: Flow, writer: asyncio.StreamWriter) -> None:
        view = self.agent.view
        level = flow.level if flow.level >= 0 else view.default_level(flow.cls)
        mark = view.marking(level)
        tc = view.nccl_traffic_class(flow.cls)
        opened = sdk.Opened(message.ref, flow.flow_id, level, mark.dscp, mark.so_priority, tc)
        self._write(writer, opened)
        # level pushes start only now: one sent before ``opened`` named a flow id the client
        # did not know yet (and was dropped); ``opened`` carries every level decided so far
        if not writer.is_closing():
            self._owner[flow.flow_id] = writer

    def _register(self, message: sdk.Open, key: int, uid: int | None) -> tuple[Flow, list[SlotKey]]:
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


def _peer_cred(writer: asyncio.StreamWriter) -> tuple[int, int | None]:
    """The client's (pid, uid) from SO_PEERCRED; (0, None) when unknown."""
    sock = writer.get_extra_info("socket")
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _ = struct.unpack("3i", raw)
        return pid, uid
    except (OSError, AttributeError):
        return 0, None


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
