"""Scenario files (TOML) and their seeded traces, shared by the simulator and the testbed.

A scenario file has a ``[scenario]`` table and one or both workload tables, ``[serving]``
(prefill/decode-disaggregated LLM serving, the MFS setting) and ``[rl]`` (disaggregated RL
post-training); a file with both is a mixed scenario whose workloads share node names, hence
links. ``[sim]`` holds engine knobs. The format is documented field by field in
``bench/scenarios/README.md``; every dataclass field below is a key of the table of the same
name.

Public API:

* :func:`load` / :func:`parse` read and validate a file or a TOML string; errors raise
  :class:`ScenarioError` whose message names every bad field path (``serving.layers: ...``);
* :func:`resolve` turns a name (``pd-serving``) or a path into a file path;
* :func:`serving_trace` and :func:`rl_plan` generate the seeded, load-scaled workload that both
  the simulator and the testbed replay;
* :func:`serving_arrival_rate` / :func:`isolated_ttft` expose the load and SLO rules;
  :func:`network_utilization` the offered load of each group of links.
"""

from __future__ import annotations

import dataclasses
import math
import random
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowsched.data import data_path
from flowsched.policies.argcheck import is_number
from flowsched.policyfile import MAX_LEVELS

#: directory of the bundled scenarios (package data; bench/scenarios links to it)
SCENARIO_DIR = data_path("scenarios")


