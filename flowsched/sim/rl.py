"""Disaggregated RL post-training workload (trainer group + rollout group) on the simulator.

Pipeline (one-step-off-policy style, ``staleness`` = how many weight versions generation may
lag behind the trainer):

* generation ``g`` runs on the rollout nodes in ``generation_chunks`` chunks: compute, then a
  TP ring all-reduce among rollout nodes (``tp`` class); after each chunk its experience is
  streamed to the trainer nodes (``experience`` class, consumer = the train step that reads it);
* trainer iteration ``i`` has ``steps_per_iteration`` steps; step ``s`` waits for all of its
  experience (every chunk of the generation that maps to it, streamed or not yet), then runs
  ``phases_per_step`` phases of compute + TP ring all-reduce among the trainer nodes (the next
  phase waits for the collective);
* after iteration ``i`` the trainers send the new weights to every rollout node
  (``param_sync``); generation ``i + 1 + staleness`` cannot start before it has arrived, so its
  deadline is the expected start of that generation.

Records: one ``iteration`` span per trainer iteration (from the previous iteration's end, so
the mean is the steady-state iteration period), one ``collective`` span per TP all-reduce and
one deadline record per param sync.

Measured window: iterations ``warmup_iterations`` .. ``iterations - 1 - staleness``. Iteration
``i`` counts the trainer's iteration ``i`` (its span, its steps' collectives, its param sync)
and generation ``i`` (its chunks' collectives). Before the window: warm-up (pipeline fill);
after it: drain, where no later generation runs alongside, so the trainer's last
``staleness`` iterations are no longer paced as in steady state and would look shorter.

A param sync keeps the estimated deadline its flows carry (what the policy sees), and is scored
against ``needed``: the end of the generation before its consumer, i.e. when the consumer would
have started without waiting for it (missed = it actually delayed generation). The syncs of the
last ``1 + staleness`` iterations feed generations that never run: marked ``drain`` (not
measured).

The workload has no randomness: the seed is not used, every seed gives the same run.
"""

from __future__ import annotations

from collections.abc import Callable

from flowsched.metrics import DeadlineRecord, SpanRecord
from flowsched.model import Flow, FlowClass
from flowsched.scenario import RlPlan, RlSection
from flowsched.sim.engine import Simulator
from flowsched.sim.topology import Topology

TRAINER_JOB = "trainer"
ROLLOUT_JOB = "rollout"


