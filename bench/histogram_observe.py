"""Cost of one histogram observation: the coordinator's hand-written histogram vs
prometheus_client's, side by side in one run (same buckets, same values).

The coordinator observes once per received frame (decision latency) and once per closed
deadline flow, inside event handling that costs about 3 us per event at saturation, so this
decides which of the two it uses (see flowsched/coordinator/histogram.py).

Usage: ``python bench/histogram_observe.py [--n 1000000] [--repeat 5]``; prints JSON with
the best-of-``repeat`` ns per observation of each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import timeit

from prometheus_client import Histogram as ClientHistogram

from flowsched.coordinator.histogram import Histogram
from flowsched.coordinator.metrics import LATENCY_BUCKETS


def per_observe_ns(observe: object, values: list[float], repeat: int) -> float:
    """Best-of-``repeat`` nanoseconds per call of ``observe`` over ``values``."""
    loop = "for v in values: observe(v)"
    namespace = {"observe": observe, "values": values}
    best = min(timeit.repeat(loop, globals=namespace, number=1, repeat=repeat))
    return best / len(values) * 1e9


def main() -> None:
    """Measure both histograms and print the figures as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1_000_000, help="observations per repeat")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(1)
    values = [rng.lognormvariate(-7.0, 1.5) for _ in range(args.n)]  # ~1 ms median, seconds
    own = Histogram(LATENCY_BUCKETS)
    client = ClientHistogram("bench", "bench", buckets=LATENCY_BUCKETS, registry=None)
    own_ns = per_observe_ns(own.observe, values, args.repeat)
    client_ns = per_observe_ns(client.observe, values, args.repeat)
    print(
        json.dumps(
            {
                "buckets": len(LATENCY_BUCKETS),
                "observations": args.n,
                "flowsched_ns_per_observe": round(own_ns, 1),
                "prometheus_client_ns_per_observe": round(client_ns, 1),
                "ratio": round(client_ns / own_ns, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
