"""Encoding and decoding of message bodies: round trips, and precise rejection of bad input."""

from __future__ import annotations

import contextlib
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from protocol_strategies import flow_opens, flows_with, messages, progress_pairs, times, u64

from flowsched.protocol import (
    MAX_PROGRESS,
    FlowClose,
    Hello,
    JobProgress,
    LocalProtocolError,
    Message,
    ProtocolError,
    Welcome,
    _codec,
    decode_body,
    encode_body,
)


@given(messages, st.sampled_from([1, 2, 3, 4]))
def test_encode_decode_round_trip(message: Message, version: int) -> None:
    decoded = decode_body(encode_body(message, version))
    assert decoded == message
    if isinstance(message, Hello | Welcome):  # the nonce and the MAC too (mac: no equality)
        assert repr(decoded) == repr(message)


@pytest.mark.parametrize(
    ("message", "keys"),
    [
        pytest.param(Hello(2, "n"), {"t", "version", "node"}, id="hello-without-nonce"),
        pytest.param(Hello(3, "n", b"a" * 32), {"t", "version", "node", "nonce"}, id="hello-v3"),
        pytest.param(
            Welcome("", 0.1, 1.0),
            {"t", "policy_toml", "timer_period", "server_time", "heartbeat_interval"},
            id="welcome-without-mac",
        ),
        pytest.param(
            Welcome("", 0.1, 1.0, mac=b"m" * 32),
            {"t", "policy_toml", "timer_period", "server_time", "heartbeat_interval", "mac"},
            id="welcome-v3",
        ),
    ],
)
def test_the_nonce_and_the_mac_are_sent_only_when_set(message: Message, keys: set[str]) -> None:
    # an empty nonce or MAC is left out: the hello and welcome of versions 1 and 2 stay what
    # an agent or coordinator of those versions decodes (they refuse unknown fields)
    body = encode_body(message)
    assert set(msgpack.unpackb(body)) == keys
    assert repr(decode_body(body)) == repr(message)


@given(
    progress_pairs,
    st.lists(flow_opens, max_size=2).map(tuple),
    st.lists(st.builds(FlowClose, u64, u64, times), max_size=2).map(tuple),
    st.booleans(),
)
def test_packed_and_map_progress_decode_to_the_same_flows(
    pairs: list[tuple[int, int]], opens: Any, closes: Any, keep_empty: bool
) -> None:
    ids, sents = [fid for fid, _ in pairs], [sent for _, sent in pairs]
    maps = [{"id": fid, "sent": sent} for fid, sent in pairs]
    packed = {"progress_ids": ids, "progress_sent": sents}
    rest = {"opens": [_codec._open_map(o) for o in opens], "closes": [
        {"id": c.id, "sent": c.sent, "closed_at": c.closed_at} for c in closes
    ]}  # fmt: skip
    if not keep_empty:  # empty arrays left out, as a minimal sender would
        rest = {key: value for key, value in rest.items() if value}
    as_maps = decode_body(msgpack.packb({"t": "flows", **rest, "progress": maps}))
    as_packed = decode_body(msgpack.packb({"t": "flows", **rest, **packed}))
    expected = flows_with(pairs, opens=opens, closes=closes)
    assert as_maps == as_packed == expected
    assert repr(as_maps) == repr(as_packed)  # field types (tuples of int) included
    # and what the encoder writes for each version reads back the same
    assert decode_body(encode_body(expected, 1)) == decode_body(encode_body(expected, 2))


