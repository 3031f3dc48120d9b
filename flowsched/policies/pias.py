"""``pias``: a multi-level feedback queue that demotes flows by bytes sent (PIAS, NSDI'15).

Every flow starts at level 0 and is demoted to level j once it has sent ``thresholds[j-1]``
bytes, so small flows finish in the top levels without anyone knowing flow sizes. Levels change
only with ``flow.sent``; the caller applies them at message boundaries.

Thresholds come from ``thresholds`` when given (K-1 non-decreasing byte counts), else they are
derived from the flow-size distribution (``size_samples``, or ``size_cdf`` as ``[size, p]``
points, else the DCTCP web-search CDF from reference/peers.md section 3.1) and the load, as
PIAS derives them offline per workload and load. Our derivation (our own formulation, in the
spirit of PIAS's queueing model, not a copy of it):

* bandwidth is normalised to 1 and flows arrive as a Poisson process with rate
  ``lambda = load / E[X]``;
* a flow whose size x ends in queue j (``a_{j-1} < x <= a_j``) sees the M/G/1 preemptive
  priority response time of a job competing with everybody's first ``a_j`` bytes:
  ``x / (1 - s(a_{j-1})) + lambda * E[min(X, a_j)^2] / 2 / ((1 - s(a_{j-1})) (1 - s(a_j)))``
  with ``s(a) = lambda * E[min(X, a)]`` (the load of the first ``a`` bytes of all flows);
* the thresholds minimise the resulting mean flow completion time. The cost is a sum of
  per-queue terms that depend only on the queue's two bounds, so an exact dynamic program over
  candidate thresholds (up to 64 quantiles of the distinct sizes) finds the optimum in
  O(K * C^2).
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from flowsched.model import Context, Decision, Flow
from flowsched.policies.argcheck import (
    Checker,
    check_fields,
    is_number,
    list_of,
    number,
    optional,
)
from flowsched.policies.base import FlowLocalDecisions
from flowsched.policies.common import level_changes

NAME = "pias"

#: DCTCP web-search flow sizes (bytes, KB read as 1000 bytes) -> CDF, reference/peers.md 3.1.
WEB_SEARCH_CDF: tuple[tuple[float, float], ...] = (
    (0, 0.0), (10e3, 0.15), (20e3, 0.20), (30e3, 0.30), (50e3, 0.40), (80e3, 0.53),
    (200e3, 0.60), (1e6, 0.70), (2e6, 0.80), (5e6, 0.90), (10e6, 0.97), (30e6, 1.0),
)  # fmt: skip
#: quantile samples drawn from a CDF
CDF_SAMPLES = 1000
#: at most this many candidate thresholds enter the dynamic program
MAX_CANDIDATES = 64


@dataclass(frozen=True, slots=True)
class Args:
    """Arguments of ``pias`` (see the module docstring)."""

    thresholds: Sequence[float] | None = None
    size_samples: Sequence[float] | None = None
    size_cdf: Sequence[Sequence[float]] | None = None
    load: float = 0.7


def _cdf_errors(value: Any, path: str) -> list[str]:
    if not isinstance(value, list | tuple) or len(value) < 2:
        return [f"{path}: expected at least two [size, probability] points, got {value!r}"]
    errors: list[str] = []
    previous = (float("-inf"), 0.0)
    for i, point in enumerate(value):
        ok = isinstance(point, list | tuple) and len(point) == 2 and all(map(is_number, point))
        if not ok or not 0 <= point[1] <= 1 or point[0] < 0:
            errors.append(f"{path}[{i}]: expected [size >= 0, probability in 0..1], got {point!r}")
            continue
        if point[0] < previous[0] or point[1] < previous[1]:
            errors.append(f"{path}[{i}]: sizes and probabilities must not decrease")
        previous = (point[0], point[1])
    if not errors and value[-1][1] != 1:
        errors.append(f"{path}[{len(value) - 1}]: the last probability must be 1")
    return errors


def validate(
    args: Mapping[str, Any], path: str, extra: Mapping[str, Checker] | None = None
) -> list[str]:
    """Field-path errors for ``args`` (empty when valid); ``extra``: the fields of a policy
    that takes pias's arguments and its own (karuna), named first among the known keys."""
    errors = check_fields(args, path, {**(extra or {}), **_FIELDS})
    if args.get("size_samples") is not None and args.get("size_cdf") is not None:
        errors.append(f"{path}.size_cdf: give either size_samples or size_cdf, not both")
    thresholds = args.get("thresholds")
    numbers = isinstance(thresholds, list | tuple) and all(map(is_number, thresholds))
    if numbers and any(b < a for a, b in itertools.pairwise(thresholds)):  # type: ignore[arg-type]
        errors.append(f"{path}.thresholds: must not decrease")
    return errors


