"""Each uid's share of the agent's loop turns (flowsched.agent.turns): a user's many busy
connections take one share per turn between them, another user's message goes through
within a turn or two, and nobody's messages are refused or left waiting for good."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from flowsched.agent.turns import UidTurns

PER_TURN = 8


class _Run:
    """Connections handling queued messages through one :class:`UidTurns`, and a ticker
    counting loop turns (it yields once a turn)."""

    def __init__(self) -> None:
        self.turns = UidTurns(PER_TURN)
        self.tick = 0
        #: (turn, uid, connection) of every message handled, in order
        self.handled: list[tuple[int, int, int]] = []

    async def ticker(self) -> None:
        while True:
            self.tick += 1
            await asyncio.sleep(0)

    async def connection(self, uid: int, conn: int, messages: int) -> None:
        """Handle ``messages`` as the SDK server does: take a share, use what it needs of it,
        give back the rest."""
        while messages:
            share = await self.turns.share(uid)
            used = min(share, messages)
            self.handled.extend([(self.tick, uid, conn)] * used)
            messages -= used
            self.turns.give_back(uid, share - used)

    def per_turn_of(self, uid: int) -> Counter[int]:
        return Counter(tick for tick, who, _ in self.handled if who == uid)


async def _with_ticker(run: _Run, *work: asyncio.Future[None] | asyncio.Task[None]) -> None:
    ticking = asyncio.ensure_future(run.ticker())
    try:
        async with asyncio.timeout(10):
            await asyncio.gather(*work)
    finally:
        ticking.cancel()


@pytest.mark.parametrize("connections", [1, 5, 50])
def test_a_busy_user_gets_its_share_every_turn_and_nothing_is_refused(connections: int) -> None:
    run = _Run()

    async def main() -> None:
        work = [run.connection(1, conn, 100) for conn in range(connections)]
        await _with_ticker(run, *map(asyncio.ensure_future, work))

    asyncio.run(main())
    assert len(run.handled) == 100 * connections  # all of it, in the end
    per_turn = run.per_turn_of(1)
    # a loop turn may see the end of one share and the start of the next, never more
    assert max(per_turn.values()) <= 2 * PER_TURN
    # and it is not held back while the loop has nothing else to do: a share at least every
    # other turn
    assert len(per_turn) >= len(run.handled) / PER_TURN / 2


def test_a_small_users_message_waits_a_turn_or_two_whatever_the_flood() -> None:
    run = _Run()
    arrived: list[int] = []

    async def latecomer() -> None:
        while run.tick < 5:  # the flood is under way
            await asyncio.sleep(0)
        arrived.append(run.tick)
        await run.connection(2, 0, 1)

    async def main() -> None:
        flood = [asyncio.ensure_future(run.connection(1, conn, 1000)) for conn in range(50)]
        await _with_ticker(run, asyncio.ensure_future(latecomer()), *flood)

    asyncio.run(main())
    [served] = [tick for tick, uid, _ in run.handled if uid == 2]
    assert served - arrived[0] <= 2
    assert max(run.per_turn_of(1).values()) <= 2 * PER_TURN  # the flood, a share a turn


def test_a_users_waiting_connections_take_its_turns_in_arrival_order() -> None:
    run = _Run()

    async def main() -> None:
        work = [asyncio.ensure_future(run.connection(1, conn, 3 * PER_TURN)) for conn in range(4)]
        await _with_ticker(run, *work)

    asyncio.run(main())
    # connection 0 took the first share and, wanting more, was first in line; from then on
    # whole shares go round the connections in the order they queued
    order = [conn for i, (_, _, conn) in enumerate(run.handled) if i % PER_TURN == 0]
    assert order[:9] == [0, 0, 1, 2, 3, 0, 1, 2, 3]


def test_a_waiting_connection_that_ends_does_not_stall_the_others() -> None:
    run = _Run()

    async def main() -> None:
        first = asyncio.ensure_future(run.connection(1, 0, 10 * PER_TURN))
        doomed = asyncio.ensure_future(run.connection(1, 1, 10 * PER_TURN))
        last = asyncio.ensure_future(run.connection(1, 2, 10 * PER_TURN))
        ticking = asyncio.ensure_future(run.ticker())
        while not run.turns.waits:
            await asyncio.sleep(0)
        doomed.cancel()  # its connection closed while it waited (the agent stopping, say)
        try:
            async with asyncio.timeout(10):
                await asyncio.gather(first, last)
        finally:
            ticking.cancel()

    asyncio.run(main())
    assert Counter(conn for _, _, conn in run.handled)[2] == 10 * PER_TURN
