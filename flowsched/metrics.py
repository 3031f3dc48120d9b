"""Per-run metrics computed from completion records (shared by the simulator and the testbed).

A run produces :class:`RunRecords`: one record per finished flow, request, collective, training
iteration and deadline-bound transfer. :func:`summarize` turns them into :class:`RunMetrics`
(SLO attainment, TTFT percentiles, collective completion time, iteration time, deadline misses,
earliness, per-class flow completion-time percentiles). Times are seconds on the run's clock.

Conventions:

* a request meets its SLO when ``ttft <= slo`` (TTFT = arrival -> last KV byte at the decoder);
  requests that never finished count as misses;
* earliness = deadline - completion (positive = finished unnecessarily early, negative = miss),
  as in the MFS paper; ``earliness_pos_mean`` averages only the non-negative part;
* records flagged ``warmup`` (requests, spans, deadline transfers) or ``drain`` (RL spans and
  syncs after the measured window: the pipeline drain, and syncs no generation consumes) are
  excluded from every statistic; flow records carry no such flag, so ``flows`` and
  ``class_fct`` count every flow;
* a deadline transfer whose consumer's actual need time is known (``needed``: an RL param sync
  and the time its generation would otherwise have started) is scored against that time, not
  against the estimated ``deadline`` its flows carried (see :attr:`DeadlineRecord.due`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class FlowRecord:
    """One finished flow."""

    flow_id: int
    cls: str
    size: int
    opened: float
    finished: float
    deadline: float | None = None
    job: str | None = None
    request: str | None = None
    first_level: int = -1
    last_level: int = -1

    @property
    def fct(self) -> float:
        """Flow completion time."""
        return self.finished - self.opened


@dataclass(slots=True)
class RequestRecord:
    """One serving request: arrival, TTFT SLO, and when its last KV byte reached the decoder."""

    request: str
    arrival: float
    slo: float
    finished: float | None = None
    warmup: bool = False
    #: when the request's prefill compute ended (its last layer's collective done), if known
    prefill_done: float | None = None
    started: float | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token, or None if the request never finished."""
        return None if self.finished is None else self.finished - self.arrival

    @property
    def met(self) -> bool:
        """True when the request finished within its SLO."""
        ttft = self.ttft
        return ttft is not None and ttft <= self.slo * (1 + 1e-9)


@dataclass(slots=True)
class SpanRecord:
    """A timed span: one collective (``kind="collective"``) or one training iteration."""

    kind: str
    job: str
    start: float
    end: float
    warmup: bool = False
    #: after the measured window (an RL pipeline drain): excluded like warm-up
    drain: bool = False

    @property
    def measured(self) -> bool:
        """True unless the span is warm-up or drain."""
        return not (self.warmup or self.drain)

    @property
    def duration(self) -> float:
        """``end - start``."""
        return self.end - self.start


@dataclass(slots=True)
class DeadlineRecord:
    """A transfer with an explicit deadline (e.g. a parameter sync): did it make it?

    ``deadline`` is the estimate the flows carried (what the policy saw); ``needed``, when set,
    is when the consumer actually needed the transfer (an RL param sync: when the generation
    that uses the weights would have started without waiting for it). ``drain`` marks a
    transfer no consumer ever used (not measured).
    """

    kind: str
    job: str
    deadline: float
    finished: float | None
    warmup: bool = False
    needed: float | None = None
    drain: bool = False

    @property
    def measured(self) -> bool:
        """True unless the record is warm-up or drain."""
        return not (self.warmup or self.drain)

    @property
    def due(self) -> float:
        """The time it is scored against: ``needed`` when known, else ``deadline``."""
        return self.deadline if self.needed is None else self.needed

    @property
    def missed(self) -> bool:
        """True when it finished after it was due (so it delayed its consumer) or never did."""
        return self.finished is None or self.finished > self.due * (1 + 1e-12) + 1e-12


@dataclass(slots=True)
class RunRecords:
    """Everything one run recorded; the input of :func:`summarize`."""

    flows: list[FlowRecord] = field(default_factory=list)
    requests: list[RequestRecord] = field(default_factory=list)
    spans: list[SpanRecord] = field(default_factory=list)
    deadlines: list[DeadlineRecord] = field(default_factory=list)
    end_time: float = 0.0


