"""``flowsched sim``: run a scenario under several policies and loads, compare, write a report.

Policy names are the registry's, plus ``ideal`` (the ideal-network bound, a ceiling) and
``NAME+late`` (NAME with the one-line late-dropping rule, ``drop_late = true``; only for the
policies that take it, :func:`~flowsched.sim.run.late_variants`). Ctrl-C stops
after the run in progress is abandoned: the finished policy/load pairs are still reported.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from flowsched import policies, scenario
from flowsched.cli._common import (
    EXIT_FAILURE,
    EXIT_USAGE,
    UsageError,
    finite_fractions,
    prepare_out_dir,
)
from flowsched.metrics import merge
from flowsched.policies import hwqueues
from flowsched.report import Outcome, PlotError, Progress, table, write_all
from flowsched.sim.run import (
    IDEAL,
    LATE_SUFFIX,
    PolicySpec,
    ideal_spec,
    late_problem,
    late_variants,
    run,
    variant,
)

DEFAULT_POLICIES = "ideal,rmlq,fair,static,static+late,edf,edf+late,sjf,pias,karuna,llf,llf+late"
#: ``flowsched sim paper``: the MFS paper's serving setting with the paper's comparison
PAPER = {
    "scenario": "pd-serving-paper",
    "policies": "ideal,rmlq,static,static+late,edf,edf+late,llf,llf+late",
    "loads": "0.5,0.6,0.7",
    "seeds": 3,
}
#: hardware queues a fabric offers when no policy file says (switches have 8 at best)
DEFAULT_HW_QUEUES = 8


def register(sub: Any) -> None:
    """Add the ``sim`` subcommand."""
    parser = sub.add_parser(
        "sim",
        help="compare policies on a simulated scenario",
        description="Run SCENARIO (a path or a name from bench/scenarios) under each policy at "
        "each load; print a comparison table and write JSON, markdown and PNG plots to --out.",
    )
    parser.add_argument(
        "scenario",
        help="scenario file or bundled name (e.g. pd-serving), or 'paper': the MFS paper's "
        f"setting ({PAPER['scenario']}, loads {PAPER['loads']}, {PAPER['seeds']} seeds, "
        "the paper's comparison; about 40 min of one core: give each load its own process, "
        "--loads 0.5 and so on, to use more cores)",
    )
    parser.add_argument(
        "--policies",
        default=None,
        help=f"comma-separated policy names, 'ideal' (the bound) and NAME+late for "
        f"{', '.join(late_variants())} (default {DEFAULT_POLICIES})",
    )
    parser.add_argument(
        "--loads", default=None, help="comma-separated load values (default 0.3,0.5,0.7,0.9)"
    )
    parser.add_argument("--seed", type=int, default=None, help="trace seed (default: the file's)")
    parser.add_argument(
        "--seeds",
        type=int,
        default=None,
        help="run N seeds (seed, seed+1, ...) and pool them (default 1)",
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


class BadInput(SystemExit):
    """Bad input to ``flowsched sim``: exit status 2; ``str()`` is the one-line message (which
    names the flag). A SystemExit, so that :func:`specs`' callers stop as they always did."""

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_USAGE)
        self.message = " ".join(message.split())

    def __str__(self) -> str:
        return self.message


def _floats(text: str) -> list[float]:
    try:
        return finite_fractions("--loads", text, scenario.MAX_LOAD, scenario.MIN_LOAD)
    except UsageError as exc:
        raise BadInput(f"flowsched sim: {exc}") from None


def specs(names: list[str], policy_file: Path | None, default_levels: int) -> list[PolicySpec]:
    """One :class:`PolicySpec` per name; a policy file sets K, the hardware queues, the timer
    and its policy's args. Every run's K levels are compressed into the hardware queues."""
    base_names = [n.removesuffix(LATE_SUFFIX) for n in names if n != IDEAL]
    unknown = [n for n in base_names if n not in policies.names()]
    if unknown:
        known = ", ".join([IDEAL, *policies.names()])
        raise BadInput(
            f"flowsched sim: --policies: unknown policy {unknown[0]!r} (known: {known}; "
            f"NAME+late for {', '.join(late_variants())})"
        )
    for name in names:
        if (problem := late_problem(name)) is not None:
            raise BadInput(f"flowsched sim: --policies: {problem}")
    levels, timer, file_args, file_policy = default_levels, None, {}, None
    queues = hwqueues.table(default_levels, min(default_levels, DEFAULT_HW_QUEUES))
    if policy_file is not None:
        from flowsched import policyfile

        try:
            cfg = policyfile.load(policy_file)
        except policyfile.PolicyFileError as exc:
            problem = policyfile.problem("--policy-file", policy_file, exc)
            raise BadInput(f"flowsched sim: {problem}") from None
        levels, timer, file_args, file_policy = (
            cfg.num_levels,
            cfg.timer_period,
            cfg.args,
            cfg.policy,
        )
        queues = cfg.level_queue
    built = []
    for name in names:
        if name == IDEAL:
            built.append(ideal_spec(levels))
            continue
        base, args = variant(name, file_policy, file_args)
        built.append(PolicySpec(base, args, levels, timer, label=name, level_queue=queues))
    for spec in built:  # e.g. rmlq needs K >= early_levels + 3: say so before any run
        try:
            spec.build()
        except ValueError as exc:
            where = f"{spec.title} with K={spec.num_levels}"
            raise BadInput(f"flowsched sim: --policies: {where}: {exc}") from None
    return built


