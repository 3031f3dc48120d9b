"""Message bodies <-> msgpack bytes, with every field type- and range-checked.

Decoding only ever builds dicts, lists, str, bytes, int, float, bool and None (msgpack with
``raw=False`` and ``strict_map_key``; extension types are rejected), then checks each field
against its message's schema. Errors name the frame type and the field path, e.g.
``flows.opens[3].deadline: expected a finite number >= 0 or nil, got str``.

The frames that arrive by the thousand (``flows``, ``resync``, ``heartbeat``) are checked
inline by fast paths that accept exactly what the field-by-field path accepts and hand
anything unusual to it, so that errors read the same (``bench/codec_decode.py`` measures
both).

A ``flows`` frame carries its progress in one of two forms (never both): ``progress``, a list
of ``{"id", "sent"}`` maps (protocol version 1), or ``progress_ids`` and ``progress_sent``,
two arrays of equal length (version 2, checked by one loop per array instead of a map per
entry). Both decode to the same :class:`Flows`; :func:`encode_body` writes the form of the
version it is given.

Before any of that, msgpack decodes under limits taken from the protocol's maxima (entries
per array, keys per map, bytes per bin, no extension types: checked from each container's
header, before the container is built) and :class:`_ArrayBudget` counts the arrays it builds,
so that a frame no message could be costs next to nothing to refuse (tests/protocol/
test_protocol_limits.py); the error names the field (:func:`_over_limit`).

Wheels compile this module with mypyc (flowsched/compiled.py), which checks annotated types
at run time: data not yet checked is typed ``object`` or ``Any`` (:data:`_Map`), never what
it should be, so that both builds raise the same :class:`LocalProtocolError` for a bad frame
(tests/protocol/test_protocol_compiled.py compares them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable
from typing import Any, Final, TypeGuard

import msgpack

from flowsched.model import FlowClass
from flowsched.protocol._messages import (
    MESSAGE_TYPES,
    PACKED_PROGRESS_VERSION,
    PROTOCOL_VERSION,
    RESYNC_FRAME_OPENS,
    Auth,
    Challenge,
    Error,
    FlowClose,
    FlowOpen,
    Flows,
    Heartbeat,
    Hello,
    JobProgress,
    Levels,
    LevelUpdate,
    Message,
    NicLoad,
    NicLoadEntry,
    Resync,
    Welcome,
)
from flowsched.protocol._util import LocalProtocolError

U64_MAX: Final = 2**64 - 1
I64_MAX: Final = 2**63 - 1
MAX_NAME: Final = 255  # node, job, link, request, error code
MAX_REASON: Final = 4096
MAX_LINKS: Final = 64
MAX_LEVEL: Final = 255
#: progress reports per ``flows`` frame, either form (an agent splits larger batches)
MAX_PROGRESS: Final = 8192
#: level updates per ``levels`` frame (the coordinator splits larger batches)
MAX_UPDATES: Final = 8192
NONCE_SIZE: Final = 32
MAC_SIZE: Final = 32
#: Entries in one array of any legal frame, either direction: a frame's ``opens`` (an agent
#: of any release sends at most RESYNC_FRAME_OPENS per frame), its progress reports or
#: ``closes`` (MAX_PROGRESS each, which the agent splits by too), a ``levels`` frame's updates,
#: an open's links, a ``nic_load`` frame's entries (its node's two links). msgpack refuses a
#: longer array from its header, before building any of it (see :func:`decode_body`).
MAX_ARRAY: Final = max(RESYNC_FRAME_OPENS, MAX_PROGRESS, MAX_UPDATES, MAX_LINKS)
#: Arrays in one legal frame: a ``flows`` frame's own four (opens, progress ids and bytes,
#: closes) and one per open (its links). A frame of nested arrays, each within MAX_ARRAY, is
#: refused at the next one: arrays are what costs a decoder most to build (a 1 MiB frame of
#: empty ones took 160-180 ms, a frame's worth of the largest legal ones 1-20 ms).
MAX_ARRAYS: Final = MAX_ARRAY + 4

#: A decoded msgpack map before its checks: str keys, or bytes ones (``bin`` keys pass
#: ``strict_map_key``), and any values. Never annotate unchecked data more narrowly: the
#: compiled build (flowsched/compiled.py) checks annotated types at run time, and a wrong
#: claim would raise TypeError where the decoder must name the bad field.
_Map = dict[Any, Any]
_MISSING: Final = object()
_CLASSES: Final = {c.label: c for c in FlowClass}
#: optional fields left out of a frame when 0 (the leadership epoch and its fencing scope)
_ZERO_MEANS_ABSENT: Final = ("epoch", "cluster", "done")
#: optional fields of ``hello`` and ``welcome`` left out when empty (the agent's nonce and the
#: coordinator's MAC, from version 3): a peer of an older version knows neither
_EMPTY_MEANS_ABSENT: Final = ("nonce", "mac")


def is_name(value: object, max_len: int = MAX_NAME) -> TypeGuard[str]:
    """True for what the protocol accepts as a name (node, job, request, link): printable text
    of 1..``max_len`` characters. Whoever forwards names into the protocol (the agent's SDK
    server) checks them with this, so that a bad name is refused where it came from."""
    return type(value) is str and 0 < len(value) <= max_len and value.isprintable()


def _bad(path: str, expected: str, value: object) -> LocalProtocolError:
    got = repr(value) if type(value) in (int, float, bool) else type(value).__name__
    return LocalProtocolError(f"{path}: expected {expected}, got {got}", code="bad_field")


class _Fields:
    """Typed getters over one msgpack map; ``finish()`` rejects keys that were not read."""

    __slots__ = ("_data", "_known", "_path", "_seen")

    def __init__(self, data: object, path: str, known: frozenset[str]) -> None:
        if type(data) is not dict:
            raise _bad(path, "a map", data)
        self._data: _Map = data
        self._known = known
        self._path = path
        self._seen = 0

    def _get(self, name: str, optional: bool) -> Any:
        value = self._data.get(name, _MISSING)
        if value is _MISSING:
            if optional:
                return None
            raise LocalProtocolError(f"{self._path}.{name}: missing field", code="bad_field")
        self._seen += 1
        return value

    def finish(self) -> None:
        if len(self._data) != self._seen:
            unknown = sorted(str(k) for k in self._data if k not in self._known)
            raise LocalProtocolError(
                f"{self._path}: unknown field(s) {', '.join(unknown)}", code="bad_field"
            )

    def integer(self, name: str, low: int, high: int, optional: bool = False) -> Any:
        value = self._get(name, optional)
        if value is None and optional:
            return None
        if type(value) is not int or not low <= value <= high:
            what = f"an integer in {low}..{high}" + (" or nil" if optional else "")
            raise _bad(f"{self._path}.{name}", what, value)
        return value

    def number(self, name: str, low: float, high: float = math.inf, optional: bool = False) -> Any:
        value = self._get(name, optional)
        if value is None and optional:
            return None
        if type(value) not in (int, float) or not (low <= value <= high and math.isfinite(value)):
            what = f"a finite number in [{low}, {high}]" + (" or nil" if optional else "")
            raise _bad(f"{self._path}.{name}", what, value)
        return float(value)

    def text(self, name: str, max_len: int = MAX_NAME, optional: bool = False) -> Any:
        value = self._get(name, optional)
        if value is None and optional:
            return None
        if type(value) is not str or len(value) > max_len:
            what = f"a string of at most {max_len} characters" + (" or nil" if optional else "")
            raise _bad(f"{self._path}.{name}", what, value)
        return value

    def name(self, name: str, optional: bool = False) -> Any:
        value = self.text(name, MAX_NAME, optional)
        if value is not None and not is_name(value):
            raise LocalProtocolError(
                f"{self._path}.{name}: expected a non-empty printable name", code="bad_field"
            )
        return value

    def blob(self, name: str, size: int, optional: bool = False) -> bytes:
        """``size`` bytes; with ``optional``, absent or nil reads as ``b""``."""
        value = self._get(name, optional)
        if value is None and optional:
            return b""
        if type(value) is not bytes or len(value) != size:
            what = f"{size} bytes (bin)" + (" or nil" if optional else "")
            raise _bad(f"{self._path}.{name}", what, value)
        return value

    def flag(self, name: str) -> bool:
        """A boolean; absent reads as False (a flag is sent only when set)."""
        value = self._get(name, True)
        if value is None:
            return False
        if type(value) is not bool:
            raise _bad(f"{self._path}.{name}", "a boolean", value)
        return value

    def has(self, name: str) -> bool:
        """Whether the map has key ``name`` (whatever its value)."""
        return name in self._data

    def array(self, name: str, optional_empty: bool = True) -> list[Any]:
        value = self._get(name, optional_empty)
        if value is None:
            return []
        if type(value) is not list:
            raise _bad(f"{self._path}.{name}", "an array", value)
        return value

    def flow_class(self, name: str) -> FlowClass:
        value = self.text(name)
        cls = _CLASSES.get(value)
        if cls is None:
            raise LocalProtocolError(
                f"{self._path}.{name}: unknown flow class {value!r}", code="bad_field"
            )
        return cls


def _known(cls: type) -> frozenset[str]:
    return frozenset(field.name for field in dataclasses.fields(cls))


_OPEN_FIELDS: Final = _known(FlowOpen)
_PROGRESS_FIELDS: Final = frozenset(("id", "sent"))
_CLOSE_FIELDS: Final = _known(FlowClose)
_NIC_FIELDS: Final = _known(NicLoadEntry)
_UPDATE_FIELDS: Final = _known(LevelUpdate)
_MESSAGE_FIELDS: Final = {t: _known(cls) | {"t"} for t, cls in MESSAGE_TYPES.items()}
_MESSAGE_FIELDS[Flows.TYPE] |= {"progress"}  # the map form of the progress arrays
#: the most fields of any message or entry (a flow open's 11)
MAX_FIELDS: Final = max(
    len(fields)
    for fields in (_OPEN_FIELDS, _PROGRESS_FIELDS, _CLOSE_FIELDS, _NIC_FIELDS, _UPDATE_FIELDS,
                   *_MESSAGE_FIELDS.values())
)  # fmt: skip
#: Keys in one map of any frame msgpack builds: twice MAX_FIELDS, so that a map with a few
#: unknown keys is still refused by its field check, which names them
MAX_MAP: Final = 2 * MAX_FIELDS


def _each(items: list[Any], path: str, parse: Callable[[object, str], Any]) -> tuple[Any, ...]:
    try:
        return tuple([parse(item, path) for item in items])
    except LocalProtocolError:
        pass
    # slow path, only to name the bad entry's index in the error (never formatted otherwise)
    return tuple([parse(item, f"{path}[{i}]") for i, item in enumerate(items)])


def _flow_open(item: object, path: str) -> FlowOpen:
    f = _Fields(item, path, _OPEN_FIELDS)
    links = f.array("links")
    if len(links) > MAX_LINKS:
        raise LocalProtocolError(f"{path}.links: more than {MAX_LINKS} links", code="bad_field")
    opened = FlowOpen(
        id=f.integer("id", 0, U64_MAX),
        cls=f.flow_class("cls"),
        opened_at=f.number("opened_at", 0.0),
        sent=f.integer("sent", 0, U64_MAX),
        size=f.integer("size", 0, U64_MAX, optional=True),
        deadline=f.number("deadline", 0.0, optional=True),
        job=f.name("job", optional=True),
        consumer_index=f.integer("consumer_index", 0, I64_MAX, optional=True),
        request=f.name("request", optional=True),
        links=_each(links, f"{path}.links", _link_name),
        level=f.integer("level", 0, MAX_LEVEL, optional=True),
    )
    f.finish()
    return opened


def _link_name(item: object, path: str) -> str:
    if is_name(item):
        return item
    raise _bad(path, f"a printable link name of 1..{MAX_NAME} characters", item)


_new: Final = object.__new__
_set_close_id: Final = vars(FlowClose)["id"].__set__
_set_close_sent: Final = vars(FlowClose)["sent"].__set__
_set_close_time: Final = vars(FlowClose)["closed_at"].__set__
_set_flows_opens: Final = vars(Flows)["opens"].__set__
_set_flows_progress_ids: Final = vars(Flows)["progress_ids"].__set__
_set_flows_progress_sent: Final = vars(Flows)["progress_sent"].__set__
_set_flows_closes: Final = vars(Flows)["closes"].__set__
_set_resync_opens: Final = vars(Resync)["opens"].__set__
_set_beat_time: Final = vars(Heartbeat)["t_sent"].__set__
_set_beat_epoch: Final = vars(Heartbeat)["epoch"].__set__
_EMPTY: Final[tuple[()]] = ()
_INF: Final = math.inf
_NUMBER: Final = (float, int)  # bool is neither (type(x) is compared, not isinstance)
#: Compiled (mypyc) code compares ints below 2**62 inline and larger ones as Python objects:
#: a range check that tests ``value < _SHORT`` first keeps the usual values inline.
_SHORT: Final = 2**62 - 1

# FlowOpen's fields, one setter each
_OPEN_KEYS: Final = tuple(field.name for field in dataclasses.fields(FlowOpen))
_set_open_id: Final = vars(FlowOpen)["id"].__set__
_set_open_cls: Final = vars(FlowOpen)["cls"].__set__
_set_open_opened_at: Final = vars(FlowOpen)["opened_at"].__set__
_set_open_sent: Final = vars(FlowOpen)["sent"].__set__
_set_open_size: Final = vars(FlowOpen)["size"].__set__
_set_open_deadline: Final = vars(FlowOpen)["deadline"].__set__
_set_open_job: Final = vars(FlowOpen)["job"].__set__
_set_open_consumer_index: Final = vars(FlowOpen)["consumer_index"].__set__
_set_open_request: Final = vars(FlowOpen)["request"].__set__
_set_open_links: Final = vars(FlowOpen)["links"].__set__
_set_open_level: Final = vars(FlowOpen)["level"].__set__
#: what an optional field left out of an open reads as (nil, like the checked path)
_OPEN_ABSENT: Final = dict.fromkeys(
    ("size", "deadline", "job", "consumer_index", "request", "links", "level")
)


def _open_entries(items: list[Any], path: str) -> tuple[FlowOpen, ...]:
    """Flow opens checked inline by :func:`_fast_open`; the first unusual entry sends the
    whole list through the checked path (which names it)."""
    out: list[FlowOpen] = []
    for item in items:
        opened = _fast_open(item)
        if opened is None:
            return _each(items, path, _flow_open)
        out.append(opened)
    return tuple(out)


def _fast_open(item: object) -> FlowOpen | None:
    """What :func:`_flow_open` accepts, built without :class:`_Fields` (about 3x faster);
    None for anything else."""
    if type(item) is not dict:
        return None
    if len(item) != len(_OPEN_KEYS):  # optional fields left out, or unknown ones
        if not item.keys() <= _OPEN_FIELDS:
            return None
        item = {**_OPEN_ABSENT, **item}
    try:  # with every key present, len(item) equal to the field count excludes unknown keys
        fid, label, sent = item["id"], item["cls"], item["sent"]
        opened_at, deadline = item["opened_at"], item["deadline"]
        size, consumer, level = item["size"], item["consumer_index"], item["level"]
        job, request, links = item["job"], item["request"], item["links"]
    except KeyError:
        return None
    cls = _CLASSES.get(label) if type(label) is str else None
    if not (
        cls is not None
        and type(fid) is int
        and 0 <= fid <= U64_MAX
        and type(sent) is int
        and 0 <= sent <= U64_MAX
        and type(opened_at) in _NUMBER
        and 0.0 <= opened_at < _INF  # NaN fails both comparisons
        and (size is None or (type(size) is int and 0 <= size <= U64_MAX))
        and (deadline is None or (type(deadline) in _NUMBER and 0.0 <= deadline < _INF))
        and (job is None or is_name(job))
        and (consumer is None or (type(consumer) is int and 0 <= consumer <= I64_MAX))
        and (request is None or is_name(request))
        and (level is None or (type(level) is int and 0 <= level <= MAX_LEVEL))
    ):
        return None
    if links is None:
        links = _EMPTY
    elif type(links) is list and len(links) <= MAX_LINKS:
        for link in links:
            if not is_name(link):
                return None
        links = tuple(links)
    else:
        return None
    # the frozen dataclass __init__ costs 4x more than filling the slots directly
    opened = _new(FlowOpen)
    _set_open_id(opened, fid)
    _set_open_cls(opened, cls)
    _set_open_opened_at(opened, float(opened_at) if type(opened_at) is int else opened_at)
    _set_open_sent(opened, sent)
    _set_open_size(opened, size)
    _set_open_deadline(opened, float(deadline) if type(deadline) is int else deadline)
    _set_open_job(opened, job)
    _set_open_consumer_index(opened, consumer)
    _set_open_request(opened, request)
    _set_open_links(opened, links)
    _set_open_level(opened, level)
    return opened


Progress = tuple[tuple[int, ...], tuple[int, ...]]


def _progress_entries(items: list[Any], path: str) -> Progress:
    """Map-form progress (``[{"id", "sent"}, ...]``) as (ids, sent) arrays, checked inline;
    anything unusual goes through the checked path, which names the bad entry."""
    # Whole-list checks in C (set(map(type, ...)), min/max) measured slower than this loop
    # for the usual 10-entry lists of maps: each entry has to be read from its map anyway.
    ids: list[int] = []
    sents: list[int] = []
    if len(items) <= MAX_PROGRESS:
        try:
            for item in items:
                fid = item["id"]  # a non-map entry raises TypeError, a missing key KeyError
                sent = item["sent"]
                if not (
                    type(fid) is int
                    and type(sent) is int
                    and 0 <= fid <= U64_MAX >= sent >= 0
                    and len(item) == 2  # no unknown key
                ):
                    break
                ids.append(fid)
                sents.append(sent)
            else:
                return tuple(ids), tuple(sents)
        except (KeyError, TypeError):
            pass
    return _progress_maps(items, path)


def _packed_arrays(ids: object, sents: object) -> Progress | None:
    """Packed-form progress checked whole: two lists of equal length (at most
    :data:`MAX_PROGRESS`) holding nothing but integers in 0..U64_MAX (``bool`` is not
    ``int`` here); None for anything else (the checked path then names what is wrong)."""
    if not (type(ids) is list and type(sents) is list and len(ids) == len(sents) <= MAX_PROGRESS):
        return None
    if _all_u64(ids) and _all_u64(sents):
        return tuple(ids), tuple(sents)
    return None


def _all_u64(values: list[Any]) -> bool:
    # One loop: for the usual 10 entries faster than whole-list passes in C
    # (set(map(type, ...)) and array("Q", ...)): 1.3 vs 1.7 us per frame as Python, 0.2 vs
    # 1.5 us compiled, where the loop is C too.
    for value in values:
        if type(value) is not int or not (0 <= value < _SHORT or 0 <= value <= U64_MAX):
            return False
    return True


def _fast_flows(data: _Map) -> Flows | None:
    """The coordinator's hot frame, checked inline: exactly what the checked path accepts,
    built without it; None for anything unusual (the checked path then decodes it, or names
    what is wrong)."""
    opens = data.get("opens")
    closes = data.get("closes")
    if "progress_ids" in data:  # the packed form
        if not (type(opens) is list and type(closes) is list and len(data) == 5) and not (
            data.keys() <= _PACKED_FLOWS_KEYS and _list_or_nil(opens, closes)
        ):  # (5 keys, every one read: none unknown)
            return None
        progress = _packed_arrays(data["progress_ids"], data.get("progress_sent"))
        if progress is None:
            return None
    else:
        maps = data.get("progress")
        if not (
            type(opens) is list and type(maps) is list and type(closes) is list and len(data) == 4
        ) and not (  # arrays left out or nil: no entries, like the checked path's optional arrays
            data.keys() <= _FLOWS_KEYS and _list_or_nil(opens, maps, closes)
        ):
            return None
        progress = None
    flows = _new(Flows)
    _set_flows_opens(flows, _open_entries(opens, "flows.opens") if opens else _EMPTY)
    if progress is None:  # the map form, read after the opens (whose errors come first)
        progress = _progress_entries(maps, "flows.progress") if maps else (_EMPTY, _EMPTY)
    _set_flows_progress_ids(flows, progress[0])
    _set_flows_progress_sent(flows, progress[1])
    _set_flows_closes(flows, _close_entries(closes) if closes else _EMPTY)
    return flows


def _fast_resync(data: _Map) -> Resync | None:
    """A resync (an agent's whole flow set, after each reconnect) checked inline like
    :func:`_fast_flows`; None for anything unusual."""
    opens = data.get("opens")
    if not (data.keys() <= _RESYNC_KEYS and _list_or_nil(opens)):
        return None
    resync = _new(Resync)
    _set_resync_opens(resync, _open_entries(opens, "resync.opens") if opens else _EMPTY)
    return resync


_FLOWS_KEYS: Final = frozenset(("t", "opens", "progress", "closes"))
_PACKED_FLOWS_KEYS: Final = frozenset(("t", "opens", "progress_ids", "progress_sent", "closes"))
_RESYNC_KEYS: Final = frozenset(("t", "opens"))


def _list_or_nil(*values: object) -> bool:
    # missing (get() gave None), nil and [] all mean no entries
    return all(value is None or type(value) is list for value in values)


def _close_entries(items: list[Any]) -> tuple[FlowClose, ...]:
    out: list[FlowClose] = []
    append = out.append
    for item in items:
        if type(item) is dict and len(item) == 3:
            fid: Any = item.get("id")
            sent: Any = item.get("sent")
            closed_at: Any = item.get("closed_at")
            if (
                type(fid) is int
                and type(sent) is int
                and 0 <= fid <= U64_MAX >= sent >= 0
                and type(closed_at) in _NUMBER
                and 0.0 <= closed_at < _INF
            ):
                close = _new(FlowClose)
                _set_close_id(close, fid)
                _set_close_sent(close, sent)
                _set_close_time(close, float(closed_at) if type(closed_at) is int else closed_at)
                append(close)
                continue
        return _each(items, "flows.closes", _flow_close)
    return tuple(out)


def _fast_heartbeat(data: _Map) -> Heartbeat | None:
    """A heartbeat checked inline (see :func:`_fast_flows`); None for anything unusual."""
    sent = data.get("t_sent")
    epoch = data.get("epoch", 0)
    if (
        type(sent) is float
        and 0.0 <= sent < math.inf
        and type(epoch) is int
        and 0 <= epoch <= U64_MAX
        and len(data) == 2 + ("epoch" in data)
    ):
        beat = object.__new__(Heartbeat)
        _set_beat_time(beat, sent)
        _set_beat_epoch(beat, epoch)
        return beat
    return None


_FAST_DECODERS: Final[dict[str, Callable[[_Map], Message | None]]] = {
    Flows.TYPE: _fast_flows,
    Heartbeat.TYPE: _fast_heartbeat,
    Resync.TYPE: _fast_resync,
}


def _flow_progress(item: object, path: str) -> tuple[int, int]:
    f = _Fields(item, path, _PROGRESS_FIELDS)
    progress = (f.integer("id", 0, U64_MAX), f.integer("sent", 0, U64_MAX))
    f.finish()
    return progress


def _progress_maps(items: list[Any], path: str) -> Progress:
    """Map-form progress checked entry by entry (errors name the entry)."""
    if len(items) > MAX_PROGRESS:
        raise LocalProtocolError(f"{path}: more than {MAX_PROGRESS} entries", code="bad_field")
    pairs: tuple[tuple[int, int], ...] = _each(items, path, _flow_progress)
    return tuple(fid for fid, _ in pairs), tuple(sent for _, sent in pairs)


def _u64(item: object, path: str) -> int:
    if type(item) is int and 0 <= item <= U64_MAX:
        return item
    raise _bad(path, f"an integer in 0..{U64_MAX}", item)


def _checked_progress(f: _Fields, path: str) -> Progress:
    """The progress of a ``flows`` frame in either form, checked field by field."""
    if not (f.has("progress_ids") or f.has("progress_sent")):
        return _progress_maps(f.array("progress"), f"{path}.progress")
    if f.has("progress"):
        raise LocalProtocolError(
            f"{path}: progress and progress_ids/progress_sent in one frame (one form only)",
            code="bad_field",
        )
    ids = f.array("progress_ids", optional_empty=False)
    sents = f.array("progress_sent", optional_empty=False)
    for name, values in (("progress_ids", ids), ("progress_sent", sents)):
        if len(values) > MAX_PROGRESS:
            raise LocalProtocolError(
                f"{path}.{name}: more than {MAX_PROGRESS} entries", code="bad_field"
            )
    if len(sents) != len(ids):
        raise LocalProtocolError(
            f"{path}.progress_sent: {len(sents)} entries, expected as many as progress_ids"
            f" ({len(ids)})",
            code="bad_field",
        )
    return _each(ids, f"{path}.progress_ids", _u64), _each(sents, f"{path}.progress_sent", _u64)


def _flow_close(item: object, path: str) -> FlowClose:
    f = _Fields(item, path, _CLOSE_FIELDS)
    close = FlowClose(
        f.integer("id", 0, U64_MAX), f.integer("sent", 0, U64_MAX), f.number("closed_at", 0.0)
    )
    f.finish()
    return close


def _nic_entry(item: object, path: str) -> NicLoadEntry:
    f = _Fields(item, path, _NIC_FIELDS)
    entry = NicLoadEntry(
        _link_name(f.text("link"), f"{path}.link"),
        f.number("bandwidth", 0.0),
        f.number("load", 0.0, 1.0),
    )
    f.finish()
    return entry


def _level_update(item: object, path: str) -> LevelUpdate:
    f = _Fields(item, path, _UPDATE_FIELDS)
    update = LevelUpdate(
        f.integer("id", 0, U64_MAX),
        f.integer("level", 0, MAX_LEVEL),
        f.number("rate", 0.0, optional=True),
        f.number("decided_at", 0.0, optional=True),
        f.integer("decided_ns", 0, I64_MAX, optional=True),
    )
    f.finish()
    return update


def _epoch(f: _Fields, name: str) -> int:
    """An optional epoch or fencing scope (absent: 0, no election)."""
    value: int | None = f.integer(name, 0, U64_MAX, optional=True)
    return 0 if value is None else value


def _decode_fields(cls: type[Message], f: _Fields) -> Message:
    path = cls.TYPE
    if cls is Flows:
        opens = _each(f.array("opens"), f"{path}.opens", _flow_open)
        ids, sents = _checked_progress(f, path)
        return Flows(
            opens=opens,
            progress_ids=ids,
            progress_sent=sents,
            closes=_each(f.array("closes"), f"{path}.closes", _flow_close),
        )
    if cls is Heartbeat:
        return Heartbeat(f.number("t_sent", 0.0), _epoch(f, "epoch"))
    if cls is Levels:
        updates = _each(f.array("updates"), f"{path}.updates", _level_update)
        return Levels(updates, _epoch(f, "epoch"))
    if cls is JobProgress:
        return JobProgress(
            f.name("job"),
            f.integer("step", 0, I64_MAX),
            f.integer("layer", 0, I64_MAX, True),
            f.flag("done"),
        )
    if cls is NicLoad:
        return NicLoad(_each(f.array("entries"), f"{path}.entries", _nic_entry))
    if cls is Resync:
        return Resync(_each(f.array("opens"), f"{path}.opens", _flow_open))
    return _decode_handshake(cls, f)


def _decode_handshake(cls: type[Message], f: _Fields) -> Message:
    if cls is Hello:
        return Hello(
            f.integer("version", 0, 65535), f.name("node"), f.blob("nonce", NONCE_SIZE, True)
        )
    if cls is Challenge:
        return Challenge(f.integer("version", 0, 65535), f.blob("nonce", NONCE_SIZE))
    if cls is Auth:
        return Auth(f.blob("mac", MAC_SIZE))
    if cls is Welcome:
        return Welcome(
            f.text("policy_toml", max_len=2**24),
            f.number("timer_period", 0.0),
            f.number("server_time", 0.0),
            f.number("heartbeat_interval", 0.0),
            _epoch(f, "epoch"),
            _epoch(f, "cluster"),
            f.blob("mac", MAC_SIZE, True),
        )
    assert cls is Error
    return Error(f.text("code"), f.text("reason", max_len=MAX_REASON))


def decode_body(body: bytes) -> Message:
    """Decode one frame body into a message.

    Raises:
        LocalProtocolError: the body is not valid msgpack, not a map with a known ``"t"``, or a
            field is missing, unknown, of the wrong type or out of range (the message names the
            frame type and field).
    """
    # A body shorter than MAX_ARRAYS bytes cannot hold more arrays: no hook to call per array
    count_arrays = _ArrayBudget().take if len(body) > MAX_ARRAYS else None
    try:
        data = msgpack.unpackb(
            body, raw=False, strict_map_key=True, use_list=True, list_hook=count_arrays,
            max_array_len=MAX_ARRAY, max_map_len=MAX_MAP, max_bin_len=MAX_BIN, max_ext_len=0,
        )  # fmt: skip
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        if "exceeds max_" in str(exc):  # a container over the limits, seen from its header
            raise LocalProtocolError(_over_limit(body), code="bad_field") from None
        raise LocalProtocolError(f"frame: not valid msgpack ({exc})", code="bad_frame") from None
    if type(data) is not dict:
        raise _bad("frame", "a map", data)
    kind = data.get("t")
    fast = _FAST_DECODERS.get(kind) if type(kind) is str else None
    if fast is not None and (decoded := fast(data)) is not None:
        return decoded
    return _decode_checked(data)


class _ArrayBudget:
    """msgpack's ``list_hook`` for one decode: refuses the array past :data:`MAX_ARRAYS`
    (msgpack hands over each array once built, inner ones first)."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = MAX_ARRAYS

    def take(self, items: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise LocalProtocolError(
                f"frame: more than {MAX_ARRAYS} arrays (a legal frame holds one per flow open"
                " and four of its own)",
                code="bad_field",
            )
        return items


#: Items a refused frame is walked through to name its container over the limits
#: (:func:`_over_limit`), and how deep (a legal frame nests 4 deep: frame, opens, open, links)
_WALK_ITEMS: Final = 4096
_WALK_DEPTH: Final = 8
#: bin fields are nonces and MACs
MAX_BIN: Final = max(NONCE_SIZE, MAC_SIZE)
#: every field name of every message and entry (a map key outside it is named "?")
_FIELD_NAMES: Final = frozenset().union(*_MESSAGE_FIELDS.values(), _OPEN_FIELDS, _UPDATE_FIELDS,
                                        _NIC_FIELDS, _CLOSE_FIELDS)  # fmt: skip


def _over_limit(body: bytes) -> str:
    """The error for a body that msgpack refused for a container over the limits: which
    container (``flows.opens[3].links: an array of 9000 entries, ...``), found by walking the
    headers up to it (at most :data:`_WALK_ITEMS` items: "frame" beyond)."""
    walk = _LimitWalk(memoryview(body))
    kind = peek_type(body)
    found = walk.item(0, kind if kind in MESSAGE_TYPES else "frame", 0)[1]
    return found or "frame: a container over the protocol's limits"


class _LimitWalk:
    """Reads msgpack headers without building anything, to name the first container over
    :data:`MAX_ARRAY`, :data:`MAX_MAP`, :data:`MAX_BIN` or any extension type."""

    __slots__ = ("left", "view")

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.left = _WALK_ITEMS

    def item(self, pos: int, path: str, depth: int) -> tuple[int, str]:
        """(where the item at ``pos`` ends or -1, the error if it holds a container over the
        limits, else "")."""
        self.left -= 1
        if self.left < 0 or depth > _WALK_DEPTH or pos >= len(self.view):
            return -1, ""
        kind, size, start = _header(self.view, pos)
        if kind == "scalar":
            return _skip_scalar(self.view, pos), ""
        if kind == "ext":
            return -1, f"{path}: an extension type (no field holds one)"
        if kind == "bin":
            if size > MAX_BIN:
                return -1, f"{path}: more than {MAX_BIN} bytes of bin ({size})"
            return start + size, ""
        if kind == "array" and size > MAX_ARRAY:
            return -1, f"{path}: more than {MAX_ARRAY} entries (an array of {size})"
        if kind == "map" and size > MAX_MAP:
            return -1, f"{path}: more than {MAX_MAP} keys (a map of {size})"
        return self.entries(start, size, kind == "map", path, depth)

    def entries(self, pos: int, count: int, is_map: bool, path: str, depth: int) -> tuple[int, str]:
        for index in range(count):
            sub = f"{path}[{index}]"
            if is_map:
                key, after = _peek_str(self.view, pos)
                if key is None:  # not a str: a key is an item too
                    pos, found = self.item(pos, f"{path}.?", depth + 1)
                    if found or pos < 0:
                        return pos, found
                    sub = f"{path}.?"
                else:
                    pos, sub = after, f"{path}.{key if key in _FIELD_NAMES else '?'}"
            pos, found = self.item(pos, sub, depth + 1)
            if found or pos < 0:
                return pos, found
        return pos, ""


def _decode_checked(data: _Map) -> Message:
    """Decode a message map field by field through :class:`_Fields` (every type; the error
    names the field)."""
    kind = data.get("t")
    cls = MESSAGE_TYPES.get(kind) if type(kind) is str else None
    if cls is None:
        raise LocalProtocolError(f"frame.t: unknown message type {kind!r}", code="bad_type")
    f = _Fields(data, cls.TYPE, _MESSAGE_FIELDS[cls.TYPE])
    f.text("t")
    message = _decode_fields(cls, f)
    f.finish()
    return message


def _open_map(o: FlowOpen) -> dict[str, Any]:
    return {
        "id": o.id,
        "cls": o.cls.label,
        "opened_at": o.opened_at,
        "sent": o.sent,
        "size": o.size,
        "deadline": o.deadline,
        "job": o.job,
        "consumer_index": o.consumer_index,
        "request": o.request,
        "links": list(o.links),
        "level": o.level,
    }


def _update_map(u: LevelUpdate) -> dict[str, Any]:
    # the decision stamps are optional: left out when unknown, so that the frame stays what
    # a receiver without them expects
    entry: dict[str, Any] = {"id": u.id, "level": u.level, "rate": u.rate}
    if u.decided_at is not None:
        entry["decided_at"] = u.decided_at
    if u.decided_ns is not None:
        entry["decided_ns"] = u.decided_ns
    return entry


def _body_map(message: Message, version: int) -> dict[str, Any]:
    if isinstance(message, Flows):
        flows: dict[str, Any] = {"opens": [_open_map(o) for o in message.opens]}
        if version >= PACKED_PROGRESS_VERSION:
            flows["progress_ids"] = message.progress_ids  # tuples pack as msgpack arrays
            flows["progress_sent"] = message.progress_sent
        else:
            flows["progress"] = [{"id": i, "sent": s} for i, s in message.reports()]
        flows["closes"] = [
            {"id": c.id, "sent": c.sent, "closed_at": c.closed_at} for c in message.closes
        ]
        return flows
    if isinstance(message, Levels):
        levels: dict[str, Any] = {"updates": [_update_map(u) for u in message.updates]}
        if message.epoch:
            levels["epoch"] = message.epoch
        return levels
    if isinstance(message, Resync):
        return {"opens": [_open_map(o) for o in message.opens]}
    if isinstance(message, NicLoad):
        entries = [
            {"link": e.link, "bandwidth": e.bandwidth, "load": e.load} for e in message.entries
        ]
        return {"entries": entries}
    body: dict[str, Any] = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
    for name in _ZERO_MEANS_ABSENT:  # frames without an election stay what they were
        if body.get(name) == 0:
            del body[name]
    if isinstance(message, (Hello, Welcome)):
        for name in _EMPTY_MEANS_ABSENT:
            if body.get(name) == b"":
                del body[name]
    return body


def welcome_digest(welcome: Welcome) -> bytes:
    """SHA-256 of every field of ``welcome`` but its MAC, in a canonical form (the numbers
    as decoded: the floats as msgpack float64s), for the welcome MAC
    (:func:`flowsched.protocol.auth.compute_welcome_mac`). A field added to :class:`Welcome`
    must be added here (tests/protocol/test_protocol_mutual_auth.py checks each field)."""
    fields = [
        welcome.policy_toml,
        float(welcome.timer_period),
        float(welcome.server_time),
        float(welcome.heartbeat_interval),
        welcome.epoch,
        welcome.cluster,
    ]
    packed: bytes = msgpack.packb(fields, use_bin_type=True)
    return hashlib.sha256(packed).digest()


def encode_body(message: Message, version: int = PROTOCOL_VERSION) -> bytes:
    """Encode ``message`` as a msgpack body (no length prefix) for a peer speaking protocol
    ``version`` (below :data:`PACKED_PROGRESS_VERSION`: progress as a list of maps). Values
    are checked on decode, so :func:`encode_body` followed by :func:`decode_body` is how to
    validate outgoing data."""
    body = {"t": message.TYPE, **_body_map(message, version)}  # "t" first: see peek_type()
    data: bytes = msgpack.packb(body, use_bin_type=True)
    return data


def peek_type(body: bytes) -> str | None:
    """The message type of a frame body without decoding it, or None when it cannot be read
    cheaply.

    Reads the map header and then keys and scalar values up to the ``"t"`` key (our encoder
    puts it first). Nothing is allocated for the other values, and any array or map before
    ``"t"`` ends the peek: the receiver checks the type against its state before it pays for
    a decode (an unauthenticated peer may only send ``hello``, ``auth`` and ``error``). At
    most :data:`MAX_MAP` keys are read: a map header may claim 2**32 - 1 of them, and a legal
    frame has no more.
    """
    view = memoryview(body)
    entries, pos = _map_header(view)
    for _ in range(min(entries, MAX_MAP)):
        key, pos = _peek_str(view, pos)
        if key is None:
            return None
        if key == "t":
            return _peek_str(view, pos)[0]
        pos = _skip_scalar(view, pos)
        if pos < 0:
            return None
    return None


def _map_header(view: memoryview) -> tuple[int, int]:
    if not view:
        return 0, 0
    lead = view[0]
    if 0x80 <= lead <= 0x8F:
        return lead & 0x0F, 1
    if lead == 0xDE and len(view) >= 3:
        return int.from_bytes(view[1:3], "big"), 3
    if lead == 0xDF and len(view) >= 5:
        return int.from_bytes(view[1:5], "big"), 5
    return 0, 0


def _peek_str(view: memoryview, pos: int) -> tuple[str | None, int]:
    """A msgpack str at ``pos`` (fixstr, str8 or str16) and the position after it."""
    if pos >= len(view):
        return None, -1
    lead = view[pos]
    if 0xA0 <= lead <= 0xBF:
        size, start = lead & 0x1F, pos + 1
    elif lead == 0xD9 and pos + 2 <= len(view):
        size, start = view[pos + 1], pos + 2
    elif lead == 0xDA and pos + 3 <= len(view):
        size, start = int.from_bytes(view[pos + 1 : pos + 3], "big"), pos + 3
    else:
        return None, -1
    if start + size > len(view) or size > MAX_NAME:
        return None, -1
    try:
        return bytes(view[start : start + size]).decode(), start + size
    except UnicodeDecodeError:
        return None, -1


#: msgpack lead bytes of fixed-size scalars -> total size (nil, bools, floats, ints)
_FIXED_SIZES: Final = {0xC0: 1, 0xC2: 1, 0xC3: 1, 0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5,
                0xCF: 9, 0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9}  # fmt: skip
#: str and bin with a length field -> size of that field
_SIZED: Final = {0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC4: 1, 0xC5: 2, 0xC6: 4}


#: extension types with a fixed size (fixext 1..16) -> that size
_FIXEXT: Final = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}
#: containers, bin and ext with a size field -> (kind, size of that field)
_SIZED_HEADERS: Final = {0xDC: ("array", 2), 0xDD: ("array", 4), 0xDE: ("map", 2),
                         0xDF: ("map", 4), 0xC4: ("bin", 1), 0xC5: ("bin", 2), 0xC6: ("bin", 4),
                         0xC7: ("ext", 1), 0xC8: ("ext", 2), 0xC9: ("ext", 4)}  # fmt: skip


def _header(view: memoryview, pos: int) -> tuple[str, int, int]:
    """The kind of the msgpack item at ``pos`` ("array", "map", "bin", "ext" or "scalar"),
    its entry count or byte size, and where its contents start (a truncated header reads as
    a scalar, which :func:`_skip_scalar` then finds truncated)."""
    lead = view[pos]
    if 0x80 <= lead <= 0x9F:
        return ("map" if lead <= 0x8F else "array"), lead & 0x0F, pos + 1
    if lead in _FIXEXT:
        return "ext", _FIXEXT[lead], pos + 2
    if lead in _SIZED_HEADERS:
        kind, width = _SIZED_HEADERS[lead]
        if pos + 1 + width <= len(view):
            return kind, int.from_bytes(view[pos + 1 : pos + 1 + width], "big"), pos + 1 + width
    return "scalar", 0, pos


def _skip_scalar(view: memoryview, pos: int) -> int:
    """The position after the scalar at ``pos``; -1 for a container or a truncated value."""
    if pos >= len(view):
        return -1
    lead = view[pos]
    if lead <= 0x7F or lead >= 0xE0:  # positive / negative fixint
        return pos + 1
    if 0xA0 <= lead <= 0xBF:
        end = pos + 1 + (lead & 0x1F)
    elif lead in _FIXED_SIZES:
        end = pos + _FIXED_SIZES[lead]
    elif lead in _SIZED:
        width = _SIZED[lead]
        size = int.from_bytes(view[pos + 1 : pos + 1 + width], "big")
        end = pos + 1 + width + size
    else:
        return -1
    return end if end <= len(view) else -1
