"""One local user flooding an agent's SDK socket, for the test and the benchmark that check
another user's opens are still answered (docs/security.md, "The SDK socket: limits per user
and per node").

:func:`flooding` starts a root process's child that runs :func:`flood` while a block runs: it
becomes ``nobody`` in a group that may use the socket, opens :data:`FLOOD_CONNECTIONS`
connections and keeps each full of opens with a long job name (refused once the user holds its
4,096 flows), reading and dropping the answers so that it is never dropped for not reading,
until a pipe says stop. The child comes from multiprocessing's fork server, not from a fork of
the calling process: that one has threads (an agent's, a daemon's log readers), and a fork copies
the locks they hold, unlocked by nobody in the child (Python 3.12 on warns of it).
"""

from __future__ import annotations

import contextlib
import grp
import multiprocessing
import os
import selectors
import socket
from collections.abc import Iterator
from multiprocessing.connection import Connection

from flowsched.protocol import sdk

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
    """Flood the SDK socket ``path`` from a child process (nobody, in ``group``) while the block
    runs; yields the child's pid. At the block's end the child is told to stop and reaped,
    killed if it has not exited within 10 s."""
    context = multiprocessing.get_context("forkserver")
    stop_read, stop_write = context.Pipe(duplex=False)
    child = context.Process(target=flood, args=(path, group, stop_read), daemon=True)
    child.start()
    stop_read.close()  # the child's copy stays open: this end's closing tells it to stop
    try:
        assert child.pid is not None
        yield child.pid
    finally:
        stop_write.close()
        child.join(10)
        if child.exitcode is None:
            child.kill()
            child.join()


def flood(path: str, group: int, stop: Connection, connections: int = FLOOD_CONNECTIONS) -> None:
    """In a child process running as root: as nobody, in ``group``, keep ``connections``
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


def _keep_sending(socks: list[socket.socket], stop: Connection) -> None:
    frames = memoryview(FLOOD_FRAMES)
    sent = dict.fromkeys(socks, 0)  # where each is in FLOOD_FRAMES: only whole frames go out
    with selectors.DefaultSelector() as selector:
        selector.register(stop, selectors.EVENT_READ)
        for sock in socks:
            selector.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
        while True:
            for key, events in selector.select():
                if key.fileobj is stop:
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
