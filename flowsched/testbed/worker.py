"""One testbed host's workload process (runs inside the host's network namespace).

It receives every transfer addressed to its host (``flowsched.transfer.Receiver``), sends its
own transfers at their trace times with ``flowsched.transfer.send_flow`` (the socket follows
the flow's level), and runs its rank of the TP jobs: compute, then a two-way exchange with the
peer rank, layer after layer; an iteration waits for the experience batch it consumes.

Before the trace's time zero it sets up all that would delay the first transfers (listeners,
the control plane's connection, the TP ranks' connections), prints its ready line and waits for
time zero from the runner (:mod:`flowsched.testbed.timezero`).

Levels come from a control plane reached through :class:`LevelClient`: the real agent through
``flowsched.client`` (``--control agent``, the default; flows name their receiving host as
``dst_node``, TP ranks use the NCCL plugin), or the testbed's minimal controller
(``--control mini``, :mod:`flowsched.testbed.minictl`, an ablation). Everything the worker
observes (opens, completions, level changes, TCP ports, spans) goes to ``--out`` as JSON at the
end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from flowsched import policyfile, transfer
from flowsched.model import FlowClass
from flowsched.testbed import timezero
from flowsched.testbed.trace import TpJob, Trace, Transfer

TRANSFER_PORT = 7000
TP_PORT = 7100
CHUNK = 64 * 1024
REPORT_EVERY = 256 * 1024
#: seconds a TP iteration waits for the experience batch it consumes before it goes on without
#: it (an error of the run)
EXPERIENCE_WAIT = 60.0
#: seconds a flow waits for its first level from the minimal controller before it is sent at
#: level 0 without it (an error of the run)
FIRST_LEVEL_WAIT = 1.0
#: seconds the TP ranks get to connect to their peers (the peer's worker starts at the same
#: time: all four were ready 0.4-0.7 s after they were started) before the worker gives up
#: without its ready line. Shorter than the runner's wait for that line
#: (``runner.READY_TIMEOUT``), so that the worker says why itself
SETUP_WAIT = 20.0


class Clock:
    """Seconds since the run's time zero on CLOCK_MONOTONIC (shared by every namespace).

    Without ``zero`` time zero is not known yet: it comes from the runner once every worker
    is ready (:meth:`start`), and :meth:`sleep_until` waits for it first.
    """

    def __init__(self, zero: timezero.TimeZero | None = None) -> None:
        self.t0_ns, self.t0_wall = 0, 0.0
        self._started = threading.Event()
        if zero is not None:
            self.start(zero)

    def start(self, zero: timezero.TimeZero) -> None:
        """Set time zero; the threads waiting in :meth:`sleep_until` go on."""
        self.t0_ns, self.t0_wall = zero.ns, zero.wall
        self._started.set()

    def now(self) -> float:
        return (time.monotonic_ns() - self.t0_ns) / 1e9

    def sleep_until(self, t: float) -> None:
        """Return at ``t`` seconds after time zero (at once if that has passed)."""
        self._started.wait()
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)


class Journal:
    """Thread-safe list of observations, written as one JSON document."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.events: list[dict[str, Any]] = []

    def add(self, kind: str, **fields: Any) -> None:
        with self._lock:
            self.events.append({"kind": kind, **fields})

    def write(self, path: str, what: str, host: str) -> None:
        """Add the process's CPU seconds (as ``what`` on ``host``) and write ``path``."""
        self.add("cpu", what=what, host=host, seconds=time.process_time())
        Path(path).write_text(json.dumps(self.events), encoding="utf-8")