_FIELDS = {
    "thresholds": optional(list_of(number(0.0))),
    "size_samples": optional(list_of(number(0.0, open_low=True), min_len=1)),
    "size_cdf": optional(_cdf_errors),
    "load": number(0.0, 1.0, open_low=True),
}


def samples_from_cdf(points: Sequence[Sequence[float]], count: int = CDF_SAMPLES) -> list[float]:
    """``count`` equally spaced quantiles of a piecewise-linear CDF given as (size, p) points."""
    sizes = [float(p[0]) for p in points]
    probs = [float(p[1]) for p in points]
    samples = []
    for i in range(count):
        q = (i + 0.5) / count
        k = bisect.bisect_left(probs, q)
        if k == 0:
            samples.append(sizes[0])
            continue
        k = min(k, len(probs) - 1)
        span = probs[k] - probs[k - 1]
        frac = 0.0 if span <= 0 else (q - probs[k - 1]) / span
        samples.append(sizes[k - 1] + frac * (sizes[k] - sizes[k - 1]))
    return [max(s, 1.0) for s in samples]


class _Distribution:
    """Prefix sums over sorted samples: F(a), E[min(X,a)], E[min(X,a)^2], E[X; X<=a] in O(log n)."""

    def __init__(self, samples: Sequence[float]) -> None:
        self.sizes = sorted(float(s) for s in samples)
        self.n = len(self.sizes)
        self.sum1 = [0.0]
        self.sum2 = [0.0]
        for size in self.sizes:
            self.sum1.append(self.sum1[-1] + size)
            self.sum2.append(self.sum2[-1] + size * size)
        self.mean = self.sum1[-1] / self.n

    def stats(self, a: float) -> tuple[float, float, float, float]:
        """``(F(a), E[min(X,a)], E[min(X,a)^2], E[X; X<=a])``; ``a = inf`` is allowed."""
        k = bisect.bisect_right(self.sizes, a)
        rest = self.n - k
        tail1 = rest * a if rest else 0.0
        tail2 = rest * a * a if rest else 0.0
        return (
            k / self.n,
            (self.sum1[k] + tail1) / self.n,
            (self.sum2[k] + tail2) / self.n,
            self.sum1[k] / self.n,
        )


def _candidates(dist: _Distribution) -> list[float]:
    distinct = sorted(set(dist.sizes))
    if len(distinct) > MAX_CANDIDATES:
        step = (len(distinct) - 1) / (MAX_CANDIDATES - 1)
        distinct = sorted({distinct[round(i * step)] for i in range(MAX_CANDIDATES)})
    return [0.0, *distinct]


def derive_thresholds(samples: Sequence[float], load: float, levels: int) -> tuple[float, ...]:
    """The ``levels - 1`` demotion thresholds (bytes) minimising the modelled mean FCT."""
    return _derive(tuple(float(s) for s in samples), float(load), int(levels))