@given(st.binary(max_size=256))
def test_random_bytes_raise_only_protocol_errors(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode_body(data)


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
_keys = st.sampled_from(["t", "id", "sent", "opens", "progress", "closes", "node", "version", "x"])


@given(
    st.sampled_from(["flows", "hello", "auth", "levels", "resync", "nic_load", "job_progress"]),
    st.dictionaries(_keys, _values, max_size=4),
)
def test_random_maps_raise_only_protocol_errors(kind: str, fields: dict[str, Any]) -> None:
    body = msgpack.packb({**fields, "t": kind}, use_bin_type=True)
    with contextlib.suppress(ProtocolError):
        decode_body(body)


_OPEN = {"id": 1, "cls": "kv", "opened_at": 1.0, "sent": 0}
WELCOME = {"t": "welcome", "policy_toml": "", "timer_period": 1, "server_time": 1.0,
           "heartbeat_interval": 0.2}  # fmt: skip

BAD_BODIES = [
    pytest.param({"t": "nope"}, "frame.t: unknown message type 'nope'", id="unknown-type"),
    pytest.param({"x": 1}, "frame.t: unknown message type None", id="missing-type"),
    pytest.param({"t": "hello", "version": 1}, "hello.node: missing field", id="missing-field"),
    pytest.param(
        {"t": "hello", "version": 1, "node": "n", "extra": 2},
        "hello: unknown field(s) extra",
        id="unknown-field",
    ),
    pytest.param({"t": "hello", "version": "1", "node": "n"}, "hello.version", id="version-str"),
    pytest.param({"t": "hello", "version": True, "node": "n"}, "hello.version", id="version-bool"),
    pytest.param({"t": "hello", "version": 1, "node": ""}, "hello.node", id="empty-node"),
    pytest.param({"t": "hello", "version": 1, "node": "a\x00b"}, "hello.node", id="nul-in-node"),
    pytest.param({"t": "auth", "mac": b"short"}, "auth.mac: expected 32 bytes", id="short-mac"),
    pytest.param(
        {"t": "hello", "version": 3, "node": "n", "nonce": b"short"},
        "hello.nonce: expected 32 bytes (bin) or nil, got bytes",
        id="short-nonce",
    ),
    pytest.param(
        {"t": "hello", "version": 3, "node": "n", "nonce": "x" * 32},
        "hello.nonce: expected 32 bytes (bin) or nil, got str",
        id="nonce-as-str",
    ),
    pytest.param(
        {**WELCOME, "mac": b"x" * 31},
        "welcome.mac: expected 32 bytes (bin) or nil, got bytes",
        id="short-welcome-mac",
    ),
    pytest.param({"t": "auth", "mac": "x" * 32}, "auth.mac", id="mac-as-str"),
    pytest.param(
        {"t": "flows", "progress": [{"id": -1, "sent": 0}]},
        "flows.progress[0].id",
        id="negative-id",
    ),
    pytest.param(
        {"t": "flows", "progress": [{"id": 1, "sent": 1.5}]},
        "flows.progress[0].sent",
        id="float-sent",
    ),
    pytest.param(
        {"t": "flows", "progress_ids": [1, True], "progress_sent": [1, 2]},
        "flows.progress_ids[1]: expected an integer in 0..18446744073709551615, got True",
        id="packed-bool-id",
    ),
    pytest.param(
        {"t": "flows", "progress_ids": [1], "progress_sent": [-1]},
        "flows.progress_sent[0]: expected an integer",
        id="packed-negative-sent",
    ),
    pytest.param(
        {"t": "flows", "progress_ids": [1, 2], "progress_sent": [1]},
        "flows.progress_sent: 1 entries, expected as many as progress_ids (2)",
        id="packed-unequal",
    ),
    pytest.param(
        {"t": "flows", "progress_ids": [1]},
        "flows.progress_sent: missing field",
        id="packed-sent-missing",
    ),
    pytest.param(
        {"t": "flows", "progress_sent": [1]},
        "flows.progress_ids: missing field",
        id="packed-ids-missing",
    ),
    pytest.param(
        {"t": "flows", "progress": [], "progress_ids": [1], "progress_sent": [1]},
        "flows: progress and progress_ids/progress_sent in one frame",
        id="both-forms",
    ),
    pytest.param(
        {"t": "flows", "progress_ids": {"a": 1}, "progress_sent": []},
        "flows.progress_ids: expected an array, got dict",
        id="packed-map",
    ),
    pytest.param(
        {"t": "flows", "progress_ids": [0] * (MAX_PROGRESS + 1), "progress_sent": [0]},
        f"flows.progress_ids: more than {MAX_PROGRESS} entries",
        id="packed-too-many",
    ),
    pytest.param(
        {"t": "flows", "progress": [{"id": 1, "sent": 1}] * (MAX_PROGRESS + 1)},
        f"flows.progress: more than {MAX_PROGRESS} entries",
        id="maps-too-many",
    ),
    pytest.param(
        {"t": "flows", "opens": [{**_OPEN, "cls": "video"}]},
        "flows.opens[0].cls: unknown flow class 'video'",
        id="unknown-class",
    ),
    pytest.param(
        {"t": "flows", "opens": [{**_OPEN, "deadline": float("nan")}]},
        "flows.opens[0].deadline",
        id="nan-deadline",
    ),
    pytest.param(
        {"t": "flows", "opens": [{**_OPEN, "links": ["a"] * 65}]},
        "flows.opens[0].links: more than 64",
        id="too-many-links",
    ),
    pytest.param(
        {"t": "flows", "opens": [{**_OPEN, "links": [3]}]},
        "flows.opens[0].links[0]",
        id="link-not-str",
    ),
    pytest.param({"t": "flows", "opens": {"a": 1}}, "flows.opens: expected an array", id="map"),
    pytest.param(
        {"t": "nic_load", "entries": [{"link": "e", "bandwidth": 1.0, "load": 1.5}]},
        "nic_load.entries[0].load",
        id="load-above-1",
    ),
    pytest.param(
        {"t": "levels", "updates": [{"id": 1, "level": 256}]},
        "levels.updates[0].level",
        id="level-above-255",
    ),
    pytest.param({"t": "job_progress", "job": "j", "step": -2}, "job_progress.step", id="neg-step"),
    pytest.param({"t": "heartbeat", "t_sent": float("inf")}, "heartbeat.t_sent", id="inf-time"),
]


@pytest.mark.parametrize(("body", "expected"), BAD_BODIES)
def test_bad_bodies_are_rejected_naming_the_field(body: dict[str, Any], expected: str) -> None:
    with pytest.raises(LocalProtocolError) as info:
        decode_body(msgpack.packb(body, use_bin_type=True))
    assert expected in str(info.value)


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"\xc1", id="reserved-byte"),
        pytest.param(b"\x92\x01", id="truncated-array"),
        pytest.param(msgpack.packb({"t": "hello"}) + b"\x00", id="trailing-bytes"),
        pytest.param(msgpack.packb(msgpack.ExtType(1, b"x")), id="ext-type"),
        pytest.param(b"\x81\x01\x02", id="int-map-key"),
        pytest.param(b"\xa2\xff\xfe", id="invalid-utf8"),
    ],
)
def test_malformed_msgpack_is_a_protocol_error(data: bytes) -> None:
    with pytest.raises(LocalProtocolError, match=r"^frame"):
        decode_body(data)