class MiniHandle:
    """A flow registered with the minimal controller (implements ``transfer.MarkedFlow``)."""

    def __init__(self, client: MiniClient, flow_id: int) -> None:
        self._client, self._id = client, flow_id
        self._level = -1
        self._listeners: list[Callable[[Any], None]] = []
        self._lock = threading.Lock()
        self.first = threading.Event()

    @property
    def id(self) -> int:
        return self._id

    @property
    def level(self) -> int:
        return max(self._level, 0)

    @property
    def dscp(self) -> int:
        return int(self._client.markings[self.level].dscp)

    @property
    def so_priority(self) -> int:
        return int(self._client.markings[self.level].so_priority)

    def add_listener(self, callback: Callable[[Any], None]) -> None:
        with self._lock:
            self._listeners.append(callback)

    def remove_listener(self, callback: Callable[[Any], None]) -> None:
        with self._lock:
            if callback in self._listeners:
                self._listeners.remove(callback)

    def progress(self, sent: int) -> None:
        self._client.send({"t": "progress", "id": self._id, "sent": sent})

    def set_level(self, level: int) -> None:
        with self._lock:
            self._level = level
            listeners = list(self._listeners)
        self.first.set()
        for callback in listeners:
            callback(self)


class MiniClient:
    """Connection to :mod:`flowsched.testbed.minictl` over the management network."""

    def __init__(self, address: tuple[str, int], markings: Any, journal: Journal) -> None:
        self.markings, self.journal = markings, journal
        self._sock = socket.create_connection(address, timeout=5)
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._send_lock = threading.Lock()
        self._handles: dict[int, MiniHandle] = {}
        threading.Thread(target=self._reader, daemon=True).start()

    def send(self, msg: dict[str, Any]) -> None:
        with self._send_lock, contextlib.suppress(OSError):
            self._sock.sendall(json.dumps(msg).encode() + b"\n")

    def _reader(self) -> None:
        try:
            self._read_levels()
        except (OSError, ValueError, KeyError) as exc:
            ended = f"{type(exc).__name__}: {exc}"
        else:
            ended = "closed by the controller"
        # the worker never closes it: every later level change of this host's flows is lost
        self.journal.add(
            "error", what="the testbed controller's connection", error=f"{ended} during the run"
        )

    def _read_levels(self) -> None:
        with self._sock.makefile("rb") as reader:
            for raw in reader:
                msg = json.loads(raw)
                handle = self._handles.get(msg["id"])
                self.journal.add(
                    "level",
                    id=msg["id"],
                    level=msg["level"],
                    decided_ns=msg["ns"],
                    received_ns=time.monotonic_ns(),
                )
                if handle is not None:
                    handle.set_level(int(msg["level"]))

    @contextlib.contextmanager
    def flow(self, t: Transfer | None, **fields: Any) -> Iterator[MiniHandle]:
        flow_id = t.flow_id if t is not None else int(fields["id"])
        handle = MiniHandle(self, flow_id)
        self._handles[flow_id] = handle
        msg = {"t": "open", "id": flow_id, **fields}
        if t is not None:
            msg.update(
                cls=t.cls,
                size=t.size,
                deadline=t.deadline,
                job=t.job,
                consumer_step=t.consumer_step,
                request=t.request,
                node=t.src,
                links=[f"{t.src}.nic0.tx", f"{t.dst}.nic0.rx"],
            )
        self.send(msg)
        if not handle.first.wait(FIRST_LEVEL_WAIT):
            self.journal.add(
                "error",
                id=flow_id,
                error=f"no level from the testbed controller within {FIRST_LEVEL_WAIT:g} s;"
                " sent at level 0",
            )
        try:
            yield handle
        finally:
            self.send({"t": "close", "id": flow_id})
            self._handles.pop(flow_id, None)

    def job_progress(self, job: str, step: int) -> None:
        self.send({"t": "job", "job": job, "step": step})


