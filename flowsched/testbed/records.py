"""Turn completions of a trace's flows into :class:`flowsched.metrics.RunRecords`.

Used by the simulator replay and by the testbed runner alike, so that both produce the same
kinds of records from the same trace: one request record per KV transfer (TTFT = KV completion
- arrival, SLO from the trace), one deadline record per parameter sync, collective and iteration
spans of the TP jobs, and one flow record per finished flow.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from flowsched.metrics import DeadlineRecord, FlowRecord, RequestRecord, RunRecords, SpanRecord
from flowsched.model import FlowClass
from flowsched.testbed.trace import Trace


class RecordBuilder:
    """Collects completions (times in seconds from the run start) and builds the records."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.finished: dict[int, float] = {}
        self.spans: list[SpanRecord] = []
        self._waiters: dict[int, list[Callable[[], None]]] = {}
        self._experience = {
            (t.job, t.consumer_step): t.flow_id
            for t in trace.transfers
            if t.cls == FlowClass.EXPERIENCE.label and t.job is not None
        }

    def transfer_done(self, flow_id: int, when: float) -> None:
        """Transfer ``flow_id`` delivered its last byte at ``when``."""
        self.finished[flow_id] = when
        for callback in self._waiters.pop(flow_id, []):
            callback()

    def is_done(self, flow_id: int) -> bool:
        """True once :meth:`transfer_done` was called for ``flow_id``."""
        return flow_id in self.finished

    def on_done(self, flow_id: int, callback: Callable[[], None]) -> None:
        """Call ``callback()`` when ``flow_id`` completes."""
        self._waiters.setdefault(flow_id, []).append(callback)

    def experience_for(self, job: str, step: int) -> int | None:
        """The experience transfer that iteration ``step`` of ``job`` consumes, if any."""
        return self._experience.get((job, step))

    def span(self, kind: str, job: str, start: float, end: float) -> None:
        """Record one collective or iteration."""
        self.spans.append(SpanRecord(kind, job, start, end))

    def build(self, flows: Iterable[FlowRecord], *, end_time: float) -> RunRecords:
        """The run's records; transfers that never finished count as misses."""
        records = RunRecords(flows=list(flows), spans=list(self.spans), end_time=end_time)
        for t in self.trace.transfers:
            done = self.finished.get(t.flow_id)
            if t.cls == FlowClass.KV.label and t.slo is not None:
                records.requests.append(
                    RequestRecord(t.request or str(t.flow_id), t.start, t.slo, done)
                )
            elif t.cls == FlowClass.PARAM_SYNC.label and t.deadline is not None:
                records.deadlines.append(
                    DeadlineRecord("param_sync", t.job or "", t.deadline, done)
                )
        return records
