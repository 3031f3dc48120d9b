"""Cost of decoding the coordinator's common frames: ``decode_body`` (inline-checked fast
paths) vs the field-by-field checked path (``_decode_checked`` after the same msgpack
unpack), side by side in one run; with ``--baseline``, also another revision's codec.

The frames are those ``bench/coordinator_load.py`` sends: a churn frame (1 kv open and 1
close), a 10-entry progress report, the load benchmark's batched churn frame (both), and
20 opens (the agents' class mix) in a ``flows`` and in a ``resync`` frame. The two frames
with progress come in both wire forms: ``{"id", "sent"}`` maps (protocol 1) and the packed
arrays (protocol 2, ``*_packed``); ``packed_vs_maps`` times each pair interleaved, decoding
and then recording the reports in a coordinator's flow table (``ClusterState.progress``).
Each frame is checked to decode to the same message every way before it is timed.

Usage: ``python bench/codec_decode.py [--number 20000] [--repeat 7] [--baseline FILE]``,
where FILE is a ``_codec.py`` of another revision, e.g. from
``git show REV:flowsched/protocol/_codec.py``, or ``source``: the running codec's own source
file as Python, which compares the builds when the codec runs compiled (put
``flowsched.compiled.build_tree``'s folder first on ``PYTHONPATH``; ``"build"`` in the output
says which one ``decode_body`` is). Prints JSON: per frame the best-of-``repeat``
CPU microseconds of the msgpack unpack alone, of ``decode_body``, of the checked path (and
of the baseline's ``decode_body``), the ratios, and the time past the unpack per entry. A
baseline older than the packed form cannot decode the ``*_packed`` frames (and one from
before the ``Flows`` arrays cannot load): those get no baseline figures.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import msgpack

from flowsched import policies
from flowsched.compiled import compiled_modules
from flowsched.coordinator.state import ClusterState
from flowsched.protocol import Flows, LocalProtocolError, _codec, decode_body
from flowsched.testbed.simagent import CLASS_MIX, flow_open, progress_fields


def _unpack(body: bytes) -> Any:
    # the same options as decode_body's
    return msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)


def _checked(body: bytes) -> object:
    return _codec._decode_checked(_unpack(body))


def load_baseline(path: str) -> ModuleType:
    """Another revision's codec module, imported under a name of its own (it shares this
    revision's message classes, so that its messages compare equal)."""
    spec = importlib.util.spec_from_file_location("flowsched.protocol._codec_baseline", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def common_frames() -> dict[str, tuple[int, bytes]]:
    """Frame name -> (entries, msgpack body), shaped like bench/coordinator_load.py's."""
    now = time.time()
    kv_open = flow_open("node-1", 11, "kv", now, kv_deadline_s=2.0)
    close = {"id": 6, "sent": 655360, "closed_at": now}
    ids, sent = list(range(10)), [655360] * 10
    progress = progress_fields(ids, sent, "maps")["progress"]
    packed = progress_fields(ids, sent, "packed")
    opens = [
        flow_open("node-1", i, CLASS_MIX[i % len(CLASS_MIX)], now, kv_deadline_s=2.0)
        for i in range(20)
    ]
    bodies = {
        "churn_1open_1close": (2, {"t": "flows", "opens": [kv_open], "progress": [],
                                   "closes": [close]}),
        "progress_10": (10, {"t": "flows", "opens": [], "progress": progress, "closes": []}),
        "progress_10_packed": (10, {"t": "flows", "opens": [], **packed, "closes": []}),
        "batched_churn_10progress_1open_1close": (12, {"t": "flows", "opens": [kv_open],
                                                       "progress": progress, "closes": [close]}),
        "batched_churn_10progress_1open_1close_packed": (
            12, {"t": "flows", "opens": [kv_open], **packed, "closes": [close]}),
        "opens_20": (20, {"t": "flows", "opens": opens, "progress": [], "closes": []}),
        "resync_20": (20, {"t": "resync", "opens": opens}),
    }  # fmt: skip
    return {name: (n, msgpack.packb(body)) for name, (n, body) in bodies.items()}


def best_us(calls: dict[str, Callable[[], object]], number: int, repeat: int) -> dict[str, float]:
    """Best-of-``repeat`` microseconds of this process's CPU time per call of each, the calls
    interleaved per repeat (so that a noisy neighbour slows them alike)."""
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeat):
        for name, call in calls.items():
            timer = timeit.Timer(call, timer=time.process_time)
            best[name] = min(best[name], timer.timeit(number) / number * 1e6)
    return best


