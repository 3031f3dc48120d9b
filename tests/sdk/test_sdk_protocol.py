"""The SDK wire format: round trips and validation errors that name the field."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flowsched.agent.flows import JobTable
from flowsched.model import FlowClass
from flowsched.protocol import FlowOpen, JobProgress, Resync, decode_body, encode_body, sdk

ROUND_TRIP = [
    pytest.param(sdk.Open(1, "kv", 10, 1.8e9, None, "job", "req-1", 3), "agent", id="open-full"),
    pytest.param(sdk.Open(7, "tp"), "agent", id="open-minimal"),
    pytest.param(sdk.Progress(2**64 - 1, 5), "agent", id="progress"),
    pytest.param(sdk.Close(9, 0), "agent", id="close"),
    pytest.param(sdk.JobProgress("j", 0, 4), "agent", id="job-progress"),
    pytest.param(sdk.Opened(1, 99, 3, 46, 6, 5), "client", id="opened"),
    pytest.param(sdk.Level(99, 0, 46, 6), "client", id="level"),
    pytest.param(sdk.Level(99, 0, 46, 6, 1.7e9, 123_456_789), "client", id="level-decided"),
    pytest.param(sdk.Open(3, "kv", dst_node="h2"), "agent", id="open-dst-node"),
    pytest.param(sdk.Error("bad", "why", 4), "client", id="error"),
    pytest.param(sdk.ListFlows(), "agent", id="list-all"),
    pytest.param(sdk.ListFlows(2**64 - 1), "agent", id="list-after"),
    pytest.param(
        sdk.FlowList(
            (
                sdk.FlowInfo(
                    1,
                    "kv",
                    42,
                    1.7e9,
                    10,
                    0,
                    2,
                    100,
                    1.7e9 + 1,
                    3,
                    "j",
                    "r",
                    1,
                    "h2",
                    ((0, 1), (5, 2**64 - 1)),
                ),
                sdk.FlowInfo(2, "bulk", 0, 0.0, 0),
            ),
            more=True,
            everyone=False,
        ),
        "client",
        id="flows",
    ),
    pytest.param(sdk.FlowList((), more=False, everyone=True), "client", id="flows-empty"),
]


@pytest.mark.parametrize(("message", "side"), ROUND_TRIP)
def test_round_trip(message: sdk.SdkMessage, side: str) -> None:
    decoder = sdk.SdkDecoder(side)
    data = sdk.encode(message) * 2
    for i in range(len(data)):  # byte by byte: framing must reassemble
        decoder.feed(data[i : i + 1])
    assert decoder.next_message() == message
    assert decoder.next_message() == message
    assert decoder.next_message() is None


def _frame(body: dict[str, object]) -> bytes:
    raw = msgpack.packb(body)
    return len(raw).to_bytes(4, "big") + raw


BAD = [
    pytest.param({"t": "open", "ref": 1, "cls": "nope"}, "open.cls", id="unknown-class"),
    pytest.param({"t": "open", "ref": -1, "cls": "kv"}, "open.ref", id="negative-ref"),
    pytest.param({"t": "open", "cls": "kv"}, "open.ref: missing", id="missing-ref"),
    pytest.param(
        {"t": "open", "ref": 1, "cls": "kv", "deadline": float("nan")},
        "open.deadline",
        id="nan-deadline",
    ),
    pytest.param(
        {"t": "open", "ref": 1, "cls": "kv", "deadline": 20.0},
        "open.deadline: expected wall-clock seconds since the epoch",
        id="relative-deadline",
    ),
    pytest.param({"t": "open", "ref": 1, "cls": "kv", "size": "big"}, "open.size", id="str-size"),
    pytest.param(
        {"t": "open", "ref": 1, "cls": "kv", "pid": 3}, "unknown field 'pid'", id="unknown-field"
    ),
    pytest.param({"t": "progress", "id": 1, "sent": -5}, "progress.sent", id="negative-sent"),
    pytest.param({"t": "job_progress", "job": "", "step": 1}, "job_progress.job", id="empty-job"),
    pytest.param({"t": "opened", "ref": 1}, "unexpected message type", id="agent-only-type"),
    pytest.param({"t": "exec", "code": "x"}, "unknown or unexpected", id="unknown-type"),
    pytest.param({"x": 1}, "string 't'", id="no-type"),
    pytest.param(
        {"t": "open", "ref": 1, "cls": "kv", "dst_node": "h\n2"}, "open.dst_node", id="bad-node"
    ),
    pytest.param(
        {"t": "open", "ref": 1, "cls": "kv", "dst_node": "x" * 200}, "open.dst_node", id="long-node"
    ),
    # refused here because the coordinator would refuse them from the agent (see _RULES)
    pytest.param({"t": "open", "ref": 1, "cls": "kv", "job": "a\nb"}, "open.job", id="job-ctrl"),
    pytest.param(
        {"t": "open", "ref": 1, "cls": "kv", "request": "r\x00"}, "open.request", id="request-nul"
    ),
    pytest.param(
        {"t": "open", "ref": 1, "cls": "experience", "consumer_index": -1},
        "open.consumer_index",
        id="negative-consumer",
    ),
    pytest.param({"t": "job_progress", "job": "j", "step": -1}, "job_progress.step", id="neg-step"),
    pytest.param({"t": "job_progress", "job": "j\tk", "step": 1}, "job_progress.job", id="job-tab"),
]


@pytest.mark.parametrize(("body", "message"), BAD)
def test_bad_frames_name_the_field(body: dict[str, object], message: str) -> None:
    decoder = sdk.SdkDecoder("agent")
    decoder.feed(_frame(body))
    with pytest.raises(sdk.SdkProtocolError, match=message):
        decoder.next_message()


def _listing(*flows: dict[str, object]) -> dict[str, object]:
    return {"t": "flows", "flows": list(flows), "more": False, "everyone": True}


_FLOW = {"id": 1, "cls": "kv", "pid": 7, "opened_at": 1.0, "sent": 0}

BAD_FROM_AGENT = [
    pytest.param(
        {"t": "flows", "flows": {}, "more": False, "everyone": True},
        r"flows\.flows: expected a list",
        id="flows-not-a-list",
    ),
    pytest.param(_listing(7), r"flows\.flows: expected a map", id="flow-not-a-map"),
    pytest.param({"t": "flows", "flows": []}, r"flows\.more: missing", id="no-more"),
    pytest.param(_listing({"id": 1}), r"flows\.flows\[\]\.cls: missing", id="flow-no-cls"),
    pytest.param(_listing({**_FLOW, "pid": -1}), r"flows\.flows\[\]\.pid", id="negative-pid"),
    pytest.param(_listing({**_FLOW, "cls": "nope"}), r"flows\.flows\[\]\.cls", id="bad-class"),
    pytest.param(_listing({**_FLOW, "job": "a\nb"}), r"flows\.flows\[\]\.job", id="job-ctrl"),
    pytest.param(
        _listing({**_FLOW, "slots": [[i, 1] for i in range(sdk.MAX_LISTED_SLOTS + 1)]}),
        r"flows\.flows\[\]\.slots: expected at most",
        id="too-many-slots",
    ),
    pytest.param(_listing({**_FLOW, "slots": [[-1, 1]]}), r"\.slots", id="negative-slot"),
    pytest.param(_listing({**_FLOW, "slots": [[1, -1]]}), r"\.slots", id="negative-claim"),
    pytest.param(_listing({**_FLOW, "slots": [3]}), r"\.slots", id="slot-not-a-pair"),
    pytest.param(_listing({**_FLOW, "slots": [[1, 2, 3]]}), r"\.slots", id="slot-triple"),
    pytest.param(_listing({**_FLOW, "slots": 3}), r"\.slots", id="slots-not-a-list"),
    pytest.param(_listing({**_FLOW, "exe": "x"}), "unknown field 'exe'", id="unknown-flow-field"),
    pytest.param({"t": "list", "after": 1}, "unexpected message type", id="client-only-type"),
]


@pytest.mark.parametrize(("body", "message"), BAD_FROM_AGENT)
def test_bad_agent_frames_name_the_field(body: dict[str, object], message: str) -> None:
    decoder = sdk.SdkDecoder("client")
    decoder.feed(_frame(body))
    with pytest.raises(sdk.SdkProtocolError, match=message):
        decoder.next_message()


def test_a_listing_after_a_negative_id_is_refused() -> None:
    decoder = sdk.SdkDecoder("agent")
    decoder.feed(_frame({"t": "list", "after": -1}))
    with pytest.raises(sdk.SdkProtocolError, match=r"list\.after"):
        decoder.next_message()


def test_encoded_size_is_what_a_flow_adds_to_a_frame() -> None:
    infos = [
        sdk.FlowInfo(i, "kv", 1, 2.0, 3, job="j" * 50, slots=((1, 9), (2, 9))) for i in range(5)
    ]
    empty = len(sdk.encode(sdk.FlowList((), more=False, everyone=True)))
    full = len(sdk.encode(sdk.FlowList(tuple(infos), more=False, everyone=True)))
    # msgpack's array header grows by 0 bytes up to 15 items
    assert full - empty == sum(sdk.encoded_size(info) for info in infos)


def test_oversized_frame_is_rejected_from_its_header() -> None:
    decoder = sdk.SdkDecoder("agent")
    decoder.feed((sdk.MAX_SDK_FRAME + 1).to_bytes(4, "big"))
    with pytest.raises(sdk.SdkProtocolError, match=r"exceeds|announces"):
        decoder.next_message()


def test_non_map_and_extension_types_are_rejected() -> None:
    for raw in (msgpack.packb([1, 2]), msgpack.packb(msgpack.ExtType(1, b"x"))):
        decoder = sdk.SdkDecoder("agent")
        decoder.feed(len(raw).to_bytes(4, "big") + raw)
        with pytest.raises(sdk.SdkProtocolError):
            decoder.next_message()


@given(st.binary(max_size=300))
def test_random_bytes_never_crash(data: bytes) -> None:
    decoder = sdk.SdkDecoder("agent")
    decoder.feed(data)
    try:
        while decoder.next_message() is not None:
            pass
    except sdk.SdkProtocolError:
        pass


def _scoped(name: str | None) -> str | None:
    """As the agent forwards an SDK name: scoped to the client's uid (the longest uid here)."""
    return None if name is None else JobTable.scoped(2**32 - 1, name)