class ScenarioError(ValueError):
    """A scenario file is invalid; ``errors`` lists ``"field.path: problem"`` strings."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("; ".join(errors))
        self.errors = errors


@dataclass(frozen=True, slots=True)
class ScenarioMeta:
    """``[scenario]``: identity, seed and the measured/warm-up sizes."""

    name: str
    description: str = ""
    seed: int = 1


@dataclass(frozen=True, slots=True)
class SimSection:
    """``[sim]``: engine knobs (see :class:`flowsched.sim.engine.SimConfig`)."""

    chunk_kib: int = 512
    timer_ms: float = 1.0
    load_tau_ms: float = 1.0
    num_levels: int = 8
    oversubscription: float = 0.0
    #: share of every link's rate that carries payload, the rest being packet headers (1 = a
    #: fluid model of the nominal rate; the testbed scenario sets TCP's share, see SimConfig)
    payload_share: float = 1.0


@dataclass(frozen=True, slots=True)
class ServingSection:
    """``[serving]``: prefill instances, decode servers, model, GPU and request trace."""

    instances: int = 2
    servers_per_instance: int = 2
    gpus_per_server: int = 4
    nics_per_server: int = 2
    nic_gbps: float = 100.0
    decode_servers: int = 2
    decode_nics: int = 2
    prefill_prefix: str = "p"
    decode_prefix: str = "d"
    layers: int = 32
    kv_bytes_per_token_layer: int = 4096
    a2a_bytes_per_token_layer: int = 32768
    flops_per_token_layer: float = 0.78e9
    weight_bytes_per_gpu_layer: float = 352e6
    gpu_tflops: float = 312.0
    gpu_efficiency: float = 0.55
    gpu_mem_gbps: float = 2000.0
    batch_tokens: int = 8192
    lookahead: int = 3
    mean_prompt_tokens: float = 1000.0
    prompt_sigma: float = 1.0
    max_prompt_tokens: int = 8192
    reuse_mean: float = 0.65
    reuse_concentration: float = 4.0
    prefix_groups: int = 16
    prefix_zipf: float = 1.1
    router_max_wait_tokens: int = 8192
    #: what the router weighs an instance by when it sends a request away from its prefix:
    #: "outstanding" (new tokens waiting plus what the running batch still has to compute) or
    #: "queued" (new tokens waiting only)
    router_load: str = "outstanding"
    slo_factor: float = 3.0
    warmup_requests: int = 100
    requests: int = 300
    #: remote KV store (Mooncake-style) servers holding the prefixes no instance caches
    kv_store_nodes: int = 0
    kv_store_nics: int = 2
    kv_store_prefix: str = "s"
    #: the hottest ``cached_groups`` prefix groups are cached on the prefill instances (group g
    #: on instance g mod instances: the victim units); the others live in the KV store.
    #: 0 = every group is cached on an instance (no store)
    cached_groups: int = 0
    #: what load 1.0 means: "compute" (the instances busy all the time) or "network" (the most
    #: loaded group of links offered its capacity; see :func:`network_utilization`)
    load_basis: str = "compute"


@dataclass(frozen=True, slots=True)
class RlSection:
    """``[rl]``: trainer and rollout groups, the iteration pipeline and transfer sizes."""

    trainer_nodes: int = 4
    rollout_nodes: int = 4
    nics_per_node: int = 2
    nic_gbps: float = 100.0
    trainer_prefix: str = "t"
    rollout_prefix: str = "r"
    iterations: int = 12
    warmup_iterations: int = 2
    steps_per_iteration: int = 4
    phases_per_step: int = 8
    phase_compute_ms: float = 20.0
    tp_bytes_per_phase: float = 64e6
    generation_ms: float = 800.0
    generation_chunks: int = 16
    gen_tp_bytes_per_chunk: float = 16e6
    param_bytes: float = 14e9
    experience_bytes: float = 2e9
    staleness: int = 1


@dataclass(frozen=True, slots=True)
class Scenario:
    """A validated scenario file."""

    scenario: ScenarioMeta
    sim: SimSection = field(default_factory=SimSection)
    serving: ServingSection | None = None
    rl: RlSection | None = None
    path: str | None = None

    @property
    def kind(self) -> str:
        """``pd-serving``, ``rl-disaggregated`` or ``mixed``."""
        if self.serving and self.rl:
            return "mixed"
        return "pd-serving" if self.serving else "rl-disaggregated"


_POSITIVE = {
    "instances",
    "servers_per_instance",
    "gpus_per_server",
    "nics_per_server",
    "nic_gbps",
    "decode_servers",
    "decode_nics",
    "layers",
    "kv_bytes_per_token_layer",
    "flops_per_token_layer",
    "gpu_tflops",
    "gpu_efficiency",
    "payload_share",
    "gpu_mem_gbps",
    "batch_tokens",
    "mean_prompt_tokens",
    "max_prompt_tokens",
    "prefix_groups",
    "slo_factor",
    "requests",
    "trainer_nodes",
    "rollout_nodes",
    "nics_per_node",
    "iterations",
    "steps_per_iteration",
    "phases_per_step",
    "generation_ms",
    "generation_chunks",
    "param_bytes",
    "num_levels",
    "reuse_concentration",
    "staleness",
    "kv_store_nics",
}
_CHOICES = {"load_basis": ("compute", "network"), "router_load": ("queued", "outstanding")}
_FRACTIONS = {"reuse_mean", "gpu_efficiency", "payload_share"}
#: the largest value each numeric key takes (fractions: 1). Far past any real cluster, and low
#: enough that the model's arithmetic stays finite and a run ends: ``rl.nic_gbps = 1e300``
#: passed as "> 0" and failed the run with an OverflowError, a huge time never ended it.
_MAXIMA: dict[str, float] = {
    # [sim]
    "chunk_kib": 1 << 20,  # 1 GiB messages
    "timer_ms": 1e7,  # times: about 3 hours
    "load_tau_ms": 1e7,
    "num_levels": MAX_LEVELS,  # a policy file's K at most
    "oversubscription": 1e3,
    # node and NIC counts
    "instances": 1024,
    "servers_per_instance": 1024,
    "decode_servers": 4096,
    "kv_store_nodes": 4096,
    "trainer_nodes": 4096,
    "rollout_nodes": 4096,
    "gpus_per_server": 64,
    "nics_per_server": 64,
    "decode_nics": 64,
    "kv_store_nics": 64,
    "nics_per_node": 64,
    # rates
    "nic_gbps": 1e5,
    "gpu_tflops": 1e6,
    "gpu_mem_gbps": 1e6,
    # [serving] model and trace
    "layers": 1024,
    "lookahead": 1024,
    "kv_bytes_per_token_layer": 1 << 30,
    "a2a_bytes_per_token_layer": 1 << 30,
    "flops_per_token_layer": 1e15,
    "weight_bytes_per_gpu_layer": 1e13,
    "batch_tokens": 1 << 30,
    "mean_prompt_tokens": 1e8,
    "max_prompt_tokens": 100_000_000,
    "prompt_sigma": 10.0,
    "reuse_concentration": 1e6,
    "prefix_groups": 65536,
    "cached_groups": 65536,
    "prefix_zipf": 100.0,
    "router_max_wait_tokens": 1 << 40,
    "slo_factor": 1e6,
    "warmup_requests": 10_000_000,
    "requests": 10_000_000,
    # [rl] pipeline
    "iterations": 100_000,
    "warmup_iterations": 100_000,
    "staleness": 100_000,
    "steps_per_iteration": 10_000,
    "phases_per_step": 10_000,
    "generation_chunks": 100_000,
    "phase_compute_ms": 1e7,
    "generation_ms": 1e7,
    "tp_bytes_per_phase": 1e15,  # bytes: 1 PB
    "gen_tp_bytes_per_chunk": 1e15,
    "param_bytes": 1e15,
    "experience_bytes": 1e15,
}
#: the smallest value of the positive keys that a tiny value breaks (the default is "> 0"): a
#: rate of 1e-300 stretched the run past any end, a FLOP count that rounds to 0 divided by 0
_MINIMA: dict[str, float] = {
    "nic_gbps": 1e-3,
    "gpu_tflops": 1e-3,
    "gpu_mem_gbps": 1e-3,
    "gpu_efficiency": 1e-3,
    "payload_share": 1e-3,
    "flops_per_token_layer": 1.0,
    "mean_prompt_tokens": 1.0,
}


# --------------------------------------------------------------------------- parsing
def resolve(name_or_path: str) -> Path:
    """A scenario path from a path or a bundled name (``pd-serving`` -> bench/scenarios/...)."""
    path = Path(name_or_path)
    if path.exists():
        return path
    bundled = SCENARIO_DIR / f"{name_or_path}.toml"
    if bundled.exists():
        return bundled
    known = ", ".join(sorted(p.stem for p in SCENARIO_DIR.glob("*.toml")))
    raise ScenarioError(
        [f"scenario: no file {name_or_path!r} and no bundled scenario (known: {known})"]
    )


def load(name_or_path: str) -> Scenario:
    """Read and validate a scenario file (path or bundled name)."""
    path = resolve(name_or_path)
    try:
        text = path.read_text(encoding="utf-8-sig")  # (an editor's byte-order mark dropped)
    except (OSError, UnicodeDecodeError) as exc:  # a directory, no permission, not text
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ScenarioError([f"{path}: cannot read: {reason}"]) from None
    return parse(text, str(path))


def parse(text: str, path: str | None = None) -> Scenario:
    """Validate TOML ``text``; raise :class:`ScenarioError` naming every bad field path."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError([f"{path or 'scenario'}: invalid TOML: {exc}"]) from None
    errors: list[str] = []
    sections = {
        "scenario": ScenarioMeta,
        "sim": SimSection,
        "serving": ServingSection,
        "rl": RlSection,
    }
    errors += [f"{key}: unknown table" for key in data if key not in sections]
    if "scenario" not in data:
        errors.append("scenario: missing table")
    if "serving" not in data and "rl" not in data:
        errors.append("serving: a scenario needs a [serving] or an [rl] table (or both)")
    built = {
        key: _build(cls, data[key], key, errors) for key, cls in sections.items() if key in data
    }
    if built.get("serving") is not None:
        errors += _serving_errors(built["serving"])
    if built.get("rl") is not None:
        errors += _rl_errors(built["rl"])
    if not errors:
        errors += _node_errors(built.get("serving"), built.get("rl"))
    if errors:
        raise ScenarioError(errors)
    return Scenario(path=path, **built)