def test_decoding_never_builds_objects_from_ext_types() -> None:
    body = msgpack.packb({"t": "heartbeat", "t_sent": msgpack.ExtType(42, b"\x00")})
    with pytest.raises(LocalProtocolError, match=r"heartbeat\.t_sent"):
        decode_body(body)


def test_level_decision_stamps_round_trip_and_stay_optional() -> None:
    from flowsched.protocol import Levels, LevelUpdate

    stamped = Levels((LevelUpdate(7, 0, None, 1.7e9, 42_000_000_123), LevelUpdate(8, 3)))
    decoded = decode_body(encode_body(stamped))
    assert isinstance(decoded, Levels)
    assert [(u.decided_at, u.decided_ns) for u in decoded.updates] == [
        (1.7e9, 42_000_000_123),
        (None, None),
    ]
    # a frame without the stamps (an older coordinator) still decodes
    old = msgpack.packb({"t": "levels", "updates": [{"id": 1, "level": 2, "rate": None}]})
    assert decode_body(old) == Levels((LevelUpdate(1, 2),))
    # stamps are not part of equality: a re-stamped update is the same decision
    assert LevelUpdate(1, 2, None, 5.0, 9) == LevelUpdate(1, 2)
    with pytest.raises(LocalProtocolError, match=r"levels\.updates.*decided_ns"):
        bad = {"id": 1, "level": 2, "decided_ns": -1}
        decode_body(msgpack.packb({"t": "levels", "updates": [bad]}))