_names = st.one_of(st.none(), st.text(max_size=300), st.sampled_from(["j", "h2", " h2", "a\x7f"]))
_ints = st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1))


@given(
    job=_names,
    request=_names,
    dst_node=_names,
    consumer_index=_ints,
    step=st.integers(-(2**63), 2**64 - 1),
    layer=_ints,
)
def test_what_the_agent_accepts_the_coordinator_accepts(
    job: str | None,
    request: str | None,
    dst_node: str | None,
    consumer_index: int | None,
    step: int,
    layer: int | None,
) -> None:
    """Every SDK open / job_progress the agent decodes, forwarded as the agent forwards it,
    decodes at the coordinator: otherwise one client's value closes the agent's connection,
    and the resync after each reconnect carries it again (a reconnect loop for the node)."""
    bodies = [
        {"t": "open", "ref": 1, "cls": "experience", "job": job, "request": request},
        {"t": "open", "ref": 2, "cls": "kv", "consumer_index": consumer_index},
        {"t": "open", "ref": 3, "cls": "kv", "dst_node": dst_node},
        {"t": "job_progress", "job": job, "step": step, "layer": layer},
    ]
    for body in bodies:
        decoder = sdk.SdkDecoder("agent")
        decoder.feed(_frame({k: v for k, v in body.items() if v is not None}))
        try:
            message = decoder.next_message()
        except sdk.SdkProtocolError:
            continue
        if isinstance(message, sdk.Open):
            links = () if message.dst_node is None else (f"{message.dst_node}:rx",)
            forwarded: Resync | JobProgress = Resync(
                (
                    FlowOpen(
                        1,
                        FlowClass.parse(message.cls),
                        0.0,
                        job=_scoped(message.job),
                        consumer_index=message.consumer_index,
                        request=_scoped(message.request),
                        links=links,
                    ),
                )
            )
        else:
            assert isinstance(message, sdk.JobProgress)
            forwarded = JobProgress(_scoped(message.job) or "", message.step, message.layer)
        assert decode_body(encode_body(forwarded)) == forwarded


