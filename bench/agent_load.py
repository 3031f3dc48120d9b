"""Agent load: table scan cost, a live agent's CPU and memory, and the SDK's open round trip.

    .venv/bin/python bench/agent_load.py [--slots 1000] [--seconds 5] [--opens 2000]

Part 1 (in process) times one agent scan (``FlowTable.slots()`` + ``FlowRegistry.observe``) of a
table with N ACTIVE slots whose byte counters all moved since the previous scan, next to the
baseline of merely copying the table out of shared memory and unpacking every slot with one
``struct.iter_unpack`` (the least any Python reader must do). Part 2 starts a real
``flowsched agent`` process (no coordinator: its local policy runs), claims N slots, keeps
adding bytes to all of them for ``--seconds``, and reads the agent's CPU time and resident
memory from /proc. Goal from the issue: an agent under 100 MiB. Part 3 times ``--opens``
``client.open_flow`` calls (each closed at once) against a real agent (no coordinator: its
local policy decides, as a connected agent does since it answers opens at once), next to the
baseline of one framed request and answer between two processes over a unix socket, encoded
and decoded with the same SDK codec, on a blocking socket and an asyncio server on uvloop
(the least any agent's open could cost). An open blocks its caller until the answer comes,
so its time is the transfer's start-up delay (docs/results.md: what a delay costs at
pd-serving's time scale). Part 4 (root, ``unshare``) starts ``--namespace-procs`` processes
in a pid namespace of their own, as a job pod without hostPID, and times the /proc scan that
places a new slot owner of such a namespace (:mod:`flowsched.shm.pidns`) and the check of
an owner already placed, next to the baseline of reading every process's status file once:
as root (which reads the processes' namespace links) and again with the agent DaemonSet's
credentials (uid 0, gid 10001, NET_ADMIN alone, via ``setpriv``: links refused, owners
placed by pid and start tick, which reads the stat files of the processes sharing the owner's
pid in their namespaces when it places one).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

from flowsched.agent.flows import FlowRegistry
from flowsched.protocol import sdk
from flowsched.shm import layout
from flowsched.shm.table import EmulatedPluginSlot, FlowTable, monotonic_ns
from flowsched.testbed.procstat import memory_mib, running_cpu_seconds


def scan_cost(num_active: int, rounds: int) -> tuple[float, float, float]:
    """Median seconds per agent scan, per progress batch, and per baseline read."""
    with tempfile.TemporaryDirectory() as tmp:
        table, _ = FlowTable.create_or_attach(f"{tmp}/table", num_slots=layout.DEFAULT_NUM_SLOTS)
        slots = [EmulatedPluginSlot(table, class_id=i % 6) for i in range(num_active)]
        registry = FlowRegistry(node="bench", links=("bench/eth0",), id_prefix=1)
        registry.observe_counts(table.busy_slots(), table.slot, time.time(), monotonic_ns())
        registry.take_batch()
        scans, batches, base = [], [], []
        slot_struct = layout.SLOT_STRUCT
        for _ in range(rounds):
            for s in slots:
                s.send(4096)
            t0 = time.perf_counter()
            registry.observe_counts(table.busy_slots(), table.slot, time.time(), monotonic_ns())
            t1 = time.perf_counter()
            registry.take_batch()
            t2 = time.perf_counter()
            raw = bytes(table._mm[layout.HEADER_SIZE :])
            sum(1 for rec in slot_struct.iter_unpack(raw) if rec[0] == layout.SLOT_ACTIVE)
            t3 = time.perf_counter()
            scans.append(t1 - t0)
            batches.append(t2 - t1)
            base.append(t3 - t2)
        del slots
        table.close()
    return statistics.median(scans), statistics.median(batches), statistics.median(base)


@contextlib.contextmanager
def agent_process(tmp: str) -> Iterator[subprocess.Popen[str]]:
    """A real ``flowsched agent`` (table and socket in ``tmp``), once it printed its ready line."""
    cmd = [sys.executable, "-m", "flowsched", "agent", "--node", "bench", "--table",
           f"{tmp}/table", "--socket", f"{tmp}/agent.sock", "--metrics-port", "-1",
           "--interface", "lo", "--log-level", "WARNING"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        proc.stdout.readline()  # ready line
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def live_agent(num_active: int, seconds: float) -> tuple[float, float, float]:
    """(idle CPU %, loaded CPU %, RSS MiB) of a real agent process."""
    with tempfile.TemporaryDirectory() as tmp, agent_process(tmp) as proc:
        time.sleep(1.0)
        c0 = running_cpu_seconds(proc.pid)
        time.sleep(seconds / 2)
        idle = (running_cpu_seconds(proc.pid) - c0) / (seconds / 2) * 100
        table = FlowTable.open(f"{tmp}/table", writable=True)
        slots = [EmulatedPluginSlot(table, class_id=i % 6) for i in range(num_active)]
        c1, t1 = running_cpu_seconds(proc.pid), time.monotonic()
        while time.monotonic() - t1 < seconds:
            for s in slots:
                s.send(65536)
            time.sleep(0.01)
        loaded = (running_cpu_seconds(proc.pid) - c1) / (time.monotonic() - t1) * 100
        rss = memory_mib(proc.pid)[0]
        for s in slots:
            s.close()
        del slots
        table.close()
    return idle, loaded, rss


#: the baseline's server: answers every framed SDK ``open`` with an ``opened`` (uvloop if there)
_BARE_SERVER = """
import asyncio, sys
from flowsched.protocol import sdk