def nodes(
    serving: ServingSection | None, rl: RlSection | None
) -> list[tuple[str, int, float, str]]:
    """Every node the workloads name, in order: (name, NICs, NIC Gb/s, the key naming it).

    Roles that name the same node (a mixed scenario's decode servers that are the RL rollout
    nodes) share its links, so they must agree on its NICs.
    """
    # (the key naming the role's prefix, its prefix, how many nodes, NICs each, Gb/s each)
    roles: list[tuple[str, str, int, int, float]] = []
    if (s := serving) is not None:
        roles += [
            ("serving.prefill_prefix", s.prefill_prefix, s.instances * s.servers_per_instance,
             s.nics_per_server, s.nic_gbps),
            ("serving.decode_prefix", s.decode_prefix, s.decode_servers, s.decode_nics,
             s.nic_gbps),
            ("serving.kv_store_prefix", s.kv_store_prefix, s.kv_store_nodes, s.kv_store_nics,
             s.nic_gbps),
        ]  # fmt: skip
    if (r := rl) is not None:
        roles += [
            ("rl.trainer_prefix", r.trainer_prefix, r.trainer_nodes, r.nics_per_node, r.nic_gbps),
            ("rl.rollout_prefix", r.rollout_prefix, r.rollout_nodes, r.nics_per_node, r.nic_gbps),
        ]
    return [
        (f"{prefix}{i}", nics, gbps, key)
        for key, prefix, count, nics, gbps in roles
        for i in range(count)
    ]


