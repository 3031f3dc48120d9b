"""Encoding and decoding of message bodies: round trips, and precise rejection of bad input."""

from __future__ import annotations

import contextlib
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from protocol_strategies import messages

from flowsched.protocol import (
    LocalProtocolError,
    Message,
    ProtocolError,
    _codec,
    decode_body,
    encode_body,
)


@given(messages)
def test_encode_decode_round_trip(message: Message) -> None:
    assert decode_body(encode_body(message)) == message


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
_progress_lists = st.lists(_progress | _progress | _odd_entry, max_size=3)
_close_lists = st.lists(_close | _close | _odd_entry, max_size=3)
_flows_maps = st.one_of(
    st.fixed_dictionaries({"closes": _close_lists}),
    st.fixed_dictionaries({"progress": _progress_lists}),
    st.fixed_dictionaries(
        {},
        optional={
            "opens": st.sampled_from([[{**_OPEN, "links": ["eth0"]}], [], None]),
            "progress": _progress_lists,
            "closes": _close_lists,
        },
    ),
    st.fixed_dictionaries({}, optional={"progress": _odd_values, "closes": _odd_values}),
    st.fixed_dictionaries({"x": st.just(1)}, optional={"progress": st.just([])}),
)
_heartbeat_maps = st.fixed_dictionaries(
    {"t_sent": _times}, optional={"epoch": _counts, "x": st.just(1)}
) | st.fixed_dictionaries({}, optional={"epoch": _counts})


def _outcome(decode: Any, data: dict[str, Any]) -> object:
    try:
        return decode(data)
    except LocalProtocolError as exc:
        return f"error: {exc}"


@settings(max_examples=400)
@given(
    st.one_of(
        _flows_maps.map(lambda m: {"t": "flows", **m}),
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


def test_fast_decoders_take_the_common_frames() -> None:
    flows = {
        "t": "flows",
        "opens": [{**_OPEN, "size": None, "links": ["eth0"]}],
        "progress": [{"id": 1, "sent": 10}, {"id": 2, "sent": 0}],
        "closes": [{"id": 3, "sent": 5, "closed_at": 2.5}],
    }
    for data in (
        flows,
        {"t": "heartbeat", "t_sent": 1.5},
        {"t": "heartbeat", "t_sent": 1.5, "epoch": 3},
    ):
        got = _codec._FAST_DECODERS[str(data["t"])](data)
        assert got is not None and repr(got) == repr(_codec._decode_checked(data))


_EDGE_VALUES = [
    -1,
    0,
    2**64 - 1,
    -(2**63),
    -0.5,
    0.0,
    1.5,
    float("inf"),
    float("nan"),
    True,
    None,
    "1",
]


@pytest.mark.parametrize("value", _EDGE_VALUES, ids=repr)
@pytest.mark.parametrize(
    "build",
    [
        pytest.param(
            lambda v: {"t": "flows", "closes": [{"id": 1, "sent": 2, "closed_at": v}]},
            id="closed_at",
        ),
        pytest.param(
            lambda v: {"t": "flows", "closes": [{"id": v, "sent": 2, "closed_at": 1.0}]},
            id="close-id",
        ),
        pytest.param(
            lambda v: {"t": "flows", "closes": [{"id": 1, "sent": v, "closed_at": 1.0}]},
            id="close-sent",
        ),
        pytest.param(
            lambda v: {"t": "flows", "progress": [{"id": v, "sent": 2}]}, id="progress-id"
        ),
        pytest.param(
            lambda v: {"t": "flows", "progress": [{"id": 1, "sent": v}]}, id="progress-sent"
        ),
        pytest.param(lambda v: {"t": "flows", "progress": v}, id="progress"),
        pytest.param(lambda v: {"t": "heartbeat", "t_sent": v}, id="t_sent"),
        pytest.param(lambda v: {"t": "heartbeat", "t_sent": 1.0, "epoch": v}, id="epoch"),
    ],
)
def test_hot_frames_decode_as_the_checked_path_at_the_edges(build: Any, value: object) -> None:
    data = build(value)
    got = _outcome(lambda d: decode_body(msgpack.packb(d, use_bin_type=True)), data)
    assert repr(got) == repr(_outcome(_codec._decode_checked, data))
