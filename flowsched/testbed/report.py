"""Tables, JSON, plots and the markdown report of the contention benchmark."""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowsched import report as shared_report
from flowsched.metrics import RunMetrics, RunRecords, merge, summarize
from flowsched.report import Outcome


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
    "SLO att.",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "CCT mean ms",
    "iter mean s",
    "sync miss",
    "KV FCT p50 ms",
    "KV FCT p99 ms",
)


def _row(policy: str, source: str, m: RunMetrics) -> list[str]:
    kv = m.class_fct.get("kv", {})
    return [
        policy,
        source,
        _fmt(m.slo_attainment),
        _fmt(m.ttft_p50, 1e3, 1),
        _fmt(m.ttft_p99, 1e3, 1),
        _fmt(m.cct_mean, 1e3, 1),
        _fmt(m.iteration_mean),
        _fmt(m.deadline_miss_rate, 1, 2),
        _fmt(kv.get("p50"), 1e3, 1),
        _fmt(kv.get("p99"), 1e3, 1),
    ]


#: how a table row names the control plane that carried the levels of a testbed run
CONTROL_LABELS = {"agent": "testbed", "mini": "testbed, mini ctl"}


def table_rows(results: list[PolicyResult]) -> list[list[str]]:
    """One testbed row (plus an ablation row when run) and one simulator row per policy."""
    rows = []
    for r in results:
        if r.testbed is not None:
            rows.append(_row(r.policy, CONTROL_LABELS.get(r.control, r.control), r.testbed))
        if r.ablation is not None:
            label = CONTROL_LABELS.get(r.ablation_control, r.ablation_control)
            rows.append(_row(r.policy, f"{label} (ablation)", r.ablation))
        rows.append(_row(r.policy, "sim", r.sim))
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
    """Header and rows of the per-seed SLO attainment table (testbed and simulator rows)."""
    seeds = sorted({s.seed for r in results for s in r.seeds})
    header = ["policy", "source", *(f"seed {s}" for s in seeds), "pooled"]
    rows = []
    for r in results:
        by_seed = {s.seed: s for s in r.seeds}
        for source in ("testbed", "sim"):
            values = [_seed_attainment(by_seed.get(s), source) for s in seeds]
            if all(v is None for v in values):
                continue
            pooled = _attainment(r, source)
            rows.append([r.policy, source, *(_fmt(v) for v in values), _fmt(pooled)])
    return header, rows


def _seed_attainment(run: SeedRun | None, source: str) -> float | None:
    if run is None:
        return None
    return run.testbed_attainment if source == "testbed" else run.sim_attainment


def seed_ratios(results: list[PolicyResult], source: str = "testbed") -> dict[str, list[float]]:
    """rmlq's SLO attainment over fair's and static's, seed by seed."""
    by = {r.policy: {s.seed: s for s in r.seeds} for r in results}
    out: dict[str, list[float]] = {}
    for name in ("fair", "static"):
        for seed, run in sorted(by.get("rmlq", {}).items()):
            rm = _seed_attainment(run, source)
            other = _seed_attainment(by.get(name, {}).get(seed), source)
            if rm is not None and other:
                out.setdefault(name, []).append(rm / other)
    return out


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
                "testbed": r.testbed.to_dict() if r.testbed else None,
                "testbed_control": r.control,
                "control_cpu_seconds": r.cpu_seconds,
                "admission_delay_s": _quantiles(r.admission),
                "ablation": r.ablation.to_dict() if r.ablation else None,
                "ablation_control": r.ablation_control or None,
                "promotion_latency_ablation_s": r.ablation_promotions,
                "sim": r.sim.to_dict(),
                "promotion_latency_s": r.promotions,
                "class_bytes": {
                    k: {f"1:{c:x}": n for c, n in v.items()} for k, v in r.class_bytes.items()
                },
                "errors": r.errors,
                "wall_seconds": r.wall_seconds,
                "per_seed": [
                    {
                        "seed": run.seed,
                        "testbed_slo_attainment": run.testbed_attainment,
                        "sim_slo_attainment": run.sim_attainment,
                    }
                    for run in r.seeds
                ],
            }
            for r in results
        },
        "promotion": promotion_summary(results),
    }


def plot(results: list[PolicyResult], out: Path, load: float) -> list[Path]:
    """PNG plots: SLO attainment per policy (testbed vs sim), TTFT and CCT CDFs of each
    (drawn by :func:`flowsched.report.plot_cdfs`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(results))
    bars = [("simulator", [r.sim.slo_attainment or 0.0 for r in results])]
    if any(r.testbed is not None for r in results):  # no testbed bars in simulator-only mode
        tb = [(r.testbed.slo_attainment or 0.0) if r.testbed else 0.0 for r in results]
        bars.insert(0, ("testbed", tb))
    width = 0.8 / len(bars)
    for i, (label, values) in enumerate(bars):
        offset = (i - (len(bars) - 1) / 2) * width
        ax.bar([x + offset for x in xs], values, width, label=label)
    ax.set_xticks(list(xs), [r.policy for r in results])
    ax.set_ylabel("KV TTFT SLO attainment")
    ax.set_ylim(0, 1)
    ax.legend()
    fig.tight_layout()
    paths.append(out / "slo_attainment.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    for source in ("testbed", "sim"):
        outcomes = [
            Outcome.from_records(r.policy, load, records)
            for r in results
            if (records := r.testbed_records if source == "testbed" else r.sim_records)
        ]
        path = out / f"cdf_{source}.png"
        if outcomes and shared_report.plot_cdfs(path, outcomes, load):
            paths.append(path)
    return paths


def headline(results: list[PolicyResult]) -> list[str]:
    """rmlq's SLO attainment relative to fair and static, on the testbed and in the sim."""
    by = {r.policy: r for r in results}
    lines = []
    for source in ("testbed", "sim"):
        rm = _attainment(by.get("rmlq"), source)
        parts = [
            f"{rm / other:.2f}x {name}"
            for name in ("fair", "static")
            if rm is not None and (other := _attainment(by.get(name), source))
        ]
        if parts:
            lines.append(f"- {source}: rmlq attains {rm:.3f}, i.e. " + ", ".join(parts) + ".")
        ratios = seed_ratios(results, source)
        if len(ratios.get("fair", [])) > 1:
            lines.append(
                f"  - {source}, seed by seed: rmlq / fair = "
                + ", ".join(f"{x:.2f}" for x in ratios["fair"])
                + "; rmlq / static = "
                + ", ".join(f"{x:.2f}" for x in ratios.get("static", []))
                + "."
            )
    return [*lines, ""] if lines else []


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
    """Write results.json, the PNG plots and report.md into ``out``; return the paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "report.md"]
    paths[0].write_text(json.dumps(to_json(results, meta), indent=1), encoding="utf-8")
    plots = plot(results, out, float(meta.get("load", 0.0)))
    paths[1].write_text(markdown(results, meta, [p.name for p in plots]), encoding="utf-8")
    return paths + plots