def _node_errors(serving: ServingSection | None, rl: RlSection | None) -> list[str]:
    """A node named by two roles with different NICs: the run would give it one role's
    (the NIC count failed the run, a different rate silently applied the first role's)."""
    seen: dict[str, tuple[int, float, str]] = {}
    errors: list[str] = []
    reported: set[tuple[str, str]] = set()
    for node, nics, gbps, key in nodes(serving, rl):
        first = seen.setdefault(node, (nics, gbps, key))
        if first[:2] != (nics, gbps) and (first[2], key) not in reported:
            reported.add((first[2], key))  # one error per pair of roles, not per node
            errors.append(
                f"{key}: node {node} is also named by {first[2]} with {first[0]} NIC(s) at "
                f"{first[1]:g} Gb/s, here {nics} at {gbps:g} Gb/s (a node shared by two roles "
                "needs the same NICs)"
            )
    return errors


def _serving_errors(cfg: ServingSection) -> list[str]:
    """Cross-field rules of ``[serving]``."""
    errors = []
    if cfg.cached_groups and not cfg.kv_store_nodes:
        errors.append(
            "serving.cached_groups: the uncached prefix groups need a KV store "
            "(set serving.kv_store_nodes > 0)"
        )
    if cfg.cached_groups > cfg.prefix_groups:
        errors.append(
            f"serving.cached_groups: {cfg.cached_groups} is more than "
            f"serving.prefix_groups ({cfg.prefix_groups})"
        )
    return errors


def _rl_errors(cfg: RlSection) -> list[str]:
    """Cross-field rules of ``[rl]``: the measured window (iterations ``warmup_iterations`` to
    ``iterations - 1 - staleness``) holds an iteration with a span (iteration 0 has none), else
    the run reports no iteration time, no sync and an empty table."""
    first = max(cfg.warmup_iterations, 1)
    if first + cfg.staleness < cfg.iterations:
        return []
    return [
        f"rl.iterations: {cfg.iterations} leave no measured iteration after "
        f"rl.warmup_iterations ({cfg.warmup_iterations}, the pipeline fill) and rl.staleness "
        f"({cfg.staleness}, the drain); the first measured iteration is {first} "
        f"(iteration 0 has no span): expected rl.iterations >= {first + cfg.staleness + 1}"
    ]