_odd_values = (
    st.none()
    | st.booleans()
    | st.integers(-2, 2**64)
    | st.floats(allow_nan=True)
    | st.sampled_from([-1, 2**64, -0.5, float("inf"), "1", [], {}])
)
# mostly valid values and entries, so that each check of the fast paths is reached
_counts = st.one_of(st.integers(0, 5), st.integers(0, 5), st.just(2**64 - 1), _odd_values)
_times = st.one_of(st.floats(0, 10), st.integers(0, 5), _odd_values)
_progress = st.fixed_dictionaries({"id": _counts, "sent": _counts})
_close = st.fixed_dictionaries({"id": _counts, "sent": _counts, "closed_at": _times})
_odd_entry = _odd_values | st.dictionaries(
    st.sampled_from(["id", "sent", "closed_at", "x"]), _counts, max_size=4
)
_progress_lists = st.lists(_progress | _progress | _odd_entry, max_size=12)
_close_lists = st.lists(_close | _close | _odd_entry, max_size=3)

#: a flow open with every field set (the agent sends all eleven, nil where unknown)
_FULL_OPEN = {
    "id": 7,
    "cls": "kv",
    "opened_at": 1.5,
    "sent": 0,
    "size": 1 << 26,
    "deadline": 3.5,
    "job": "job-3",
    "consumer_index": 3,
    "request": "req-1",
    "links": ["node-1/eth0"],
    "level": 2,
}
_OPTIONAL_OPEN_KEYS = ["size", "deadline", "job", "consumer_index", "request", "links", "level"]
_names = st.sampled_from(["eth0", "x" * 255, "x" * 256, "", "a\x00b", "\u00e9", " "])
_open_values = st.one_of(
    _counts,
    _times,
    _names,
    st.sampled_from(["kv", "tp", "bulk", "kv_reuse", "KV", "video", 2**63 - 1, 2**63, 255, 256]),
    st.lists(_names | _odd_values, max_size=3),
    st.sampled_from([["eth0"] * 64, ["eth0"] * 65]),
)


@st.composite
def _opens(draw: st.DrawFn) -> object:
    """A valid open (all fields, or only the required ones) with a few fields left out, set
    to nil, or replaced by an edge value, or an unknown key added; now and then a non-map."""
    if draw(st.integers(0, 9)) == 0:
        return draw(_odd_values)
    entry: dict[str, Any] = dict(draw(st.sampled_from([_FULL_OPEN, _OPEN])))
    for key in draw(st.lists(st.sampled_from(_OPTIONAL_OPEN_KEYS), max_size=3)):
        if draw(st.booleans()):
            entry.pop(key, None)
        else:
            entry[key] = None
    for key in draw(st.lists(st.sampled_from([*_FULL_OPEN, "x"]), max_size=2)):
        entry[key] = draw(_open_values)
    return entry


_open_lists = st.lists(_opens(), max_size=3)


@st.composite
def _packed(draw: st.DrawFn) -> dict[str, Any]:
    """Packed-form progress: two arrays of mostly valid counts, mostly of equal length; now
    and then one left out, set to an odd value, lengthened, or the map form added."""
    pairs = draw(st.lists(st.tuples(_counts, _counts), max_size=12))
    fields: dict[str, Any] = {
        "progress_ids": [fid for fid, _ in pairs],
        "progress_sent": [sent for _, sent in pairs],
    }
    change = draw(st.integers(0, 9))
    key = draw(st.sampled_from(["progress_ids", "progress_sent"]))
    if change == 0:
        del fields[key]
    elif change == 1:
        fields[key] = draw(_odd_values)
    elif change == 2:
        fields[key] = [*fields[key], draw(_counts)]
    elif change == 3:
        fields["progress"] = draw(st.sampled_from([[], None, [{"id": 1, "sent": 1}]]))
    return fields


