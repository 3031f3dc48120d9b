"""The compiled codec and framing against the same revision's Python source.

The wheel compiles ``_codec`` and ``_framing`` with mypyc (flowsched/compiled.py), which
checks annotated types at run time: a wrong annotation on unchecked data would raise
TypeError where the decoder must raise a ProtocolError naming the field, and a float or int
annotation could change a value or a message. Here the running build's decoder, encoder,
``peek_type`` and framing are compared with their source imported as plain Python, on the
edge tables and strategies of test_protocol_codec.py and on hostile frames (bin map keys,
nesting, random bytes): the same message (field types included), or the same error type,
code and text; nothing else may escape either. tests/packaging/test_wheel.py runs this on
the wheel; in an editable checkout the modules are Python and these tests are skipped.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import math
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import msgpack
import pytest
import test_protocol_codec as codec_tests
import test_protocol_limits as limits_tests
from hypothesis import given, settings
from hypothesis import strategies as st
from protocol_strategies import messages

from flowsched.protocol import Message, ProtocolError, _codec, _framing


def _is_compiled(module: ModuleType) -> bool:
    return str(module.__file__).endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def _interpreted(module: ModuleType) -> ModuleType:
    """``module``'s source file imported as Python under a name of its own (it shares the
    message and error classes with the compiled module, so that results compare equal)."""
    stem = module.__name__.rpartition(".")[2]
    source = Path(str(module.__file__)).with_name(f"{stem}.py")
    spec = importlib.util.spec_from_file_location(f"{module.__name__}_interpreted", source)
    assert spec is not None and spec.loader is not None, source
    twin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(twin)
    assert not _is_compiled(twin)
    return twin


COMPILED = _is_compiled(_codec) and _is_compiled(_framing)
pytestmark = pytest.mark.skipif(
    not COMPILED,
    reason="the codec runs as Python here; tests/packaging/test_wheel.py runs this on the wheel",
)
CODEC = _interpreted(_codec) if COMPILED else _codec
FRAMING = _interpreted(_framing) if COMPILED else _framing


def _outcome(call: Callable[..., object], *args: object) -> tuple[object, ...]:
    """What ``call`` returned (as repr: field types count) or the protocol error it raised;
    any other exception fails the test."""
    try:
        result = call(*args)
    except ProtocolError as exc:
        return ("error", type(exc).__name__, exc.code, str(exc))
    return ("ok", repr(result))


def _same_decoding(body: bytes) -> None:
    compiled = _outcome(_codec.decode_body, body)
    assert compiled == _outcome(CODEC.decode_body, body), body
    assert _codec.peek_type(body) == CODEC.peek_type(body), body


def _same_map_decoding(data: dict[Any, Any]) -> None:
    """The fast decoder of ``data``'s type and the checked path alike, then the whole body."""
    kind = data.get("t")
    if type(kind) is str and kind in _codec._FAST_DECODERS:
        fast = _outcome(_codec._FAST_DECODERS[kind], data)
        assert fast == _outcome(CODEC._FAST_DECODERS[kind], data), data
    checked = _outcome(_codec._decode_checked, data)
    assert checked == _outcome(CODEC._decode_checked, data), data
    try:
        body = msgpack.packb(data, use_bin_type=True)
    except OverflowError:  # an integer msgpack cannot carry (the strategies have 2**64)
        return
    _same_decoding(body)


def test_the_twins_are_what_they_should_be() -> None:
    assert _is_compiled(_codec) and not _is_compiled(CODEC)
    assert _is_compiled(_framing) and not _is_compiled(FRAMING)
    assert CODEC.LocalProtocolError is _codec.LocalProtocolError


def test_the_edge_tables_decode_alike() -> None:
    """Every hot-frame field at every edge value, and every bad body, in both builds."""
    for build in codec_tests._EDGE_BUILDS:
        for value in codec_tests._EDGE_VALUES:
            _same_map_decoding(build.values[0](value))
    for bad in codec_tests.BAD_BODIES:
        _same_map_decoding(bad.values[0])


def test_frames_over_the_limits_are_refused_alike() -> None:
    """Each container over the decoder's limits, and the largest legal frames, in both builds."""
    for over in limits_tests.OVER_LIMIT:
        _same_decoding(over.values[0])
    for largest in limits_tests.LARGEST:
        _same_decoding(_codec.encode_body(largest.values[0]))


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xc1",
        b"\x92\x01",
        msgpack.packb({"t": "hello"}) + b"\x00",
        msgpack.packb(msgpack.ExtType(1, b"x")),
        b"\x81\x01\x02",
        b"\xa2\xff\xfe",
        b"\x81\xc4\x01t\xa5flows",  # a bin "t" key
        b"\x82\xa1t\xa5flows\xc4\x05opens\x90",  # a bin key next to the str ones
        msgpack.packb({"t": "flows", "opens": [{b"id": 1, "cls": "kv", "opened_at": 1.0}]}),
        msgpack.packb({"t": "flows", "progress": [{b"id": 1, b"sent": 2}]}),
        msgpack.packb({"t": "flows", "closes": [{"id": 1, "sent": 2, b"closed_at": 1.0}]}),
        msgpack.packb({"t": "hello", "version": 2, "node": "n", b"node": "m"}),
        msgpack.packb({"t": "hello", "version": 3, "node": "n", "nonce": b"x" * 32}),
        msgpack.packb({"t": "hello", "version": 3, "node": "n", "nonce": None}),
        msgpack.packb({"t": "hello", "version": 3, "node": "n", "nonce": bytearray(32)}),
        msgpack.packb({**codec_tests.WELCOME, "mac": b"m" * 32}),
        msgpack.packb({**codec_tests.WELCOME, "mac": "m" * 32}),
        msgpack.packb({"t": "heartbeat", "t_sent": msgpack.ExtType(42, b"\x00")}),
        msgpack.packb([[[[[]]]]] * 3),
    ],
)
def test_malformed_and_bin_keyed_frames_decode_alike(body: bytes) -> None:
    _same_decoding(body)