def _build(cls: type, table: Any, path: str, errors: list[str]) -> Any:
    if not isinstance(table, dict):
        errors.append(f"{path}: expected a table")
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    errors += [f"{path}.{key}: unknown key" for key in table if key not in fields]
    values: dict[str, Any] = {}
    for name, spec in fields.items():
        if name in table:
            values[name] = _check_value(table[name], hints[name], f"{path}.{name}", errors)
        elif spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
            errors.append(f"{path}.{name}: missing required key")
    if any(e.startswith(f"{path}.") for e in errors):
        return None
    return cls(**values)


def _check_value(value: Any, hint: Any, path: str, errors: list[str]) -> Any:
    expected = _expected_type(hint)
    ok = isinstance(value, expected) and not isinstance(value, bool)
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        if not is_number(value):
            errors.append(f"{path}: {value!r} is out of range (too large for a float)")
            return None
        value, ok = float(value), True
    if not ok:
        errors.append(f"{path}: expected {expected.__name__}, got {value!r}")
        return None
    key = path.rsplit(".", 1)[-1]
    if key in _CHOICES and value not in _CHOICES[key]:
        errors.append(f"{path}: {value!r} is not one of {', '.join(_CHOICES[key])}")
        return None
    if isinstance(value, int | float) and _out_of_range(key, value):
        errors.append(f"{path}: {value!r} is out of range ({_range_text(key)})")
    return value


def _expected_type(hint: Any) -> type:
    if isinstance(hint, types.UnionType):
        return next(a for a in typing.get_args(hint) if a is not type(None))  # type: ignore[no-any-return]
    return hint  # type: ignore[no-any-return]


def _out_of_range(key: str, value: float) -> bool:
    if isinstance(value, float) and not math.isfinite(value):
        return True
    if value > (1.0 if key in _FRACTIONS else _MAXIMA.get(key, math.inf)):
        return True
    if key in _MINIMA:
        return value < _MINIMA[key]
    if key in _POSITIVE:
        return value <= 0
    return value < 0


def _range_text(key: str) -> str:
    positive = "> 0" if key in _POSITIVE else ">= 0"
    low = f">= {_MINIMA[key]:g}" if key in _MINIMA else positive
    if key in _FRACTIONS:
        return "expected 0..1" if low == ">= 0" else f"expected {low} and <= 1"
    if key in _MAXIMA:
        high = _MAXIMA[key]
        return f"expected {low} and <= {high if isinstance(high, int) else format(high, 'g')}"
    return f"expected {low}"


# --------------------------------------------------------------------------- serving trace
@dataclass(frozen=True, slots=True)
class Request:
    """One serving request of a trace (tokens; ``prefix_group`` = which cached prefix it reuses)."""

    request_id: str
    arrival: float
    prompt_tokens: int
    reused_tokens: int
    prefix_group: int
    slo: float
    warmup: bool

    @property
    def new_tokens(self) -> int:
        """Tokens that must be computed (the prompt minus the reused prefix)."""
        return self.prompt_tokens - self.reused_tokens


def layer_compute_time(cfg: ServingSection, new_tokens: int) -> float:
    """Roofline time of one layer on one instance: max(FLOPs, expert-weight reads).

    FLOPs = flops_per_token_layer x tokens spread over the instance's GPUs at
    ``gpu_tflops x gpu_efficiency``; the memory floor is each GPU reading its expert weights.
    """
    gpus = cfg.servers_per_instance * cfg.gpus_per_server
    flops = (
        cfg.flops_per_token_layer * new_tokens / (gpus * cfg.gpu_tflops * 1e12 * cfg.gpu_efficiency)
    )
    memory = cfg.weight_bytes_per_gpu_layer / (cfg.gpu_mem_gbps * 1e9)
    return max(flops, memory)


