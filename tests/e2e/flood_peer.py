"""TEST SUPPORT: unauthenticated peers flooding a coordinator (run as a separate process).

The flood tests run it with a lower CPU priority (nice 10): on a shared two-core test machine
the flooding process would otherwise take the CPU the coordinator and the agent need, which a
remote attacker cannot do. Prints one JSON line with what it did.

Modes:
  half-sent  N connections, each announcing a 1 MiB first frame and sending 64 KiB of it;
             waits until the coordinator has closed every one.
  flows      WORKERS connections at a time, each sending a complete, well-formed 1 MiB
             ``flows`` frame, for SECONDS; counts the frames sent.
  drip       N connections, one byte of a hello on each every 0.25 s for 1 s; then prints
             ``holding``, waits for a line on stdin, and waits until every one was closed.
  tls-hello  N connections to a TLS listener, each sending a TLS client hello and nothing
             more (a stalled handshake); waits until the coordinator has closed every one.
  tls-half-sent
             half-sent, over N completed TLS handshakes (no client certificate).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import ssl
import sys
import time

from flowsched.model import FlowClass
from flowsched.protocol import (
    Connection,
    FlowOpen,
    Flows,
    Role,
    encode_body,
    frame,
)

MIB = 1 << 20


async def until_closed(reader: asyncio.StreamReader, timeout: float) -> bool:
    """True when the peer closed the connection within ``timeout``."""
    try:
        async with asyncio.timeout(timeout):
            while await reader.read(1 << 16):
                pass
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


def flows_frame() -> bytes:
    """A well-formed ``flows`` frame of just under 1 MiB."""

    def body(count: int) -> bytes:
        opens = (FlowOpen(10**6 + i, FlowClass.BULK, 1.0, job="j" * 200) for i in range(count))
        return encode_body(Flows(opens=tuple(opens)))

    small, large = len(body(100)), len(body(200))
    count = 100 + (MIB - 16 * 1024 - small) * 100 // (large - small)
    return frame(body(count))


async def half_sent(host: str, port: int, count: int) -> dict[str, float]:
    opened = [await asyncio.open_connection(host, port) for _ in range(count)]
    for _, writer in opened:
        writer.write(MIB.to_bytes(4, "big") + bytes(64 * 1024))
    closed = await asyncio.gather(*(until_closed(r, 15.0) for r, _ in opened))
    for _, writer in opened:
        writer.close()
    return {"connections": count, "closed": sum(closed)}


async def flows(host: str, port: int, workers: int, seconds: float) -> dict[str, float]:
    data, sent = flows_frame(), 0
    end = time.monotonic() + seconds

    async def worker() -> None:
        nonlocal sent
        while time.monotonic() < end:
            reader, writer = await asyncio.open_connection(host, port)
            with contextlib.suppress(ConnectionError):
                writer.write(data)
            sent += 1
            await until_closed(reader, 5.0)
            writer.close()

    await asyncio.gather(*(worker() for _ in range(workers)))
    return {"frames": sent, "frame_bytes": len(data), "seconds": seconds}


async def drip(host: str, port: int, count: int, wait: float) -> dict[str, float]:
    hello = Connection(Role.AGENT, token=b"x" * 16).hello("drip")
    opened = [await asyncio.open_connection(host, port) for _ in range(count)]
    for step in range(4):  # a byte of a hello every 0.25 s: never a whole handshake
        for _, writer in opened:
            with contextlib.suppress(ConnectionError, RuntimeError):
                writer.write(hello[step : step + 1])
        await asyncio.sleep(0.25)
    print("holding", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    closed = await asyncio.gather(*(until_closed(r, wait) for r, _ in opened))
    for _, writer in opened:
        writer.close()
    return {"connections": count, "closed": sum(closed)}


def client_hello() -> bytes:
    """The first flight of a TLS client: its hello, as a real client sends it."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    session = context.wrap_bio(incoming, outgoing)
    with contextlib.suppress(ssl.SSLWantReadError):
        session.do_handshake()
    return outgoing.read()


async def tls_hello(host: str, port: int, count: int) -> dict[str, float]:
    hello = client_hello()
    opened = [await asyncio.open_connection(host, port) for _ in range(count)]
    for _, writer in opened:
        writer.write(hello)
    closed = await asyncio.gather(*(until_closed(r, 30.0) for r, _ in opened))
    for _, writer in opened:
        writer.close()
    return {"connections": count, "closed": sum(closed)}


async def tls_half_sent(host: str, port: int, count: int) -> dict[str, float]:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    opened = []
    for _ in range(count):
        with contextlib.suppress(ConnectionError, ssl.SSLError):  # evicted while connecting
            opened.append(await asyncio.open_connection(host, port, ssl=context))
    for _, writer in opened:
        writer.write(MIB.to_bytes(4, "big") + bytes(64 * 1024))
    closed = await asyncio.gather(*(until_closed(r, 30.0) for r, _ in opened))
    for _, writer in opened:
        writer.close()
    return {"connections": count, "opened": len(opened), "closed": sum(closed)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "mode", choices=("half-sent", "flows", "drip", "tls-hello", "tls-half-sent")
    )
    parser.add_argument("--to", required=True, help="HOST:PORT")
    parser.add_argument("--count", type=int, default=1500)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--wait", type=float, default=10.0)
    args = parser.parse_args()
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    host, port = args.to.rsplit(":", 1)
    if args.mode == "half-sent":
        result = asyncio.run(half_sent(host, int(port), args.count))
    elif args.mode == "tls-hello":
        result = asyncio.run(tls_hello(host, int(port), args.count))
    elif args.mode == "tls-half-sent":
        result = asyncio.run(tls_half_sent(host, int(port), args.count))
    elif args.mode == "flows":
        result = asyncio.run(flows(host, int(port), args.workers, args.seconds))
    else:
        result = asyncio.run(drip(host, int(port), args.count, args.wait))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