class AgentClient:
    """The real control plane: ``flowsched.client`` talking to this host's agent.

    It connects at once (the SDK would on the first flow): the first transfer's admission
    must be the open round trip, not also the connection to the agent. RuntimeError naming
    the socket when the agent cannot be reached (the SDK has logged why).
    """

    def __init__(self, clock: Clock, journal: Journal) -> None:
        from flowsched import client

        self._client, self.clock, self.journal = client, clock, journal
        connection = client.connection()
        if not connection.ensure_connected():
            raise RuntimeError(f"no connection to the agent at {connection.path}")

    @contextlib.contextmanager
    def flow(self, t: Transfer | None, **fields: Any) -> Iterator[Any]:
        if t is None:
            ctx = self._client.flow(fields["cls"])
        else:
            deadline = None if t.deadline is None else self.clock.t0_wall + t.deadline
            ctx = self._client.flow(
                t.cls,
                bytes=t.size,
                deadline=deadline,
                consumer_step=t.consumer_step,
                request=t.request,
                dst_node=t.dst,
            )
        with ctx as handle:
            flow_id = t.flow_id if t is not None else int(fields["id"])

            def on_change(h: Any) -> None:
                # decided_ns: the coordinator's decision (CLOCK_MONOTONIC, shared by every
                # namespace of this machine), None for the first level of the flow
                self.journal.add(
                    "level",
                    id=flow_id,
                    level=h.level,
                    decided_ns=h.decided_ns,
                    received_ns=time.monotonic_ns(),
                )

            handle.add_listener(on_change)
            on_change(handle)
            yield handle

    def job_progress(self, job: str, step: int) -> None:
        self._client.job_progress(job, step)


LevelClient = MiniClient | AgentClient


