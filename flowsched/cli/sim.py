"""``flowsched sim``: run a scenario under several policies and loads, compare, write a report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from flowsched import policies, scenario
from flowsched.metrics import merge
from flowsched.report import Outcome, Progress, table, write_all
from flowsched.sim.run import PolicySpec, run

DEFAULT_POLICIES = "rmlq,fair,static,edf,sjf,pias,karuna,llf"


def register(sub: Any) -> None:
    """Add the ``sim`` subcommand."""
    parser = sub.add_parser(
        "sim",
        help="compare policies on a simulated scenario",
        description="Run SCENARIO (a path or a name from bench/scenarios) under each policy at "
        "each load; print a comparison table and write JSON, markdown and PNG plots to --out.",
    )
    parser.add_argument("scenario", help="scenario file or bundled name (e.g. pd-serving)")
    parser.add_argument("--policies", default=DEFAULT_POLICIES, help="comma-separated policy names")
    parser.add_argument("--loads", default="0.3,0.5,0.7,0.9", help="comma-separated load values")
    parser.add_argument("--seed", type=int, default=None, help="trace seed (default: the file's)")
    parser.add_argument(
        "--seeds", type=int, default=1, help="run N seeds (seed, seed+1, ...) and pool them"
    )
    parser.add_argument("--out", type=Path, default=None, help="directory for JSON/markdown/PNG")
    parser.add_argument(
        "--policy-file",
        type=Path,
        default=None,
        help="policy file: K, timer and the arguments of the policy it names",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=_run)


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"flowsched sim: --loads: expected numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise SystemExit("flowsched sim: --loads: expected positive numbers")
    return values


def specs(names: list[str], policy_file: Path | None, default_levels: int) -> list[PolicySpec]:
    """One :class:`PolicySpec` per name; a policy file sets K, the timer and its policy's args."""
    unknown = [n for n in names if n not in policies.names()]
    if unknown:
        raise SystemExit(
            f"flowsched sim: unknown policy {unknown[0]!r} (known: {', '.join(policies.names())})"
        )
    if policy_file is None:
        built = [PolicySpec(name, {}, default_levels) for name in names]
    else:
        from flowsched import policyfile

        try:
            cfg = policyfile.load(policy_file)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"flowsched sim: {policy_file}: {exc}") from None
        built = [
            PolicySpec(
                name, cfg.args if name == cfg.policy else {}, cfg.num_levels, cfg.timer_period
            )
            for name in names
        ]
    for spec in built:  # e.g. rmlq needs K >= early_levels + 3: say so before any run
        try:
            spec.build()
        except ValueError as exc:
            where = f"{spec.name} with K={spec.num_levels}"
            raise SystemExit(f"flowsched sim: {where}: {exc}") from None
    return built


def _run(args: argparse.Namespace) -> int:
    try:
        scen = scenario.load(args.scenario)
    except scenario.ScenarioError as exc:
        print(f"flowsched sim: {exc}", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    loads = _floats(args.loads)
    first = args.seed if args.seed is not None else scen.scenario.seed
    seeds = list(range(first, first + max(args.seeds, 1)))
    runs = specs(names, args.policy_file, scen.sim.num_levels)
    outcomes = _compare(scen, runs, loads, seeds, quiet=args.quiet)
    seed_text = f"seed {first}" if len(seeds) == 1 else f"seeds {seeds[0]}..{seeds[-1]} pooled"
    print(table(outcomes, f"{scen.scenario.name} ({scen.kind}), {seed_text}"))
    if args.out is not None:
        meta = {
            "scenario": scen.scenario.name,
            "kind": scen.kind,
            "path": scen.path,
            "seeds": seeds,
            "policies": names,
            "loads": loads,
            "policy_file": str(args.policy_file) if args.policy_file else None,
        }
        for path in write_all(args.out, outcomes, meta):
            print(f"wrote {path}")
    return 0


def _compare(
    scen: scenario.Scenario,
    runs: list[PolicySpec],
    loads: list[float],
    seeds: list[int],
    *,
    quiet: bool,
) -> list[Outcome]:
    """Every policy at every load; the records of all seeds are pooled into one outcome."""
    progress = None if quiet else Progress(len(runs) * len(loads) * len(seeds))
    outcomes = []
    for load in loads:
        for spec in runs:
            results = []
            for seed in seeds:
                label = f"{spec.name} @ load {load:g}, seed {seed}"
                if progress:
                    progress.step(label)
                results.append(run(scen, spec, load, seed))
                if progress:
                    progress.advance(f"{label} ({results[-1].wall_s:.1f}s)")
            records = merge(r.records for r in results)
            oracle = spec.name in policies.ORACLES
            wall = sum(r.wall_s for r in results)
            outcomes.append(
                Outcome.from_records(spec.name, load, records, oracle=oracle, wall_s=wall)
            )
    if progress:
        progress.close()
    return outcomes
