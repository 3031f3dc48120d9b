"""Comparison reports for policy runs: terminal table, JSON, PNG plots, markdown, progress bar.

Shared by ``flowsched sim`` and the testbed. Input is a list of :class:`Outcome` (one policy at
one load); nothing here knows how the outcome was produced. Plots use matplotlib's Agg backend
(no display needed). The ideal-network bound is shown first as the ceiling, oracle policies
(``llf``) last as references; neither is ranked. Tables, JSON and plots use the same units
(ms, %), and every plot names its scenario, loads and seeds and gives each policy one colour
(the same for its simulator and testbed rows, which differ by their markers).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from flowsched.metrics import RunMetrics, RunRecords, collective_values, summarize, ttft_values


@dataclass(slots=True)
class Outcome:
    """One policy at one load: its metrics and the raw samples the CDF plots need."""

    policy: str
    load: float
    metrics: RunMetrics
    ttfts: list[float] = field(default_factory=list)
    ccts: list[float] = field(default_factory=list)
    oracle: bool = False
    wall_s: float = 0.0
    #: the ideal-network bound: a ceiling, never a competitor
    bound: bool = False
    #: the metrics of each seed (for error bars); empty when only pooled records exist
    per_seed: list[RunMetrics] = field(default_factory=list)
    #: where it ran ("" = the simulator); a row's ``x ideal`` uses the bound of its own source
    source: str = ""

    @classmethod
    def from_records(
        cls,
        policy: str,
        load: float,
        records: RunRecords,
        *,
        oracle: bool = False,
        wall_s: float = 0.0,
        bound: bool = False,
        seeds: Sequence[RunRecords] = (),
        source: str = "",
    ) -> Outcome:
        """Summarize ``records`` (pooled) and each of ``seeds`` into an outcome."""
        return cls(
            policy,
            load,
            summarize(records),
            ttft_values(records),
            collective_values(records),
            oracle,
            wall_s,
            bound,
            [summarize(r) for r in seeds] if len(seeds) > 1 else [],
            source,
        )

    @property
    def display(self) -> str:
        """The row name: ``ideal (bound)``, ``llf (oracle)`` or the policy."""
        if self.bound:
            return f"{self.policy} (bound)"
        return f"{self.policy} (oracle)" if self.oracle else self.policy

    def spread(self, attr: str) -> tuple[float, float] | None:
        """(min, max) of ``attr`` over the seeds, or None with fewer than two seeds."""
        values = [v for m in self.per_seed if (v := getattr(m, attr)) is not None]
        return (min(values), max(values)) if len(values) > 1 else None


# --------------------------------------------------------------------------- table
_COLUMNS: list[tuple[str, str, float, str]] = [
    # header, RunMetrics attribute, scale, format
    ("SLO att", "slo_attainment", 100.0, "{:.1f}%"),
    ("TTFT p50 ms", "ttft_p50", 1e3, "{:.1f}"),
    ("TTFT p99 ms", "ttft_p99", 1e3, "{:.1f}"),
    ("CCT ms", "cct_mean", 1e3, "{:.3f}"),
    ("iter ms", "iteration_mean", 1e3, "{:.1f}"),
    ("miss", "deadline_miss_rate", 100.0, "{:.1f}%"),
    ("early+ ms", "earliness_pos_mean", 1e3, "{:.2f}"),
]
#: JSON key suffix of each scale: the JSON carries the table's numbers in the table's units
_UNIT = {100.0: "pct", 1e3: "ms"}
#: metrics the table does not show, with their JSON units
_EXTRA: list[tuple[str, float]] = [
    ("ttft_mean", 1e3),
    ("cct_p99", 1e3),
    ("earliness_mean", 1e3),
]


def _cell(metrics: RunMetrics, attr: str, scale: float, fmt: str) -> str:
    value = getattr(metrics, attr)
    return "-" if value is None else fmt.format(value * scale)


def _used_columns(outcomes: Sequence[Outcome]) -> list[tuple[str, str, float, str]]:
    return [c for c in _COLUMNS if any(getattr(o.metrics, c[1]) is not None for o in outcomes)]


def _order(outcome: Outcome) -> int:
    return 0 if outcome.bound else 2 if outcome.oracle else 1


def vs_bound(outcome: Outcome, outcomes: Iterable[Outcome]) -> float | None:
    """``outcome``'s SLO attainment / the ideal bound's at the same load and from the same
    source (None if either lacks)."""
    bound = next(
        (o for o in outcomes if o.bound and o.load == outcome.load and o.source == outcome.source),
        None,
    )
    mine = outcome.metrics.slo_attainment
    if bound is None or mine is None or not bound.metrics.slo_attainment:
        return None
    return mine / bound.metrics.slo_attainment


def table(outcomes: Sequence[Outcome], title: str = "") -> str:
    """A fixed-width comparison table: one block per load, the ideal bound first (the ceiling),
    competitors next, oracles last; ``x ideal`` = SLO attainment / the bound's."""
    columns = _used_columns(outcomes)
    ratio = any(o.bound for o in outcomes) and any(
        o.metrics.slo_attainment is not None for o in outcomes
    )
    header = ["load", "policy", *(c[0] for c in columns), *(["x ideal"] if ratio else [])]
    rows: list[list[str]] = []
    for load in sorted({o.load for o in outcomes}):
        at_load = [o for o in outcomes if o.load == load]
        for outcome in sorted(at_load, key=_order):
            cells = [_cell(outcome.metrics, *c[1:]) for c in columns]
            if ratio:
                value = vs_bound(outcome, at_load)
                cells.append("-" if value is None else f"{value:.2f}")
            rows.append([f"{load:g}", outcome.display, *cells])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [title] if title else []
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------- JSON / markdown
def to_json(outcomes: Sequence[Outcome], meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """A JSON-ready dict: ``meta`` plus one entry per outcome (metrics, no raw samples)."""
    return {
        "meta": dict(meta or {}),
        "runs": [
            {
                "policy": o.policy,
                "load": o.load,
                "oracle": o.oracle,
                "bound": o.bound,
                "source": o.source or "simulator",
                "wall_s": round(o.wall_s, 3),
                "vs_ideal": vs_bound(o, outcomes),
                "metrics": _finite(json_metrics(o.metrics)),
                "per_seed": [_finite(json_metrics(m)) for m in o.per_seed],
            }
            for o in outcomes
        ],
    }


def json_metrics(metrics: RunMetrics) -> dict[str, Any]:
    """``metrics`` in the table's units, each key named with its unit (``ttft_p50_ms``)."""
    data: dict[str, Any] = {"requests": metrics.requests, "iterations": metrics.iterations}
    data["deadline_transfers"] = metrics.deadline_transfers
    data["flows"] = metrics.flows
    for attr, scale in [(c[1], c[2]) for c in _COLUMNS] + _EXTRA:
        value = getattr(metrics, attr)
        data[f"{attr}_{_UNIT[scale]}"] = None if value is None else value * scale
    data["class_fct_ms"] = {
        cls: {k: v if k == "count" else v * 1e3 for k, v in stats.items()}
        for cls, stats in metrics.class_fct.items()
    }
    return data


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def best_baseline(outcomes: Iterable[Outcome], load: float, exclude: str) -> Outcome | None:
    """The outcome other than ``exclude`` with the highest SLO attainment at ``load``, neither
    an oracle nor the ideal bound (references and the ceiling, never baselines)."""
    candidates = [
        o
        for o in outcomes
        if o.load == load
        and not o.oracle
        and not o.bound
        and o.policy != exclude
        and o.metrics.slo_attainment is not None
    ]
    return max(candidates, key=lambda o: o.metrics.slo_attainment or 0.0, default=None)


def markdown(
    outcomes: Sequence[Outcome],
    meta: dict[str, Any] | None = None,
    plots: Sequence[str] = ("attainment.png", "iteration.png"),
) -> str:
    """A short markdown report: what ran, the table, the ``plots`` (file names)."""
    meta = meta or {}
    lines = [f"# flowsched comparison: {meta.get('scenario', '')}", ""]
    lines += [f"- {key}: {value}" for key, value in meta.items()]
    lines += ["", "```", table(outcomes), "```", ""]
    lines += [
        "The `ideal (bound)` row is the ceiling, not a competitor: every KV, KV-reuse, param-sync "
        "and experience flow on a private full-rate path, the collectives alone on the real "
        "links. `x ideal` = SLO attainment / the bound's. Oracle rows (`llf`) use perfect "
        "knowledge and are a reference, not a competitor. Times in ms, ratios in %.",
        "",
    ]
    for name in plots:
        lines += [f"![{name.removesuffix('.png')}]({name})", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- plots
def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


#: a fixed colour per known policy name, so a policy looks the same in every plot
_PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf", "#393b79", "#b8860b", "#637939", "#8c6d31", "#843c39", "#7b4173",
)  # fmt: skip
_KNOWN = (
    "ideal", "rmlq", "fair", "static", "static+late", "edf", "edf+late", "sjf", "pias",
    "karuna", "llf", "llf+late", "rmlq+late", "karuna+late", "sjf+late", "pias+late",
)  # fmt: skip


def colour(policy: str) -> str:
    """The colour of ``policy`` in every plot (known names fixed, others by a stable hash)."""
    if policy in _KNOWN:
        return _PALETTE[_KNOWN.index(policy) % len(_PALETTE)]
    return _PALETTE[sum(policy.encode()) % len(_PALETTE)]


def policy_of(label: str) -> str:
    """The policy a row's label names: its first word (``flowsched bench serving`` labels its
    rows with their source, ``rmlq sim`` and ``rmlq testbed``; policy names have no spaces)."""
    return label.split(" ", 1)[0]


def line_style(outcome: Outcome) -> dict[str, Any]:
    """How ``outcome`` is drawn in every plot: its policy's colour whatever the row's source,
    the line by role (the bound dotted, oracles dashed), the marker by source (squares for
    rows measured on the testbed, circles for the simulator's)."""
    return {
        "color": colour(policy_of(outcome.policy)),
        "linestyle": ":" if outcome.bound else "--" if outcome.oracle else "-",
        "marker": "s" if outcome.source else "o",
        "label": outcome.display,
    }


def plot_title(meta: dict[str, Any] | None, loads: Iterable[float]) -> str:
    """``scenario, load(s) ..., seeds ...`` from the report's ``meta``."""
    meta = meta or {}
    loads = sorted(set(loads))
    load_text = "load " + ", ".join(f"{x:g}" for x in loads) if loads else ""
    seeds = meta.get("seeds") or []
    seed_text = (
        f"seed {seeds[0]}"
        if len(seeds) == 1
        else f"seeds {seeds[0]}-{seeds[-1]} (bars: min-max)"
        if seeds
        else ""
    )
    return ", ".join(x for x in (str(meta.get("scenario", "")), load_text, seed_text) if x)


def plot_vs_load(
    path: Path,
    outcomes: Sequence[Outcome],
    attr: str,
    ylabel: str,
    scale: float,
    meta: dict[str, Any] | None = None,
) -> bool:
    """``metrics.<attr>`` against load, one line (one colour) per policy, min-max error bars
    across seeds; False if no data."""
    series: dict[str, list[Outcome]] = {}
    for o in outcomes:
        value = getattr(o.metrics, attr)
        if value is not None and math.isfinite(value):
            series.setdefault(o.display, []).append(o)
    if not series:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for runs in sorted(series.values(), key=lambda r: (_order(r[0]), r[0].policy)):
        runs = sorted(runs, key=lambda o: o.load)
        xs = [o.load for o in runs]
        ys = [getattr(o.metrics, attr) * scale for o in runs]
        low, high = [], []
        for o, y in zip(runs, ys, strict=True):
            spread = o.spread(attr)
            # the pooled value can sit a rounding error (or, for a pooled mean of unequal
            # seeds, more) outside the per-seed range: a bar never reaches past the value
            low.append(max(y - spread[0] * scale, 0.0) if spread else 0.0)
            high.append(max(spread[1] * scale - y, 0.0) if spread else 0.0)
        ax.errorbar(xs, ys, yerr=[low, high], capsize=3, **line_style(runs[0]))
    ax.set_xticks(sorted({o.load for o in outcomes}))
    ax.set_xlabel("load")
    ax.set_ylabel(ylabel)
    ax.set_title(plot_title(meta, (o.load for o in outcomes)), fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_cdfs(
    path: Path, outcomes: Sequence[Outcome], load: float, meta: dict[str, Any] | None = None
) -> bool:
    """CDFs of TTFT and collective completion time at ``load``; False if no samples."""
    at_load = sorted((o for o in outcomes if o.load == load), key=_order)
    panels = [
        (name, attr)
        for name, attr in (("TTFT (ms)", "ttfts"), ("collective (ms)", "ccts"))
        if any(getattr(o, attr) for o in at_load)
    ]
    if not panels:
        return False
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (name, attr) in zip(axes[0], panels, strict=True):
        for o in at_load:
            values = sorted(v * 1e3 for v in getattr(o, attr))
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                # a marker every tenth of the samples: the source shows, the curve stays a line
                ax.plot(values, ys, markevery=max(len(values) // 10, 1), **line_style(o))
        ax.set_xlabel(name)
        ax.set_ylabel("CDF")
        ax.set_xscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(plot_title(meta, [load]).replace(" (bars: min-max)", " pooled"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


class PlotError(RuntimeError):
    """Drawing the plots failed. The results were written all the same, results.json last
    (with the reason under ``meta.plot_error``); ``paths`` lists what was written."""

    def __init__(self, message: str, paths: list[Path]) -> None:
        super().__init__(message)
        self.paths = paths


def draw_plots(draw: Callable[[list[Path]], None]) -> tuple[list[Path], str | None]:
    """Run ``draw``, which appends the path of each plot it writes; return those plots and,
    when drawing failed, why. Every exception is caught: matplotlib raises many kinds, and an
    hour-long run's figures must still be written (then the caller raises PlotError)."""
    plots: list[Path] = []
    try:
        draw(plots)
    except Exception as exc:
        return plots, f"{type(exc).__name__}: {exc}"
    return plots, None


def write_results(
    path: Path, document: dict[str, Any], problem: str | None, written: list[Path], indent: int
) -> None:
    """Write ``document`` to ``path`` (results.json) in one step, after the plots and the
    report, so that a results.json says the run is done only when everything else is there;
    ``problem`` (from :func:`draw_plots`) goes into its meta and raises PlotError after it."""
    if problem is not None:
        document = {**document, "meta": {**document["meta"], "plot_error": problem}}
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(document, indent=indent) + "\n", encoding="utf-8")
    partial.replace(path)
    if problem is not None:
        raise PlotError(
            f"drawing the plots failed ({problem}); {', '.join(p.name for p in written)} were "
            "written without the rest",
            written,
        )


def write_all(
    out_dir: Path, outcomes: Sequence[Outcome], meta: dict[str, Any] | None = None
) -> list[Path]:
    """Write the PNG plots, ``report.md`` and ``results.json`` (last) into ``out_dir``; return
    the paths. PlotError when a plot failed, after the other files are written."""
    out_dir.mkdir(parents=True, exist_ok=True)

    def draw(plots: list[Path]) -> None:
        for name, attr, label, scale in (
            ("attainment.png", "slo_attainment", "SLO attainment (%)", 100.0),
            ("iteration.png", "iteration_mean", "iteration time (ms)", 1e3),
        ):
            if plot_vs_load(out_dir / name, outcomes, attr, label, scale, meta):
                plots.append(out_dir / name)
        for load in sorted({o.load for o in outcomes}):
            path = out_dir / f"cdf_load{load:g}.png"
            if plot_cdfs(path, outcomes, load, meta):
                plots.append(path)

    plots, problem = draw_plots(draw)
    # the report links only the summary plots that were drawn
    summary = [p.name for p in plots if not p.name.startswith("cdf_")]
    written = [out_dir / "results.json", out_dir / "report.md"]
    written[1].write_text(markdown(outcomes, meta, summary))
    write_results(written[0], to_json(outcomes, meta), problem, [*plots, *written], indent=2)
    return written + plots


# --------------------------------------------------------------------------- progress
class Progress:
    """A one-line progress bar on a stream (stderr by default); no dependencies.

    On a terminal the line is redrawn in place; otherwise one line per step is written.
    """

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 24) -> None:
        self.total, self.done, self.width = max(total, 1), 0, width
        self.stream = stream if stream is not None else sys.stderr
        self.started = time.monotonic()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def line(self, label: str) -> str:
        """The bar text for the current state, with the time left estimated from the pace of
        the units done so far (``eta ?`` before the first one)."""
        filled = self.width * self.done // self.total
        elapsed = time.monotonic() - self.started
        bar = "#" * filled + "." * (self.width - filled)
        eta = "?"
        if self.done:
            eta = _duration(elapsed / self.done * (self.total - self.done))
        return f"[{bar}] {self.done}/{self.total} {elapsed:6.1f}s eta {eta} {label}"

    def step(self, label: str) -> None:
        """Announce that the next unit (``label``) starts."""
        self._write(self.line(label))

    def advance(self, label: str = "") -> None:
        """Count one unit as done."""
        self.done += 1
        self._write(self.line(label))

    def close(self) -> None:
        """Finish the line."""
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()

    def _write(self, text: str) -> None:
        self.stream.write(("\r" + text + "\x1b[K") if self._tty else text + "\n")
        self.stream.flush()


def _duration(seconds: float) -> str:
    """``42s``, ``3m05s`` or ``1h02m``."""
    total = max(round(seconds), 0)
    if total < 60:
        return f"{total}s"
    if total < 3600:
        return f"{total // 60}m{total % 60:02d}s"
    return f"{total // 3600}h{total % 3600 // 60:02d}m"