@settings(max_examples=300)
@given(st.binary(max_size=256))
def test_random_bytes_decode_alike(body: bytes) -> None:
    _same_decoding(body)


_KINDS = ["flows", "resync", "heartbeat", "hello", "challenge", "auth", "welcome", "error",
          "levels", "nic_load", "job_progress", "x"]  # fmt: skip
_KEYS = st.sampled_from(
    ["t", "id", "sent", "closed_at", "opened_at", "cls", "links", "opens", "progress",
     "progress_ids", "progress_sent", "closes", "t_sent", "epoch", "node", "version",
     "updates", "entries", "link", "load", "bandwidth", "level", "rate", "nonce", "mac",
     "policy_toml", "x"]
) | st.binary(max_size=3) | st.text(max_size=3)  # fmt: skip
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.sampled_from([0, 1, 255, 256, 2**63, 2**64 - 1, -0.0, math.inf, "kv", "eth0", ""])
    | st.text(max_size=6)
    | st.binary(max_size=6)
)
_hostile = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_KEYS, inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=400)
@given(st.sampled_from(_KINDS), st.dictionaries(_KEYS, _hostile, max_size=5))
def test_hostile_maps_decode_alike(kind: str, fields: dict[Any, Any]) -> None:
    _same_map_decoding({"t": kind, **fields})


def _with_bin_key(data: dict[str, Any], index: int) -> dict[Any, Any]:
    """``data`` with its ``index``-th key (by sorted order, ``"t"`` included) sent as bin."""
    keys = sorted(data)
    key = keys[index % len(keys)]
    return {(k.encode() if k == key else k): v for k, v in data.items()}


_hot_maps = st.one_of(
    codec_tests._flows_maps.map(lambda m: {"t": "flows", **m}),
    codec_tests._resync_maps.map(lambda m: {"t": "resync", **m}),
    codec_tests._heartbeat_maps.map(lambda m: {"t": "heartbeat", **m}),
)


@settings(max_examples=600)
@given(_hot_maps, st.none() | st.integers(0, 10))
def test_hot_frames_decode_alike(data: dict[str, Any], bin_key: int | None) -> None:
    """The strategies that reach each check of the fast paths, now and then with one key
    of the frame sent as bin (msgpack's strict_map_key lets str and bin keys through)."""
    _same_map_decoding(data if bin_key is None else _with_bin_key(data, bin_key))


@given(messages, st.sampled_from([1, 2]))
def test_messages_encode_alike(message: Message, version: int) -> None:
    body = _codec.encode_body(message, version)
    assert body == CODEC.encode_body(message, version)
    _same_decoding(body)


_header_sizes = st.sampled_from([0, 1, 5, 4096, 4097, 2**20, 2**20 + 1, 2**32 - 1])


@given(
    st.lists(st.tuples(_header_sizes | st.integers(0, 64), st.binary(max_size=64)), max_size=6),
    st.integers(1, 40),
    st.sampled_from([1, 16, 4096, 2**20]),
)
def test_framing_cuts_any_stream_alike(
    parts: list[tuple[int, bytes]], chunk: int, limit: int
) -> None:
    """Headers of any size (empty, at and past the limit) with bodies of any length, fed
    in chunks: the same bodies, then the same error or the same bytes still buffered."""
    stream = b"".join(size.to_bytes(4, "big") + body for size, body in parts)
    results = []
    for module in (_framing, FRAMING):
        buffer = module.ReceiveBuffer(limit)
        seen: list[object] = []
        for start in range(0, len(stream), chunk):
            buffer.feed(memoryview(stream)[start : start + chunk])
            outcome = _outcome(buffer.next_body)
            while outcome[0] == "ok" and outcome[1] != "None":
                seen.append(outcome)
                outcome = _outcome(buffer.next_body)
            if outcome[0] == "error":
                seen.append(outcome)
                break
        results.append((seen, len(buffer), buffer.max_frame_size))
    assert results[0] == results[1]


@pytest.mark.parametrize("size", [0, 1, 9, 10, 11])
def test_frame_refuses_alike(size: int) -> None:
    body = b"x" * size
    assert _outcome(_framing.frame, body, 10) == _outcome(FRAMING.frame, body, 10)
