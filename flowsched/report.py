"""Comparison reports for policy runs: terminal table, JSON, PNG plots, markdown, progress bar.

Shared by ``flowsched sim`` and the testbed. Input is a list of :class:`Outcome` (one policy at
one load); nothing here knows how the outcome was produced. Plots use matplotlib's Agg backend
(no display needed). Oracle policies (``llf``) are shown as reference rows, never ranked.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterable, Sequence
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

    @classmethod
    def from_records(
        cls,
        policy: str,
        load: float,
        records: RunRecords,
        *,
        oracle: bool = False,
        wall_s: float = 0.0,
    ) -> Outcome:
        """Summarize ``records`` into an outcome."""
        return cls(
            policy,
            load,
            summarize(records),
            ttft_values(records),
            collective_values(records),
            oracle,
            wall_s,
        )


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


def _cell(metrics: RunMetrics, attr: str, scale: float, fmt: str) -> str:
    value = getattr(metrics, attr)
    return "-" if value is None else fmt.format(value * scale)


def _used_columns(outcomes: Sequence[Outcome]) -> list[tuple[str, str, float, str]]:
    return [c for c in _COLUMNS if any(getattr(o.metrics, c[1]) is not None for o in outcomes)]


def table(outcomes: Sequence[Outcome], title: str = "") -> str:
    """A fixed-width comparison table: one block per load, competitors first, oracles last."""
    columns = _used_columns(outcomes)
    header = ["load", "policy", *(c[0] for c in columns)]
    rows: list[list[str]] = []
    for load in sorted({o.load for o in outcomes}):
        at_load = [o for o in outcomes if o.load == load]
        for outcome in sorted(at_load, key=lambda o: o.oracle):
            name = f"{outcome.policy} (oracle)" if outcome.oracle else outcome.policy
            cells = [_cell(outcome.metrics, *c[1:]) for c in columns]
            rows.append([f"{load:g}", name, *cells])
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
                "wall_s": round(o.wall_s, 3),
                "metrics": _finite(o.metrics.to_dict()),
            }
            for o in outcomes
        ],
    }


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def best_baseline(outcomes: Iterable[Outcome], load: float, exclude: str) -> Outcome | None:
    """The non-oracle outcome other than ``exclude`` with the highest SLO attainment at ``load``."""
    candidates = [
        o
        for o in outcomes
        if o.load == load
        and not o.oracle
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
        "Oracle rows (`llf`) use perfect knowledge and are a reference, not a competitor.",
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


def plot_vs_load(
    path: Path, outcomes: Sequence[Outcome], attr: str, ylabel: str, scale: float
) -> bool:
    """Line plot of ``metrics.<attr>`` against load, one line per policy; False if no data."""
    series: dict[str, list[tuple[float, float]]] = {}
    for o in outcomes:
        value = getattr(o.metrics, attr)
        if value is not None and math.isfinite(value):
            series.setdefault(o.policy + (" (oracle)" if o.oracle else ""), []).append(
                (o.load, value * scale)
            )
    if not series:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in sorted(series.items()):
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot(xs, ys, marker="o", linestyle="--" if "oracle" in name else "-", label=name)
    ax.set_xlabel("load")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_cdfs(path: Path, outcomes: Sequence[Outcome], load: float) -> bool:
    """CDFs of TTFT and collective completion time at ``load``; False if no samples."""
    at_load = [o for o in outcomes if o.load == load]
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
                ax.plot(values, ys, label=o.policy, linestyle="--" if o.oracle else "-")
        ax.set_xlabel(name)
        ax.set_ylabel("CDF")
        ax.set_xscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"load {load:g}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_all(
    out_dir: Path, outcomes: Sequence[Outcome], meta: dict[str, Any] | None = None
) -> list[Path]:
    """Write ``results.json``, ``report.md`` and the PNG plots into ``out_dir``; return paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots: list[Path] = []
    for name, attr, label, scale in (
        ("attainment.png", "slo_attainment", "SLO attainment (%)", 100.0),
        ("iteration.png", "iteration_mean", "iteration time (ms)", 1e3),
    ):
        if plot_vs_load(out_dir / name, outcomes, attr, label, scale):
            plots.append(out_dir / name)
    summary = [p.name for p in plots]  # the report links only the plots that were drawn
    for load in sorted({o.load for o in outcomes}):
        path = out_dir / f"cdf_load{load:g}.png"
        if plot_cdfs(path, outcomes, load):
            plots.append(path)
    written = [out_dir / "results.json", out_dir / "report.md"]
    written[0].write_text(json.dumps(to_json(outcomes, meta), indent=2) + "\n")
    written[1].write_text(markdown(outcomes, meta, summary))
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
        """The bar text for the current state."""
        filled = self.width * self.done // self.total
        elapsed = time.monotonic() - self.started
        bar = "#" * filled + "." * (self.width - filled)
        return f"[{bar}] {self.done}/{self.total} {elapsed:6.1f}s {label}"

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