async def serve(reader, writer):
    decoder = sdk.SdkDecoder("agent")
    while data := await reader.read(65536):
        decoder.feed(data)
        while (message := decoder.next_message()) is not None:
            writer.write(sdk.encode(sdk.Opened(message.ref, 1, 6, 8, 0)))

async def main():
    server = await asyncio.start_unix_server(serve, path=sys.argv[1])
    print("ready", flush=True)
    async with server:
        await server.serve_forever()

try:
    import uvloop
    uvloop.run(main())
except ImportError:
    asyncio.run(main())
"""


def _quantiles(seconds: list[float]) -> tuple[float, float]:
    """(median, p99) of ``seconds``."""
    ordered = sorted(seconds)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def sdk_open_round_trip(opens: int) -> tuple[tuple[float, float], tuple[float, float], int]:
    """((median, p99) s of ``client.open_flow`` against a real agent, the same of the bare
    framed round trip, the level the agent answered)."""
    from flowsched import client  # its connection is per process: made once, kept

    with tempfile.TemporaryDirectory() as tmp, agent_process(tmp):
        socket_path = f"{tmp}/agent.sock"
        times, level = [], -1
        for _ in range(opens):
            t0 = time.perf_counter()
            handle = client.open_flow(
                "kv", bytes=1 << 20, deadline=time.time() + 1.0, socket_path=socket_path
            )
            times.append(time.perf_counter() - t0)
            if not handle.connected:
                raise RuntimeError("the SDK did not reach the agent")
            level = handle.level
            handle.close()
        client.connection(socket_path).close()
        ours = _quantiles(times)
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/bare.sock"
        server = subprocess.Popen(
            [sys.executable, "-c", _BARE_SERVER, path], stdout=subprocess.PIPE, text=True
        )
        try:
            assert server.stdout is not None
            server.stdout.readline()
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(path)
                sock.settimeout(5.0)
                decoder = sdk.SdkDecoder("client")
                times = []
                for ref in range(opens):
                    t0 = time.perf_counter()
                    sock.sendall(sdk.encode(sdk.Open(ref, "kv", 1 << 20, time.time() + 1.0)))
                    while (answer := decoder.next_message()) is None:
                        decoder.feed(sock.recv(65536))
                    times.append(time.perf_counter() - t0)
                    assert isinstance(answer, sdk.Opened) and answer.ref == ref
        finally:
            server.terminate()
            server.wait(timeout=10)
    return ours, _quantiles(times), level


def placement_timings(rounds: int, owner: tuple[int, int, int] | None = None) -> list[float]:
    """[s per /proc scan, s per check of a placed owner, s per baseline status read of every
    process] as this process sees /proc. ``owner``: (namespace, pid there, start tick) of the
    owner to check, else the first the scan placed by its namespace link."""
    from flowsched.shm.pidns import PidNamespaces, nspids

    spaces = PidNamespaces()
    scans, base = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        spaces._scan()
        scans.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for name in os.listdir("/proc"):
            if name.isdigit():
                with contextlib.suppress(OSError), open(f"/proc/{name}/status", "rb") as f:
                    nspids(f.read())
        base.append(time.perf_counter() - t0)
    if owner is None:
        (ns, inner), here = next(iter(spaces._found.items()))
        owner = (ns, inner, spaces.start_of(here))
    assert spaces.local_pid(owner[0], owner[1], 1, owner[2]) > 0, "the owner was not placed"
    t0 = time.perf_counter()
    for _ in range(1000):
        spaces.local_pid(owner[0], owner[1], 1, owner[2])
    check = (time.perf_counter() - t0) / 1000
    return [statistics.median(scans), check, statistics.median(base)]


Placements = tuple[list[float], list[float] | None]


def namespace_placement(procs: int, rounds: int = 5) -> Placements | None:
    """Placement timings (:func:`placement_timings`) with ``procs`` processes in a pid namespace
    of their own, by this process (root: it reads their namespace links) and by one with the
    DaemonSet's credentials (uid 0, gid 10001, NET_ADMIN alone: it places them by start; None
    without setpriv); None without unshare."""
    script = f"for i in $(seq {procs}); do sleep 600 & done; echo ready; wait"
    cmd = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "sh", "-c", script]
    try:
        job = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    except OSError:
        return None
    try:
        assert job.stdout is not None
        if job.stdout.readline().strip() != "ready":
            return None
        from flowsched.shm.pidns import PidNamespaces

        with_links = placement_timings(rounds)
        spaces = PidNamespaces()
        spaces._scan()
        (ns, inner), here = next(iter(spaces._found.items()))
        if shutil.which("setpriv") is None:
            return with_links, None
        owner = f"{ns},{inner},{spaces.start_of(here)}"
        probe = [
            "setpriv", "--reuid=0", "--regid=10001", "--clear-groups",
            "--bounding-set=-all,+net_admin", "--inh-caps=-all", "--",
            sys.executable, __file__, "--placement-probe", owner, "--rounds", str(rounds),
        ]  # fmt: skip
        done = subprocess.run(probe, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"the probe with the DaemonSet's credentials failed: {done.stderr}")
        return with_links, [float(x) for x in done.stdout.split()]
    finally:
        job.kill()  # --kill-child: the namespace's init dies with it, and every process in it
        job.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slots", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--opens", type=int, default=2000, help="SDK opens timed (part 3)")
    parser.add_argument(
        "--namespace-procs", type=int, default=1000, help="processes in the namespace (part 4)"
    )
    parser.add_argument("--placement-probe", help=argparse.SUPPRESS)  # part 4's second run
    args = parser.parse_args()
    if args.placement_probe:
        ns, inner, start = map(int, args.placement_probe.split(","))
        print(*placement_timings(args.rounds, (ns, inner, start)))
        return
    scan, batch, base = scan_cost(args.slots, args.rounds)
    print(f"{args.slots} active slots, all counters moved: agent scan {scan * 1e3:.2f} ms "
          f"(baseline copy+unpack of the table {base * 1e3:.2f} ms, ratio {scan / base:.1f}x); "
          f"progress batch of {args.slots} flows {batch * 1e3:.2f} ms")  # fmt: skip
    idle, loaded, rss = live_agent(args.slots, args.seconds)
    print(f"live agent (poll 5 ms): idle {idle:.1f}% CPU, {args.slots} busy slots "
          f"{loaded:.1f}% CPU, RSS {rss:.1f} MiB (goal < 100 MiB)")  # fmt: skip
    (median, p99), (bare_median, bare_p99), level = sdk_open_round_trip(args.opens)
    print(f"SDK open (kv flow, answered at level {level}; {args.opens} opens): median "
          f"{median * 1e3:.3f} ms, p99 {p99 * 1e3:.3f} ms; bare framed round trip median "
          f"{bare_median * 1e3:.3f} ms, p99 {bare_p99 * 1e3:.3f} ms; ratio "
          f"{median / bare_median:.1f}x / {p99 / bare_p99:.1f}x")  # fmt: skip
    placed = namespace_placement(args.namespace_procs)
    if placed is None:
        print("pid namespace placement: skipped (needs root and unshare --pid)")
        return
    for who, timings in zip(
        ("root (reads namespace links)", "DaemonSet credentials (places by start)"),
        placed,
        strict=True,
    ):
        if timings is None:
            print(f"pid namespace placement as {who}: skipped (needs setpriv)")
            continue
        scan, check, base = timings
        print(f"pid namespace placement as {who}, {args.namespace_procs} processes in a job's "
              f"namespace: /proc scan {scan * 1e3:.1f} ms (baseline: read every status file "
              f"{base * 1e3:.1f} ms, ratio {scan / base:.2f}x); check of a placed owner "
              f"{check * 1e6:.0f} us")  # fmt: skip


if __name__ == "__main__":
    main()