@dataclass(slots=True)
class RunMetrics:
    """Summary of one run. ``None`` means "no data of that kind in this run"."""

    requests: int = 0
    slo_attainment: float | None = None
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    ttft_mean: float | None = None
    cct_mean: float | None = None
    cct_p99: float | None = None
    iteration_mean: float | None = None
    iterations: int = 0
    deadline_transfers: int = 0
    deadline_miss_rate: float | None = None
    earliness_mean: float | None = None
    earliness_pos_mean: float | None = None
    flows: int = 0
    class_fct: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def merge(runs: Iterable[RunRecords]) -> RunRecords:
    """Pool the records of several runs (e.g. seeds) into one, for statistics over all of them."""
    merged = RunRecords()
    for records in runs:
        merged.flows.extend(records.flows)
        merged.requests.extend(records.requests)
        merged.spans.extend(records.spans)
        merged.deadlines.extend(records.deadlines)
        merged.end_time = max(merged.end_time, records.end_time)
    return merged


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100, linear interpolation); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(records: RunRecords) -> RunMetrics:
    """Compute :class:`RunMetrics` from ``records`` (warm-up and drain records excluded)."""
    metrics = RunMetrics(flows=len(records.flows))
    _serving(metrics, [r for r in records.requests if not r.warmup])
    _spans(metrics, [s for s in records.spans if s.measured])
    _deadlines(metrics, [d for d in records.deadlines if d.measured])
    metrics.class_fct = class_percentiles(records.flows)
    return metrics


def _serving(metrics: RunMetrics, requests: list[RequestRecord]) -> None:
    metrics.requests = len(requests)
    if not requests:
        return
    metrics.slo_attainment = sum(r.met for r in requests) / len(requests)
    ttfts = [r.ttft for r in requests if r.ttft is not None]
    metrics.ttft_p50 = percentile(ttfts, 50)
    metrics.ttft_p99 = percentile(ttfts, 99)
    metrics.ttft_mean = _mean(ttfts)
    early = [r.arrival + r.slo - r.finished for r in requests if r.finished is not None]
    _earliness(metrics, early)


def _earliness(metrics: RunMetrics, early: list[float]) -> None:
    if not early:
        return
    metrics.earliness_mean = _mean(early)
    metrics.earliness_pos_mean = sum(max(e, 0.0) for e in early) / len(early)


def _spans(metrics: RunMetrics, spans: list[SpanRecord]) -> None:
    collectives = [s.duration for s in spans if s.kind == "collective"]
    metrics.cct_mean = _mean(collectives)
    metrics.cct_p99 = percentile(collectives, 99)
    iterations = [s.duration for s in spans if s.kind == "iteration"]
    metrics.iterations = len(iterations)
    metrics.iteration_mean = _mean(iterations)


def _deadlines(metrics: RunMetrics, deadlines: list[DeadlineRecord]) -> None:
    metrics.deadline_transfers = len(deadlines)
    if not deadlines:
        return
    metrics.deadline_miss_rate = sum(d.missed for d in deadlines) / len(deadlines)
    if metrics.earliness_mean is None:
        early = [d.due - d.finished for d in deadlines if d.finished is not None]
        _earliness(metrics, early)


def class_percentiles(flows: Iterable[FlowRecord]) -> dict[str, dict[str, float]]:
    """Per flow class: count and completion-time p50/p99/mean (seconds)."""
    by_class: dict[str, list[float]] = {}
    for flow in flows:
        by_class.setdefault(flow.cls, []).append(flow.fct)
    table: dict[str, dict[str, float]] = {}
    for cls, fcts in sorted(by_class.items()):
        table[cls] = {
            "count": float(len(fcts)),
            "p50": percentile(fcts, 50) or 0.0,
            "p99": percentile(fcts, 99) or 0.0,
            "mean": _mean(fcts) or 0.0,
        }
    return table


def ttft_values(records: RunRecords) -> list[float]:
    """Measured (non-warm-up, finished) TTFTs, for CDF plots."""
    return [r.ttft for r in records.requests if not r.warmup and r.ttft is not None]


def collective_values(records: RunRecords) -> list[float]:
    """Measured collective completion times, for CDF plots."""
    return [s.duration for s in records.spans if s.kind == "collective" and s.measured]