def measure_frame(
    entries: int, body: bytes, baseline: ModuleType | None, number: int, repeat: int
) -> dict[str, float]:
    """The figures of one frame (see the module docstring)."""
    calls: dict[str, Callable[[bytes], object]] = {
        "unpack": _unpack,
        "fast": decode_body,
        "checked": _checked,
    }
    if baseline is not None and _decodes(baseline, body):
        calls["baseline"] = baseline.decode_body
    expected = repr(decode_body(body))
    for decode in calls.values():
        if decode is not _unpack:  # the same message, field types included
            assert repr(decode(body)) == expected, decode
    us = best_us(
        {what: functools.partial(call, body) for what, call in calls.items()}, number, repeat
    )
    figures = {
        "entries": entries,
        "unpack_us": round(us["unpack"], 2),
        "decode_body_us": round(us["fast"], 2),
        "checked_us": round(us["checked"], 2),
        "checked_over_decode_body": round(us["checked"] / us["fast"], 2),
        "decode_body_past_unpack_us_per_entry": round((us["fast"] - us["unpack"]) / entries, 3),
        "checked_past_unpack_us_per_entry": round((us["checked"] - us["unpack"]) / entries, 3),
    }
    if "baseline" in us:
        figures["baseline_decode_body_us"] = round(us["baseline"], 2)
        figures["baseline_over_decode_body"] = round(us["baseline"] / us["fast"], 2)
        past = (us["baseline"] - us["unpack"]) / entries
        figures["baseline_past_unpack_us_per_entry"] = round(past, 3)
    return figures


def _decodes(codec: ModuleType, body: bytes) -> bool:
    try:
        codec.decode_body(body)
    except LocalProtocolError:
        return False
    return True


def recording_state() -> ClusterState:
    """A coordinator's flow table holding the 10 flows the progress frames report (node-1,
    wire ids 0-9), with the default policy (rmlq, which only observes progress)."""
    state = ClusterState(policies.create("rmlq", {}, num_levels=8))
    now = time.time()
    opens = [flow_open("node-1", i, CLASS_MIX[i], now, kv_deadline_s=2.0) for i in range(10)]
    opened = decode_body(msgpack.packb({"t": "flows", "opens": opens}))
    assert isinstance(opened, Flows)
    state.open_flows("node-1", opened.opens, now)
    state.flush(now)
    return state


def packed_vs_maps(
    frames: dict[str, tuple[int, bytes]], number: int, repeat: int
) -> dict[str, dict[str, float]]:
    """Each frame with progress in both forms, timed interleaved: ``decode_body`` alone, and
    decoded then recorded by ``ClusterState.progress`` (what the coordinator does with it)."""
    state = recording_state()

    def record(body: bytes) -> None:
        message = decode_body(body)
        assert isinstance(message, Flows)
        state.progress("node-1", message.progress_ids, message.progress_sent)
        state.progressed.clear()  # as a flush would: the set stays at its usual size

    results = {}
    for name in ("progress_10", "batched_churn_10progress_1open_1close"):
        maps, packed = frames[name][1], frames[f"{name}_packed"][1]
        assert repr(decode_body(maps)) == repr(decode_body(packed)), name
        calls: dict[str, Callable[[], object]] = {
            "maps_decode": functools.partial(decode_body, maps),
            "packed_decode": functools.partial(decode_body, packed),
            "maps_decode_record": functools.partial(record, maps),
            "packed_decode_record": functools.partial(record, packed),
        }
        us = best_us(calls, number, repeat)
        results[name] = {what: round(value, 2) for what, value in us.items()} | {
            "maps_over_packed_decode": round(us["maps_decode"] / us["packed_decode"], 2),
            "maps_over_packed_decode_record": round(
                us["maps_decode_record"] / us["packed_decode_record"], 2
            ),
        }
    return results


def main() -> None:
    """Time every common frame each way and print the figures as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=20_000, help="calls per timing")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument(
        "--baseline",
        help="a _codec.py of another revision, timed alongside; 'source': this codec's source",
    )
    args = parser.parse_args()
    if args.baseline == "source":
        args.baseline = str(Path(str(_codec.__file__)).with_name("_codec.py"))
    baseline = load_baseline(args.baseline) if args.baseline else None
    frames = common_frames()
    results: dict[str, Any] = {
        "build": "compiled" if _codec.__name__ in compiled_modules() else "python",
        "baseline": args.baseline,
    }
    results |= {
        name: measure_frame(entries, body, baseline, args.number, args.repeat)
        for name, (entries, body) in frames.items()
    }
    results["packed_vs_maps"] = packed_vs_maps(frames, args.number, args.repeat)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
