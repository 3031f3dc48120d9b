"""Cost of decoding the coordinator's common frames: ``decode_body`` (inline-checked fast
paths) vs the field-by-field checked path (``_decode_checked`` after the same msgpack
unpack), side by side in one run; with ``--baseline``, also another revision's codec.

The frames are those ``bench/coordinator_load.py`` sends: a churn frame (1 kv open and 1
close), a 10-entry progress report, the load benchmark's batched churn frame (both), and
20 opens (the agents' class mix) in a ``flows`` and in a ``resync`` frame. Each frame is
checked to decode to the same message every way before it is timed.

Usage: ``python bench/codec_decode.py [--number 20000] [--repeat 7] [--baseline FILE]``,
where FILE is a ``_codec.py`` of another revision, e.g. from
``git show REV:flowsched/protocol/_codec.py``. Prints JSON: per frame the best-of-``repeat``
CPU microseconds of the msgpack unpack alone, of ``decode_body``, of the checked path (and
of the baseline's ``decode_body``), the ratios, and the time past the unpack per entry.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import time
import timeit
from collections.abc import Callable
from types import ModuleType
from typing import Any

import msgpack

from flowsched.protocol import _codec, decode_body
from flowsched.testbed.simagent import CLASS_MIX, flow_open


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
    progress = [{"id": i, "sent": 655360} for i in range(10)]
    opens = [
        flow_open("node-1", i, CLASS_MIX[i % len(CLASS_MIX)], now, kv_deadline_s=2.0)
        for i in range(20)
    ]
    bodies = {
        "churn_1open_1close": (2, {"t": "flows", "opens": [kv_open], "progress": [],
                                   "closes": [close]}),
        "progress_10": (10, {"t": "flows", "opens": [], "progress": progress, "closes": []}),
        "batched_churn_10progress_1open_1close": (12, {"t": "flows", "opens": [kv_open],
                                                       "progress": progress, "closes": [close]}),
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
    if baseline is not None:
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
    if baseline is not None:
        figures["baseline_decode_body_us"] = round(us["baseline"], 2)
        figures["baseline_over_decode_body"] = round(us["baseline"] / us["fast"], 2)
        past = (us["baseline"] - us["unpack"]) / entries
        figures["baseline_past_unpack_us_per_entry"] = round(past, 3)
    return figures


def main() -> None:
    """Time every common frame each way and print the figures as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=20_000, help="calls per timing")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--baseline", help="a _codec.py of another revision, timed alongside")
    args = parser.parse_args()
    baseline = load_baseline(args.baseline) if args.baseline else None
    results = {
        name: measure_frame(entries, body, baseline, args.number, args.repeat)
        for name, (entries, body) in common_frames().items()
    }
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