_flows_maps = st.one_of(
    st.fixed_dictionaries({"closes": _close_lists}),
    st.fixed_dictionaries({"progress": _progress_lists}),
    st.fixed_dictionaries({"opens": _open_lists}),
    st.fixed_dictionaries(
        {},
        optional={
            "opens": _open_lists | st.sampled_from([[], None]),
            "progress": _progress_lists,
            "closes": _close_lists,
        },
    ),
    st.fixed_dictionaries(
        {}, optional={"opens": _odd_values, "progress": _odd_values, "closes": _odd_values}
    ),
    st.fixed_dictionaries({"x": st.just(1)}, optional={"progress": st.just([])}),
    st.tuples(
        _packed(),
        st.fixed_dictionaries(
            {},
            optional={
                "opens": _open_lists | st.sampled_from([[], None]),
                "closes": _close_lists | st.sampled_from([[], None]),
                "x": st.just(1),
            },
        ),
    ).map(lambda parts: {**parts[1], **parts[0]}),
)
_resync_maps = st.fixed_dictionaries(
    {}, optional={"opens": _open_lists | _odd_values, "x": st.just(1)}
)
_heartbeat_maps = st.fixed_dictionaries(
    {"t_sent": _times}, optional={"epoch": _counts, "x": st.just(1)}
) | st.fixed_dictionaries({}, optional={"epoch": _counts})


def _outcome(decode: Any, data: dict[str, Any]) -> object:
    try:
        return decode(data)
    except LocalProtocolError as exc:
        return f"error: {exc}"


@settings(max_examples=600)
@given(
    st.one_of(
        _flows_maps.map(lambda m: {"t": "flows", **m}),
        _resync_maps.map(lambda m: {"t": "resync", **m}),
        _heartbeat_maps.map(lambda m: {"t": "heartbeat", **m}),
    )
)
def test_fast_decoders_agree_with_the_checked_path(data: dict[str, Any]) -> None:
    # the hot frames skip the field-by-field path: they must accept exactly what it accepts,
    # build the same message (field types included), or fail with the same error
    fast = _codec._FAST_DECODERS[data["t"]]
    got = _outcome(fast, data)
    if got is None:
        return  # unusual: decode_body hands it to the checked path
    expected = _outcome(_codec._decode_checked, data)
    assert repr(got) == repr(expected)


def _refuse(*args: object) -> None:
    raise AssertionError(f"the checked path was taken for {args}")


def test_fast_decoders_take_the_common_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    if not str(_codec.__file__).endswith(".py"):
        pytest.skip(
            "the compiled codec calls its functions directly, past any patch (the builds are"
            " compared in test_protocol_compiled.py instead)"
        )
    flows: dict[str, Any] = {
        "t": "flows",
        "opens": [
            _FULL_OPEN,
            {**_FULL_OPEN, "cls": "tp", "size": None, "deadline": None, "job": None},
            {**_OPEN, "size": None, "links": ["eth0"]},  # optional fields left out
            {**_OPEN, "opened_at": 2, "deadline": 5, "links": []},  # integer times
        ],
        "progress": [{"id": i, "sent": 10 * i} for i in range(10)],
        "closes": [{"id": 3, "sent": 5, "closed_at": 2.5}, {"id": 4, "sent": 5, "closed_at": 3}],
    }
    frames: tuple[dict[str, Any], ...] = (
        flows,
        {"t": "flows", "progress": [{"id": 1, "sent": 2}]},  # the other arrays left out
        {
            "t": "flows",
            "opens": None,
            "progress": [],
            "closes": [{"id": 1, "sent": 0, "closed_at": 0.0}],
        },
        {"t": "resync", "opens": flows["opens"]},
        {"t": "resync"},
        {"t": "heartbeat", "t_sent": 1.5},
        {"t": "heartbeat", "t_sent": 1.5, "epoch": 3},
        {  # the packed form, as encode_body writes it
            "t": "flows",
            "opens": flows["opens"],
            "progress_ids": list(range(10)),
            "progress_sent": [655360] * 9 + [2**64 - 1],
            "closes": flows["closes"],
        },
        {"t": "flows", "progress_ids": [1], "progress_sent": [0]},  # the other arrays left out
        {"t": "flows", "opens": None, "progress_ids": [], "progress_sent": [], "closes": []},
    )
    expected = [_codec._decode_checked(data) for data in frames]
    # the fast decoders build every entry themselves: none reaches the checked entry parsers
    for name in (
        "_flow_open",
        "_flow_progress",
        "_progress_maps",
        "_u64",
        "_flow_close",
        "_decode_checked",
    ):
        monkeypatch.setattr(_codec, name, _refuse)
    for data, checked in zip(frames, expected, strict=True):
        got = _codec._FAST_DECODERS[str(data["t"])](data)
        assert got is not None and repr(got) == repr(checked)
        assert repr(decode_body(msgpack.packb(data, use_bin_type=True))) == repr(checked)


