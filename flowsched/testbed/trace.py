"""The seeded workload of the contention benchmark, run both on the testbed and in the simulator.

A :class:`Trace` is a flat, fully determined list of what happens (times are seconds from the
start of the run):

* TP jobs: two hosts run ``iterations`` x ``layers``; each layer computes for ``compute`` seconds
  and then exchanges ``message_bytes`` each way (a two-rank collective, class ``tp``). An
  iteration may wait for the experience batch it consumes (RL post-training: the train step
  needs its samples).
* Transfers: one flow each, opened at ``start`` from ``src`` to ``dst``: KV transfers of serving
  requests (explicit deadline = arrival + SLO), parameter syncs (explicit deadline), experience
  batches (implicit: consumed by a TP job's iteration ``consumer_step``).

The same :class:`Trace` drives the real testbed (:mod:`flowsched.testbed.worker`) and the
simulator replay (:mod:`flowsched.testbed.replay`), so both see identical flows.
"""

from __future__ import annotations

import json
import math
import random
import tomllib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flowsched.model import FlowClass
from flowsched.policies.argcheck import is_number


@dataclass(frozen=True, slots=True)
class TpJob:
    """A tensor-parallel pair of hosts running layer-wise collectives."""

    job: str
    hosts: tuple[str, str]
    iterations: int
    layers: int
    compute: float
    message_bytes: int
    start: float = 0.0
    #: host that receives this job's experience batches (None = no experience dependency)
    experience_host: str | None = None


@dataclass(frozen=True, slots=True)
class Transfer:
    """One flow of a non-collective class."""

    flow_id: int
    cls: str
    src: str
    dst: str
    start: float
    size: int
    #: explicit deadline (seconds from run start) or None
    deadline: float | None = None
    request: str | None = None
    slo: float | None = None
    job: str | None = None
    consumer_step: int | None = None


@dataclass(slots=True)
class Trace:
    """Everything one benchmark run does (hosts are ``h0``..``h{n-1}``)."""

    seed: int
    hosts: int
    rate_bytes: float
    duration: float
    load: float
    tp_jobs: list[TpJob] = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)

    def to_json(self) -> str:
        """The trace as JSON (workers read it back with :meth:`from_json`)."""
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Trace:
        """Inverse of :meth:`to_json`."""
        data = json.loads(text)
        jobs = [TpJob(**{**j, "hosts": tuple(j["hosts"])}) for j in data.pop("tp_jobs")]
        transfers = [Transfer(**t) for t in data.pop("transfers")]
        return cls(**data, tp_jobs=jobs, transfers=transfers)

    def for_host(self, host: str) -> list[Transfer]:
        """Transfers that ``host`` sends."""
        return [t for t in self.transfers if t.src == host]


@dataclass(frozen=True, slots=True)
class ScenarioParams:
    """Knobs of the default testbed scenario (``bench/contention/scenario.toml``)."""

    hosts: int = 4
    duration: float = 30.0
    #: offered load of KV transfers on each decode host's ingress link (0..1)
    load: float = 0.6
    kv_mean_bytes: int = 1_500_000
    kv_min_bytes: int = 200_000
    kv_max_bytes: int = 6_000_000
    #: SLO = slo_factor x (KV size / link rate + slo_base), the MFS "3x low-load TTFT" rule
    slo_factor: float = 3.0
    slo_base: float = 0.01
    tp_layers: int = 8
    tp_compute: float = 0.03
    tp_message_bytes: int = 500_000
    param_sync_bytes: int = 20_000_000
    param_sync_period: float = 5.0
    param_sync_slack: float = 2.5
    experience_bytes: int = 2_000_000


_PARAM_FIELDS = set(ScenarioParams.__dataclass_fields__)


def load_params(
    path: str | Path | None, overrides: Mapping[str, Any] | None = None
) -> ScenarioParams:
    """Scenario parameters from the ``[testbed]`` table of a TOML file (defaults when None)
    with ``overrides`` (e.g. command-line values) on top; the merged table is validated as a
    whole by :func:`params_from_mapping`. OSError when the file cannot be read, ValueError
    (naming the field) when it or an override is invalid."""
    table: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        try:
            document = tomllib.loads(Path(path).read_text(encoding="utf-8-sig"))  # BOM dropped
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: cannot read: not UTF-8 text ({exc.reason})") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: invalid TOML: {exc}") from None
        table, source = document.get("testbed", {}), str(path)
        if not isinstance(table, dict):
            raise ValueError(f"{source}: testbed: expected a table, got {table!r}")
    if overrides:
        table, source = {**table, **overrides}, f"{source} + command line"
    return params_from_mapping(table, source)


#: fields that divide or bound a loop of :func:`generate`: zero would crash it or never end
_POSITIVE = ("duration", "kv_mean_bytes", "tp_layers", "param_sync_period")
#: host counts the testbed builds: prefill and decode halves, at most TopologySpec's 16
MIN_HOSTS, MAX_HOSTS = 4, 16


def params_from_mapping(table: Mapping[str, Any], source: str = "<scenario>") -> ScenarioParams:
    """Validate a ``[testbed]`` table; ValueError names the bad field."""
    defaults = ScenarioParams()
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key not in _PARAM_FIELDS:
            raise ValueError(f"{source}: testbed.{key}: unknown key")
        expected = type(getattr(defaults, key))
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{source}: testbed.{key}: expected a number, got {value!r}")
        if not is_number(value) or value < 0 or (expected is int and value != int(value)):
            raise ValueError(
                f"{source}: testbed.{key}: expected a non-negative {expected.__name__}"
            )
        values[key] = expected(value)
    params = ScenarioParams(**{**asdict(defaults), **values})
    _check_ranges(params, source)
    return params