class Worker:
    """Runs one host's share of the trace."""

    def __init__(
        self,
        trace: Trace,
        host: str,
        ips: dict[str, str],
        clock: Clock,
        control: LevelClient,
        journal: Journal,
    ) -> None:
        self.trace, self.host, self.ips, self.clock = trace, host, ips, clock
        self.control, self.journal = control, journal
        self.done: dict[int, float] = {}
        self._done_cv = threading.Condition()

    def run(self, timeout: float, at_ready: Callable[[], None] | None = None) -> None:
        """Run this host's share of the trace.

        First all that must not delay the first transfers: listen for transfers and for the
        peers of its TP ranks, connect the ranks (through the plugin too), start every flow's
        thread (each waits for the clock's time zero); then ``at_ready()`` (the process says
        ready and starts the clock at the time zero it is given), then wait at most ``timeout``
        s for this host's flows and TP ranks to end and every transfer to it to arrive.
        TimeoutError naming the TP ranks not connected within :data:`SETUP_WAIT` s.
        """
        receiver = transfer.Receiver((self.ips[self.host], TRANSFER_PORT), timeout=timeout)
        receiver.start()
        try:
            threads = self._prepare(receiver)
            if at_ready is not None:
                at_ready()
            self._finish(threads, timeout)
        finally:
            receiver.stop()

    def _prepare(self, receiver: transfer.Receiver) -> list[threading.Thread]:
        """Start the receiver's, the flows' and the TP ranks' threads; return the flows' and
        the ranks' once every rank is connected (or failed: its error is in the journal)."""
        self._thread(f"receiver on {self.host}", self._drain, receiver).start()
        tp_servers = {
            j.job: self._tp_listener(j) for j in self.trace.tp_jobs if j.hosts[1] == self.host
        }
        threads = [
            self._thread(f"flow {t.flow_id}", self._send, t) for t in self.trace.for_host(self.host)
        ]
        connected: dict[str, threading.Event] = {}
        for job in self.trace.tp_jobs:
            if self.host in job.hosts:
                what = f"TP job {job.job}, rank on {self.host}"
                connected[what] = threading.Event()
                # set by the rank once connected, or by the thread's end if it failed first
                threads.append(
                    self._thread(
                        what,
                        self._tp_rank,
                        job,
                        tp_servers.get(job.job),
                        connected[what],
                        ended=connected[what],
                    )
                )
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + SETUP_WAIT
        late = [w for w, e in connected.items() if not e.wait(max(deadline - time.monotonic(), 0))]
        if late:
            raise TimeoutError(f"{'; '.join(late)}: not connected within {SETUP_WAIT:g} s")
        return threads

    def _finish(self, threads: list[threading.Thread], timeout: float) -> None:
        """Wait at most ``timeout`` s for ``threads`` and this host's receives; an error for
        each that did not end."""
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0.1))
        for thread in threads:
            if thread.is_alive():  # its flow or TP job never ended: the records lack it
                self.journal.add(
                    "error", what=thread.name, error=f"still running after {timeout:g} s"
                )
        self._wait_receives(deadline, timeout)

    def _thread(
        self,
        what: str,
        target: Callable[..., None],
        *args: Any,
        ended: threading.Event | None = None,
    ) -> threading.Thread:
        """A daemon thread running ``target(*args)`` whose exception becomes an ``error`` event
        (the run's errors), so a failed thread never leaves the report silently short; it sets
        ``ended`` when it ends."""

        def guarded() -> None:
            try:
                target(*args)
            except Exception as exc:  # any failure of the thread must reach the journal
                self.journal.add("error", what=what, error=f"{type(exc).__name__}: {exc}")
            finally:
                if ended is not None:
                    ended.set()

        return threading.Thread(target=guarded, name=what, daemon=True)

    def _wait_receives(self, deadline: float, timeout: float) -> None:
        """Wait until every transfer to this host arrived; an error naming those that did not
        by ``deadline`` (the run's ``timeout`` s), which the records then lack."""
        expected = {t.flow_id for t in self.trace.transfers if t.dst == self.host}
        with self._done_cv:
            self._done_cv.wait_for(
                lambda: expected <= set(self.done), max(deadline - time.monotonic(), 0.1)
            )
            missing = sorted(expected - set(self.done))
        if missing:
            self.journal.add(
                "error",
                what=f"receiver on {self.host}",
                error=f"flows {', '.join(map(str, missing))} did not arrive within {timeout:g} s",
            )

    def _drain(self, receiver: transfer.Receiver) -> None:
        while True:
            stats = receiver.results.get()
            when = (stats.completed * 1e9 - self.clock.t0_ns) / 1e9
            self.journal.add("done", id=stats.flow_id, t=when, ok=stats.ok)
            if not stats.ok:
                # still marked done below, so a TP iteration waiting for it goes on; the failure
                # shows in the run's errors instead
                self.journal.add(
                    "error",
                    id=stats.flow_id,
                    error=f"received {stats.bytes} of {stats.expected} bytes: {stats.error}",
                )
            with self._done_cv:
                self.done[stats.flow_id] = when
                self._done_cv.notify_all()

    def _send(self, t: Transfer) -> None:
        self.clock.sleep_until(t.start)
        self.journal.add("open", id=t.flow_id, t=self.clock.now())
        try:
            with self.control.flow(t) as handle:
                self.journal.add("admitted", id=t.flow_id, t=self.clock.now())
                sock = connect_retry((self.ips[t.dst], TRANSFER_PORT), 5.0)
                self.journal.add(
                    "tuple",
                    id=t.flow_id,
                    sport=sock.getsockname()[1],
                    dport=TRANSFER_PORT,
                    src=self.ips[t.src],
                    dst=self.ips[t.dst],
                )
                with sock:
                    stats = transfer.send_flow(
                        sock,
                        t.size,
                        flow_handle=handle,
                        chunk=CHUNK,
                        flow_id=t.flow_id,
                        report_every=REPORT_EVERY,
                    )
                self.journal.add(
                    "applied", id=t.flow_id, levels=[[round(m * 1e9), lv] for m, lv in stats.levels]
                )
        except (OSError, transfer.TransferError) as exc:
            self.journal.add("error", id=t.flow_id, error=str(exc))

    # -- TP jobs --------------------------------------------------------------------------

    def _tp_listener(self, job: TpJob) -> socket.socket:
        index = self.trace.tp_jobs.index(job)
        return socket.create_server((self.ips[self.host], TP_PORT + index))

    def _tp_connect(
        self, job: TpJob, server: socket.socket | None
    ) -> tuple[socket.socket, socket.socket]:
        """(send socket, receive socket): rank 0 connects first, rank 1 accepts first."""
        index = self.trace.tp_jobs.index(job)
        peer = job.hosts[1] if job.hosts[0] == self.host else job.hosts[0]
        if server is None:  # rank 0: the peer listens; it connects back on the same socket
            out = connect_retry((self.ips[peer], TP_PORT + index), 10.0)
            return out, out
        conn, _ = server.accept()
        return conn, conn

    def _tp_rank(
        self, job: TpJob, server: socket.socket | None, connected: threading.Event
    ) -> None:
        """The rank of ``job`` on this host: it connects to its peer, sets ``connected``, and
        from the job's start on runs its iterations."""
        sock, _ = self._tp_connect(job, server)
        if isinstance(self.control, AgentClient):
            self._tp_rank_plugin(job, sock, connected)
            return
        connected.set()
        base_id = 1_000_000_000 + 1000 * self.trace.tp_jobs.index(job)
        flow_id = base_id + job.hosts.index(self.host)
        self.clock.sleep_until(job.start)
        with (
            sock,
            self.control.flow(
                None, id=flow_id, cls=FlowClass.TP.label, job=job.job, node=self.host
            ) as handle,
        ):
            self._tp_iterations(job, lambda: _exchange(sock, job.message_bytes, handle))

    def _tp_iterations(self, job: TpJob, exchange: Callable[[], None]) -> None:
        """The rank's iterations: each waits for its experience, then ``layers`` times computes
        and runs ``exchange`` (one collective); the recording rank journals the spans."""
        recorder = self.host == (job.experience_host or job.hosts[0])
        for step in range(job.iterations):
            self._wait_experience(job, step)
            started = self.clock.now()
            if recorder:
                self.control.job_progress(job.job, step)
            for _ in range(job.layers):
                time.sleep(job.compute)
                begin = self.clock.now()
                exchange()
                if recorder:
                    self.journal.add(
                        "span", span="collective", job=job.job, start=begin, end=self.clock.now()
                    )
            if recorder:
                self.journal.add(
                    "span", span="iteration", job=job.job, start=started, end=self.clock.now()
                )

    def _tp_rank_plugin(self, job: TpJob, oob: socket.socket, connected: threading.Event) -> None:
        """The TP rank through the real NCCL net plugin, driven as NCCL drives it.

        The plugin finds the host's flow table through ``FLOWSCHED_TABLE`` and its class
        through ``FLOWSCHED_CLASS=tp``; the agent reports its connections and writes their
        levels, which the plugin applies on the next ``isend``.
        """
        from flowsched.nccl import plugin_path
        from flowsched.nccl.harness import Plugin

        with oob:
            plugin = Plugin(plugin_path(), version=11)
            ctx = plugin.init(comm_id=0xF5E0 + self.trace.tp_jobs.index(job), traffic_class=-1)
            send, recv = _plugin_pair(ctx, oob)
            send_buf, recv_buf = send.register(job.message_bytes), recv.register(job.message_bytes)
            connected.set()
            self.clock.sleep_until(job.start)
            self._tp_iterations(
                job,
                lambda: _plugin_exchange(send, recv, (send_buf, recv_buf), oob, job.message_bytes),
            )
            # CPU seconds of this rank's thread: what its progress loop (POLL) costs
            self.journal.add(
                "cpu", what="tp rank", job=job.job, host=self.host, seconds=time.thread_time()
            )
            send_buf.release()
            recv_buf.release()
            send.close()
            recv.close()
            ctx.finalize()

    def _wait_experience(self, job: TpJob, step: int) -> None:
        needed = [
            t.flow_id
            for t in self.trace.transfers
            if t.job == job.job and t.consumer_step == step and t.dst == self.host
        ]
        with self._done_cv:
            if self._done_cv.wait_for(lambda: all(n in self.done for n in needed), EXPERIENCE_WAIT):
                return
            missing = [n for n in needed if n not in self.done]
        self.journal.add(
            "error",
            what=f"TP job {job.job}, iteration {step} on {self.host}",
            error=f"its experience (flows {', '.join(map(str, missing))}) did not arrive within "
            f"{EXPERIENCE_WAIT:g} s; it went on without it",
        )


