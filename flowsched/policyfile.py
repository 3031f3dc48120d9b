"""Policy files: parse, validate and apply ``policies/*.toml``.

A policy file names the scheduling policy and its arguments, the number of levels K, how the K
levels are compressed into the fabric's hardware queues, the DSCP / SO_PRIORITY marking of each
queue, the coordinator's timer period, and the class rules (NCCL ``trafficClass`` values -> flow
class, each class's static default level and default relative deadline). The shipped files
(``flowsched/data/policies/*.toml``, also reachable as ``policies/*.toml``) document every key.

Validation collects every error, each naming its field path
(``classes.kv.deadline: expected a number > 0, got -1``), and raises them together in one
:class:`PolicyFileError`.
"""

from __future__ import annotations

import importlib.resources
import json
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowsched import policies
from flowsched.model import EXPLICIT_DEADLINE, FlowClass
from flowsched.policies import hwqueues, static
from flowsched.policies.argcheck import (
    Checker,
    check_fields,
    integer,
    is_int,
    list_of,
    number,
    one_of,
)
from flowsched.policies.base import Policy
from flowsched.shm.layout import MAX_CLASS_MAP

#: NCCL's ``ncclNetCommConfig.trafficClass`` is an int; -1 means "not set". We accept 0..255.
MAX_TRAFFIC_CLASS = 255
#: DSCP is 6 bits.
MAX_DSCP = 63
#: Unprivileged processes may set SO_PRIORITY 0..6 only (7+ needs CAP_NET_ADMIN).
MAX_SO_PRIORITY = 6
MAX_LEVELS = 64
MAX_HW_QUEUES = 8
#: the shortest ``timer_period`` (s) a file may set
MIN_TIMER_PERIOD = 1e-6

#: Default DSCP per hardware queue when a file gives no ``[[queues]]``, most urgent first:
#: EF, CS5, AF41, CS4, AF21, AF11, CS1, LE (RFC 8622 lower effort). DSCP 0 (best effort) is
#: left to untagged traffic so that a capture can tell scheduled from unscheduled packets.
#: None is in 24-31 or 48-55: RoCE fabrics usually reserve DSCP 26 (lossless, PFC priority 3)
#: and 48 (CNP, priority 6), and a switch mapping DSCP >> 3 to priorities puts those ranges there.
DEFAULT_DSCPS = (46, 40, 34, 32, 18, 10, 8, 1)