def _check_ranges(params: ScenarioParams, source: str) -> None:
    if not MIN_HOSTS <= params.hosts <= MAX_HOSTS or params.hosts % 2:
        raise ValueError(
            f"{source}: testbed.hosts: need an even number in {MIN_HOSTS}..{MAX_HOSTS}, "
            f"got {params.hosts}"
        )
    if not 0 < params.load < 2:
        raise ValueError(f"{source}: testbed.load: expected 0 < load < 2, got {params.load}")
    for key in _POSITIVE:
        if getattr(params, key) <= 0:
            raise ValueError(f"{source}: testbed.{key}: must be > 0, got {getattr(params, key)}")
    if params.tp_compute == 0 and params.tp_message_bytes == 0:
        raise ValueError(
            f"{source}: testbed.tp_compute, testbed.tp_message_bytes: a TP layer takes no time "
            "when both are 0"
        )
    if params.kv_min_bytes > params.kv_max_bytes:
        raise ValueError(
            f"{source}: testbed.kv_min_bytes: {params.kv_min_bytes} is above "
            f"testbed.kv_max_bytes ({params.kv_max_bytes})"
        )


def generate(params: ScenarioParams, rate_bytes: float, seed: int) -> Trace:
    """The seeded trace: prefill hosts are the first half, decode hosts the second half.

    * one TP job on the first two prefill hosts, one iteration per ``layers`` collectives, with
      enough iterations to cover the duration at low load;
    * KV requests with Poisson arrivals from every prefill host to every decode host, at
      ``load`` of a decode host's ingress capacity;
    * periodic parameter syncs from a decode (rollout) host to the TP job's first host;
    * one experience batch per TP iteration from a decode host to the job's second host.
    """
    rng = random.Random(seed)
    names = [f"h{i}" for i in range(params.hosts)]
    prefill, decode = names[: params.hosts // 2], names[params.hosts // 2 :]
    trace = Trace(seed, params.hosts, rate_bytes, params.duration, params.load)
    ids = _ids()
    trace.tp_jobs.append(_tp_job(params, rate_bytes, prefill))
    trace.transfers += _kv_requests(params, rate_bytes, prefill, decode, rng, ids)
    trace.transfers += _param_syncs(params, rate_bytes, decode[0], prefill[0], ids)
    trace.transfers += _experience(params, trace.tp_jobs[0], decode[-1], ids, rate_bytes)
    trace.transfers.sort(key=lambda t: (t.start, t.flow_id))
    return trace


def _ids() -> Any:
    counter = iter(range(1, 1 << 40))
    return counter


def _tp_job(params: ScenarioParams, rate_bytes: float, prefill: list[str]) -> TpJob:
    layer_time = params.tp_compute + params.tp_message_bytes / rate_bytes
    iterations = max(1, math.ceil(params.duration / (params.tp_layers * layer_time) * 0.6))
    return TpJob(
        job="tp0",
        hosts=(prefill[0], prefill[1]),
        iterations=iterations,
        layers=params.tp_layers,
        compute=params.tp_compute,
        message_bytes=params.tp_message_bytes,
        experience_host=prefill[1],
    )


def _kv_size(params: ScenarioParams, rng: random.Random) -> int:
    # exponential around the mean, clipped: prompt lengths are heavy-tailed
    size = int(rng.expovariate(1.0 / params.kv_mean_bytes))
    return min(max(size, params.kv_min_bytes), params.kv_max_bytes)


def _kv_requests(
    params: ScenarioParams,
    rate: float,
    prefill: list[str],
    decode: list[str],
    rng: random.Random,
    ids: Any,
) -> list[Transfer]:
    # arrivals per second so that each decode host's ingress sees `load` of its capacity
    per_second = params.load * rate * len(decode) / params.kv_mean_bytes
    transfers, t = [], rng.expovariate(per_second)
    while t < params.duration:
        size = _kv_size(params, rng)
        src, dst = rng.choice(prefill), rng.choice(decode)
        slo = params.slo_factor * (size / rate + params.slo_base)
        flow_id = next(ids)
        transfers.append(
            Transfer(
                flow_id,
                FlowClass.KV.label,
                src,
                dst,
                round(t, 6),
                size,
                deadline=round(t + slo, 6),
                request=f"r{flow_id}",
                slo=round(slo, 6),
            )
        )
        t += rng.expovariate(per_second)
    return transfers


def _param_syncs(
    params: ScenarioParams, rate: float, src: str, dst: str, ids: Any
) -> list[Transfer]:
    transfers, t = [], params.param_sync_period / 2
    need = params.param_sync_bytes / rate
    while t + need < params.duration:
        transfers.append(
            Transfer(
                next(ids),
                FlowClass.PARAM_SYNC.label,
                src,
                dst,
                round(t, 6),
                params.param_sync_bytes,
                deadline=round(t + need + params.param_sync_slack, 6),
                job="sync",
            )
        )
        t += params.param_sync_period
    return transfers


def _experience(
    params: ScenarioParams, job: TpJob, src: str, ids: Any, rate: float
) -> list[Transfer]:
    if job.experience_host is None or params.experience_bytes == 0:
        return []
    # batch k is produced ahead of time; the trainer's iteration k consumes it
    iteration = job.layers * (job.compute + job.message_bytes / rate)
    return [
        Transfer(
            next(ids),
            FlowClass.EXPERIENCE.label,
            src,
            job.experience_host,
            round(max(0.0, (k - 1.5) * iteration), 6),
            params.experience_bytes,
            job=job.job,
            consumer_step=k,
        )
        for k in range(job.iterations)
    ]
