"""Tables, JSON, plots and the markdown report of the contention benchmark.

Rows: the ideal-network bound first (simulator only, the ceiling), then the policies, oracles
(``llf``) last. Every row states KV SLO attainment and the collective and iteration times side
by side (the trace is scored jointly: a policy cannot win by starving TP), the fractions of KV
flows admitted at the top level and above the collectives, and attainment relative to the
bound. Units as in :mod:`flowsched.report`: % and ms, in the table and in the JSON alike.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowsched import report as shared_report
from flowsched.metrics import RunMetrics, RunRecords, merge, summarize
from flowsched.policies import ORACLES
from flowsched.report import Outcome, colour, json_metrics
from flowsched.sim.run import IDEAL, LATE_SUFFIX


@dataclass(slots=True)
class SeedRun:
    """One policy on one seed's trace: the simulator replay and, when run, the testbed."""

    seed: int
    sim_records: RunRecords
    testbed_records: RunRecords | None = None
    ablation_records: RunRecords | None = None
    #: SLO attainment of the replay and of the testbed run (None without one), set once here
    sim_attainment: float | None = field(init=False)
    testbed_attainment: float | None = field(init=False)

    def __post_init__(self) -> None:
        self.sim_attainment = summarize(self.sim_records).slo_attainment
        tb = self.testbed_records
        self.testbed_attainment = None if tb is None else summarize(tb).slo_attainment


@dataclass(slots=True)
class PolicyResult:
    """One policy's testbed and simulator metrics on the same traces (pooled over the seeds
    in ``seeds``; the records of every seed are kept for the per-seed view)."""

    policy: str
    testbed: RunMetrics | None
    sim: RunMetrics
    testbed_records: RunRecords | None = None
    sim_records: RunRecords | None = None
    promotions: list[float] = field(default_factory=list)
    class_bytes: dict[str, dict[int, int]] = field(default_factory=dict)
    #: packets the testbed's shaped ports dropped during this policy's runs
    dropped_packets: int = 0
    errors: list[str] = field(default_factory=list)
    wall_seconds: float = 0.0
    #: open -> first level delays of the testbed run's transfers (sorted, seconds)
    admission: list[float] = field(default_factory=list)
    #: CPU seconds of the control-plane processes and the sniffer during the testbed run
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    #: control plane of the testbed rows: "agent" (the real coordinator + one agent per host
    #: + the NCCL plugin for TP, the default) or "mini" (the testbed's minimal controller)
    control: str = "agent"
    #: the same policy run again with the other control plane (an ablation), when asked for
    ablation: RunMetrics | None = None
    ablation_promotions: list[float] = field(default_factory=list)
    ablation_records: RunRecords | None = None
    ablation_control: str = ""
    #: every seed's runs, in the order they ran
    seeds: list[SeedRun] = field(default_factory=list)

    def pool(self) -> None:
        """Set the pooled records and metrics from ``seeds`` (every request of every seed)."""
        sims = [s.sim_records for s in self.seeds]
        self.sim_records = merge(sims)
        self.sim = summarize(self.sim_records)
        tbs = [s.testbed_records for s in self.seeds if s.testbed_records is not None]
        if tbs:
            self.testbed_records = merge(tbs)
            self.testbed = summarize(self.testbed_records)
        ablations = [s.ablation_records for s in self.seeds if s.ablation_records is not None]
        if ablations:
            self.ablation_records = merge(ablations)
            self.ablation = summarize(self.ablation_records)