# -- bounds on what the coordinator learns from (audit H4) ------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"t": "open", "ref": 1, "cls": "kv", "consumer_index": 2**63 - 1}, "consumer_index"),
        (
            {"t": "open", "ref": 1, "cls": "kv", "consumer_index": sdk.MAX_LAYER + 1},
            "consumer_index",
        ),
        (
            {"t": "open", "ref": 1, "cls": "kv_reuse", "consumer_index": sdk.MAX_LAYER + 1},
            "consumer_index",
        ),
        (
            {"t": "open", "ref": 1, "cls": "experience", "consumer_index": sdk.MAX_STEP + 1},
            "consumer_index",
        ),
        ({"t": "job_progress", "job": "j", "step": sdk.MAX_STEP + 1}, "step"),
        ({"t": "job_progress", "job": "j", "step": 1, "layer": sdk.MAX_LAYER + 1}, "layer"),
        ({"t": "open", "ref": 1, "cls": "kv", "request": "r" * (sdk.MAX_REQUEST + 1)}, "request"),
    ],
    ids=["kv-i64", "kv-layer", "kv-reuse-layer", "experience-step", "step", "layer", "request"],
)
def test_absurd_layers_steps_and_unscopable_names_are_refused(
    body: dict[str, object], field: str
) -> None:
    # one kv open at consumer_index 2**63-1 used to set rmlq's model depth for every request
    with pytest.raises(sdk.SdkProtocolError, match=rf"\.{field}: ") as refused:
        sdk.decode_body(msgpack.packb(body), sdk.CLIENT_MESSAGES)
    assert refused.value.field == field


def test_a_step_beyond_the_layer_bound_is_fine_where_the_consumer_is_a_step() -> None:
    body = {"t": "open", "ref": 1, "cls": "experience", "consumer_index": sdk.MAX_LAYER + 1}
    message = sdk.decode_body(msgpack.packb(body), sdk.CLIENT_MESSAGES)
    assert isinstance(message, sdk.Open) and message.consumer_index == sdk.MAX_LAYER + 1
    layer = {"t": "open", "ref": 1, "cls": "kv", "consumer_index": sdk.MAX_LAYER}
    assert sdk.decode_body(msgpack.packb(layer), sdk.CLIENT_MESSAGES) is not None