def _defaults(args: argparse.Namespace) -> None:
    """Fill in what the command line left out (``paper`` has its own defaults)."""
    paper = args.scenario == "paper"
    if paper:
        args.scenario = PAPER["scenario"]
    if args.policies is None:
        args.policies = PAPER["policies"] if paper else DEFAULT_POLICIES
    if args.loads is None:
        args.loads = PAPER["loads"] if paper else "0.3,0.5,0.7,0.9"
    if args.seeds is None:
        args.seeds = PAPER["seeds"] if paper else 1


def _run(args: argparse.Namespace) -> int:
    _defaults(args)
    try:
        scen = scenario.load(args.scenario)
    except scenario.ScenarioError as exc:
        print(f"flowsched sim: {exc}", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    try:
        if not names:
            raise BadInput(f"flowsched sim: --policies: no policy given in {args.policies!r}")
        loads = _floats(args.loads)
        if args.seeds < 1:
            raise BadInput(f"flowsched sim: --seeds: expected at least 1, got {args.seeds}")
        if args.seed is not None and args.seed < 0:
            # random.Random(-n) is random.Random(n): --seed -1 --seeds 3 pooled one trace twice
            raise BadInput(f"flowsched sim: --seed: expected at least 0, got {args.seed}")
        runs = specs(names, args.policy_file, scen.sim.num_levels)
        if args.out is not None:  # now: a bad --out must not wait for the end of the runs
            try:
                prepare_out_dir("--out", args.out)
            except UsageError as exc:
                raise BadInput(f"flowsched sim: {exc}") from None
    except BadInput as exc:
        print(exc.message, file=sys.stderr)
        raise
    first = args.seed if args.seed is not None else scen.scenario.seed
    seeds = list(range(first, first + args.seeds))
    outcomes: list[Outcome] = []
    interrupted = False
    try:
        _compare(scen, runs, loads, seeds, outcomes, quiet=args.quiet)
    except KeyboardInterrupt:
        interrupted = True
        print(
            f"\nflowsched sim: interrupted; reporting the {len(outcomes)} finished "
            "policy/load pairs",
            file=sys.stderr,
        )
    seed_text = f"seed {first}" if len(seeds) == 1 else f"seeds {seeds[0]}..{seeds[-1]} pooled"
    if outcomes:
        print(table(outcomes, f"{scen.scenario.name} ({scen.kind}), {seed_text}"))
    if args.out is not None and outcomes:
        meta = {
            "scenario": scen.scenario.name,
            "kind": scen.kind,
            "path": scen.path,
            "seeds": seeds,
            "policies": names,
            "loads": loads,
            "policy_file": str(args.policy_file) if args.policy_file else None,
            "complete": not interrupted,
        }
        try:
            paths = write_all(args.out, outcomes, meta)
        except PlotError as exc:  # the figures are written; the run failed all the same
            for path in exc.paths:
                print(f"wrote {path}")
            print(f"flowsched sim: {exc}", file=sys.stderr)
            return EXIT_FAILURE
        for path in paths:
            print(f"wrote {path}")
    return 130 if interrupted else 0


def _compare(
    scen: scenario.Scenario,
    runs: list[PolicySpec],
    loads: list[float],
    seeds: list[int],
    outcomes: list[Outcome],
    *,
    quiet: bool,
) -> None:
    """Every policy at every load, appended to ``outcomes`` as each pair finishes (so an
    interrupted comparison keeps what is done); the seeds' records are pooled per pair."""
    progress = None if quiet else Progress(len(runs) * len(loads) * len(seeds))
    try:
        for load in loads:
            for spec in runs:
                results = []
                for seed in seeds:
                    label = f"{spec.title} @ load {load:g}, seed {seed}"
                    if progress:
                        progress.step(label)
                    results.append(run(scen, spec, load, seed))
                    if progress:
                        progress.advance(f"{label} ({results[-1].wall_s:.1f}s)")
                records = [r.records for r in results]
                outcomes.append(
                    Outcome.from_records(
                        spec.title,
                        load,
                        merge(records),
                        oracle=spec.name in policies.ORACLES and not spec.bound,
                        wall_s=sum(r.wall_s for r in results),
                        bound=spec.bound,
                        seeds=records,
                    )
                )
    finally:
        if progress:
            progress.close()