class PolicyFileError(ValueError):
    """Every problem found in one policy file; ``errors`` name their field paths."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))

    def __str__(self) -> str:
        return "\n".join(self.errors)


@dataclass(frozen=True, slots=True)
class ClassRule:
    """How one flow class is recognised and what it gets without an agent or an SDK hint.

    ``traffic_classes``: NCCL ``trafficClass`` values that select this class.
    ``default_level``: the level the plugin uses when no agent is running.
    ``deadline``: default relative deadline in seconds (explicit-deadline classes only).
    """

    traffic_classes: tuple[int, ...]
    default_level: int
    deadline: float | None


@dataclass(frozen=True, slots=True)
class LevelMarking:
    """What goes on the wire for one level: the DSCP code point and the socket SO_PRIORITY."""

    dscp: int
    so_priority: int


@dataclass(frozen=True, slots=True)
class Gating:
    """The NCCL plugin's host-side permit (``[gating]``); None = the plugin's default.

    ``enabled``: defer a less urgent send while more urgent ones are in flight on the device
    (plugin default: on in wrapping mode, off in transport mode). ``min_share``: the fraction
    of a device's bytes each level keeps (starvation guard). ``window``: seconds over which
    that share is measured. ``max_deferral``: the longest a send waits, seconds (0 = no bound).
    The plugin's FLOWSCHED_GATING* environment variables win over the file.
    """

    enabled: bool | None = None
    min_share: float | None = None
    window: float | None = None
    max_deferral: float | None = None


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """A validated policy file."""

    source: str
    policy: str
    args: dict[str, Any]
    num_levels: int
    hw_queues: int
    timer_period: float
    classes: dict[FlowClass, ClassRule]
    #: one marking per level 0..K-1, after compressing levels into hardware queues
    levels: tuple[LevelMarking, ...]
    hw_mapping: str = "ends"
    #: one marking per hardware queue 0..hw_queues-1
    queues: tuple[LevelMarking, ...] = ()
    #: the hardware queue of each level 0..K-1
    level_queue: tuple[int, ...] = ()
    description: str = ""
    gating: Gating = Gating()

    def class_for_traffic_class(self, tc: int) -> FlowClass | None:
        """The flow class that NCCL ``trafficClass`` value ``tc`` selects, if any."""
        for cls, rule in self.classes.items():
            if tc in rule.traffic_classes:
                return cls
        return None

    def make_policy(self) -> Policy:
        """A fresh policy object as the file describes it."""
        return policies.create(self.policy, self.args, num_levels=self.num_levels)

    def summary(self) -> str:
        """One line: policy, K, hardware queues, timer."""
        return (
            f"policy {self.policy}, K={self.num_levels}, hw_queues={self.hw_queues} "
            f"({self.hw_mapping}), timer {self.timer_period * 1e3:g} ms"
        )


def load(path: str | Path) -> PolicyConfig:
    """Parse and validate the policy file at ``path``; raise :class:`PolicyFileError`."""
    return loads(read_text(path), source=str(path))


def read_text(path: str | Path) -> str:
    """The text of the policy file at ``path``; :class:`PolicyFileError` ``cannot read: ...``
    when it is missing, a directory, unreadable or not UTF-8 (like every other error, it does
    not name the file: whoever reports it does). A byte-order mark (an editor's UTF-8 BOM),
    which TOML does not take, is dropped."""
    try:
        return Path(path).read_text(encoding="utf-8-sig")
    except OSError as exc:
        raise PolicyFileError([f"cannot read: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError as exc:
        raise PolicyFileError(
            [f"cannot read: not UTF-8 text ({exc.reason} at byte {exc.start})"]
        ) from None


def problem(flag: str, path: str | Path, exc: PolicyFileError) -> str:
    """One line for a command's bad policy file: ``--policy FILE: error; error``."""
    return f"{flag} {path}: " + "; ".join(exc.errors)


def loads(text: str, source: str = "<string>") -> PolicyConfig:
    """Parse and validate policy-file ``text``; ``source`` names it in the result."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyFileError([f"invalid TOML: {exc}"]) from None
    return from_mapping(document, source=source)


def embedded_default() -> PolicyConfig:
    """The packaged ``default.toml`` (RMLQ)."""
    resource = importlib.resources.files("flowsched") / "data" / "policies" / "default.toml"
    return loads(resource.read_text(encoding="utf-8"), source="<embedded default.toml>")


def shipped_files() -> list[str]:
    """Names of the policy files shipped in the package (``default.toml``, ...)."""
    folder = importlib.resources.files("flowsched") / "data" / "policies"
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".toml"))


def from_mapping(document: Mapping[str, Any], source: str = "<mapping>") -> PolicyConfig:
    """Validate an already parsed document (the TOML tables as dicts)."""
    if not isinstance(document, Mapping):
        raise PolicyFileError([f"expected a table at the top level, got {document!r}"])
    errors = check_fields(document, "", _TOP_LEVEL)
    errors = [e[1:] if e.startswith(".") else e for e in errors]
    section = _table(document, "policy", errors)
    errors += check_fields(section, "policy", _POLICY_FIELDS)
    name = section.get("name")
    num_levels = _get_int(section, "num_levels", 8)
    hw_queues = _get_int(section, "hw_queues", min(num_levels, MAX_HW_QUEUES))
    args = section.get("args", {})
    if isinstance(name, str) and isinstance(args, Mapping):
        errors += _policy_arg_errors(name, args)
    if not any(e.startswith("policy") for e in errors):
        errors += _construction_errors(str(name), dict(args), num_levels)
    if not any(e.startswith(("policy.num_levels", "policy.hw_queues")) for e in errors):
        errors += _hw_queue_errors(num_levels, hw_queues)
    classes = _classes(document, num_levels, errors)
    queues = _queues(document, hw_queues, errors)
    gating = _table(document, "gating", errors)
    errors += check_fields(gating, "gating", _GATING_FIELDS)
    if errors:
        raise PolicyFileError(errors)
    config = _build(document, source, classes, queues)
    mapped = sum(len(rule.traffic_classes) for rule in config.classes.values())
    if mapped > MAX_CLASS_MAP:  # the agent could not hand the rest to the plugin
        raise PolicyFileError(
            [
                f"classes: {mapped} traffic_classes in all (defaults included); the node's "
                f"flow table maps at most {MAX_CLASS_MAP}"
            ]
        )
    return config


# -- field specifications ---------------------------------------------------------------------

_TOP_LEVEL: dict[str, Checker] = {
    "description": lambda v, p: [] if isinstance(v, str) else [f"{p}: expected a string"],
    "policy": lambda v, p: [],
    "classes": lambda v, p: [],
    "queues": lambda v, p: [],
    "gating": lambda v, p: [],
}

_POLICY_FIELDS: dict[str, Checker] = {
    "name": lambda v, p: (
        []
        if v in policies.names()
        else [f"{p}: unknown policy {v!r} (known: {', '.join(policies.names())})"]
    ),
    "num_levels": integer(1, MAX_LEVELS),
    "hw_queues": integer(1, MAX_HW_QUEUES),
    "hw_mapping": one_of(*hwqueues.RULES),
    # a period below the clocks' resolution (1e-300) re-armed the sweep at the same instant
    "timer_period": number(MIN_TIMER_PERIOD, 60.0),
    "args": lambda v, p: [] if isinstance(v, Mapping) else [f"{p}: expected a table, got {v!r}"],
}

_CLASS_FIELDS: dict[str, Checker] = {
    "traffic_classes": list_of(integer(0, MAX_TRAFFIC_CLASS)),
    "default_level": integer(0, MAX_LEVELS - 1),
    "deadline": number(0.0, None, open_low=True),
}

#: the table carries milliseconds in 16 bits (flowsched.shm.layout.GATE_UNSET excluded)
_MAX_GATE_SECONDS = 65.534

_GATING_FIELDS: dict[str, Checker] = {
    "enabled": lambda v, p: [] if isinstance(v, bool) else [f"{p}: expected true or false"],
    "min_share": number(0.0, 1.0),
    "window": number(0.001, _MAX_GATE_SECONDS),
    "max_deferral": number(0.0, _MAX_GATE_SECONDS),
}

_QUEUE_FIELDS: dict[str, Checker] = {
    "dscp": integer(0, MAX_DSCP),
    "so_priority": integer(0, MAX_SO_PRIORITY),
}


def _table(document: Mapping[str, Any], key: str, errors: list[str]) -> Mapping[str, Any]:
    value = document.get(key, {})
    if not isinstance(value, Mapping):
        errors.append(f"{key}: expected a table, got {value!r}")
        return {}
    if key == "policy" and "name" not in value:
        errors.append('policy.name: missing (the policy to run, e.g. "rmlq")')
    return value


def _get_int(section: Mapping[str, Any], key: str, default: int) -> int:
    value = section.get(key, default)
    return value if is_int(value) and value >= 1 else default


def _policy_arg_errors(name: str, args: Mapping[str, Any]) -> list[str]:
    try:
        mod = policies.module(name)
    except KeyError:
        return []  # already reported under policy.name
    errors: list[str] = mod.validate(dict(args), "policy.args")
    return errors


# -- classes ----------------------------------------------------------------------------------


def _classes(
    document: Mapping[str, Any], num_levels: int, errors: list[str]
) -> dict[FlowClass, Any]:
    section = document.get("classes", {})
    if not isinstance(section, Mapping):
        errors.append(f"classes: expected a table keyed by class, got {section!r}")
        return {}
    labels = {c.label: c for c in FlowClass}
    found: dict[FlowClass, Any] = {}
    for key, value in section.items():
        if key not in labels:
            errors.append(
                f"classes.{key}: unknown flow class (expected one of: {', '.join(labels)})"
            )
        elif not isinstance(value, Mapping):
            errors.append(f"classes.{key}: expected a table, got {value!r}")
        else:
            errors.extend(_class_errors(labels[key], value, num_levels))
            found[labels[key]] = value
    errors.extend(_duplicate_traffic_classes(found))
    return found


def _class_errors(cls: FlowClass, rule: Mapping[str, Any], num_levels: int) -> list[str]:
    path = f"classes.{cls.label}"
    errors = check_fields(rule, path, _CLASS_FIELDS)
    level = rule.get("default_level")
    if is_int(level) and 0 <= level < MAX_LEVELS and level >= num_levels:
        errors.append(
            f"{path}.default_level: {level} is outside 0..{num_levels - 1} (K={num_levels})"
        )
    if "deadline" in rule and cls not in EXPLICIT_DEADLINE:
        explicit = ", ".join(sorted(c.label for c in EXPLICIT_DEADLINE))
        errors.append(
            f"{path}.deadline: only explicit-deadline classes ({explicit}) take a deadline"
        )
    return errors


def _duplicate_traffic_classes(found: Mapping[FlowClass, Mapping[str, Any]]) -> list[str]:
    owner: dict[int, str] = {}
    errors: list[str] = []
    for cls, rule in found.items():
        values = rule.get("traffic_classes", [])
        if not isinstance(values, list):
            continue
        for i, tc in enumerate(values):
            if not is_int(tc):
                continue
            if tc in owner:
                errors.append(
                    f"classes.{cls.label}.traffic_classes[{i}]: trafficClass {tc} is already "
                    f"mapped to {owner[tc]}"
                )
            owner.setdefault(tc, cls.label)
    return errors


def default_class_rule(cls: FlowClass, num_levels: int) -> ClassRule:
    """The rule a class gets when the file does not mention it.

    trafficClass value = the class id (``tp`` 0 ... ``bulk`` 5), the ``static`` policy's
    default level (:func:`flowsched.policies.static.default_level`), no default deadline.
    """
    return ClassRule((int(cls),), static.default_level(cls, num_levels), None)


# -- hardware queues and markings -------------------------------------------------------------


def default_queue_markings(hw_queues: int) -> tuple[LevelMarking, ...]:
    """Distinct DSCP per queue (spread over :data:`DEFAULT_DSCPS`) and SO_PRIORITY 6..0.

    With one queue everything is best effort (DSCP 0, SO_PRIORITY 0). With 8 queues the two
    least urgent share SO_PRIORITY 0 (only 0..6 are unprivileged) but keep distinct DSCPs.
    """
    if hw_queues == 1:
        return (LevelMarking(0, 0),)
    last = len(DEFAULT_DSCPS) - 1
    markings = []
    for queue in range(hw_queues):
        dscp = DEFAULT_DSCPS[round(queue * last / (hw_queues - 1))]
        if hw_queues > MAX_SO_PRIORITY + 1:
            prio = max(MAX_SO_PRIORITY - queue, 0)
        else:
            prio = round(MAX_SO_PRIORITY * (hw_queues - 1 - queue) / (hw_queues - 1))
        markings.append(LevelMarking(dscp, prio))
    return tuple(markings)


def _queues(document: Mapping[str, Any], hw_queues: int, errors: list[str]) -> list[Any]:
    value = document.get("queues")
    if value is None:
        return []
    if not isinstance(value, list):
        errors.append(f"queues: expected an array of tables ([[queues]]), got {value!r}")
        return []
    if len(value) != hw_queues:
        errors.append(
            f"queues: expected one entry per hardware queue ({hw_queues}), got {len(value)}"
        )
    seen: dict[int, int] = {}
    for i, entry in enumerate(value):
        path = f"queues[{i}]"
        if not isinstance(entry, Mapping):
            errors.append(f"{path}: expected a table with dscp and so_priority, got {entry!r}")
            continue
        errors.extend(check_fields(entry, path, _QUEUE_FIELDS))
        errors.extend(f"{path}.{key}: missing" for key in _QUEUE_FIELDS if key not in entry)
        dscp = entry.get("dscp")
        if is_int(dscp) and dscp in seen:
            errors.append(f"{path}.dscp: {dscp} is already used by queues[{seen[dscp]}]")
        if is_int(dscp):
            seen.setdefault(dscp, i)
    return value


# -- building ---------------------------------------------------------------------------------


def _build(
    document: Mapping[str, Any],
    source: str,
    classes: Mapping[FlowClass, Mapping[str, Any]],
    queue_entries: list[Any],
) -> PolicyConfig:
    section = document["policy"]
    num_levels = int(section.get("num_levels", 8))
    hw_queues = int(section.get("hw_queues", min(num_levels, MAX_HW_QUEUES)))
    rule = str(section.get("hw_mapping", "ends"))
    queues = (
        tuple(LevelMarking(int(q["dscp"]), int(q["so_priority"])) for q in queue_entries)
        if queue_entries
        else default_queue_markings(hw_queues)
    )
    level_queue = hwqueues.table(num_levels, hw_queues, rule)
    return PolicyConfig(
        source=source,
        policy=str(section["name"]),
        args=dict(section.get("args", {})),
        num_levels=num_levels,
        hw_queues=hw_queues,
        timer_period=float(section.get("timer_period", 0.001)),
        classes=_class_rules(classes, num_levels),
        levels=tuple(queues[q] for q in level_queue),
        hw_mapping=rule,
        queues=queues,
        level_queue=level_queue,
        description=str(document.get("description", "")),
        gating=Gating(**dict(document.get("gating", {}))),
    )


def _class_rules(
    classes: Mapping[FlowClass, Mapping[str, Any]], num_levels: int
) -> dict[FlowClass, ClassRule]:
    rules: dict[FlowClass, ClassRule] = {}
    for cls in FlowClass:
        base = default_class_rule(cls, num_levels)
        given = classes.get(cls, {})
        deadline = given.get("deadline", base.deadline)
        rules[cls] = ClassRule(
            traffic_classes=tuple(given.get("traffic_classes", base.traffic_classes)),
            default_level=int(given.get("default_level", base.default_level)),
            deadline=None if deadline is None else float(deadline),
        )
    _drop_shadowed_defaults(rules, classes)
    return rules


def _drop_shadowed_defaults(
    rules: dict[FlowClass, ClassRule], given: Mapping[FlowClass, Any]
) -> None:
    """A default trafficClass value that the file assigns to another class belongs to that one."""
    explicit = {
        tc
        for cls, rule in given.items()
        if "traffic_classes" in rule
        for tc in rule["traffic_classes"]
    }
    for cls, rule in rules.items():
        if cls not in given or "traffic_classes" not in given[cls]:
            kept = tuple(tc for tc in rule.traffic_classes if tc not in explicit)
            rules[cls] = ClassRule(kept, rule.default_level, rule.deadline)


def _hw_queue_errors(num_levels: int, hw_queues: int) -> list[str]:
    """More hardware queues than levels: a level is one queue, so only K of them would carry
    traffic, and the default markings spread over all H would mark the scavenger level
    (bulk) with a middle queue's DSCP (CS4 for K=4, H=8) instead of LE."""
    if hw_queues <= num_levels:
        return []
    return [
        f"policy.hw_queues: {hw_queues} is more than num_levels ({num_levels}); each level "
        f"uses one hardware queue, so set hw_queues to at most {num_levels}"
    ]


def _construction_errors(name: str, args: dict[str, Any], num_levels: int) -> list[str]:
    """Errors that depend on K (e.g. too few levels for the policy's layout)."""
    try:
        policies.create(name, args, num_levels=num_levels)
    except (ValueError, TypeError, ArithmeticError) as exc:  # e.g. thresholds overflow
        return [str(exc) if str(exc).startswith("policy") else f"policy: {exc}"]
    return []


def to_toml(document: Mapping[str, Any], prefix: str = "") -> str:
    """TOML text of ``document``: scalars, lists of scalars, tables and arrays of tables."""
    lines: list[str] = []
    nested: list[tuple[str, Any]] = []
    for key, value in document.items():
        if isinstance(value, Mapping) or (
            isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value)
        ):
            nested.append((key, value))
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    out = "\n".join(lines) + ("\n" if lines else "")
    for key, value in nested:
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out += f"\n[{name}]\n" + to_toml(value, f"{name}.")
        else:
            for item in value:
                out += f"\n[[{name}]]\n" + to_toml(item, f"{name}.")
    return out


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        # a JSON string is a TOML basic string, but for the escapes: \uXXXX pairs for
        # characters beyond U+FFFF (TOML takes no surrogates: an emoji in a description made
        # the file unreadable), and DEL, which TOML wants escaped
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


__all__ = [
    "ClassRule",
    "LevelMarking",
    "PolicyConfig",
    "PolicyFileError",
    "default_class_rule",
    "default_queue_markings",
    "embedded_default",
    "from_mapping",
    "load",
    "loads",
    "shipped_files",
    "to_toml",
]
