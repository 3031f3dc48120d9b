"""``flowsched bench``: benchmarks. ``flowsched bench contention`` is the main one."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowsched.cli._common import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    UsageError,
    finite_fractions,
    positive_int,
    prepare_out_dir,
)

if TYPE_CHECKING:
    from flowsched.testbed.bench import BenchOptions
    from flowsched.testbed.trace import ScenarioParams

#: edf+late, the strongest baseline in the simulator, runs on the testbed too
DEFAULT_POLICIES = "fair,static,edf,edf+late,rmlq"
#: simulator-only rows: the ideal-network bound (the ceiling), the other late-dropping baseline
#: and the oracle; replays cost seconds, testbed runs ~28 s each (make demo stays under 10 min)
DEFAULT_SIM_POLICIES = "ideal,static+late,llf,llf+late"
#: traces per benchmark: one run on this 2-core testbed varies by several percent of SLO
#: attainment from run to run (fair most), so the default pools three seeds
DEFAULT_SEEDS = 3


def register(sub: Any) -> None:
    """Add the ``bench`` subcommand and its sub-subcommands."""
    parser = sub.add_parser("bench", help="run a benchmark (contention: the main job)")
    benches = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    contention = benches.add_parser(
        "contention",
        help="every policy on one seeded trace, on a local netns testbed and in the simulator",
        description="Build a network-namespace testbed with strict-priority htb bottlenecks, "
        "run every policy on the same seeded trace, replay it in the simulator at the "
        "testbed's link rates, and write a table, JSON, PNG plots and a markdown report. "
        "Without root or kernel support it says so and runs the simulator only.",
    )
    contention.add_argument("--out", default="results/contention", help="output directory")
    contention.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        help="comma-separated, each with a file in bench/contention/policies/, those that take "
        f"drop_late also as NAME+late (default {DEFAULT_POLICIES})",
    )
    contention.add_argument(
        "--sim-policies",
        default=DEFAULT_SIM_POLICIES,
        help="comma-separated policies replayed in the simulator only: 'ideal' (the ideal-network "
        "bound), a benchmark policy file's name, or a registered policy (NAME+late adds "
        f"drop_late, for the policies that take it) (default {DEFAULT_SIM_POLICIES}; '' for none)",
    )
    contention.add_argument(
        "--scenario",
        default=None,
        help="TOML file with a [testbed] table (default bench/contention/scenario.toml)",
    )
    contention.add_argument("--seed", type=int, default=1, help="first seed (default 1)")
    contention.add_argument(
        "--seeds",
        type=int,
        default=DEFAULT_SEEDS,
        help="run N traces (seed, seed+1, ...), every policy on each, and pool them "
        f"(default {DEFAULT_SEEDS})",
    )
    contention.add_argument("--duration", type=float, default=None, help="seconds of trace")
    contention.add_argument(
        "--load",
        type=float,
        default=None,
        help="KV load on each decode host's ingress link, 0 < LOAD < 2 (1 = its capacity)",
    )
    contention.add_argument("--rate-mbit", type=float, default=200.0, help="link rate")
    contention.add_argument("--hosts", type=int, default=None)
    contention.add_argument(
        "--min-share",
        type=float,
        default=0.02,
        help="guaranteed share of the link per priority class (default 0.02)",
    )
    contention.add_argument(
        "--control",
        choices=("agent", "mini"),
        default="agent",
        help="control plane of the runs: the real coordinator + one agent per host, TP "
        "through the NCCL plugin (agent, the default), or the testbed's minimal controller "
        "(mini, an ablation: no agents, no plugin)",
    )
    contention.add_argument(
        "--ablation-policies",
        default="",
        metavar="POLICIES",
        help="policies run a second time with the other control plane (e.g. rmlq; default none)",
    )
    contention.add_argument(
        "--switch-queue-kb", type=positive_int, default=256, help="switch queue per class (kB)"
    )
    contention.add_argument(
        "--simulate-only",
        action="store_true",
        help="skip the testbed, run the simulator replay only",
    )
    contention.set_defaults(func=_contention)
    _register_serving(benches)


#: the serving benchmark's defaults: each testbed run takes 75-90 s (55-80 s of arrivals)
SERVING_POLICIES = "rmlq,static+late,edf+late"
SERVING_SIM_POLICIES = "ideal"
#: loads of the serving benchmark are fractions of the prefill instances' capacity; from 2 on
#: the queues only grow (the same bound as the contention benchmark's --load)
MAX_SERVING_LOAD = 2.0


def _register_serving(benches: Any) -> None:
    serving = benches.add_parser(
        "serving",
        help="pd-serving shrunk to the netns testbed: live and in the simulator side by side",
        description="Run the scenario pd-serving-testbed (pd-serving on 200 Mbit/s links, "
        "every time x 100: bench/scenarios/pd-serving-testbed.toml) on a network-namespace "
        "testbed with the real coordinator, one agent per node and real sockets, and in the "
        "simulator, on the same request traces; the ideal-network bound on both (each side's "
        "x ideal is against its own). "
        "rmlq runs policies/default.toml, a baseline its levels and queues; every time in the "
        "file x 100, every layer count / 4. Without root or kernel support it runs the "
        "simulator only.",
    )
    serving.add_argument("--out", default="results/serving", help="output directory")
    serving.add_argument(
        "--policies",
        default=SERVING_POLICIES,
        help="comma-separated, those that take drop_late also as NAME+late "
        f"(default {SERVING_POLICIES})",
    )
    serving.add_argument(
        "--sim-policies",
        default=SERVING_SIM_POLICIES,
        help="simulator only: policies as above (the ideal bound runs in any case; "
        f"default {SERVING_SIM_POLICIES})",
    )
    serving.add_argument(
        "--loads",
        default="0.6",
        help=f"comma-separated, each 0 < LOAD < {MAX_SERVING_LOAD:g} (default 0.6)",
    )
    serving.add_argument("--seed", type=int, default=1, help="first seed (default 1)")
    serving.add_argument("--seeds", type=int, default=1, help="how many seeds, >= 1 (default 1)")
    serving.add_argument("--simulate-only", action="store_true", help="skip the testbed")
    serving.set_defaults(func=_serving)


def _serving(args: argparse.Namespace) -> int:
    from flowsched import scenario
    from flowsched.testbed import serving

    try:
        if args.seeds < 1:
            raise UsageError(f"--seeds: expected at least 1, got {args.seeds}")
        if args.seed < 0:  # random.Random(-n) is random.Random(n): a seed twice
            raise UsageError(f"--seed: expected at least 0, got {args.seed}")
        loads = finite_fractions("--loads", args.loads, MAX_SERVING_LOAD, scenario.MIN_LOAD)
        options = serving.ServingOptions(
            out=prepare_out_dir("--out", args.out),
            policies=_serving_names(args.policies, "--policies"),
            loads=tuple(loads),
            seeds=tuple(range(args.seed, args.seed + args.seeds)),
            sim_policies=_serving_names(args.sim_policies, "--sim-policies"),
            simulate_only=args.simulate_only,
            command="flowsched bench serving " + " ".join(sys.argv[3:]),
        )
    except (OSError, ValueError) as exc:  # the command line (UsageError too): exit 2
        print(f"flowsched bench serving: {exc}", file=sys.stderr)
        return 2
    errors: list[str] = []

    def run() -> int:
        serving.run(options, recorded_errors=errors)
        return len(errors)

    try:
        return _on_testbed("serving", run, args.simulate_only)
    except (OSError, ValueError) as exc:  # during the run (a full disk...): a failure, not usage
        print(f"flowsched bench serving: {exc}", file=sys.stderr)
        return EXIT_FAILURE


def _serving_names(text: str, flag: str) -> tuple[str, ...]:
    """``_names``, each a policy the serving benchmark writes a file for (or ``ideal``);
    UsageError under ``flag`` otherwise, before the run (which would not say which flag)."""
    from flowsched.sim.run import IDEAL
    from flowsched.testbed import serving

    names = _names(text, flag)
    for name in names:
        try:
            if name != IDEAL:
                serving.policy_document(name)
        except ValueError as exc:
            raise UsageError(f"{flag}: {exc}") from None
    return names


def _contention(args: argparse.Namespace) -> int:
    from flowsched.testbed import bench

    try:
        options = _options(args)
    except (OSError, ValueError) as exc:
        print(f"flowsched bench contention: {exc}", file=sys.stderr)
        return 2

    def run() -> int:
        return sum(len(r.errors) for r in bench.run(options))

    return _on_testbed("contention", run, args.simulate_only)


def _on_testbed(name: str, run: Callable[[], int], simulate_only: bool = False) -> int:
    """Run a testbed benchmark that returns how many errors its testbed runs recorded; the
    exit status (1 when it recorded any: its figures measure incomplete runs), with a line
    for a stop, a missing testbed or plugin, or a testbed another run holds. ``simulate_only``: no
    testbed was built, and a stop says nothing of one. A plot that failed fails the run."""
    from flowsched.nccl import PluginNotFoundError
    from flowsched.report import PlotError
    from flowsched.testbed import netns

    removed = "" if simulate_only else "; the testbed was removed"
    try:
        errors = run()
    except PlotError as exc:  # the results are written, without (some of) the plots
        print(f"flowsched bench {name}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except netns.Terminated as exc:
        print(f"flowsched bench {name}: terminated{removed}", file=sys.stderr)
        return 128 + exc.signum
    except KeyboardInterrupt:
        print(f"flowsched bench {name}: interrupted{removed}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (
        netns.TestbedUnavailable,
        netns.TestbedBusy,
        netns.TestbedLeftBehind,
        PluginNotFoundError,
    ) as exc:
        print(f"flowsched bench {name}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    if errors:
        print(
            f"flowsched bench {name}: {errors} errors during the testbed runs (listed above); "
            "exit status 1",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    return EXIT_OK


def _options(args: argparse.Namespace) -> BenchOptions:
    """The validated :class:`~flowsched.testbed.bench.BenchOptions` of the command line;
    OSError or ValueError (naming the option or field) when something is wrong."""
    from flowsched.sim.run import IDEAL
    from flowsched.testbed import bench, netns

    if args.seeds < 1:
        raise ValueError("--seeds must be at least 1")
    if args.seed < 0:  # random.Random(-n) is random.Random(n): a seed twice
        raise ValueError("--seed must be at least 0")
    policies, ablation = _policy_names(args)
    sim_policies = tuple(
        n for n in _names(args.sim_policies, "--sim-policies") if n not in policies
    )
    for name in sim_policies:
        if name != IDEAL:
            bench.policy_config(name)
    params = _params(args)
    try:
        spec = netns.TopologySpec(
            hosts=params.hosts,
            rate_mbit=args.rate_mbit,
            min_share=args.min_share,
            switch_queue_bytes=args.switch_queue_kb * 1000,
        )
    except ValueError as exc:  # it names its field (rate_mbit: ...): name the flag
        field, _, problem = str(exc).partition(":")
        raise UsageError(f"{_SPEC_FLAGS.get(field, field)}:{problem}") from None
    out = prepare_out_dir("--out", args.out)  # now, not after the runs
    return bench.BenchOptions(
        out=out,
        policies=policies,
        params=params,
        seed=args.seed,
        seeds=args.seeds,
        spec=spec,
        simulate_only=args.simulate_only,
        control=args.control,
        ablation_policies=ablation,
        sim_policies=sim_policies,
        command=bench.command_line(sys.argv[3:] if len(sys.argv) > 3 else []),
    )


#: TopologySpec fields that ``bench contention`` sets from flags
_SPEC_FLAGS = {"rate_mbit": "--rate-mbit", "min_share": "--min-share"}


def _policy_names(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``--policies`` (each with its benchmark policy file) and ``--ablation-policies`` (a
    subset of them)."""
    from flowsched.sim.run import LATE_SUFFIX
    from flowsched.testbed import bench

    policies = _names(args.policies, "--policies")
    ablation = _names(args.ablation_policies)
    if not policies:
        raise ValueError("--policies: no policy given")
    for name in policies:  # NAME+late runs NAME's file with drop_late (_names checked it takes it)
        bench.policy_path(name.removesuffix(LATE_SUFFIX))
    unknown = [name for name in ablation if name not in policies]
    if unknown:
        raise ValueError(
            f"--ablation-policies: {', '.join(unknown)} not in --policies ({', '.join(policies)})"
        )
    return policies, ablation