class RlWorkload:
    """Drives ``iterations`` trainer iterations and the generations that feed them."""

    def __init__(self, sim: Simulator, topo: Topology, cfg: RlSection, plan: RlPlan) -> None:
        self.sim, self.topo, self.cfg, self.plan = sim, topo, cfg, plan
        self.trainers = [f"{cfg.trainer_prefix}{i}" for i in range(cfg.trainer_nodes)]
        self.rollouts = [f"{cfg.rollout_prefix}{i}" for i in range(cfg.rollout_nodes)]
        self.gen_nominal = cfg.generation_ms / 1e3
        self._experience_left: dict[int, int] = {}
        self._step_waiting: int | None = None
        self._gen_started: dict[int, float] = {}
        self._gen_done: dict[int, float] = {}
        self._synced: set[int] = set()
        #: sync records waiting for the end of the generation before their consumer
        self._sync_pending: dict[int, DeadlineRecord] = {}
        self._last_iteration_end: float | None = None
        self._chunk_counter = 0

    def start(self) -> None:
        """Start generation 0 and the trainer's first step."""
        self._start_generation(0)
        self._wait_step(0)

    # ------------------------------------------------------------------ measured window
    def _warmup(self, iteration: int) -> bool:
        """Before the measured window (pipeline fill)."""
        return iteration < self.cfg.warmup_iterations

    def _drain(self, iteration: int) -> bool:
        """After the measured window: the last ``staleness`` iterations (pipeline drain)."""
        return iteration > self.cfg.iterations - 1 - self.cfg.staleness

    # ------------------------------------------------------------------ collectives
    def _ring(
        self,
        nodes: list[str],
        size: float,
        job: str,
        index: int,
        iteration: int,
        then: Callable[[], None],
    ) -> None:
        """Ring all-reduce: each node sends ``size`` bytes to the next, split over its NICs."""
        nics = self.cfg.nics_per_node
        pairs = [
            (a, nodes[(k + 1) % len(nodes)], n) for k, a in enumerate(nodes) for n in range(nics)
        ]
        if len(nodes) < 2 or size <= 0:
            self.sim.after(0.0, then)
            return
        start, left = self.sim.now, [len(pairs)]

        def done(_flow: Flow) -> None:
            left[0] -= 1
            if left[0] == 0:
                span = SpanRecord("collective", job, start, self.sim.now)
                span.warmup, span.drain = self._warmup(iteration), self._drain(iteration)
                self.sim.records.spans.append(span)
                then()

        for src, dst, nic in pairs:
            self.sim.open_flow(
                FlowClass.TP,
                int(size / nics),
                self.topo.path(src, nic, dst, nic),
                done,
                job=job,
                consumer_index=index,
                node=src,
            )

    # ------------------------------------------------------------------ generation
    def _start_generation(self, gen: int) -> None:
        if gen >= self.cfg.iterations or gen in self._gen_started:
            return
        needed = gen - 1 - self.cfg.staleness
        if gen > 0 and (gen - 1) not in self._gen_done:
            return
        if needed >= 0 and needed not in self._synced:
            return
        self._gen_started[gen] = self.sim.now
        self._gen_chunk(gen, 0)

    def _gen_chunk(self, gen: int, chunk: int) -> None:
        cfg = self.cfg
        self._chunk_counter += 1
        self.sim.set_job_index(ROLLOUT_JOB, self._chunk_counter)

        def computed() -> None:
            self._stream_experience(gen, chunk)
            self._ring(
                self.rollouts,
                self.plan.gen_tp_bytes_per_chunk,
                ROLLOUT_JOB,
                self._chunk_counter,
                gen,
                lambda: self._chunk_done(gen, chunk),
            )

        self.sim.after(self.gen_nominal / cfg.generation_chunks, computed)

    def _chunk_done(self, gen: int, chunk: int) -> None:
        if chunk + 1 < self.cfg.generation_chunks:
            self._gen_chunk(gen, chunk + 1)
            return
        self._gen_done[gen] = self.sim.now
        record = self._sync_pending.pop(gen - self.cfg.staleness, None)
        if record is not None:  # generation gen + 1 could start now, were its weights in
            record.needed = self.sim.now
        self._start_generation(gen + 1)

    def _stream_experience(self, gen: int, chunk: int) -> None:
        cfg = self.cfg
        step = (
            gen * cfg.steps_per_iteration + chunk * cfg.steps_per_iteration // cfg.generation_chunks
        )
        size = self.plan.experience_bytes / cfg.generation_chunks / len(self.rollouts)
        for k, src in enumerate(self.rollouts):
            dst = self.trainers[k % len(self.trainers)]
            nic = (chunk + k) % cfg.nics_per_node
            self.sim.open_flow(
                FlowClass.EXPERIENCE,
                int(size),
                self.topo.path(src, nic, dst, nic),
                lambda _f, s=step: self._experience_arrived(s),  # type: ignore[misc]
                job=TRAINER_JOB,
                consumer_index=step,
                node=src,
                oracle_deadline=self._step_estimate(step),
            )

    def _step_estimate(self, step: int) -> float:
        """Oracle: the earliest time the consumer step could start (nominal trainer pace)."""
        current = self.sim.job_index.get(TRAINER_JOB, 0)
        per_step = self.cfg.phases_per_step * self.cfg.phase_compute_ms / 1e3
        return self.sim.now + max(step - current, 0) * per_step

    def _experience_pending(self, step: int) -> int:
        """Experience flows of ``step`` not yet arrived, counting chunks not streamed yet.

        A step consumes every chunk of its generation that maps to it, so it must wait for all
        of them, not only for the ones streamed so far (a fast trainer would otherwise start
        the step mid-generation and its iteration, hence the param sync, would end early).
        """
        if step not in self._experience_left:
            cfg = self.cfg
            local = step % cfg.steps_per_iteration
            chunks = sum(
                1
                for c in range(cfg.generation_chunks)
                if c * cfg.steps_per_iteration // cfg.generation_chunks == local
            )
            self._experience_left[step] = chunks * len(self.rollouts)
        return self._experience_left[step]

    def _experience_arrived(self, step: int) -> None:
        self._experience_left[step] = self._experience_pending(step) - 1
        if self._experience_left[step] == 0 and self._step_waiting == step:
            self._run_step(step)

    # ------------------------------------------------------------------ training
    def _wait_step(self, step: int) -> None:
        self.sim.set_job_index(TRAINER_JOB, step)
        if step // self.cfg.steps_per_iteration >= self.cfg.iterations:
            return
        if self._experience_pending(step) != 0:
            self._step_waiting = step
            return
        self._run_step(step)

    def _run_step(self, step: int) -> None:
        self._step_waiting = None
        self._phase(step, 0)

    def _phase(self, step: int, phase: int) -> None:
        cfg = self.cfg

        def computed() -> None:
            then = (
                (lambda: self._phase(step, phase + 1))
                if phase + 1 < cfg.phases_per_step
                else (lambda: self._step_done(step))
            )
            iteration = step // cfg.steps_per_iteration
            self._ring(
                self.trainers, self.plan.tp_bytes_per_phase, TRAINER_JOB, step, iteration, then
            )

        self.sim.after(cfg.phase_compute_ms / 1e3, computed)

    def _step_done(self, step: int) -> None:
        cfg = self.cfg
        if (step + 1) % cfg.steps_per_iteration == 0:
            self._iteration_done(step // cfg.steps_per_iteration)
        self._wait_step(step + 1)

    def _iteration_done(self, iteration: int) -> None:
        now = self.sim.now
        if self._last_iteration_end is not None:  # iteration 0 has no span (no previous end)
            span = SpanRecord("iteration", TRAINER_JOB, self._last_iteration_end, now)
            span.warmup, span.drain = self._warmup(iteration), self._drain(iteration)
            self.sim.records.spans.append(span)
        self._last_iteration_end = now
        self._param_sync(iteration)

    def _sync_deadline(self, iteration: int) -> float:
        """Expected start of the generation that needs these weights.

        That is the end of the generation before it: known once it has started, else
        extrapolated at the nominal pace from the last generation that has started.
        """
        gen = iteration + 1 + self.cfg.staleness
        previous = gen - 1
        if previous in self._gen_started:
            return self._gen_started[previous] + self.gen_nominal
        if not self._gen_started:
            return self.sim.now + (previous + 1) * self.gen_nominal
        last = max(self._gen_started)
        return self._gen_started[last] + (previous - last + 1) * self.gen_nominal

    def _sync_record(self, iteration: int, deadline: float) -> DeadlineRecord:
        """The sync's record: scored against the end of the generation before its consumer
        (known now, or set when it ends); ``drain`` when its consumer never runs."""
        record = DeadlineRecord("param_sync", TRAINER_JOB, deadline, None, self._warmup(iteration))
        consumer = iteration + 1 + self.cfg.staleness
        if consumer >= self.cfg.iterations:
            record.drain = True
        elif consumer - 1 in self._gen_done:
            record.needed = self._gen_done[consumer - 1]
        else:
            self._sync_pending[iteration] = record
        return record

    def _param_sync(self, iteration: int) -> None:
        cfg = self.cfg
        deadline = self._sync_deadline(iteration)
        record = self._sync_record(iteration, deadline)
        self.sim.records.deadlines.append(record)
        size = self.plan.param_bytes / len(self.trainers) / cfg.nics_per_node
        pairs = [
            (t, r, n)
            for t in self.trainers
            for r in self.rollouts
            for n in range(cfg.nics_per_node)
        ]
        left = [len(pairs)]

        def done(_flow: Flow) -> None:
            left[0] -= 1
            if left[0] == 0:
                record.finished = self.sim.now
                self._synced.add(iteration)
                self._start_generation(iteration + 1 + cfg.staleness)

        for src, dst, nic in pairs:
            self.sim.open_flow(
                FlowClass.PARAM_SYNC,
                int(size),
                self.topo.path(src, nic, dst, nic),
                done,
                job=TRAINER_JOB,
                deadline=deadline,
                node=src,
                oracle_deadline=deadline,
            )
