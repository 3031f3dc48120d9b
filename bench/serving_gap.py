"""Where the serving testbed's rows fall short of the simulator's: two overheads, one at a time.

``flowsched bench serving`` runs pd-serving-testbed live and in the simulator; the testbed rows
come out lower. This script runs the same policy files in the simulator with one overhead of the
testbed modelled at a time, to tell which one accounts for the gap:

* ``--open-delay S``: every KV and KV-reuse flow starts S seconds after the workload opens it
  (the agent's open round trip: the SDK waits for the coordinator's first level). The bound has
  no agents on its private paths, so it is not delayed.
* ``--collective-scale F``: every all-to-all flow carries F x its bytes (the testbed's
  collectives take longer than line rate: TCP, thread wake-ups and reports on 2 shared cores).
* ``--decision-delay S``: every flow starts at once at the level the policy admits it at, and
  every later decision reaches it S seconds after the policy made it (the agent's report, the
  coordinator's turn and the level's way back, for every class).
* ``--provisional-level N`` (with ``--open-delay``): the delayed flows start at once at level
  N instead of waiting, and take the policy's level only after the delay (an agent that
  answers an open with a level of its own and lets the coordinator's follow); N = -1: at the
  level the policy admits them at (the agent's own copy of the policy deciding the same), with
  the policy's later decisions on them held back until the delay has passed.

Each row is pooled over the seeds; ``x ideal`` is against the bound run with the same overhead::

    .venv/bin/python bench/serving_gap.py --open-delay 0,0.01,0.02 --collective-scale 1,1.2,1.4

``--scenario pd-serving`` runs the full-size scenario instead, with the shipped policies (not
the testbed's files, whose times are x 100): what the same delays cost at the real time scale.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flowsched import scenario
from flowsched.cli.sim import specs as cli_specs
from flowsched.metrics import merge, summarize
from flowsched.model import Decision, Flow, FlowClass
from flowsched.sim.engine import ActiveFlow, DoneCallback, Simulator
from flowsched.sim.run import IDEAL, run
from flowsched.testbed.serving import SCENARIO, sim_spec

DELAYED = frozenset({FlowClass.KV, FlowClass.KV_REUSE})


class OverheadSimulator(Simulator):
    """The simulator with a start delay (or a provisional level) on deadline flows, scaled
    collectives, and decisions that reach their flows late."""

    def __init__(
        self,
        *args: Any,
        open_delay: float,
        collective_scale: float,
        provisional_level: int | None = None,
        decision_delay: float = 0.0,
    ) -> None:
        super().__init__(*args)
        self.open_delay, self.collective_scale = open_delay, collective_scale
        self.provisional_level, self.decision_delay = provisional_level, decision_delay
        self._held: set[int] = set()  # flows still at their provisional level
        self._in_flight: dict[int, Decision] = {}  # the latest decision on its way to a flow

    def open_flow(
        self,
        cls: FlowClass,
        size: int,
        links: tuple[str, ...],
        on_done: DoneCallback | None = None,
        **fields: object,
    ) -> Flow:
        if cls == FlowClass.TP:
            size = int(size * self.collective_scale)
        if cls in DELAYED and self.open_delay > 0 and self.provisional_level is not None:
            flow = super().open_flow(cls, size, links, on_done, **fields)
            state = self.active.get(flow.flow_id)
            if state is not None:
                if self.provisional_level >= 0:
                    self._apply(state, Decision(self.provisional_level))
                self._held.add(flow.flow_id)
                self.after(self.open_delay, lambda: self._release(flow.flow_id))
            return flow
        if cls in DELAYED and self.open_delay > 0:
            opened: list[Flow] = []
            self.after(
                self.open_delay,
                lambda: opened.append(
                    super(OverheadSimulator, self).open_flow(cls, size, links, on_done, **fields)
                ),
            )
            # the workload keeps no reference to the flow it opened: a placeholder is enough
            return Flow(-1, cls, self.now, size=size, links=links)
        return super().open_flow(cls, size, links, on_done, **fields)

    def _release(self, flow_id: int) -> None:
        """The policy's level reaches the flow: re-evaluated now, from its provisional level."""
        self._held.discard(flow_id)
        if flow_id in self.active:
            self._touched.add(flow_id)
            self._request_reevaluate()

    def _decide(self, state: ActiveFlow, decision: Decision) -> None:
        flow_id = state.flow.flow_id
        if flow_id in self._held:  # the decision has not arrived yet
            return
        if self.decision_delay <= 0:
            super()._decide(state, decision)
        elif self._in_flight.get(flow_id) != decision:  # the policy repeats itself meanwhile
            self._in_flight[flow_id] = decision
            self.after(self.decision_delay, lambda: self._arrive(state, decision))

    def _arrive(self, state: ActiveFlow, decision: Decision) -> None:
        flow_id = state.flow.flow_id
        if self._in_flight.get(flow_id) == decision:
            del self._in_flight[flow_id]
        if flow_id in self.active:
            super()._decide(state, decision)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default=SCENARIO)
    parser.add_argument("--policies", default="rmlq,static+late,static")
    parser.add_argument("--loads", default="0.5,0.6,0.7")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--open-delay", default="0,0.01,0.02", help="seconds, comma-separated")
    parser.add_argument("--collective-scale", default="1,1.4", help="comma-separated")
    parser.add_argument("--provisional-level", type=int, default=None)
    parser.add_argument("--decision-delay", default="0", help="seconds, comma-separated")
    args = parser.parse_args()
    scen = scenario.load(args.scenario)
    names = [IDEAL, *args.policies.split(",")]
    if args.scenario == SCENARIO:
        with tempfile.TemporaryDirectory() as work:
            specs = {name: sim_spec(name, Path(work)) for name in names}
    else:
        specs = dict(zip(names, cli_specs(names, None, scen.sim.num_levels), strict=True))
    cases = [(float(d), 1.0, 0.0) for d in args.open_delay.split(",")]
    cases += [(0.0, float(f), 0.0) for f in args.collective_scale.split(",") if float(f) != 1.0]
    cases += [(0.0, 1.0, float(d)) for d in args.decision_delay.split(",") if float(d) != 0.0]
    header = f"{'delay s':>7}  {'TP x':>4}  {'decide s':>8}  {'load':>4}  "
    print(header + "  ".join(f"{n:>16}" for n in names))
    for delay, scale, decide in cases:
        for load in (float(v) for v in args.loads.split(",")):
            cells = []
            for name, spec in specs.items():
                overheads = (delay, scale, decide) if name != IDEAL else (0.0, scale, 0.0)
                make = _maker(*overheads, args.provisional_level)
                pooled = merge(
                    [
                        run(scen, spec, load, int(seed), simulator=make).records
                        for seed in args.seeds.split(",")
                    ]
                )
                cells.append(summarize(pooled).slo_attainment or 0.0)
            bound = cells[0] or 1.0
            row = "  ".join(f"{c:6.1%} ({c / bound:.2f}x)" for c in cells)
            print(f"{delay:7g}  {scale:4g}  {decide:8g}  {load:4g}  {row}", flush=True)


def _maker(
    delay: float, scale: float, decide: float, provisional: int | None
) -> Callable[..., Simulator]:
    return lambda *a: OverheadSimulator(
        *a,
        open_delay=delay,
        collective_scale=scale,
        provisional_level=provisional,
        decision_delay=decide,
    )


if __name__ == "__main__":
    main()
