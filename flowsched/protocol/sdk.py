"""Wire format between applications (:mod:`flowsched.client`) and their node agent (sans-IO).

Transport: a unix stream socket. The client's first frame may carry one descriptor of its
``/proc/self/ns/pid`` (``SCM_RIGHTS``): the agent keys the client's flows by that pid namespace
where it may not read the client's namespace link (:mod:`flowsched.shm.pidns`); an agent that
does not look for it never sees it. Framing is the agent/coordinator protocol's (4-byte
big-endian length, msgpack body, bounded size; :data:`MAX_SDK_FRAME` = 64 KiB here). A body is
a msgpack map with the message type under ``"t"``. Decoding builds only plain msgpack values
and checks every field; an unknown type or field, or a value of the wrong type or range, raises
:class:`SdkProtocolError` naming the message type and field (``open.deadline: expected ...``).

Client -> agent:

* ``open{ref, cls, size?, deadline?, consumer_index?, job?, request?, peer?, dst_node?}``: open
  an SDK flow. ``ref`` is the client's name for the pending request; the agent answers
  ``opened`` (or ``error`` with the same ``ref``). ``dst_node`` names the node that receives
  the flow: the agent adds that node's ingress link (``<dst_node>:rx``) to the flow's links.
  The process id comes from the socket (SO_PEERCRED), never from the message. The agent scopes
  ``job`` and ``request`` to the client's uid (``"<uid>/<name>"``) before forwarding them.
  ``deadline`` is wall-clock seconds since the epoch, not before :data:`MIN_DEADLINE`.
  ``consumer_index`` is a layer index for kv and kv_reuse (at most :data:`MAX_LAYER`), else a
  step (at most :data:`MAX_STEP`).
* ``progress{id, sent}``, ``close{id, sent}``: bytes the application moved itself.
* ``job_progress{job, step, layer?}``: the job reached a step (and layer).
* ``list{after?}``: the open SDK flows with ids above ``after``, oldest first (``flowsched
  flows``); root and the agent's own user see every user's, others their own.

Agent -> client:

* ``opened{ref, id, level, dscp, so_priority, nccl_traffic_class?}``: the flow id and the
  marking to use now.
* ``level{id, level, dscp, so_priority, decided_at?, decided_ns?}``: pushed whenever the flow's
  level changes; ``decided_at`` (wall seconds) / ``decided_ns`` (CLOCK_MONOTONIC ns of the
  coordinator's machine) say when the coordinator decided it, when it did.
* ``flows{flows, more, everyone}``: one page of the answer to ``list``: each flow as
  :class:`FlowInfo`; ``more``: ask again with ``after`` = the last id; ``everyone``: every
  user's flows are listed, not only the asker's.
* ``error{code, reason, ref?}``.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, ClassVar

import msgpack

from flowsched.model import LAYER_CLASSES, FlowClass
from flowsched.protocol import (
    I64_MAX,
    MAX_NAME,
    U64_MAX,
    LocalProtocolError,
    ReceiveBuffer,
    frame,
    is_name,
)

MAX_SDK_FRAME = 64 * 1024
MAX_TEXT = MAX_NAME
U32_MAX = 2**32 - 1
#: longest node name in ``open.dst_node`` (its link id ``<node>:rx`` must fit a protocol name)
MAX_NODE = 128
#: longest job and request name: the agent scopes both to the client's uid (``"<uid>/<job>"``),
#: which must still fit a protocol name
MAX_JOB = MAX_NAME - 16
MAX_REQUEST = MAX_JOB
#: largest layer index: ``job_progress.layer``, and ``open.consumer_index`` of the classes whose
#: consumer is a layer (kv, kv_reuse). The coordinator learns a model's depth from the deepest
#: index it sees; no model has a million layers
MAX_LAYER = 1 << 20
#: largest step: ``job_progress.step``, and ``open.consumer_index`` of the other classes
MAX_STEP = 1 << 40
#: earliest ``open.deadline`` (2001-09-09): a deadline is wall-clock seconds since the epoch,
#: and one below this is a relative one given by mistake (``deadline=20.0`` meant as "20 s from
#: now"), long past: its flow would stay at level 0 for good
MIN_DEADLINE = 1e9


class SdkProtocolError(ValueError):
    """A malformed SDK frame; the message names the message type and field (``field``: the
    bad field's name, when one is to blame)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class Open:
    """Client asks to open a flow."""

    TYPE: ClassVar[str] = "open"
    ref: int
    cls: str
    size: int | None = None
    deadline: float | None = None
    consumer_index: int | None = None
    job: str | None = None
    request: str | None = None
    peer: int | None = None
    dst_node: str | None = None


@dataclass(frozen=True, slots=True)
class Progress:
    """Bytes the application has sent on flow ``id`` so far."""

    TYPE: ClassVar[str] = "progress"
    id: int
    sent: int


@dataclass(frozen=True, slots=True)
class Close:
    """The application finished flow ``id`` after ``sent`` bytes."""

    TYPE: ClassVar[str] = "close"
    id: int
    sent: int


@dataclass(frozen=True, slots=True)
class JobProgress:
    """Job ``job`` is now at ``step`` (and ``layer``); ``done`` (sent only when True): the job
    ended (a serving batch's prefill finished). An agent of an earlier release refuses it."""

    TYPE: ClassVar[str] = "job_progress"
    job: str
    step: int
    layer: int | None = None
    done: bool | None = None


@dataclass(frozen=True, slots=True)
class Opened:
    """The agent's answer to ``open``."""

    TYPE: ClassVar[str] = "opened"
    ref: int
    id: int
    level: int
    dscp: int
    so_priority: int
    nccl_traffic_class: int | None = None


@dataclass(frozen=True, slots=True)
class Level:
    """Flow ``id`` now has ``level`` with this marking."""

    TYPE: ClassVar[str] = "level"
    id: int
    level: int
    dscp: int
    so_priority: int
    decided_at: float | None = None
    decided_ns: int | None = None


@dataclass(frozen=True, slots=True)
class Error:
    """A refused request (``ref`` names it when it was an ``open``)."""

    TYPE: ClassVar[str] = "error"
    code: str
    reason: str
    ref: int | None = None


@dataclass(frozen=True, slots=True)
class ListFlows:
    """Client asks for the open SDK flows with ids above ``after`` (all: None)."""

    TYPE: ClassVar[str] = "list"
    after: int | None = None


@dataclass(frozen=True, slots=True)
class FlowInfo:
    """One open SDK flow as the agent lists it: what its ``open`` asked for (``job`` and
    ``request`` as the application named them, unscoped), who opened it, where it stands."""

    TYPE: ClassVar[str] = "flows.flows[]"
    id: int
    cls: str
    #: the opening process (SO_PEERCRED, in the agent's pid namespace; 0: not visible there)
    pid: int
    opened_at: float
    sent: int
    uid: int | None = None
    #: the level decided for it (None: none yet, its class default applies)
    level: int | None = None
    size: int | None = None
    #: its deadline (wall-clock seconds), the class's default deadline when it gave none
    deadline: float | None = None
    consumer_index: int | None = None
    job: str | None = None
    request: str | None = None
    peer: int | None = None
    dst_node: str | None = None
    #: the NCCL connections that carry it: (flow-table slot, the slot's claim_seq) each, at
    #: most MAX_LISTED_SLOTS (a slot claimed again since is another connection)
    slots: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class FlowList:
    """One page of the answer to ``list``."""

    TYPE: ClassVar[str] = "flows"
    flows: tuple[FlowInfo, ...]
    more: bool
    everyone: bool


SdkMessage = Open | Progress | Close | JobProgress | ListFlows | Opened | Level | Error | FlowList
CLIENT_MESSAGES: dict[str, type[Any]] = {
    m.TYPE: m for m in (Open, Progress, Close, JobProgress, ListFlows)
}
AGENT_MESSAGES: dict[str, type[Any]] = {m.TYPE: m for m in (Opened, Level, Error, FlowList)}
#: carrier slots listed per flow in ``flows`` (a flow's carriers beyond are not named)
MAX_LISTED_SLOTS = 256
#: the slot indexes of a table are below 2**24 (flowsched.shm.table)
_MAX_SLOT = (1 << 24) - 1

# field name -> (kind, low, high); kind in "u" (int range), "f" (finite float >= 0), "s" (text
# of low..high characters), "n" (a protocol name of at most high characters, see is_name).
# Whatever the agent forwards to the coordinator (job, request, dst_node, consumer_index, step,
# layer) must pass the coordinator's own checks too: a value the coordinator refuses would close
# the agent's connection, and the resync after reconnecting would carry it again.
_RULES: dict[str, tuple[str, float, float]] = {
    "ref": ("u", 0, U32_MAX),
    "id": ("u", 0, U64_MAX),
    "sent": ("u", 0, U64_MAX),
    "size": ("u", 0, U64_MAX),
    "deadline": ("f", 0, math.inf),
    "consumer_index": ("u", 0, MAX_STEP),
    "step": ("u", 0, MAX_STEP),
    "layer": ("u", 0, MAX_LAYER),
    "peer": ("u", -1, 2**31 - 1),
    "level": ("u", 0, 255),
    "dscp": ("u", 0, 63),
    "so_priority": ("u", 0, U32_MAX),
    "nccl_traffic_class": ("u", -(2**31), 2**31 - 1),
    "cls": ("s", 1, 32),
    "job": ("n", 1, MAX_JOB),
    "request": ("n", 1, MAX_REQUEST),
    "dst_node": ("n", 1, MAX_NODE),
    "decided_at": ("f", 0, math.inf),
    "decided_ns": ("u", 0, I64_MAX),
    "code": ("s", 1, MAX_TEXT),
    "reason": ("s", 0, 4096),
    "done": ("b", 0, 1),
    "after": ("u", 0, U64_MAX),
    "pid": ("u", 0, 2**31 - 1),
    "uid": ("u", 0, U32_MAX),
    "opened_at": ("f", 0, math.inf),
    "more": ("b", 0, 1),
    "everyone": ("b", 0, 1),
}


def encode(message: SdkMessage) -> bytes:
    """One complete frame (length prefix included) carrying ``message``."""
    return frame(msgpack.packb(_body(message), use_bin_type=True), MAX_SDK_FRAME)


def encoded_size(info: FlowInfo) -> int:
    """Bytes ``info`` takes in a ``flows`` frame (the agent fills pages up to the frame limit)."""
    return len(msgpack.packb(_fields(info), use_bin_type=True))


def _body(message: SdkMessage) -> dict[str, Any]:
    if isinstance(message, FlowList):
        flows = [_fields(info) for info in message.flows]
        return {"t": message.TYPE, "flows": flows, "more": message.more,
                "everyone": message.everyone}  # fmt: skip
    return {"t": message.TYPE, **_fields(message)}


def _fields(message: Any) -> dict[str, Any]:
    """The fields of ``message`` that are set (None and empty slot lists left out)."""
    values = asdict(message)
    return {
        k: [list(pair) for pair in v] if k == "slots" else v
        for k, v in values.items()
        if v not in (None, ())
    }


def decode_body(body: bytes, allowed: dict[str, type[Any]]) -> SdkMessage:
    """Decode and validate one frame body whose type must be among ``allowed``."""
    try:
        data = msgpack.unpackb(
            body, raw=False, strict_map_key=True, max_bin_len=0, ext_hook=_no_ext
        )
    except SdkProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types
        raise SdkProtocolError(f"frame is not valid msgpack: {exc}") from None
    if type(data) is not dict or type(data.get("t")) is not str:
        raise SdkProtocolError("frame body must be a map with a string 't' (message type)")
    kind = data.pop("t")
    cls = allowed.get(kind)
    if cls is None:
        raise SdkProtocolError(f"unknown or unexpected message type {kind!r}")
    message: SdkMessage = _build(cls, data)
    return message


def check_message(message: SdkMessage) -> None:
    """Check ``message`` with exactly the rules the decoder applies to it on receipt (the
    client checks what it is about to send: the agent drops a connection that sends a bad
    frame).

    Raises:
        SdkProtocolError: naming the first bad field (``.field``).
    """
    body = _body(message)
    del body["t"]
    _build(type(message), body)


def _no_ext(code: int, data: bytes) -> object:
    raise SdkProtocolError(f"msgpack extension type {code} is not allowed")


def _build(cls: type[Any], data: dict[str, Any]) -> Any:
    known = {f.name: f for f in fields(cls)}
    for name in data:
        if name not in known:
            raise SdkProtocolError(f"{cls.TYPE}: unknown field {name!r}")
    values: dict[str, Any] = {}
    for name, f in known.items():
        if name not in data:
            if f.default is MISSING:
                raise SdkProtocolError(f"{cls.TYPE}.{name}: missing field")
            continue
        if name in _NESTED:
            values[name] = _NESTED[name](cls.TYPE, data[name])
        else:
            values[name] = _check(cls.TYPE, name, data[name], optional=f.default is None)
    if cls is Open:
        _check_deadline(cls.TYPE, values.get("deadline"))
    if cls is Open or cls is FlowInfo:
        _check_class(cls.TYPE, values["cls"])
        _check_node(cls.TYPE, values.get("dst_node"))
        _check_layer(cls.TYPE, values["cls"], values.get("consumer_index"))
    return cls(**values)


def _flow_infos(where: str, value: Any) -> tuple[FlowInfo, ...]:
    if type(value) is not list:
        raise SdkProtocolError(f"{where}.flows: expected a list of flows", "flows")
    infos = []
    for item in value:
        if type(item) is not dict:
            raise SdkProtocolError(f"{where}.flows: expected a map for each flow", "flows")
        infos.append(_build(FlowInfo, item))
    return tuple(infos)


def _slot_list(where: str, value: Any) -> tuple[tuple[int, int], ...]:
    if (
        type(value) is not list
        or len(value) > MAX_LISTED_SLOTS
        or not all(_is_slot_key(v) for v in value)
    ):
        raise SdkProtocolError(
            f"{where}.slots: expected at most {MAX_LISTED_SLOTS} [slot, claim_seq] pairs (slot "
            f"in 0..{_MAX_SLOT})",
            "slots",
        )
    return tuple((index, seq) for index, seq in value)


def _is_slot_key(value: Any) -> bool:
    if type(value) is not list or len(value) != 2:
        return False
    index, seq = value
    return (
        type(index) is int and type(seq) is int and 0 <= index <= _MAX_SLOT and 0 <= seq <= U64_MAX
    )


#: fields that hold lists, with their checks (the others are scalars checked by _RULES)
_NESTED = {"flows": _flow_infos, "slots": _slot_list}


def _check(msg_type: str, name: str, value: Any, *, optional: bool) -> Any:
    if value is None and optional:
        return None
    kind, low, high = _RULES[name]
    where = f"{msg_type}.{name}"
    if kind == "u":
        if type(value) is not int or not low <= value <= high:
            raise SdkProtocolError(f"{where}: expected an integer in {int(low)}..{int(high)}", name)
    elif kind == "b":
        if type(value) is not bool:
            raise SdkProtocolError(f"{where}: expected true or false", name)
    elif kind == "f":
        if type(value) not in (int, float) or not _finite(value) or value < low:
            raise SdkProtocolError(f"{where}: expected a finite number >= {low:g}", name)
        value = float(value)
    elif kind == "n":
        if not is_name(value, int(high)):
            raise SdkProtocolError(
                f"{where}: expected a printable name of 1..{int(high)} characters", name
            )
    elif type(value) is not str or not low <= len(value) <= high:
        raise SdkProtocolError(
            f"{where}: expected text of {int(low)}..{int(high)} characters", name
        )
    return value


def _finite(value: float) -> bool:
    """math.isfinite, False (not OverflowError) for an int too large for a float."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _check_deadline(where: str, deadline: float | None) -> None:
    if deadline is not None and deadline < MIN_DEADLINE:
        raise SdkProtocolError(
            f"{where}.deadline: expected wall-clock seconds since the epoch (time.time() + 20 "
            f"for 20 s from now), not before {MIN_DEADLINE:.0f} (2001-09-09)",
            "deadline",
        )


def _check_node(where: str, node: str | None) -> None:
    # printable is checked with the other names; a node name with surrounding blanks would
    # make a link id no agent reports
    if node is not None and node != node.strip():
        raise SdkProtocolError(f"{where}.dst_node: expected a printable node name", "dst_node")


def _check_layer(where: str, label: str, index: int | None) -> None:
    if index is not None and index > MAX_LAYER and FlowClass.parse(label) in LAYER_CLASSES:
        raise SdkProtocolError(
            f"{where}.consumer_index: a {label} flow's consumer is a layer: expected an "
            f"integer in 0..{MAX_LAYER}",
            "consumer_index",
        )


def _check_class(where: str, label: str) -> None:
    try:
        FlowClass.parse(label)
    except ValueError as exc:
        raise SdkProtocolError(f"{where}.cls: {exc}", "cls") from None


class SdkDecoder:
    """Sans-IO receive side: feed bytes, take validated messages.

    ``side`` is ``"agent"`` (decodes client messages) or ``"client"`` (decodes agent messages).
    """

    def __init__(self, side: str) -> None:
        if side not in ("agent", "client"):
            raise ValueError("side must be 'agent' or 'client'")
        self._allowed = CLIENT_MESSAGES if side == "agent" else AGENT_MESSAGES
        self._buffer = ReceiveBuffer(MAX_SDK_FRAME)

    def feed(self, data: bytes) -> None:
        """Append received bytes."""
        self._buffer.feed(data)

    def next_message(self) -> SdkMessage | None:
        """The next complete message, None if more bytes are needed; raise SdkProtocolError."""
        try:
            body = self._buffer.next_body()
        except LocalProtocolError as exc:
            raise SdkProtocolError(exc.reason) from None
        return None if body is None else decode_body(body, self._allowed)