def a2a_cross_bytes(cfg: ServingSection, new_tokens: int) -> float:
    """All-to-all bytes of one layer that cross servers (leave a NIC), whole instance.

    Each token sends ``a2a_bytes_per_token_layer`` (dispatch + combine); a uniform expert choice
    sends the fraction (GPUs on other servers) / (GPUs of the instance) across the network.
    """
    gpus = cfg.servers_per_instance * cfg.gpus_per_server
    remote = (gpus - cfg.gpus_per_server) / gpus
    return new_tokens * cfg.a2a_bytes_per_token_layer * remote


def store_held(cfg: ServingSection, group: int) -> bool:
    """True when prefix ``group`` lives in the remote KV store (no instance caches it)."""
    return cfg.kv_store_nodes > 0 and cfg.cached_groups > 0 and group >= cfg.cached_groups


def isolated_ttft(
    cfg: ServingSection, prompt_tokens: int, new_tokens: int, remote_tokens: int = 0
) -> float:
    """Contention-free TTFT of a request served alone (the "TTFT at low load" of the SLO).

    Per layer: compute, then the all-to-all at full NIC speed; the P2D KV of each layer overlaps
    the next layer, so only the last layer's P2D adds: ``L x (C + A2A) + P2D_layer``. A prefix
    that must be fetched (``remote_tokens`` > 0, the KV store's prefixes) adds the first layer's
    fetch, and a layer cannot be shorter than its fetch (the lookahead overlaps the others).
    """
    nic = cfg.nic_gbps * 1e9 / 8
    nics = cfg.servers_per_instance * cfg.nics_per_server
    a2a = a2a_cross_bytes(cfg, new_tokens) / nics / nic
    p2d = prompt_tokens * cfg.kv_bytes_per_token_layer / nic
    fetch = remote_tokens * cfg.kv_bytes_per_token_layer / nic
    per_layer = max(layer_compute_time(cfg, new_tokens) + a2a, fetch)
    return fetch + cfg.layers * per_layer + max(p2d - per_layer, 0.0) * cfg.layers + p2d


def _mean_prompt(cfg: ServingSection) -> float:
    """E[prompt tokens]: the lognormal's mean with the clip at ``max_prompt_tokens``."""
    sigma = cfg.prompt_sigma
    mu = math.log(cfg.mean_prompt_tokens) - sigma**2 / 2
    if sigma <= 0:
        return min(cfg.mean_prompt_tokens, cfg.max_prompt_tokens)
    cut = math.log(cfg.max_prompt_tokens)

    def phi(x: float) -> float:
        return 0.5 * (1 + math.erf(x / math.sqrt(2)))

    below = math.exp(mu + sigma**2 / 2) * phi((cut - mu - sigma**2) / sigma)
    return below + cfg.max_prompt_tokens * (1 - phi((cut - mu) / sigma))


def _store_share(cfg: ServingSection) -> float:
    """The fraction of requests whose prefix lives in the KV store (Zipf popularity)."""
    weights = [(g + 1) ** -cfg.prefix_zipf for g in range(cfg.prefix_groups)]
    held = sum(w for g, w in enumerate(weights) if store_held(cfg, g))
    return float(held / sum(weights))