def _fmt(value: float | None, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def _ratio(tb: float | None, sim: float | None) -> str:
    if tb is None or sim is None or sim == 0:
        return "-"
    return f"{tb / sim:.2f}"


COLUMNS = (
    "policy",
    "source",
    "SLO att. %",
    "x ideal",
    "CCT mean ms",
    "iter mean ms",
    "KV@top %",
    "KV>TP %",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "sync miss %",
    "KV FCT p50 ms",
    "KV FCT p99 ms",
)


def display(policy: str) -> str:
    """``ideal (bound)``, ``llf (oracle)``, ``llf+late (oracle)`` or the policy name."""
    if policy == IDEAL:
        return f"{policy} (bound)"
    if is_oracle(policy):
        return f"{policy} (oracle)"
    return policy


def is_oracle(policy: str) -> bool:
    """True for an oracle (``llf``, ``llf+late``): a reference, shown marked and last."""
    return policy.removesuffix(LATE_SUFFIX) in ORACLES


def _order(result: PolicyResult) -> int:
    return 0 if result.policy == IDEAL else 2 if is_oracle(result.policy) else 1


def _row(
    policy: str,
    source: str,
    m: RunMetrics,
    records: RunRecords | None = None,
    ideal: float | None = None,
    tp_level: int | None = None,
) -> list[str]:
    kv = m.class_fct.get("kv", {})
    top = top_share(records) if records is not None else None
    above = above_collectives_share(records, tp_level) if records is not None else None
    ratio = m.slo_attainment / ideal if ideal and m.slo_attainment is not None else None
    return [
        display(policy),
        source,
        _fmt(m.slo_attainment, 100.0, 1),
        _fmt(ratio, 1, 2),
        _fmt(m.cct_mean, 1e3, 1),
        _fmt(m.iteration_mean, 1e3, 0),
        _fmt(top, 100.0, 0),
        _fmt(above, 100.0, 0),
        _fmt(m.ttft_p50, 1e3, 1),
        _fmt(m.ttft_p99, 1e3, 1),
        _fmt(m.deadline_miss_rate, 100.0, 1),
        _fmt(kv.get("p50"), 1e3, 1),
        _fmt(kv.get("p99"), 1e3, 1),
    ]


def ideal_attainment(results: Sequence[PolicyResult]) -> float | None:
    """The ideal bound's (simulated) SLO attainment, if it ran."""
    bound = next((r for r in results if r.policy == IDEAL), None)
    return bound.sim.slo_attainment if bound is not None else None


#: how a table row names the control plane that carried the levels of a testbed run
CONTROL_LABELS = {"agent": "testbed", "mini": "testbed, mini ctl"}


#: marks a testbed row whose runs recorded errors (the figures measure incomplete runs)
ERROR_MARK = "!"
#: how the contention benchmark starts the errors of an ablation run
ABLATION_ERROR = re.compile(r"seed -?\d+, ablation \(")


def error_counts(result: PolicyResult) -> tuple[int, int]:
    """(errors of the main testbed runs, errors of the ablation runs) of ``result``."""
    ablation = sum(1 for e in result.errors if ABLATION_ERROR.match(e))
    return len(result.errors) - ablation, ablation


def _marked(label: str, errors: int) -> str:
    return f"{label} {ERROR_MARK}{errors} err" if errors else label


def table_rows(results: list[PolicyResult]) -> list[list[str]]:
    """One testbed row (plus an ablation row when run) and one simulator row per policy; the
    bound first, oracles last. ``x ideal`` = attainment / the bound's simulated attainment.
    A testbed row whose runs recorded errors says so in its source (``testbed !2 err``); a
    policy none of whose testbed runs started has that row with no figures."""
    ideal = ideal_attainment(results)
    rows = []
    for r in sorted(results, key=_order):
        main_errors, ablation_errors = error_counts(r)
        tp = _tp_level(r)
        label = _marked(CONTROL_LABELS.get(r.control, r.control), main_errors)
        if r.testbed is not None:
            rows.append(_row(r.policy, label, r.testbed, r.testbed_records, ideal, tp))
        elif main_errors:  # no testbed run started: the row says so, not the simulator's alone
            rows.append([display(r.policy), label, *["-"] * (len(COLUMNS) - 2)])
        if r.ablation is not None:
            label = CONTROL_LABELS.get(r.ablation_control, r.ablation_control)
            label = _marked(f"{label} (ablation)", ablation_errors)
            rows.append(_row(r.policy, label, r.ablation, r.ablation_records, ideal, tp))
        rows.append(_row(r.policy, "sim", r.sim, r.sim_records, ideal, tp))
    return rows


def render_table(
    rows: list[list[str]], markdown: bool = False, columns: Sequence[str] = COLUMNS
) -> str:
    """Aligned text table (or a markdown table) of ``rows`` under ``columns``."""
    if markdown:
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def agreement_rows(results: list[PolicyResult]) -> list[list[str]]:
    """testbed / simulator ratios of SLO attainment and mean collective completion time."""
    return [
        [
            r.policy,
            _ratio(r.testbed.slo_attainment, r.sim.slo_attainment),
            _ratio(r.testbed.cct_mean, r.sim.cct_mean),
        ]
        for r in results
        if r.testbed is not None
    ]


def seed_rows(results: list[PolicyResult]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the per-seed SLO attainment table (testbed and simulator rows; a
    testbed row whose runs recorded errors marked as in :func:`table_rows`)."""
    seeds = sorted({s.seed for r in results for s in r.seeds})
    header = ["policy", "source", *(f"seed {s} %" for s in seeds), "pooled %"]
    rows = []
    for r in results:
        by_seed = {s.seed: s for s in r.seeds}
        for source in ("testbed", "sim"):
            values = [_seed_attainment(by_seed.get(s), source) for s in seeds]
            if all(v is None for v in values):
                continue
            pooled = _attainment(r, source)
            cells = [_fmt(v, 100.0, 1) for v in [*values, pooled]]  # % as in the main table
            label = _marked(source, error_counts(r)[0]) if source == "testbed" else source
            rows.append([display(r.policy), label, *cells])
    return header, rows


def _seed_attainment(run: SeedRun | None, source: str) -> float | None:
    if run is None:
        return None
    return run.testbed_attainment if source == "testbed" else run.sim_attainment


def seed_ratios(
    results: list[PolicyResult], source: str = "testbed"
) -> dict[str, list[float | None]]:
    """rmlq's SLO attainment over fair's and static's, seed by seed: one entry per seed of
    rmlq's, in order, None where a side has no figure (no run) or fair's or static's is 0."""
    by = {r.policy: {s.seed: s for s in r.seeds} for r in results}
    out: dict[str, list[float | None]] = {}
    for name in ("fair", "static"):
        if name not in by:
            continue
        for seed, run in sorted(by.get("rmlq", {}).items()):
            rm = _seed_attainment(run, source)
            other = _seed_attainment(by[name].get(seed), source)
            out.setdefault(name, []).append(rm / other if rm is not None and other else None)
    return out


def _ratio_list(ratios: list[float | None]) -> str:
    return ", ".join("-" if x is None else f"{x:.2f}" for x in ratios)


def nearest_rank(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by nearest rank: the sorted value at index
    ``floor(q * n)``, capped at the last (so q = 0.5 of an even count is the upper middle one).

    Every percentile the contention report prints, except the promotion medians (the mean of
    the two middle values, :func:`statistics.median`), comes from here. Raises ValueError for
    no values.
    """
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def promotion_summary(results: list[PolicyResult]) -> dict[str, Any]:
    """Median / p90 / count of measured promotion latencies over all policies (seconds)."""
    values = [v for r in results for v in r.promotions]
    if not values:
        return {"count": 0}
    return {
        "count": len(values),
        "median": statistics.median(values),
        "p90": nearest_rank(values, 0.9),
        "by_policy": {
            r.policy: (statistics.median(r.promotions) if r.promotions else None) for r in results
        },
    }


def drops_line(results: list[PolicyResult]) -> str:
    """One line: the packets the testbed's shaped ports dropped, in all and per policy that ran
    there (a drop costs TCP a retransmission the fluid simulator never pays)."""
    ran = [r for r in results if r.testbed_records is not None]
    total = sum(r.dropped_packets for r in ran)
    each = ", ".join(f"{r.policy} {r.dropped_packets}" for r in ran)
    return f"the testbed's ports dropped {total} packets ({each})"


def _quantiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    p50, p90 = (nearest_rank(values, q) for q in (0.5, 0.9))
    return {"p50": p50, "p90": p90, "count": float(len(values))}


def to_json(results: list[PolicyResult], meta: dict[str, Any]) -> dict[str, Any]:
    """The JSON document written to ``results.json``."""
    return {
        "meta": meta,
        "policies": {
            r.policy: {
                "bound": r.policy == IDEAL,
                "oracle": _order(r) == 2,
                "testbed": json_metrics(r.testbed) if r.testbed else None,
                "testbed_kv_top_pct": _pct(top_share(r.testbed_records))
                if r.testbed_records
                else None,
                "sim_kv_top_pct": _pct(top_share(r.sim_records)) if r.sim_records else None,
                "testbed_kv_above_tp_pct": _pct(
                    above_collectives_share(r.testbed_records, _tp_level(r))
                )
                if r.testbed_records
                else None,
                "sim_kv_above_tp_pct": _pct(above_collectives_share(r.sim_records))
                if r.sim_records
                else None,
                "testbed_control": r.control,
                "control_cpu_seconds": r.cpu_seconds,
                "admission_delay_s": _quantiles(r.admission),
                "ablation": json_metrics(r.ablation) if r.ablation else None,
                "ablation_control": r.ablation_control or None,
                "promotion_latency_ablation_s": r.ablation_promotions,
                "sim": json_metrics(r.sim),
                "promotion_latency_s": r.promotions,
                "class_bytes": {
                    k: {f"1:{c:x}": n for c, n in v.items()} for k, v in r.class_bytes.items()
                },
                "dropped_packets": r.dropped_packets,
                "errors": r.errors,
                "wall_seconds": r.wall_seconds,
                "per_seed": [
                    {
                        "seed": run.seed,
                        "testbed_slo_attainment_pct": _pct(run.testbed_attainment),
                        "sim_slo_attainment_pct": _pct(run.sim_attainment),
                    }
                    for run in r.seeds
                ],
            }
            for r in results
        },
        "promotion": promotion_summary(results),
    }


def top_share(records: RunRecords) -> float | None:
    """Fraction of KV flows admitted at level 0 (the top level)."""
    kv = [f for f in records.flows if f.cls == "kv"]
    return sum(f.first_level == 0 for f in kv) / len(kv) if kv else None


def tp_admission_level(records: RunRecords) -> int | None:
    """The most urgent level any collective (TP) flow was admitted at; None without one."""
    levels = [f.first_level for f in records.flows if f.cls == "tp" and f.first_level >= 0]
    return min(levels) if levels else None


def above_collectives_share(records: RunRecords, tp_level: int | None = None) -> float | None:
    """Fraction of KV flows admitted above every collective: at a level more urgent than
    ``tp_level`` (default: :func:`tp_admission_level` of ``records``). With an urgent tier of
    several levels the top level alone understates how many flows skip the deferral: rmlq's
    tier is levels 0-1, both above the collectives. The testbed's records hold no TP flows
    (the plugin carries them): its rows take the level from the simulator's run of the same
    policy. None without KV flows or a TP level."""
    line = tp_admission_level(records) if tp_level is None else tp_level
    kv = [f for f in records.flows if f.cls == "kv"]
    if line is None or not kv:
        return None
    return sum(0 <= f.first_level < line for f in kv) / len(kv)


def _pct(value: float | None) -> float | None:
    return None if value is None else value * 100.0


def _tp_level(result: PolicyResult) -> int | None:
    """The TP admission level of ``result``'s simulator run (the same policy, same traces)."""
    return tp_admission_level(result.sim_records) if result.sim_records else None


def _seed_spread(result: PolicyResult, source: str) -> tuple[float, float] | None:
    values = [v for run in result.seeds if (v := _seed_attainment(run, source)) is not None]
    return (min(values), max(values)) if len(values) > 1 else None


def _plot_label(result: PolicyResult, sources: list[tuple[str, str, str | None]]) -> str:
    """A policy's name under its bars, marked as in :func:`table_rows` when its testbed bars
    come from runs that recorded errors."""
    errors = error_counts(result)[0] if any(s[1] == "testbed" for s in sources) else 0
    return _marked(display(result.policy), errors if result.testbed is not None else 0)


def _plot_collectives(
    ax: Any, results: list[PolicyResult], sources: list[tuple[str, str, str | None]]
) -> None:
    """Mean collective completion time per policy (the other half of the joint score)."""
    width = 0.8 / len(sources)
    for i, (_label, source, hatch) in enumerate(sources):
        offset = (i - (len(sources) - 1) / 2) * width
        for x, r in enumerate(results):
            metrics = r.testbed if source == "testbed" else r.sim
            if metrics is None or metrics.cct_mean is None:
                continue
            ax.bar(
                x + offset,
                metrics.cct_mean * 1e3,
                width,
                color=colour(r.policy),
                hatch=hatch,
                edgecolor="black",
                linewidth=0.5,
            )
    ax.set_xticks(list(range(len(results))), [_plot_label(r, sources) for r in results])
    ax.tick_params(axis="x", rotation=30, labelsize=7)
    ax.set_ylabel("mean collective time (ms)")
    ax.set_title("collectives (lower is better)", fontsize=9)


def plot(
    results: list[PolicyResult], out: Path, load: float, meta: dict[str, Any] | None = None
) -> list[Path]:
    """PNG plots: SLO attainment per policy (testbed hatched, simulator solid; one colour per
    policy; min-max bars across seeds), TTFT and CCT CDFs of each (drawn by
    :func:`flowsched.report.plot_cdfs`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = sorted(results, key=_order)
    paths = []
    width_in = max(6.0, 0.9 * len(results) + 2)
    fig, (ax, cct_ax) = plt.subplots(
        1, 2, figsize=(width_in * 1.6, 4), gridspec_kw={"width_ratios": [1.0, 0.6]}
    )
    xs = range(len(results))
    from matplotlib.patches import Patch

    sources: list[tuple[str, str, str | None]] = [("simulator", "sim", None)]
    if any(r.testbed is not None for r in results):  # no testbed bars in simulator-only mode
        sources.insert(0, ("testbed", "testbed", "//"))
    width = 0.8 / len(sources)
    for i, (_label, source, hatch) in enumerate(sources):
        offset = (i - (len(sources) - 1) / 2) * width
        for x, r in zip(xs, results, strict=True):
            value = _attainment(r, source)
            if value is None:
                continue
            spread = _seed_spread(r, source)
            ax.bar(
                x + offset,
                value * 100,
                width,
                color=colour(r.policy),
                hatch=hatch,
                edgecolor="black",
                linewidth=0.5,
                yerr=[[(value - spread[0]) * 100], [(spread[1] - value) * 100]] if spread else None,
                capsize=3,
            )
    handles = [
        Patch(facecolor="lightgrey", edgecolor="black", hatch=hatch, label=label)
        for label, _source, hatch in sources
    ]
    ax.set_xticks(list(xs), [_plot_label(r, sources) for r in results], rotation=20, fontsize=8)
    ax.set_ylabel("KV TTFT SLO attainment (%)")
    ax.set_ylim(0, 100)
    meta = meta or {}
    seeds = meta.get("seeds") or []
    ax.set_title(
        f"contention trace, KV load {load:g}, "
        + (
            f"seeds {seeds[0]}-{seeds[-1]} pooled (bars: min-max)"
            if len(seeds) > 1
            else f"seed {seeds[0]}"
            if seeds
            else ""
        ),
        fontsize=9,
    )
    ax.legend(handles=handles, fontsize=8)
    _plot_collectives(cct_ax, results, sources)
    fig.tight_layout()
    paths.append(out / "slo_attainment.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    plot_meta = {"scenario": "contention trace", "seeds": seeds}
    for source in ("testbed", "sim"):
        outcomes = [
            Outcome.from_records(
                r.policy,
                load,
                records,
                bound=r.policy == IDEAL,
                oracle=_order(r) == 2,
                source="" if source == "sim" else source,
            )
            for r in results
            if (records := r.testbed_records if source == "testbed" else r.sim_records)
        ]
        path = out / f"cdf_{source}.png"
        if outcomes and shared_report.plot_cdfs(path, outcomes, load, plot_meta):
            paths.append(path)
    return paths


#: the baselines rmlq is scored against jointly (attainment and collective time), in order
JOINT_BASELINES = ("edf", "edf+late")


#: the policies the headline compares (rmlq and its baselines)
_COMPARED = ("rmlq", *JOINT_BASELINES, "fair", "static")


def headline(results: list[PolicyResult]) -> list[str]:
    """The joint score on each source: rmlq's KV SLO attainment and its collective and iteration
    times next to edf's, and edf+late's where it ran (a policy must not win attainment by
    starving TP), its share of KV flows admitted at the top level, its ratio to the ideal
    bound; then rmlq against fair and static, and which of them ran on the testbed with
    errors (their figures measure incomplete runs)."""
    by = {r.policy: r for r in results}
    lines: list[str] = []
    for source in ("testbed", "sim"):
        start = len(lines)
        joints = [
            _joint(by.get("rmlq"), by.get(name), name, source, shares=not index)
            for index, name in enumerate(JOINT_BASELINES)
        ]
        joint = joints[0]
        lines += [f"- {source}: {line}" for line in joints if line]
        rm = _attainment(by.get("rmlq"), source)
        parts = [
            f"{rm / other:.2f}x {name}"
            for name in ("fair", "static")
            if rm is not None and (other := _attainment(by.get(name), source))
        ]
        if parts:  # under the joint line, else on its own naming the source
            prefix = "  - " if joint else f"- {source}: "
            lines.append(prefix + "rmlq attains " + ", ".join(parts) + ".")
        ratios = seed_ratios(results, source)
        fair = ratios.get("fair", [])
        if len(fair) > 1 and any(x is not None for x in fair):
            lines.append(
                f"  - {source}, seed by seed: rmlq / fair = {_ratio_list(fair)}"
                f"; rmlq / static = {_ratio_list(ratios.get('static', []))}."
            )
        flawed = [
            _marked(r.policy, n)
            for r in results
            if r.policy in _COMPARED and r.testbed is not None and (n := error_counts(r)[0])
        ]
        if source == "testbed" and flawed and len(lines) > start:
            lines.append(
                f"  - {source}: measured in runs that recorded errors: {', '.join(flawed)}."
            )
    ideal = ideal_attainment(results)
    if ideal is not None:
        lines.append(
            f"- ideal-network bound (simulator; every transfer on a private full-rate path, TP "
            f"alone on the links): {ideal * 100:.1f}% attainment, the ceiling of every row."
        )
    return [*lines, ""] if lines else []


def _joint(
    rmlq: PolicyResult | None,
    other: PolicyResult | None,
    name: str,
    source: str,
    *,
    shares: bool = True,
) -> str:
    """``rmlq A% vs NAME B% attainment, CCT x vs y ms, ...: met/missed`` (empty if absent);
    with ``shares``, rmlq's shares of KV flows at the top level and above the collectives."""
    if rmlq is None or other is None:
        return ""
    testbed = source == "testbed"
    a, b = (rmlq.testbed, other.testbed) if testbed else (rmlq.sim, other.sim)
    if a is None or b is None or a.slo_attainment is None or b.slo_attainment is None:
        return ""
    if not a.cct_mean or not b.cct_mean:
        return ""
    records = rmlq.testbed_records if testbed else rmlq.sim_records
    top = top_share(records) if records is not None and shares else None
    above = above_collectives_share(records, _tp_level(rmlq)) if records is not None else None
    met = a.slo_attainment >= b.slo_attainment and a.cct_mean <= b.cct_mean
    text = (
        f"rmlq {a.slo_attainment * 100:.1f}% vs {name} {b.slo_attainment * 100:.1f}% KV SLO "
        f"attainment, with mean collective time {a.cct_mean * 1e3:.1f} vs "
        f"{b.cct_mean * 1e3:.1f} ms"
    )
    if a.iteration_mean and b.iteration_mean:
        text += (
            f" and mean iteration {a.iteration_mean * 1e3:.0f} vs {b.iteration_mean * 1e3:.0f} ms"
        )
    if top is not None:
        text += f"; rmlq admits {top:.0%} of KV flows at the top level"
        if above is not None:
            text += f" and {above:.0%} above the collectives"
    verdict = "both" if met else "not both"
    return text + f". Attainment >= {name}'s and collective time <= {name}'s: {verdict}."


def _attainment(result: PolicyResult | None, source: str) -> float | None:
    if result is None:
        return None
    metrics = result.testbed if source == "testbed" else result.sim
    return metrics.slo_attainment if metrics is not None else None


#: alt text of each plot :func:`plot` may write, in the order the report shows them
PLOT_TITLES = {
    "slo_attainment.png": "SLO attainment",
    "cdf_testbed.png": "testbed CDFs",
    "cdf_sim.png": "simulator CDFs",
}


def markdown(results: list[PolicyResult], meta: dict[str, Any], plots: Sequence[str] = ()) -> str:
    """The short markdown report (``report.md``), linking the plots named in ``plots`` (the
    file names :func:`plot` wrote)."""
    promo = promotion_summary(results)
    lines = [
        "# Contention benchmark",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Mode: {meta['mode']}. {meta['setup']}",
        "",
        f"Trace: {_seed_text(meta)}, {meta['duration']} s each, KV load {meta['load']} of "
        f"each decode host's ingress link, {meta['flows']} transfers, link rate "
        f"{meta['rate_mbit']} Mbit/s.",
        "",
        render_table(table_rows(results), markdown=True),
        "",
        *headline(results),
    ]
    header, rows = seed_rows(results)
    if len(header) > 4:
        lines += ["SLO attainment seed by seed:", ""]
        lines += [render_table(rows, markdown=True, columns=header), ""]
    agreement = agreement_rows(results)
    if agreement:
        lines += [
            "Testbed / simulator ratios (1.00 = identical):",
            "",
            "| policy | SLO attainment | mean CCT |",
            "|---|---|---|",
        ]
        lines += [f"| {a} | {b} | {c} |" for a, b, c in agreement]
        lines.append("")
    if promo.get("count"):
        lines.append(
            f"Promotion latency (decision -> first packet in the new class at the switch port): "
            f"median {promo['median'] * 1e3:.1f} ms, p90 {promo['p90'] * 1e3:.1f} ms over "
            f"{promo['count']} promotions."
        )
        lines.append("")
    if any(r.testbed_records is not None for r in results):
        drops = drops_line(results)
        lines += [drops[0].upper() + drops[1:] + ".", ""]
    lines += [f"- {note}" for note in meta.get("notes", [])]
    lines.append("")
    for name, title in PLOT_TITLES.items():
        if name in plots:
            lines += [f"![{title}]({name})", ""]
    return "\n".join(lines)


def _seed_text(meta: dict[str, Any]) -> str:
    seeds = meta.get("seeds") or [meta["seed"]]
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    return f"seeds {', '.join(str(s) for s in seeds)} (every policy runs every seed; pooled)"


def write(results: list[PolicyResult], meta: dict[str, Any], out: Path) -> list[Path]:
    """Write the PNG plots, report.md and results.json (last) into ``out``; return the paths.
    :class:`~flowsched.report.PlotError` when a plot failed, after the other files are
    written."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "report.md"]
    load = float(meta.get("load", 0.0))
    plots, problem = shared_report.draw_plots(
        lambda drawn: drawn.extend(plot(results, out, load, meta))
    )
    paths[1].write_text(markdown(results, meta, [p.name for p in plots]), encoding="utf-8")
    shared_report.write_results(
        paths[0], to_json(results, meta), problem, [*plots, paths[1], paths[0]], indent=1
    )
    return paths + plots