_ABSENT = object()  # an edge "value": the key left out

_EDGE_VALUES = [
    _ABSENT,
    -1,
    0,
    1,
    255,
    256,
    2**63 - 1,
    2**63,
    2**64 - 1,
    -(2**63),
    -0.5,
    -0.0,
    0.0,
    1.5,
    1e308,
    float("inf"),
    float("-inf"),
    float("nan"),
    True,
    False,
    None,
    "1",
    "kv",
    "",
    " ",
    "a\x00b",
    "x" * 255,
    "x" * 256,
    b"kv",
    [],
    ["eth0"],
    ["eth0"] * 64,
    ["eth0"] * 65,
    [3],
    [""],
    [None],
    ["eth0", True],
    {"a": 1},
]


def _edge_id(value: object) -> str:
    if value is _ABSENT:
        return "absent"
    text = repr(value)
    return text if len(text) <= 20 else f"{text[:12]}...({len(text)} chars)"


def _set(entry: dict[Any, Any], key: Any, value: object) -> dict[Any, Any]:
    """``entry`` with ``key`` set to ``value``, or left out for ``_ABSENT``."""
    entry = dict(entry)
    if value is _ABSENT:
        entry.pop(key, None)
    else:
        entry[key] = value
    return entry


def _frame(kind: str, **arrays: object) -> dict[str, Any]:
    return {"t": kind, **{k: v for k, v in arrays.items() if v is not _ABSENT}}


def _array(*items: object) -> list[object]:
    return [item for item in items if item is not _ABSENT]


_PROGRESS = {"id": 1, "sent": 2}
_TEN = list(range(10))
_CLOSE = {"id": 1, "sent": 2, "closed_at": 1.0}
_EDGE_BUILDS = [
    pytest.param(lambda v: _frame("flows", closes=[_set(_CLOSE, "closed_at", v)]), id="closed_at"),
    pytest.param(lambda v: _frame("flows", closes=[_set(_CLOSE, "id", v)]), id="close-id"),
    pytest.param(lambda v: _frame("flows", closes=[_set(_CLOSE, "sent", v)]), id="close-sent"),
    pytest.param(lambda v: _frame("flows", closes=[_set(_CLOSE, "x", v)]), id="close-extra"),
    pytest.param(lambda v: _frame("flows", closes=_array(_CLOSE, v)), id="close-entry"),
    pytest.param(lambda v: _frame("flows", progress=[_set(_PROGRESS, "id", v)]), id="progress-id"),
    pytest.param(
        lambda v: _frame("flows", progress=[_set(_PROGRESS, "sent", v)]), id="progress-sent"
    ),
    pytest.param(
        lambda v: _frame("flows", progress=[_PROGRESS] * 9 + [_set(_PROGRESS, "x", v)]),
        id="progress-extra",
    ),
    pytest.param(
        lambda v: _frame("flows", progress=_array(*[_PROGRESS] * 5, v)), id="progress-entry"
    ),
    pytest.param(lambda v: _frame("flows", progress=v), id="progress"),
    pytest.param(
        lambda v: _frame("flows", progress_ids=_array(v), progress_sent=[1]), id="packed-id"
    ),
    pytest.param(
        lambda v: _frame("flows", progress_ids=[1], progress_sent=_array(v)), id="packed-sent"
    ),
    pytest.param(
        lambda v: _frame("flows", progress_ids=_array(*_TEN[:9], v), progress_sent=_TEN),
        id="packed-10th-id",
    ),
    pytest.param(
        lambda v: _frame("flows", progress_ids=_TEN, progress_sent=_array(v, *_TEN[1:])),
        id="packed-1st-sent",
    ),
    pytest.param(lambda v: _frame("flows", progress_ids=v, progress_sent=[1]), id="packed-ids"),
    pytest.param(lambda v: _frame("flows", progress_ids=[1], progress_sent=v), id="packed-sents"),
    pytest.param(
        lambda v: _frame("flows", progress_ids=v, progress_sent=v), id="packed-both-arrays"
    ),
    pytest.param(
        lambda v: _frame("flows", progress=v, progress_ids=[1], progress_sent=[2]),
        id="packed-and-maps",
    ),
    pytest.param(
        lambda v: _frame("flows", opens=v, closes=v, progress_ids=[1], progress_sent=[2]),
        id="packed-opens-closes",
    ),
    pytest.param(
        lambda v: _set(_frame("flows", progress_ids=[1], progress_sent=[2]), "x", v),
        id="packed-extra",
    ),
    pytest.param(lambda v: _frame("flows", opens=v, progress=[_PROGRESS]), id="opens"),
    pytest.param(lambda v: _set(_frame("flows", closes=[_CLOSE]), "x", v), id="flows-extra"),
    pytest.param(lambda v: _frame("flows", opens=_array(_FULL_OPEN, v)), id="open-entry"),
    *(
        pytest.param(lambda v, k=key: _frame("flows", opens=[_set(_FULL_OPEN, k, v)]), id=key)
        for key in [*_FULL_OPEN, "x"]
    ),
    pytest.param(lambda v: _frame("flows", opens=[_set(_FULL_OPEN, b"id", v)]), id="bin-key"),
    pytest.param(lambda v: _frame("flows", opens=[_set(_OPEN, "deadline", v)]), id="few-keys"),
    pytest.param(
        lambda v: _frame("flows", opens=[_set(_FULL_OPEN, "links", _array(*["eth0"] * 63, v))]),
        id="64th-link",
    ),
    pytest.param(lambda v: _frame("resync", opens=v), id="resync"),
    pytest.param(lambda v: _frame("resync", opens=[_set(_OPEN, "level", v)]), id="resync-level"),
    pytest.param(lambda v: _set(_frame("resync", opens=[_OPEN]), "x", v), id="resync-extra"),
    pytest.param(lambda v: _frame("heartbeat", t_sent=v), id="t_sent"),
    pytest.param(lambda v: _frame("heartbeat", t_sent=1.0, epoch=v), id="epoch"),
]