def network_utilization(cfg: ServingSection) -> dict[str, float]:
    """Offered utilization of each group of links at 1 request/s (mean request, uniform spread).

    ``decode ingress``: the P2D KV; ``prefill egress`` / ``prefill ingress``: the all-to-all
    plus P2D out / Stage-1 in; ``store egress``: Stage-1 fetches of store-held prefixes. Fetches
    of prefixes cached on another instance (router overflow) depend on the queues and are not
    counted, so this is a lower bound where the router overflows often.
    """
    nic = cfg.nic_gbps * 1e9 / 8
    layers, kv = cfg.layers, cfg.kv_bytes_per_token_layer
    prompt = _mean_prompt(cfg)
    new = prompt * (1 - cfg.reuse_mean)
    p2d = prompt * kv * layers
    a2a = a2a_cross_bytes(cfg, 1) * new * layers
    fetched = _store_share(cfg) * prompt * cfg.reuse_mean * kv * layers
    prefill_links = cfg.instances * cfg.servers_per_instance * cfg.nics_per_server * nic
    groups = {
        "decode ingress": p2d / (cfg.decode_servers * cfg.decode_nics * nic),
        "prefill egress": (a2a + p2d) / prefill_links,
        "prefill ingress": (a2a + fetched) / prefill_links,
    }
    if cfg.kv_store_nodes:
        groups["store egress"] = fetched / (cfg.kv_store_nodes * cfg.kv_store_nics * nic)
    return groups


def serving_capacity(cfg: ServingSection) -> float:
    """Requests/s the prefill instances sustain at the mean request size (compute load 1.0).

    Mean isolated busy time per request = L x (C + A2A) at the mean new-token count; the
    instances work in parallel.
    """
    new = max(int(cfg.mean_prompt_tokens * (1 - cfg.reuse_mean)), 1)
    nic = cfg.nic_gbps * 1e9 / 8
    nics = cfg.servers_per_instance * cfg.nics_per_server
    busy = cfg.layers * (layer_compute_time(cfg, new) + a2a_cross_bytes(cfg, new) / nics / nic)
    return cfg.instances / busy


#: the loads a run takes, from MIN_LOAD to below MAX_LOAD: a load of 1e-300 spread a serving
#: trace over 1e300 s (a run that never ended), one of 1e300 made infinite RL transfer sizes
#: (OverflowError); far past either end nothing more is learnt
MIN_LOAD = 1e-3
MAX_LOAD = 100.0


def check_load(load: float) -> None:
    """ValueError unless ``load`` is a finite number > 0 (0 has no arrivals, NaN no order),
    from :data:`MIN_LOAD` to below :data:`MAX_LOAD`."""
    if not (math.isfinite(load) and MIN_LOAD <= load < MAX_LOAD):
        raise ValueError(
            f"load: expected a finite number > 0 (from {MIN_LOAD:g} to below {MAX_LOAD:g}), "
            f"got {load!r}"
        )


def serving_arrival_rate(cfg: ServingSection, load: float) -> float:
    """Poisson arrival rate (requests/s) for ``load``: a fraction of :func:`serving_capacity`
    (``load_basis = "compute"``), or the rate at which the most loaded group of links of
    :func:`network_utilization` is offered ``load`` x its capacity (``"network"``); ValueError
    unless ``load`` is a finite number > 0."""
    check_load(load)
    if cfg.load_basis == "network":
        return load / max(network_utilization(cfg).values())
    return load * serving_capacity(cfg)


