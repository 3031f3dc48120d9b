"""The simulator's workload API in real time: a workload's flows run on the testbed's hosts.

:class:`LiveEngine` implements :class:`flowsched.sim.engine.Engine`, so the simulator's serving
workload (:class:`flowsched.sim.serving.ServingWorkload`: routing, batching, the layer pace,
Stage-1 fetches, the EP all-to-all and the per-layer P2D) drives the testbed unchanged:

* ``at`` / ``after`` are timers on CLOCK_MONOTONIC, in seconds from the run's time zero; a
  callback runs with ``now`` = its scheduled time (a compute step that began then);
* ``open_flow`` asks the host process of the flow's source node
  (:mod:`flowsched.testbed.serving_host`) to send the bytes through its real agent, with the
  flow's class, size, deadline, request, job and consumer step;
* the flow's ``on_done`` runs when the receiving host reports its last byte, with ``now`` = the
  time that byte arrived;
* ``set_job_index`` becomes ``job_progress`` at the hosts that run the job;
* a flow of a ``private`` class (the ideal-network bound) never touches the network: it finishes
  ``size / private_rate`` seconds after it opens, as on a private full-rate path.

Host processes connect to the engine's unix socket (a path: network namespaces do not separate
the file system) and speak JSON lines. Host -> engine: ``{"t": "hello", "host": H}`` once, then
``{"t": "done", "id": N, "at": S, "ok": B, "error": E}`` per received flow. Engine -> host:
``{"t": "start", "t0_ns", "t0_wall"}`` once every host said hello (time zero, so that a host
that was slow to start never shifts the trace), then ``{"t": "open", "id", "cls", "size",
"dst", "deadline", "request", "job", "step"}``, ``{"t": "job", "job", "step"}``,
``{"t": "job_done", "job", "step"}`` (the job ended) and ``{"t": "stop"}``.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from flowsched.metrics import FlowRecord, RunRecords
from flowsched.model import Flow, FlowClass
from flowsched.sim.engine import DoneCallback
from flowsched.testbed.timezero import TimeZero

#: bytes of one JSON line the engine accepts from a host (a ``done`` report is ~100)
MAX_LINE = 64 * 1024


class LiveEngine:
    """Timers and flows of one workload on the testbed (see the module docstring).

    ``node_host`` maps the workload's node names to testbed hosts; ``job_hosts(job)`` names
    the hosts whose agents hear a job's progress. Flows of the ``private`` classes finish at
    ``private_rate`` bytes/s without being sent (the ideal-network bound's private paths).
    """

    def __init__(
        self,
        socket_path: Path,
        node_host: Mapping[str, str],
        job_hosts: Callable[[str], Iterable[str]],
        *,
        private: frozenset[FlowClass] = frozenset(),
        private_rate: float = 0.0,
    ) -> None:
        if private and private_rate <= 0:
            raise ValueError(f"private_rate: {private_rate} must be positive with private classes")
        self.now = 0.0
        self.records = RunRecords()
        self.job_index: dict[str, int] = {}
        self.errors: list[str] = []
        #: ids of the flows whose host reported them failed (each one is in ``errors``)
        self.failed: set[int] = set()
        self._node_host, self._job_hosts = dict(node_host), job_hosts
        self._private, self._private_rate = private, private_rate
        #: time zero on CLOCK_MONOTONIC (and the wall clock): construction until :meth:`start`
        self.t0_ns, self.t0_wall = time.monotonic_ns(), time.time()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._ids = itertools.count(1)
        self._in_flight: dict[int, tuple[Flow, DoneCallback | None]] = {}
        self._inbox: queue.Queue[dict[str, Any]] = queue.Queue()
        self._hosts: dict[str, socket.socket] = {}
        self._hosts_changed = threading.Condition()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket_path = socket_path
        socket_path.unlink(missing_ok=True)
        self._listener.bind(str(socket_path))
        os.chmod(socket_path, 0o600)
        self._listener.listen(64)
        threading.Thread(target=self._accept_loop, name="live-accept", daemon=True).start()

    # ------------------------------------------------------------------ the Engine API
    def at(self, when: float, callback: Callable[[], None]) -> None:
        """Run ``callback()`` at ``when`` (seconds from time zero; not before ``now``)."""
        heapq.heappush(self._timers, (max(when, self.now), next(self._seq), callback))

    def after(self, delay: float, callback: Callable[[], None]) -> None:
        """Run ``callback()`` ``delay`` seconds after ``now``."""
        self.at(self.now + delay, callback)

    def open_flow(
        self,
        cls: FlowClass,
        size: int,
        links: tuple[str, ...],
        on_done: DoneCallback | None = None,
        **fields: Any,
    ) -> Flow:
        """Send ``size`` bytes from the first link's node to the last link's node."""
        flow = Flow(next(self._ids), cls, self.now, size=int(size), links=links, **fields)
        if not links or size <= 0:  # inside one node: no network
            self.at(self.now, lambda: self._finish(flow, on_done, self.now))
            return flow
        if cls in self._private:
            done = self.now + int(size) / self._private_rate
            self.at(done, lambda: self._finish(flow, on_done, done))
            return flow
        src, dst = (self._node_host[_node_of(link)] for link in (links[0], links[-1]))
        self._in_flight[flow.flow_id] = (flow, on_done)
        self._send(
            src,
            {
                "t": "open",
                "id": flow.flow_id,
                "cls": cls.label,
                "size": flow.size,
                "dst": dst,
                "deadline": flow.deadline,
                "request": flow.request,
                "job": flow.job,
                "step": flow.consumer_index,
            },
        )
        return flow

    def set_job_index(self, job: str, index: int) -> None:
        """Record the job's progress and report it to the agents of its hosts."""
        if self.job_index.get(job) == index:
            return
        self.job_index[job] = index
        for host in self._job_hosts(job):
            self._send(host, {"t": "job", "job": job, "step": index})

    def end_job(self, job: str) -> None:
        """The job ended: forget it, and tell the agents of its hosts (so the coordinator
        forgets it too, as the simulator does)."""
        index = self.job_index.pop(job, None)
        if index is None:
            return
        for host in self._job_hosts(job):
            self._send(host, {"t": "job_done", "job": job, "step": index})

    # ------------------------------------------------------------------ running
    def wait_for_hosts(self, hosts: Iterable[str], timeout: float) -> None:
        """Block until every host of ``hosts`` said hello (TimeoutError names the missing)."""
        wanted = set(hosts)
        with self._hosts_changed:
            if not self._hosts_changed.wait_for(lambda: wanted <= set(self._hosts), timeout):
                missing = ", ".join(sorted(wanted - set(self._hosts)))
                raise TimeoutError(
                    f"host processes did not connect within {timeout:.0f} s: {missing}"
                )

    def start(self, delay: float) -> None:
        """Set time zero ``delay`` seconds from now and tell every connected host."""
        zero = TimeZero.after(delay)
        self.t0_ns, self.t0_wall = zero.ns, zero.wall
        for host in list(self._hosts):
            self._send(host, {"t": "start", "t0_ns": self.t0_ns, "t0_wall": self.t0_wall})

    def clock(self) -> float:
        """Seconds since time zero, now."""
        return (time.monotonic_ns() - self.t0_ns) / 1e9

    def run(self, timeout: float) -> None:
        """Fire timers and completions until nothing is pending, or ``timeout`` seconds pass
        (TimeoutError: how many flows were still in flight)."""
        deadline = time.monotonic() + timeout
        while self._timers or self._in_flight:
            now = self.clock()
            if self._timers and self._timers[0][0] <= now:
                when, _, callback = heapq.heappop(self._timers)
                self.now = when
                callback()
                continue
            wait = self._timers[0][0] - now if self._timers else 0.5
            try:
                message = self._inbox.get(timeout=max(min(wait, deadline - time.monotonic()), 0))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{len(self._in_flight)} flows still in flight after {timeout:.0f} s"
                    ) from None
                continue
            self._handle(message)

    def stop(self) -> None:
        """Tell every host to finish, close the engine's socket and remove its file."""
        for host in list(self._hosts):
            self._send(host, {"t": "stop"})
        self._listener.close()
        self._socket_path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ internals
    def _handle(self, message: dict[str, Any]) -> None:
        if message.get("t") != "done":
            self.errors.append(f"a host sent an unexpected line: {message}")
            return
        entry = self._in_flight.pop(int(message["id"]), None)
        if entry is None:
            self.errors.append(f"a host reported flow {message['id']}, which is not in flight")
            return
        if not message.get("ok", True):
            self.failed.add(int(message["id"]))
            self.errors.append(f"flow {message['id']}: {message.get('error', 'failed')}")
        self.now = float(message["at"])
        self._finish(*entry, self.now)

    def _finish(self, flow: Flow, on_done: DoneCallback | None, finished: float) -> None:
        self.records.flows.append(
            FlowRecord(
                flow.flow_id,
                flow.cls.label,
                flow.size or 0,
                flow.opened_at,
                finished,
                flow.deadline,
                flow.job,
                flow.request,
            )
        )
        self.records.end_time = max(self.records.end_time, finished)
        if on_done is not None:
            on_done(flow)

    def _send(self, host: str, message: dict[str, Any]) -> None:
        sock = self._hosts.get(host)
        if sock is None:
            raise RuntimeError(f"no host process for {host}")
        with contextlib.suppress(OSError):  # a host that died shows as flows never done
            sock.sendall(json.dumps(message).encode() + b"\n")

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._reader, args=(conn,), daemon=True).start()

    def _reader(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as lines, contextlib.suppress(OSError):
            # a host that closes or dies ends its reader; its flows never finish (run() says)
            for raw in iter(lambda: lines.readline(MAX_LINE), b""):
                try:
                    message = json.loads(raw)
                except ValueError:
                    self._inbox.put({"t": "bad", "line": raw[:80].decode(errors="replace")})
                    continue
                if message.get("t") == "hello":
                    with self._hosts_changed:
                        self._hosts[str(message["host"])] = conn
                        self._hosts_changed.notify_all()
                else:
                    self._inbox.put(message)


def _node_of(link: str) -> str:
    """The node of a topology link name (``"p0.nic0.tx"`` -> ``"p0"``)."""
    return link.split(".", 1)[0]
