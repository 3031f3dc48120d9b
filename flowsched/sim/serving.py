"""Prefill/decode-disaggregated serving workload (the MFS setting) on the simulator.

Per batch on one prefill instance and per layer ``l`` (reference notes, section 6):

* Stage 1 (``kv_reuse``): reused KV blocks held elsewhere -- by another instance (the "victim"
  that caches a hot prefix) or by the remote KV store (the prefixes no instance caches) -- are
  fetched per layer, ``lookahead`` layers ahead; layer ``l`` waits for them.
* compute ``C_l`` (roofline, :func:`flowsched.scenario.layer_compute_time`);
* Stage 2 (``tp`` class): the EP all-to-all (dispatch + combine) between the instance's servers,
  one flow per (source NIC, destination NIC) pair; layer ``l + 1`` waits for it;
* Stage 3 (``kv``): the layer's KV of every request goes to its decode server; the request's
  TTFT ends with its last P2D byte; deadline = arrival + SLO.

Routing is KV-cache aware: a request goes to the instance caching its prefix unless that
instance already has more than ``router_max_wait_tokens`` waiting, else (and always for a
store-held prefix) to the least loaded instance, which then fetches the reused prefix remotely
(Stage 1). An instance's load is the new tokens waiting for it plus what its running batch
still has to compute, by layers not yet done (``router_load = "outstanding"``, as a router that
counts active prefill work), or the waiting tokens only (``"queued"``). Batches take waiting
requests in arrival order up to ``batch_tokens`` new tokens (vLLM-like).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from flowsched.metrics import RequestRecord, SpanRecord
from flowsched.model import Flow, FlowClass
from flowsched.scenario import (
    Request,
    ServingSection,
    a2a_cross_bytes,
    layer_compute_time,
    store_held,
)
from flowsched.sim.engine import Engine
from flowsched.sim.topology import Topology


@dataclass(slots=True)
class _Batch:
    job: str
    instance: int
    requests: list[Request]
    gpu_of: dict[str, int]
    #: request -> where its prefix is fetched from: an instance index, or -1 - store node
    remote: dict[str, int]
    layer: int = 0
    pending_reuse: dict[int, int] = field(default_factory=dict)
    issued_reuse: int = 0
    waiting_layer: bool = False

    @property
    def new_tokens(self) -> int:
        return sum(r.new_tokens for r in self.requests)


class ServingWorkload:
    """Drives the requests of one trace through prefill instances and decode servers."""

    def __init__(self, sim: Engine, topo: Topology, cfg: ServingSection, trace: list[Request]):
        self.sim, self.topo, self.cfg = sim, topo, cfg
        self.trace = trace
        self.queues: list[deque[Request]] = [deque() for _ in range(cfg.instances)]
        self.running: list[_Batch | None] = [None] * cfg.instances
        self.records: dict[str, RequestRecord] = {}
        self._p2d_left: dict[str, int] = {}
        self._decode_of: dict[str, int] = {}
        self._batches = 0
        self._gpu_rr = [0] * cfg.instances
        nic = cfg.nic_gbps * 1e9 / 8
        self._a2a_rate = nic * cfg.servers_per_instance * cfg.nics_per_server

    def start(self) -> None:
        """Schedule every arrival of the trace."""
        for request in self.trace:
            self.sim.at(request.arrival, lambda r=request: self._arrive(r))  # type: ignore[misc]

    # ------------------------------------------------------------------ placement
    def _server(self, instance: int, gpu: int) -> tuple[str, int]:
        """(node name, NIC index) of GPU ``gpu`` of ``instance``."""
        cfg = self.cfg
        server = instance * cfg.servers_per_instance + gpu // cfg.gpus_per_server
        local = gpu % cfg.gpus_per_server
        nic = local * cfg.nics_per_server // cfg.gpus_per_server
        return f"{cfg.prefill_prefix}{server}", nic

    def _holder(self, request: Request) -> int:
        """The instance caching the request's prefix, or ``-1 - n`` for KV-store node n."""
        if store_held(self.cfg, request.prefix_group):
            return -1 - request.prefix_group % self.cfg.kv_store_nodes
        return request.prefix_group % self.cfg.instances

    def _arrive(self, request: Request) -> None:
        self.records[request.request_id] = RequestRecord(
            request.request_id, request.arrival, request.slo, warmup=request.warmup
        )
        holder = self._holder(request)
        waiting = [sum(r.new_tokens for r in q) for q in self.queues]
        target = holder
        if holder < 0 or waiting[holder] > self.cfg.router_max_wait_tokens:
            load = [waiting[i] + self._running_tokens(i) for i in range(self.cfg.instances)]
            target = min(range(self.cfg.instances), key=lambda i: (load[i], i))
        self.queues[target].append(request)
        self._decode_of[request.request_id] = int(request.request_id[1:]) % self.cfg.decode_servers
        self._maybe_start(target)

    def _running_tokens(self, instance: int) -> float:
        """New tokens of the instance's running batch still to be computed (by layers left),
        when the router counts them."""
        batch = self.running[instance]
        if batch is None or self.cfg.router_load != "outstanding":
            return 0.0
        return batch.new_tokens * (self.cfg.layers - batch.layer) / self.cfg.layers

    # ------------------------------------------------------------------ batches
    def _maybe_start(self, instance: int) -> None:
        queue = self.queues[instance]
        if self.running[instance] is not None or not queue:
            return
        chosen: list[Request] = []
        tokens = 0
        while queue and (not chosen or tokens + queue[0].new_tokens <= self.cfg.batch_tokens):
            request = queue.popleft()
            chosen.append(request)
            tokens += request.new_tokens
        self._batches += 1
        batch = _Batch(f"i{instance}/b{self._batches}", instance, chosen, {}, {})
        self.running[instance] = batch
        gpus = self.cfg.servers_per_instance * self.cfg.gpus_per_server
        for request in chosen:
            batch.gpu_of[request.request_id] = self._gpu_rr[instance] % gpus
            self._gpu_rr[instance] += 1
            if self._holder(request) != instance:
                batch.remote[request.request_id] = self._holder(request)
            self._p2d_left[request.request_id] = self.cfg.layers
            self.records[request.request_id].started = self.sim.now
        self._issue_reuse(batch)
        self._try_layer(batch)

    def _issue_reuse(self, batch: _Batch) -> None:
        """Issue Stage-1 fetches up to ``lookahead`` layers past the current one."""
        last = min(batch.layer + self.cfg.lookahead, self.cfg.layers - 1)
        while batch.remote and batch.issued_reuse <= last:
            layer = batch.issued_reuse
            batch.issued_reuse += 1
            for request in batch.requests:
                holder = batch.remote.get(request.request_id)
                if holder is not None:
                    self._reuse_flow(batch, request, holder, layer)

    def _reuse_flow(self, batch: _Batch, request: Request, holder: int, layer: int) -> None:
        cfg = self.cfg
        size = request.reused_tokens * cfg.kv_bytes_per_token_layer
        gpus = cfg.servers_per_instance * cfg.gpus_per_server
        number = int(request.request_id[1:])
        if holder < 0:
            src, src_nic = f"{cfg.kv_store_prefix}{-1 - holder}", number % cfg.kv_store_nics
        else:
            src, src_nic = self._server(holder, number % gpus)
        dst, dst_nic = self._server(batch.instance, batch.gpu_of[request.request_id])
        links = self.topo.path(src, src_nic, dst, dst_nic)
        batch.pending_reuse[layer] = batch.pending_reuse.get(layer, 0) + 1
        estimate = self._layer_estimate(batch)
        self.sim.open_flow(
            FlowClass.KV_REUSE,
            size,
            links,
            lambda _f, b=batch, j=layer: self._reuse_done(b, j),  # type: ignore[misc]
            job=batch.job,
            consumer_index=layer,
            request=request.request_id,
            node=src,
            oracle_deadline=self.sim.now + max(layer - batch.layer, 0) * estimate,
        )

    def _reuse_done(self, batch: _Batch, layer: int) -> None:
        batch.pending_reuse[layer] -= 1
        if batch.waiting_layer and batch.layer == layer:
            self._try_layer(batch)

    def _layer_estimate(self, batch: _Batch) -> float:
        tokens = batch.new_tokens
        compute = layer_compute_time(self.cfg, tokens)
        return compute + a2a_cross_bytes(self.cfg, tokens) / self._a2a_rate

    def _try_layer(self, batch: _Batch) -> None:
        """Start computing the current layer once its reused KV has arrived."""
        self.sim.set_job_index(batch.job, batch.layer)
        if batch.pending_reuse.get(batch.layer, 0) > 0:
            batch.waiting_layer = True
            return
        batch.waiting_layer = False
        self._issue_reuse(batch)
        compute = layer_compute_time(self.cfg, batch.new_tokens)
        self.sim.after(compute, lambda: self._layer_computed(batch))

    def _layer_computed(self, batch: _Batch) -> None:
        layer = batch.layer
        self.sim.set_job_index(batch.job, layer + 1)
        for request in batch.requests:
            self._p2d_flow(batch, request, layer)
        self._all_to_all(batch, layer)

    # ------------------------------------------------------------------ stage 2 and 3
    def _all_to_all(self, batch: _Batch, layer: int) -> None:
        cfg = self.cfg
        servers = [
            batch.instance * cfg.servers_per_instance + s for s in range(cfg.servers_per_instance)
        ]
        pairs = [
            (a, b, n, m)
            for a in servers
            for b in servers
            if a != b
            for n in range(cfg.nics_per_server)
            for m in range(cfg.nics_per_server)
        ]
        total = a2a_cross_bytes(cfg, batch.new_tokens)
        if not pairs or total <= 0:
            self._layer_done(batch, self.sim.now)
            return
        start, left = self.sim.now, [len(pairs)]

        def done(_flow: Flow) -> None:
            left[0] -= 1
            if left[0] == 0:
                self._layer_done(batch, start)

        for a, b, n, m in pairs:
            links = self.topo.path(f"{cfg.prefill_prefix}{a}", n, f"{cfg.prefill_prefix}{b}", m)
            self.sim.open_flow(
                FlowClass.TP,
                int(total / len(pairs)),
                links,
                done,
                job=batch.job,
                consumer_index=layer + 1,
                node=f"{cfg.prefill_prefix}{a}",
            )

    def _layer_done(self, batch: _Batch, start: float) -> None:
        warm = all(r.warmup for r in batch.requests)
        self.sim.records.spans.append(
            SpanRecord("collective", batch.job, start, self.sim.now, warm)
        )
        batch.layer += 1
        if batch.layer < self.cfg.layers:
            self._try_layer(batch)
            return
        for request in batch.requests:
            self.records[request.request_id].prefill_done = self.sim.now
        self.sim.end_job(batch.job)
        self.running[batch.instance] = None
        self._maybe_start(batch.instance)

    def _p2d_flow(self, batch: _Batch, request: Request, layer: int) -> None:
        cfg = self.cfg
        src, src_nic = self._server(batch.instance, batch.gpu_of[request.request_id])
        decode = self._decode_of[request.request_id]
        dst = f"{cfg.decode_prefix}{decode}"
        links = self.topo.path(src, src_nic, dst, int(request.request_id[1:]) % cfg.decode_nics)
        deadline = request.arrival + request.slo
        size = request.prompt_tokens * cfg.kv_bytes_per_token_layer
        # true deadline: the later layers' KV still has to cross the same NIC after this one
        oracle = (
            deadline - (cfg.layers - 1 - layer) * size / self.topo.capacity[links[0]]
            if links
            else deadline
        )
        self.sim.open_flow(
            FlowClass.KV,
            request.prompt_tokens * cfg.kv_bytes_per_token_layer,
            links,
            lambda _f, r=request: self._p2d_done(r),  # type: ignore[misc]
            job=batch.job,
            request=request.request_id,
            deadline=deadline,
            consumer_index=layer,
            node=src,
            oracle_deadline=oracle,
        )

    def _p2d_done(self, request: Request) -> None:
        left = self._p2d_left[request.request_id] - 1
        self._p2d_left[request.request_id] = left
        if left == 0:
            self.records[request.request_id].finished = self.sim.now

    def finish(self) -> None:
        """Copy the request records into the simulator's run records."""
        self.sim.records.requests.extend(self.records.values())