def _names(text: str, flag: str | None = None) -> tuple[str, ...]:
    """The comma-separated names of ``text``, each once (a policy named twice would run twice
    into the same folders and keep one entry in results.json); with ``flag``, policy names, a
    ``NAME+late`` of a policy that has no such variant refused under the flag's name."""
    from flowsched.sim.run import late_problem

    names = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    for name in names if flag is not None else ():
        if (problem := late_problem(name)) is not None:
            raise UsageError(f"{flag}: {problem}")
    return names


def _params(args: argparse.Namespace) -> ScenarioParams:
    """The scenario: ``--scenario`` (which must exist), else the repository's default file when
    there is one, else the built-in defaults; ``--duration/--load/--hosts`` on top."""
    from flowsched.testbed import bench
    from flowsched.testbed.trace import load_params

    scenario: Path | None = Path(args.scenario) if args.scenario else None
    if scenario is not None and not scenario.is_file():
        problem = "not a file" if scenario.exists() else "no such file"
        raise FileNotFoundError(f"--scenario: {scenario}: {problem}")
    if scenario is None and (bench.BENCH_DIR / "scenario.toml").exists():
        scenario = bench.BENCH_DIR / "scenario.toml"
    overrides = {
        k: v
        for k, v in (("duration", args.duration), ("load", args.load), ("hosts", args.hosts))
        if v is not None
    }
    return load_params(scenario, overrides)