def serving_trace(cfg: ServingSection, load: float, seed: int) -> list[Request]:
    """The seeded request trace at ``load``: Poisson arrivals, lognormal prompts, Beta reuse.

    Prompt lengths are lognormal with mean ``mean_prompt_tokens`` and log-sd ``prompt_sigma``;
    the reused fraction is Beta-distributed with mean ``reuse_mean``; the prefix a request
    reuses is drawn Zipf(``prefix_zipf``) over ``prefix_groups`` (hot prefixes make victim
    units). The same seed gives the same sizes at every load; only the arrival times scale.
    """
    rng = random.Random(seed)
    rate = serving_arrival_rate(cfg, load)
    weights = [1.0 / (g + 1) ** cfg.prefix_zipf for g in range(cfg.prefix_groups)]
    mu = math.log(cfg.mean_prompt_tokens) - cfg.prompt_sigma**2 / 2
    alpha = cfg.reuse_mean * cfg.reuse_concentration
    beta = (1 - cfg.reuse_mean) * cfg.reuse_concentration
    now, requests = 0.0, []
    for i in range(cfg.warmup_requests + cfg.requests):
        gap = rng.expovariate(1.0)
        prompt = min(max(int(rng.lognormvariate(mu, cfg.prompt_sigma)), 16), cfg.max_prompt_tokens)
        reuse = rng.betavariate(alpha, beta) if alpha > 0 and beta > 0 else cfg.reuse_mean
        reused = min(int(prompt * reuse), prompt - 1)
        group = rng.choices(range(cfg.prefix_groups), weights)[0]
        now += gap / rate
        remote = reused if store_held(cfg, group) else 0
        slo = cfg.slo_factor * isolated_ttft(cfg, prompt, prompt - reused, remote)
        requests.append(Request(f"q{i}", now, prompt, reused, group, slo, i < cfg.warmup_requests))
    return requests


# --------------------------------------------------------------------------- rl plan
@dataclass(frozen=True, slots=True)
class RlPlan:
    """Load-scaled transfer sizes of the RL pipeline (bytes)."""

    param_bytes: float
    experience_bytes: float
    tp_bytes_per_phase: float
    gen_tp_bytes_per_chunk: float


def _rl_window(cfg: RlSection) -> tuple[float, float, float]:
    """(trainer node bandwidth B/s, sync window s, trainer TP bytes per node inside the window).

    The trainer finishes iteration i one train step after generation i ends; the sync must land
    before generation i + 1 + staleness starts, i.e. within ``staleness`` generation periods
    minus that last step. The trainer's remaining steps of the next iteration run inside the
    window and send their TP collectives through the same NICs.
    """
    bandwidth = cfg.nic_gbps * 1e9 / 8 * cfg.nics_per_node
    tp_time = cfg.tp_bytes_per_phase / bandwidth
    step = cfg.phases_per_step * (cfg.phase_compute_ms / 1e3 + tp_time)
    window = max(cfg.staleness * cfg.generation_ms / 1e3 - step, 1e-3)
    tp_bytes = (cfg.steps_per_iteration - 1) * cfg.phases_per_step * cfg.tp_bytes_per_phase
    return bandwidth, window, tp_bytes * cfg.staleness


def rl_nominal_load(cfg: RlSection) -> float:
    """Load of the file's nominal sizes: trainer-egress bytes / capacity over the sync window.

    Each trainer node sends its 1/trainer_nodes shard of the weights to every rollout node, and
    its TP collectives; load 1.0 means a perfect scheduler just meets every sync deadline.
    """
    bandwidth, window, tp_bytes = _rl_window(cfg)
    sync = cfg.param_bytes / cfg.trainer_nodes * cfg.rollout_nodes
    return (sync + tp_bytes) / (bandwidth * window)


def rl_plan(cfg: RlSection, load: float) -> RlPlan:
    """Scale the param-sync and experience sizes so that :func:`rl_nominal_load` equals ``load``.

    TP collective sizes are model properties and stay fixed; the deferrable transfers scale.
    ValueError unless ``load`` is a finite number > 0.
    """
    check_load(load)
    bandwidth, window, tp_bytes = _rl_window(cfg)
    sync_per_node = max(load * bandwidth * window - tp_bytes, 0.0)
    scale = sync_per_node / (cfg.param_bytes / cfg.trainer_nodes * cfg.rollout_nodes)
    return RlPlan(
        param_bytes=cfg.param_bytes * scale,
        experience_bytes=cfg.experience_bytes * scale,
        tp_bytes_per_phase=cfg.tp_bytes_per_phase,
        gen_tp_bytes_per_chunk=cfg.gen_tp_bytes_per_chunk,
    )
