"""A minimal control plane for the testbed: an ablation (``--control mini``), never the default.

The benchmark's runs use the real coordinator and agents; this controller isolates the policy
from the control plane's costs (SDK round trips, batching, agents' CPU) when asked for.

It runs the same policy object as the coordinator (``PolicyConfig.make_policy()``) on the flows
the testbed workers report, on the same hooks (admit on open, re-evaluate on job progress,
completion and a timer, release on close), and sends level changes back. It speaks JSON lines
over TCP on the testbed's private management network only (never a real network): one object
per line, worker -> controller ``{"t": "open"|"progress"|"close"|"job", ...}``, controller ->
worker ``{"t": "level", "id", "level", "ns"}`` where ``ns`` is CLOCK_MONOTONIC at the decision
(the promotion-latency measurement starts there).

Times given to the policy are seconds since the run's time zero (on CLOCK_MONOTONIC, which
every namespace shares), the same clock the trace and the simulator replay use. The runner sends
time zero on stdin once the workers are ready (:mod:`flowsched.testbed.timezero`); the workers
connect before that (the listen backlog holds them) and are served only after it, so no message
is ever handled before time zero is known.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import socket
import sys
import threading
import time
from typing import Any

from flowsched import policyfile
from flowsched.model import Context, Decision, Flow, FlowClass
from flowsched.policies.base import Policy
from flowsched.testbed import timezero

MAX_LINE = 1 << 16
#: time constant of the link-load EWMA (the simulator replay uses the same)
LOAD_TAU = 0.02


class LinkMeter:
    """Utilization rho of every host link, from the switch ports' byte counters (sysfs).

    The switch port toward host ``h`` transmits what ``h`` receives (``h.nic0.rx``) and
    receives what ``h`` sends (``h.nic0.tx``); an EWMA with time constant :data:`LOAD_TAU`
    smooths the per-tick rate, as the agents' NIC counters would.
    """

    def __init__(self, ports: dict[str, str], bandwidth: float) -> None:
        self.bandwidth = bandwidth
        self.sources = {}
        for host, dev in ports.items():
            base = f"/sys/class/net/{dev}/statistics"
            self.sources[f"{host}.nic0.rx"] = f"{base}/tx_bytes"
            self.sources[f"{host}.nic0.tx"] = f"{base}/rx_bytes"
        self.last = {
            link: (time.monotonic(), self._read(path)) for link, path in self.sources.items()
        }
        self.load = dict.fromkeys(self.sources, 0.0)

    @staticmethod
    def _read(path: str) -> int:
        try:
            with open(path, encoding="ascii") as f:
                return int(f.read())
        except (OSError, ValueError):
            return 0

    def sample(self) -> None:
        now = time.monotonic()
        for link, path in self.sources.items():
            then, count = self.last[link]
            value = self._read(path)
            self.last[link] = (now, value)
            if now <= then:
                continue
            rho = min((value - count) / ((now - then) * self.bandwidth), 1.0)
            alpha = 1.0 - math.exp(-(now - then) / LOAD_TAU)
            self.load[link] += alpha * (rho - self.load[link])


class Controller:
    """Cluster flow table + policy; thread-safe."""

    def __init__(
        self,
        policy: Policy,
        t0_ns: int,
        bandwidth: float,
        period: float,
        meter: LinkMeter | None = None,
    ) -> None:
        self.policy, self.t0_ns, self.bandwidth, self.period = policy, t0_ns, bandwidth, period
        self.meter = meter
        self.lock = threading.Lock()
        self.flows: dict[int, tuple[Flow, socket.socket]] = {}
        self.job_index: dict[str, int] = {}
        self.decisions = 0

    def now(self) -> float:
        return (time.monotonic_ns() - self.t0_ns) / 1e9

    def context(self) -> Context:
        load = dict(self.meter.load) if self.meter else {}
        return Context(
            now=self.now(),
            job_index=dict(self.job_index),
            link_load=load,
            default_bandwidth=self.bandwidth,
        )

    def handle(self, msg: dict[str, Any], conn: socket.socket) -> None:
        kind = msg.get("t")
        with self.lock:
            if kind == "open":
                self._open(msg, conn)
            elif kind == "progress" and msg["id"] in self.flows:
                self.flows[msg["id"]][0].sent = int(msg["sent"])
            elif kind == "close" and msg["id"] in self.flows:
                flow, _ = self.flows.pop(msg["id"])
                self.policy.release(flow, self.context())
                self._reevaluate()
            elif kind == "job":
                self.job_index[str(msg["job"])] = int(msg["step"])
                self._reevaluate()

    def _open(self, msg: dict[str, Any], conn: socket.socket) -> None:
        flow = Flow(
            flow_id=int(msg["id"]),
            cls=FlowClass.parse(msg["cls"]),
            opened_at=self.now(),
            size=msg.get("size"),
            deadline=msg.get("deadline"),
            job=msg.get("job"),
            consumer_index=msg.get("consumer_step"),
            request=msg.get("request"),
            links=tuple(msg.get("links", ())),
            node=msg.get("node"),
        )
        self.flows[flow.flow_id] = (flow, conn)
        self._apply(flow, conn, self.policy.admit(flow, self.context()))

    def _reevaluate(self) -> None:
        if not self.flows:
            return
        changes = self.policy.reevaluate([f for f, _ in self.flows.values()], self.context())
        for flow_id, decision in changes.items():
            if flow_id in self.flows:
                flow, conn = self.flows[flow_id]
                self._apply(flow, conn, decision)

    def _apply(self, flow: Flow, conn: socket.socket, decision: Decision) -> None:
        if decision.level == flow.level:
            return
        flow.level = decision.level
        self.decisions += 1
        line = {
            "t": "level",
            "id": flow.flow_id,
            "level": decision.level,
            "ns": time.monotonic_ns(),
        }
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps(line).encode() + b"\n")

    def timer(self, stop: threading.Event) -> None:
        while not stop.wait(self.period):
            if self.meter is not None:
                self.meter.sample()
            with self.lock:
                self._reevaluate()


def _serve_conn(ctl: Controller, conn: socket.socket) -> None:
    with conn, conn.makefile("rb") as reader:
        for raw in reader:
            if len(raw) > MAX_LINE:
                return
            try:
                ctl.handle(json.loads(raw), conn)
            except (ValueError, KeyError, TypeError) as exc:
                # stderr: stdout is the ready line's pipe, which nobody reads afterwards
                print(f"minictl: bad message {raw[:80]!r}: {exc}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m flowsched.testbed.minictl --policy F --listen H:P ...``, then
    time zero on stdin; 1 when none comes (stderr says why)."""
    parser = argparse.ArgumentParser(prog="flowsched.testbed.minictl")
    parser.add_argument("--policy", required=True)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--bandwidth", type=float, required=True)
    parser.add_argument("--ports", default="{}", help="JSON host -> switch port device")
    args = parser.parse_args(argv)
    cfg = policyfile.load(args.policy)
    meter = LinkMeter(json.loads(args.ports), args.bandwidth)
    host, port = args.listen.rsplit(":", 1)
    server = socket.create_server((host, int(port)), backlog=64)
    print(f"minictl listening on {host}:{server.getsockname()[1]}", flush=True)
    try:
        zero = timezero.wait()
    except timezero.NoTimeZero as exc:
        print(f"minictl: {exc}", file=sys.stderr, flush=True)
        return 1
    ctl = Controller(cfg.make_policy(), zero.ns, args.bandwidth, cfg.timer_period, meter)
    stop = threading.Event()
    threading.Thread(target=ctl.timer, args=(stop,), daemon=True).start()
    while True:
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_serve_conn, args=(ctl, conn), daemon=True).start()


if __name__ == "__main__":
    raise SystemExit(main())
