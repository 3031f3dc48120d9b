"""One local user flooding an agent's SDK socket, for the test and the benchmark that check
another user's opens are still answered (docs/security.md, "The SDK socket: limits per user
and per node").

:func:`flooding` forks a root process's child that runs :func:`flood` while a block runs: it
becomes ``nobody`` in a group that may use the socket, opens :data:`FLOOD_CONNECTIONS`
connections and keeps each full of opens with a long job name (refused once the user holds its
4,096 flows), reading and dropping the answers so that it is never dropped for not reading,
until a pipe says stop.
"""

from __future__ import annotations

import contextlib
import grp
import os
import selectors
import signal
import socket
from collections.abc import Iterator

from flowsched.protocol import sdk
from flowsched.testbed.daemons import wait_for

#: the uid and gid the flooding child takes
NOBODY = 65534
#: connections of the flooding user, below its cap of 256
FLOOD_CONNECTIONS = 200
#: what each connection sends, over and over: 1,000 opens with a 200-character job name
FLOOD_FRAMES = b"".join(sdk.encode(sdk.Open(ref, "bulk", job="j" * 200)) for ref in range(1000))


def shareable_group() -> grp.struct_group | None:
    """A group other than root's that the SDK socket can be handed to (``--group``), or None
    when the machine has none of users/nogroup/daemon/staff."""
    for name in ("users", "nogroup", "daemon", "staff"):
        try:
            return grp.getgrnam(name)
        except KeyError:
            continue
    return None


@contextlib.contextmanager
def flooding(path: str, group: int) -> Iterator[int]:
    """Flood the SDK socket ``path`` from a forked child (nobody, in ``group``) while the block
    runs; yields the child's pid. At the block's end the child is told to stop and reaped,
    killed if it has not exited within 10 s."""
    stop_read, stop_write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        os.close(stop_write)  # the parent's closing it is the signal to stop
        flood(path, group, stop_read)
    os.close(stop_read)
    try:
        yield child
    finally:
        os.close(stop_write)
        _reap(child)


def _reap(child: int) -> None:
    """Wait for ``child`` to exit; kill it if it has not within 10 s."""
    with contextlib.suppress(AssertionError):
        wait_for(lambda: os.waitpid(child, os.WNOHANG)[0] == child, 10, "the flood to stop")
        return
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)


def flood(path: str, group: int, stop: int, connections: int = FLOOD_CONNECTIONS) -> None:
    """In a forked child of a root process: as nobody, in ``group``, keep ``connections``
    connections to the SDK socket ``path`` full of opens until ``stop`` (a pipe's read end)
    is readable or closed; then exit the child (status 0, or 1 if it failed)."""
    code = 1
    try:
        os.setgroups([group])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        socks = []
        for _ in range(connections):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            sock.setblocking(False)
            socks.append(sock)
        _keep_sending(socks, stop)
        code = 0
    finally:
        os._exit(code)


def _keep_sending(socks: list[socket.socket], stop: int) -> None:
    frames = memoryview(FLOOD_FRAMES)
    sent = dict.fromkeys(socks, 0)  # where each is in FLOOD_FRAMES: only whole frames go out
    with selectors.DefaultSelector() as selector:
        selector.register(stop, selectors.EVENT_READ)
        for sock in socks:
            selector.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
        while True:
            for key, events in selector.select():
                if key.fd == stop:
                    return
                sock = key.fileobj  # type: ignore[assignment]
                try:
                    if events & selectors.EVENT_READ and not sock.recv(1 << 20):
                        selector.unregister(sock)
                    elif events & selectors.EVENT_WRITE:
                        offset = sent[sock]
                        sent[sock] = (offset + sock.send(frames[offset:])) % len(frames)
                except BlockingIOError:
                    pass
                except OSError:
                    selector.unregister(sock)