def _plugin_pair(ctx: Any, oob: socket.socket) -> tuple[Any, Any]:
    """Both ranks listen, swap handles out of band, then alternate connect and accept."""
    from flowsched.nccl.harness import HANDLE_SIZE

    listener = ctx.listen()
    oob.sendall(bytes(listener.handle))
    connector = ctx.connector(transfer.recv_exact(oob, HANDLE_SIZE))
    send = recv = None
    deadline = time.monotonic() + 30
    while send is None or recv is None:
        send = send or connector.step()
        recv = recv or listener.accept_step()
        if time.monotonic() > deadline:
            raise TimeoutError("plugin connect/accept did not complete")
        time.sleep(0.001)
    listener.close()
    return send, recv


def _plugin_exchange(
    send: Any, recv: Any, buffers: tuple[Any, Any], oob: socket.socket, size: int
) -> None:
    """One collective through the plugin: ``size`` bytes each way, then :func:`_barrier`."""
    send_buf, recv_buf = buffers
    requests = [recv.post(recv_buf, size, timeout=60), send.post(send_buf, size, timeout=60)]
    _wait_requests(requests, 60.0)
    _barrier(oob)


#: How a TP rank waits between passes of ``test()`` over its outstanding plugin requests
#: (FLOWSCHED_TESTBED_POLL): ``sleep0`` (default: ``time.sleep(0)``, on Linux a nanosleep that
#: returns after the thread's timer slack, 50 us, so a pass every ~75 us), ``yield``
#: (``sched_yield``, a spin like NCCL's proxy), ``sleep:SECONDS``, or ``backoff`` (yield for
#: BACKOFF_SPIN after each completion, then sleeps doubling up to BACKOFF_MAX). The plugin
#: moves a message up to its inline size only inside ``test()``; at the testbed's link rate
#: the socket buffers hide pauses this short (bench/contention/README.md: what each measured).
POLL = os.environ.get("FLOWSCHED_TESTBED_POLL", "sleep0")
BACKOFF_SPIN = 0.0005
BACKOFF_MAX = 0.0002