@pytest.mark.parametrize("value", _EDGE_VALUES, ids=_edge_id)
@pytest.mark.parametrize("build", _EDGE_BUILDS)
def test_hot_frames_decode_as_the_checked_path_at_the_edges(build: Any, value: object) -> None:
    data = build(value)
    got = _outcome(lambda d: decode_body(msgpack.packb(d, use_bin_type=True)), data)
    assert repr(got) == repr(_outcome(_codec._decode_checked, data))


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"progress": [{"id": 1, "sent": 2}] * MAX_PROGRESS}, id="maps"),
        pytest.param(
            {"progress_ids": [1] * MAX_PROGRESS, "progress_sent": [2] * MAX_PROGRESS},
            id="packed",
        ),
    ],
)
def test_a_frame_of_max_progress_reports_is_accepted(fields: dict[str, Any]) -> None:
    decoded = decode_body(msgpack.packb({"t": "flows", **fields}))
    assert decoded == flows_with([(1, 2)] * MAX_PROGRESS)


def test_a_jobs_end_is_sent_only_when_set() -> None:
    """``done`` is left out when false: the frame stays what a version-3 coordinator decodes
    (it refuses unknown fields); set, it round-trips."""
    plain = JobProgress("batch", 7, 7)
    assert msgpack.unpackb(encode_body(plain)) == {
        "t": "job_progress", "job": "batch", "step": 7, "layer": 7,
    }  # fmt: skip
    ended = JobProgress("batch", 8, None, done=True)
    assert msgpack.unpackb(encode_body(ended))["done"] is True
    assert decode_body(encode_body(ended)) == ended


@pytest.mark.parametrize("value", [1, "yes", None, 0.0])
def test_a_jobs_end_must_be_a_boolean(value: object) -> None:
    body = msgpack.packb({"t": "job_progress", "job": "j", "step": 1, "done": value})
    if value is None:  # nil reads as absent
        assert decode_body(body) == JobProgress("j", 1)
        return
    with pytest.raises(LocalProtocolError, match=r"job_progress\.done: expected a boolean"):
        decode_body(body)
