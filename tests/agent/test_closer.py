"""The agent's descriptor closer (flowsched.agent.closer): each owner's descriptors closed in
order in a thread of that owner's, which ends once none is left; a close held up by one owner
holds up no other owner's; the shutdown waits a bounded time in all."""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
from agent_helpers import lingering_tcp_socket, wait_until

from flowsched.agent import closer
from flowsched.agent.closer import DescriptorCloser

#: seconds a lingering socket's close would be held up: far longer than any test waits (each
#: ends the close early by closing the socket's peer)
LINGER = 60


def _closer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("flowsched-closer")]


@pytest.fixture
def new_closer_threads() -> Callable[[], list[str]]:
    """The names of the closer threads alive that were not when the test began (an earlier
    test's may still be closing)."""
    before = set(_closer_threads())
    return lambda: [t.name for t in _closer_threads() if t not in before]


def _shut(read_end: int, timeout: float) -> bool:
    """Whether the pipe's write end is closed (its read end sees the end) within ``timeout``."""
    readable, _, _ = select.select([read_end], [], [], timeout)
    return bool(readable) and os.read(read_end, 1) == b""


@pytest.fixture
def pipes() -> Iterator[list[tuple[int, int]]]:
    """Up to 8 pipes (read end, write end): the test hands write ends over; the read ends
    are closed afterwards."""
    made = [os.pipe() for _ in range(8)]
    yield made
    for read_end, _ in made:
        os.close(read_end)


@pytest.fixture
def peers() -> Iterator[list[socket.socket]]:
    """The peers of the test's lingering sockets: closed at its end, which ends any close
    still held up."""
    held: list[socket.socket] = []
    yield held
    for peer in held:
        peer.close()


def _lingering(peers: list[socket.socket]) -> int:
    """A descriptor whose close is held up until its peer (kept in ``peers``) closes."""
    sock, peer = lingering_tcp_socket(LINGER)
    peers.append(peer)
    return sock.detach()


@pytest.mark.parametrize("held_owner", [0, 1000, None], ids=["root", "a-user", "the-agent"])
def test_a_close_held_up_holds_up_its_owners_later_closes_only(
    pipes: list[tuple[int, int]],
    peers: list[socket.socket],
    new_closer_threads: Callable[[], list[str]],
    held_owner: int | None,
) -> None:
    """One thread closed every owner's descriptors in turn: the others' waited behind a
    lingering socket for its linger time (and the SDK server, counting them, would stop
    taking anyone's)."""
    others = [owner for owner in (0, 1000, 2000, None) if owner != held_owner]
    descriptors = DescriptorCloser()
    (held_next, held_next_w), *rest = pipes
    descriptors.close_later([_lingering(peers), held_next_w], held_owner)
    for owner, (_, write_end) in zip(others, rest, strict=False):
        descriptors.close_later([write_end], owner)
    for owner, (read_end, _) in zip(others, rest, strict=False):
        assert _shut(read_end, 10), f"owner {owner}'s descriptor waited behind the linger"
    wait_until(lambda: descriptors.waiting == 2)  # the held owner's two, and no other's
    assert descriptors.waiting_of(held_owner) == 2
    # the held owner's next descriptor is closed after the lingering one, not before
    assert not _shut(held_next, 0)
    wait_until(lambda: new_closer_threads() == [f"flowsched-closer-{held_owner}"])
    peers.pop().close()  # the lingering close returns
    assert _shut(held_next, 10)
    wait_until(lambda: descriptors.waiting == 0)
    wait_until(lambda: not new_closer_threads())  # idle owners keep no thread


def test_an_owner_handing_more_over_later_gets_a_thread_again(
    pipes: list[tuple[int, int]], new_closer_threads: Callable[[], list[str]]
) -> None:
    descriptors = DescriptorCloser()
    for read_end, write_end in pipes[:3]:
        descriptors.close_later([write_end], 1000)
        assert _shut(read_end, 10)
        wait_until(lambda: not new_closer_threads())
    assert descriptors.waiting == 0 and descriptors.waiting_of(1000) == 0


def test_the_shutdown_waits_its_timeout_in_all_for_closes_held_up(
    pipes: list[tuple[int, int]], peers: list[socket.socket]
) -> None:
    """The agent's stop waits for the closes a bounded time, however many owners' are held
    up."""
    descriptors = DescriptorCloser()
    held_owners = range(1000, 1010)
    for owner in held_owners:
        descriptors.close_later([_lingering(peers)], owner)
    (read_end, write_end), *_ = pipes
    descriptors.close_later([write_end], 2000)
    timeout = 0.2
    started = time.monotonic()
    descriptors.stop(timeout)
    # ten owners' threads joined one after the other, each for the timeout, would take 2 s
    assert time.monotonic() - started < 5 * timeout
    assert _shut(read_end, 10)  # another owner's close is not held up
    wait_until(lambda: descriptors.waiting == len(held_owners))
    for peer in peers:
        peer.close()
    descriptors.stop(10)  # returns once every close is done
    assert descriptors.waiting == 0


class _OutOfThreads(threading.Thread):
    """A thread that cannot be started while ``refusing`` is set (the process is at its
    thread limit)."""

    refusing = True

    def start(self) -> None:
        if _OutOfThreads.refusing:
            raise RuntimeError("can't start new thread")
        super().start()


def test_an_owner_whose_thread_cannot_start_waits_for_the_next_one(
    pipes: list[tuple[int, int]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A hand-over never raises into the agent's loop: the owner's descriptors wait (counted)
    until a thread can be started for them."""
    descriptors = DescriptorCloser()
    monkeypatch.setattr(closer, "threading", SimpleNamespace(Thread=_OutOfThreads))
    monkeypatch.setattr(_OutOfThreads, "refusing", True)
    (first, first_w), (second, second_w) = pipes[:2]
    descriptors.close_later([first_w], 1000)
    assert "cannot start a thread to close descriptors of uid 1000" in caplog.text
    assert descriptors.waiting_of(1000) == 1 and not _shut(first, 0)
    monkeypatch.setattr(_OutOfThreads, "refusing", False)
    descriptors.close_later([second_w], 2000)  # the next hand-over starts both
    assert _shut(first, 10) and _shut(second, 10)
    wait_until(lambda: descriptors.waiting == 0)