def _wait_requests(requests: list[Any], timeout: float, poll: str | None = None) -> None:
    """Call ``test()`` on every outstanding request until all are done, as NCCL's proxy
    thread does, pausing between passes as :data:`POLL` says.

    NCCL's proxy spins on a core of its own; the testbed's ranks share two cores with the KV
    senders, agents and coordinator, so the default pause is the shortest sleep the kernel
    gives: it leaves the CPU (and the GIL) to others, and a sleeper that wakes preempts a busy
    task where a ``sched_yield`` spinner can wait out a whole time slice behind it.
    """
    pause = _poll_pause(POLL if poll is None else poll)
    deadline = time.monotonic() + timeout
    pending = list(requests)
    while True:
        left = [r for r in pending if not r.test()]
        if not left:
            return
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"{len(left)} of {len(requests)} plugin requests did not complete")
        pause(now, len(left) < len(pending))
        pending = left


def _poll_pause(poll: str) -> Callable[[float, bool], None]:
    """The pause between two passes: ``pause(now, completed_one)`` (see :data:`POLL`)."""
    if poll == "yield":
        return lambda now, completed: os.sched_yield()
    if poll == "sleep0":
        return lambda now, completed: time.sleep(0)
    if poll.startswith("sleep:"):
        seconds = float(poll.split(":", 1)[1])
        return lambda now, completed: time.sleep(seconds)
    if poll == "backoff":
        return _Backoff(BACKOFF_SPIN, BACKOFF_MAX).pause
    raise ValueError(f"FLOWSCHED_TESTBED_POLL: unknown mode {poll!r}")


class _Backoff:
    """Yield for ``spin`` seconds after the start or a completion, then sleep 20 us doubling
    up to ``longest``."""

    def __init__(self, spin: float, longest: float) -> None:
        self.spin, self.longest = spin, longest
        self.since: float | None = None
        self.sleep = 0.0

    def pause(self, now: float, completed: bool) -> None:
        if self.since is None or completed:
            self.since, self.sleep = now, 0.0
        if now - self.since < self.spin:
            os.sched_yield()
            return
        self.sleep = min(max(self.sleep * 2, 2e-5), self.longest)
        time.sleep(self.sleep)


