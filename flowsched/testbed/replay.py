"""Replay a testbed :class:`~flowsched.testbed.trace.Trace` in the flow-level simulator.

The simulator gets the testbed's link rates (every host has one NIC, egress and ingress at the
testbed's rate, of which TCP's payload gets 1448 / 1514: the rest is headers) and the same
flows at the same times with the same dependencies, and runs the same policy object the
coordinator runs. Its records are comparable one to one with the testbed's
(:mod:`flowsched.testbed.records`).
"""

from __future__ import annotations

from collections.abc import Callable

from flowsched.metrics import RunRecords
from flowsched.model import Flow, FlowClass
from flowsched.policies.base import Policy
from flowsched.sim.engine import SimConfig, Simulator
from flowsched.testbed.minictl import LOAD_TAU
from flowsched.testbed.netns import TCP_PAYLOAD_SHARE
from flowsched.testbed.records import RecordBuilder
from flowsched.testbed.trace import TpJob, Trace, Transfer


def links(src: str, dst: str) -> tuple[str, str]:
    """Simulator links from ``src`` to ``dst`` (NIC egress then ingress)."""
    return (f"{src}.nic0.tx", f"{dst}.nic0.rx")


def capacity(trace: Trace) -> dict[str, float]:
    """Every testbed link at the testbed's rate (bytes/s)."""
    caps: dict[str, float] = {}
    for i in range(trace.hosts):
        caps[f"h{i}.nic0.tx"] = trace.rate_bytes
        caps[f"h{i}.nic0.rx"] = trace.rate_bytes
    return caps


def replay(
    trace: Trace,
    policy: Policy,
    *,
    timer_period: float = 0.01,
    chunk_bytes: int = 65536,
    level_queue: tuple[int, ...] = (),
    private_classes: frozenset[FlowClass] = frozenset(),
    payload_share: float = TCP_PAYLOAD_SHARE,
) -> RunRecords:
    """Run ``trace`` under ``policy`` in the simulator; return its records.

    ``level_queue`` maps the policy's levels onto the hardware queues (the policy file's);
    ``private_classes`` puts those classes on private full-rate paths (the ideal bound);
    ``payload_share`` of each link's rate carries payload (default: TCP's on the testbed).
    """
    config = SimConfig(
        chunk_bytes=chunk_bytes,
        timer_period=timer_period,
        load_tau=LOAD_TAU,
        default_bandwidth=trace.rate_bytes,
        level_queue=level_queue,
        private_classes=private_classes,
        payload_share=payload_share,
    )
    sim = Simulator(capacity(trace), policy, config)
    builder = RecordBuilder(trace)
    for transfer in trace.transfers:
        sim.at(transfer.start, _opener(sim, transfer, builder))
    for job in trace.tp_jobs:
        _TpRunner(sim, job, builder).start()
    sim.run(until=trace.duration * 4)
    return builder.build(sim.records.flows, end_time=sim.now)


def _opener(sim: Simulator, transfer: Transfer, builder: RecordBuilder) -> Callable[[], None]:
    def open_it() -> None:
        def done(flow: Flow) -> None:
            builder.transfer_done(transfer.flow_id, sim.now)

        sim.open_flow(
            FlowClass.parse(transfer.cls),
            transfer.size,
            links(transfer.src, transfer.dst),
            done,
            deadline=transfer.deadline,
            job=transfer.job,
            request=transfer.request,
            consumer_index=transfer.consumer_step,
            node=transfer.src,
        )

    return open_it


class _TpRunner:
    """A TP job in simulated time: compute, exchange, next layer; iterations wait for data."""

    def __init__(self, sim: Simulator, job: TpJob, builder: RecordBuilder) -> None:
        self.sim, self.job, self.builder = sim, job, builder
        self.iteration, self.layer, self.pending = 0, 0, 0
        self.iteration_start = self.collective_start = 0.0

    def start(self) -> None:
        self.sim.at(self.job.start, self._begin_iteration)

    def _begin_iteration(self) -> None:
        if self.iteration >= self.job.iterations:
            return
        needed = self.builder.experience_for(self.job.job, self.iteration)
        if needed is not None and not self.builder.is_done(needed):
            self.builder.on_done(needed, lambda: self.sim.at(self.sim.now, self._begin_iteration))
            return
        self.iteration_start = self.sim.now
        self.sim.set_job_index(self.job.job, self.iteration)
        self.layer = 0
        self.sim.after(self.job.compute, self._collective)

    def _collective(self) -> None:
        self.collective_start, self.pending = self.sim.now, 2
        a, b = self.job.hosts
        for src, dst in ((a, b), (b, a)):
            self.sim.open_flow(
                FlowClass.TP,
                self.job.message_bytes,
                links(src, dst),
                self._half_done,
                job=self.job.job,
                node=src,
            )

    def _half_done(self, flow: Flow) -> None:
        self.pending -= 1
        if self.pending:
            return
        self.builder.span("collective", self.job.job, self.collective_start, self.sim.now)
        self.layer += 1
        if self.layer < self.job.layers:
            self.sim.after(self.job.compute, self._collective)
            return
        self.builder.span("iteration", self.job.job, self.iteration_start, self.sim.now)
        self.iteration += 1
        self._begin_iteration()