@functools.lru_cache(maxsize=32)
def _derive(samples: tuple[float, ...], load: float, levels: int) -> tuple[float, ...]:
    if levels <= 1:
        return ()
    dist = _Distribution(samples)
    arrival = load / dist.mean
    points = [*_candidates(dist), float("inf")]
    stats = [dist.stats(a) for a in points]

    def queue_cost(lo: int, hi: int) -> float:
        f_lo, m1_lo, _, s_lo = stats[lo]
        f_hi, m1_hi, m2_hi, s_hi = stats[hi]
        if f_hi <= f_lo:
            return 0.0
        # both floored: at load 1 the load of the sizes below the largest can round to 1
        left_lo = max(1.0 - arrival * m1_lo, 1e-9)
        left_hi = max(1.0 - arrival * m1_hi, 1e-9)
        wait = arrival * m2_hi / 2.0 / (left_lo * left_hi)
        return (f_hi - f_lo) * wait + (s_hi - s_lo) / left_lo

    thresholds = _optimise(len(points), levels, queue_cost, points)
    # More queues than the sizes have use for: the optimum's ties gave the spare ones
    # threshold 0 (an empty queue, every size is > 0), first, so a new flow started below
    # them all (the web-search CDF at K=16: level 5). Keep them empty at the bottom instead,
    # by repeating the largest threshold (the largest size when none is useful): same cost.
    useful = [t for t in thresholds if t > 0]
    pad = useful[-1] if useful else points[-2]
    return (*useful, *[pad] * (len(thresholds) - len(useful)))


def _optimise(
    count: int, levels: int, queue_cost: Any, points: Sequence[float]
) -> tuple[float, ...]:
    """Exact DP: best[i] = cheapest split of the sizes up to points[i] into j queues."""
    last = count - 1  # index of +inf
    best = [queue_cost(0, i) for i in range(count)]
    choice: list[list[int]] = []
    for _ in range(levels - 1):
        step_best, step_choice = [], []
        for i in range(count):
            j = min(range(i + 1), key=lambda k: best[k] + queue_cost(k, i))
            step_best.append(best[j] + queue_cost(j, i))
            step_choice.append(j)
        best = step_best
        choice.append(step_choice)
    bounds = [last]
    for step in reversed(choice):
        bounds.append(step[bounds[-1]])
    return tuple(points[i] for i in reversed(bounds[1:]))


def resolve_thresholds(args: Args, levels: int) -> tuple[float, ...]:
    """The thresholds a PIAS queue set of ``levels`` levels uses for ``args``."""
    if args.thresholds is not None:
        if len(args.thresholds) != levels - 1:
            raise ValueError(
                f"policy.args.thresholds: expected {levels - 1} thresholds for K={levels}, "
                f"got {len(args.thresholds)}"
            )
        return tuple(float(t) for t in args.thresholds)
    if args.size_samples is not None:
        samples: Sequence[float] = args.size_samples
    else:
        samples = samples_from_cdf(args.size_cdf or WEB_SEARCH_CDF)
    return derive_thresholds(samples, args.load, levels)


def sent_level(sent: int, thresholds: Sequence[float]) -> int:
    """MLFQ level of a flow that has sent ``sent`` bytes: the number of thresholds reached."""
    return bisect.bisect_right(thresholds, sent)


class PiasPolicy(FlowLocalDecisions):
    """Demote by bytes sent across the derived thresholds."""

    name: ClassVar[str] = NAME
    #: each decision depends on one flow and the Context only (see policies.base)
    per_flow_decisions: ClassVar[bool] = True

    def __init__(self, args: Args, num_levels: int) -> None:
        self.num_levels = num_levels
        self.thresholds = resolve_thresholds(args, num_levels)

    def describe_levels(self) -> list[str]:
        """The bytes-sent range of each level (for ``flowsched policy show``)."""
        bounds = [0.0, *self.thresholds, float("inf")]
        return [f"bytes sent in [{lo:.4g}, {hi:.4g})" for lo, hi in itertools.pairwise(bounds)]

    def _level(self, flow: Flow) -> int:
        return sent_level(flow.sent, self.thresholds)

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        return Decision(self._level(flow))

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        return level_changes(flows, self._level)

    def release(self, flow: Flow, ctx: Context) -> None:
        return None


def new(args: Mapping[str, Any], *, num_levels: int) -> PiasPolicy:
    """Build a :class:`PiasPolicy` from validated ``args``."""
    return PiasPolicy(Args(**args), num_levels)
