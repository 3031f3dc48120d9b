"""One SDK client connection, read and written by the agent's loop itself.

Not an asyncio transport: a transport reads with a plain ``recv()``, so the kernel drops the
descriptors a client passed (``SCM_RIGHTS``) in the loop's thread, and it closes the socket
there, releasing whatever descriptors still wait in its receive queue. Dropping the last
reference to a descriptor can block for as long as its owner likes (a TCP socket with
``SO_LINGER`` and unsent data), and the loop is the agent's only thread. Here every read takes
the passed descriptors with a control buffer, and they and the socket itself go to a
:class:`~flowsched.agent.closer.DescriptorCloser` (docs/security.md), unless the socket
provably holds nothing (see :func:`_holds_nothing`).
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import socket
import sys
import termios
from collections.abc import Callable

from flowsched.agent.closer import DescriptorCloser

#: descriptors the kernel passes with one message at most (``SCM_MAX_FD``); a read stops at a
#: message carrying descriptors, so one read never brings more
SCM_MAX_FD = 253
#: a control buffer that takes every descriptor one read can bring: what does not fit would
#: be dropped by the kernel in the reading thread
_CONTROL_SIZE = socket.CMSG_SPACE(SCM_MAX_FD * array.array("i").itemsize)
#: bytes read ahead of the connection's handler before the loop stops reading it
INBOX_LIMIT = 65536


class ClientConnection:
    """A client's socket with a read and a write queue; :meth:`read` returns the bytes and
    the descriptors passed with them (the caller hands those to the closer).

    Reading is driven by the loop, as a transport's is (once :meth:`read` is first called):
    what arrives is read when the loop sees it, in the order the connections became readable,
    up to :data:`INBOX_LIMIT` bytes ahead of the handler. ``may_read`` is asked before each
    read: False ends the connection (ConnectionAbortedError from :meth:`read`)."""

    def __init__(
        self,
        sock: socket.socket,
        closer: DescriptorCloser,
        owner: int | None,
        may_read: Callable[[], bool] = lambda: True,
    ) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._fd = sock.fileno()
        self._closer = closer
        self._owner = owner
        self._may_read = may_read
        self._loop = asyncio.get_running_loop()
        self._buffer = bytearray()
        self._inbox = bytearray()
        self._passed: list[int] = []
        self._error: OSError | None = None
        self._eof = False
        self._reading = False
        self._closing = False
        self._released = False
        self._wakeup: asyncio.Future[None] | None = None
        self._linger: asyncio.TimerHandle | None = None

    def is_closing(self) -> bool:
        """Whether it is closed or being closed (nothing more is written)."""
        return self._closing

    def get_write_buffer_size(self) -> int:
        """Bytes queued for the client."""
        return len(self._buffer)

    def write(self, data: bytes) -> None:
        """Send ``data`` now as far as the socket takes it, queue the rest."""
        if self._closing:
            return
        if not self._buffer:
            data = data[self._send(data) :]
            if self._closing or not data:
                return
            self._loop.add_writer(self._fd, self._flush)
        self._buffer += data

    def close(self, linger: float | None = None) -> None:
        """Close once what is queued is sent, or after ``linger`` seconds at the latest
        (aborted then)."""
        if self._closing:
            return
        self._closing = True
        if not self._buffer:
            self._release()
        elif linger is not None:
            self._linger = self._loop.call_later(linger, self.abort)

    def abort(self) -> None:
        """Close now, dropping what is queued."""
        self._closing = True
        self._buffer.clear()
        self._release()

    async def read(self, size: int) -> tuple[bytes, list[int]]:
        """Up to ``size`` bytes (b"": the client left, or the connection is closed) and the
        descriptors passed since the last read (the caller's to close).

        Raises:
            OSError: reading failed (ConnectionAbortedError: ``may_read`` said no).
        """
        while not (self._inbox or self._passed or self._eof or self._released):
            if self._error is not None:
                raise self._error
            self._resume()
            self._wakeup = self._loop.create_future()
            try:
                await self._wakeup
            finally:
                self._wakeup = None
        data = bytes(self._inbox[:size])
        del self._inbox[:size]
        passed, self._passed = self._passed, []
        self._resume()
        return data, passed

    def _resume(self) -> None:
        """Have the loop read again, unless ahead of the handler, done, or closed."""
        stop = self._eof or self._released or self._error is not None
        if not self._reading and not stop and len(self._inbox) < INBOX_LIMIT:
            self._reading = True
            self._loop.add_reader(self._fd, self._on_readable)

    def _pause(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._fd)

    def _on_readable(self) -> None:
        if not self._may_read():
            self._error = ConnectionAbortedError("too many descriptors wait to be closed")
        else:
            try:
                data, ancdata, _, _ = self.sock.recvmsg(
                    INBOX_LIMIT, _CONTROL_SIZE, socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC
                )
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._error = exc
            else:
                self._passed += _passed(ancdata)
                self._inbox += data
                self._eof = not data
        if self._eof or self._error is not None or len(self._inbox) >= INBOX_LIMIT:
            self._pause()
        if self._wakeup is not None:
            _set_once(self._wakeup)

    def _send(self, data: bytes | bytearray) -> int:
        try:
            return self.sock.send(data, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError:  # the client went away: its reads end too
            self.abort()
            return 0

    def _flush(self) -> None:
        sent = self._send(self._buffer)
        del self._buffer[:sent]
        if not self._buffer and not self._released:
            self._loop.remove_writer(self._fd)
            if self._closing:
                self._release()

    def _release(self) -> None:
        """Unregister the socket from the loop, then hand it to the closer: its last
        reference (and the descriptors its queue may hold) is dropped there."""
        if self._released:
            return
        self._released = True
        if self._linger is not None:
            self._linger.cancel()
        self._loop.remove_writer(self._fd)
        self._pause()
        if self._wakeup is not None:
            _set_once(self._wakeup)  # a waiting read returns b""
        if not self._passed and _holds_nothing(self.sock):
            self.sock.close()  # the usual end: nothing the client sent waits in it
        else:
            self._closer.close_later([*self._passed, self.sock.detach()], self._owner)
        self._passed = []


def _holds_nothing(sock: socket.socket) -> bool:
    """Shut ``sock`` down both ways and say whether its receive queue is then empty: the client
    can send nothing more, and on a stream socket a descriptor comes with at least one byte, so
    its close drops no descriptor of the client's and cannot block. Closing it in the loop
    keeps such sockets (connections that ended or were refused having sent nothing more) out of
    the closer, where they would wait behind the user's held-up closes and count against the
    agent's total: a flood of them stopped the agent taking anybody's connections."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
        queued = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    except OSError:
        return False
    return int.from_bytes(queued, sys.byteorder, signed=True) == 0


def _passed(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors in a message's ancillary data."""
    fds = array.array("i")
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return list(fds)


def _set_once(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