#: TCP congestion control of the testbed's data sockets (FLOWSCHED_TESTBED_CC, default bbr)
CONGESTION = os.environ.get("FLOWSCHED_TESTBED_CC", "")


def connect_retry(address: tuple[str, int], timeout: float) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if CONGESTION:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, CONGESTION.encode())
            sock.settimeout(timeout)
            sock.connect(address)
            sock.settimeout(None)
            return sock
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _barrier(sock: socket.socket) -> None:
    """One byte each way: the collective is complete only once BOTH ranks hold their data.

    A completed send only means the bytes are in the socket buffer; without this, a rank
    would count its collective done while its own bytes are still queued in the network.
    """
    sock.sendall(b"\x01")
    transfer.recv_exact(sock, 1)


def _exchange(sock: socket.socket, size: int, handle: Any) -> None:
    """Send ``size`` bytes to the peer, receive its ``size`` bytes, then :func:`_barrier`."""
    received: list[transfer.ReceiveStats] = []
    reader = threading.Thread(target=lambda: received.append(_recv_message(sock)), daemon=True)
    reader.start()
    marker = transfer.SocketMarker(sock)
    marker.apply(handle.level, handle.dscp, handle.so_priority)
    payload = memoryview(b"\x00" * size)
    sock.sendall(len(payload).to_bytes(8, "big"))
    sock.sendall(payload)
    reader.join()
    _barrier(sock)


def skip_exact(sock: socket.socket, size: int) -> None:
    """Read and drop exactly ``size`` bytes of a collective (OSError if the peer closes)."""
    buf = bytearray(256 * 1024)
    while size:
        n = sock.recv_into(buf, min(len(buf), size))
        if n == 0:
            raise OSError("peer closed during a collective")
        size -= n


def _recv_message(sock: socket.socket) -> transfer.ReceiveStats:
    header = transfer.recv_exact(sock, 8)
    skip_exact(sock, int.from_bytes(header, "big"))
    now = time.monotonic()
    return transfer.ReceiveStats(0, 0, 0, True, "", now, now, now, time.time(), "", None)


def main(argv: list[str] | None = None) -> int:
    """Entry point (``python -m flowsched.testbed.worker ...``), started by the runner: once
    set up it prints its ready line and waits for time zero on stdin
    (:mod:`flowsched.testbed.timezero`); 1 when it cannot take part (no agent or controller,
    a TP peer that never came, no time zero), saying why on stderr."""
    parser = argparse.ArgumentParser(prog="flowsched.testbed.worker")
    parser.add_argument("--trace", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--ips", required=True, help="JSON host -> data IP")
    parser.add_argument("--policy", required=True)
    parser.add_argument("--control", choices=("agent", "mini"), default="agent")
    parser.add_argument("--ctl", default="")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    trace = Trace.from_json(Path(args.trace).read_text(encoding="utf-8"))
    journal, clock = Journal(), Clock()
    cfg = policyfile.load(args.policy)
    try:
        control: LevelClient
        if args.control == "mini":
            host, port = args.ctl.rsplit(":", 1)
            control = MiniClient((host, int(port)), cfg.levels, journal)
        else:
            control = AgentClient(clock, journal)
        worker = Worker(trace, args.host, json.loads(args.ips), clock, control, journal)
        worker.run(args.timeout, lambda: _start_at_time_zero(clock))
    except (OSError, RuntimeError) as exc:  # TimeoutError, NoTimeZero, no agent, no controller
        print(f"worker on {args.host}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        journal.write(args.out, "worker", args.host)
    return 0


def _start_at_time_zero(clock: Clock) -> None:
    """Say ready, wait for the runner's time zero and start ``clock`` at it."""
    timezero.announce_ready()
    clock.start(timezero.wait())


if __name__ == "__main__":
    raise SystemExit(main())
