"""Fair shares of the agent's event loop between SDK users: one user's flood of messages
does not hold up another user's clients.

The agent serves every SDK connection on one event loop. A connection's handler used to
handle everything it had read (up to 64 KiB, a few hundred messages) before the loop turned,
so a user with 200 connections had tens of thousands of messages handled per loop turn, and
each step of another user's client (its accept, its first read, its ``open``) waited seconds
for the next turn. :class:`UidTurns` gives each uid at most :data:`MESSAGES_PER_TURN` messages
per loop turn, all of its connections together. A connection whose uid has spent its share
waits in that uid's line (first come, first served) for a later turn, while other uids'
connections go on. Nothing is refused, and no share is held back from a uid the loop has
nothing else for: a busy uid alone gets a share at every turn.
"""

from __future__ import annotations

import asyncio
from collections import deque

#: messages of one uid (all of its connections together) handled per loop turn: enough that
#: one busy connection pays the loop's turn for a tiny part of its work, few enough that a
#: turn stays near a millisecond however many connections a user floods the agent with
MESSAGES_PER_TURN = 64


class UidTurns:
    """Per-uid shares of each event loop turn (see the module docstring)."""

    def __init__(self, per_turn: int = MESSAGES_PER_TURN) -> None:
        self.per_turn = per_turn
        #: messages each uid may still have handled in this turn (absent: all of its share)
        self._left: dict[int | None, int] = {}
        #: per uid, the connections waiting for a turn of their own, in arrival order
        self._waiting: dict[int | None, deque[asyncio.Future[None]]] = {}
        self._end_scheduled = False
        #: times a connection waited for a later turn (its uid had spent its share)
        self.waits = 0

    async def share(self, uid: int | None) -> int:
        """How many messages the caller may handle now (at least one; give back what it did
        not use with :meth:`give_back` before it awaits anything). Waits for a later turn when
        ``uid`` has spent its share of this one, or when others of ``uid`` wait already."""
        if not self._waiting.get(uid):
            left = self._take(uid)
            if left:
                return left
        self.waits += 1
        await self._wait_in_line(uid)
        return self._take(uid)  # the turn's share is whole: nobody of uid took any since

    def give_back(self, uid: int | None, unused: int) -> None:
        """Return the part of a :meth:`share` the caller did not use (to the same turn)."""
        if unused and uid in self._left:
            self._left[uid] += unused

    def _take(self, uid: int | None) -> int:
        """All that is left of ``uid``'s share of this turn (0: spent)."""
        left = self._left.get(uid)
        if left is None:
            left = self.per_turn
            self._schedule_end()
        self._left[uid] = 0
        return left

    async def _wait_in_line(self, uid: int | None) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        line = self._waiting.setdefault(uid, deque())
        line.append(future)
        self._schedule_end()
        try:
            await future
        finally:
            line.remove(future)
            if not line and self._waiting.get(uid) is line:
                del self._waiting[uid]

    def _schedule_end(self) -> None:
        if not self._end_scheduled:
            self._end_scheduled = True
            # call_soon from within a turn runs at the next one: this turn ends there
            asyncio.get_running_loop().call_soon(self._end_turn)

    def _end_turn(self) -> None:
        """A new turn: every uid's share is whole again, and the first connection in each
        uid's line has it (unless the one woken earlier has not run yet)."""
        self._end_scheduled = False
        self._left.clear()
        for line in self._waiting.values():
            for future in line:
                if future.cancelled():
                    continue  # its connection is ending; the next one has the turn
                if not future.done():
                    future.set_result(None)
                break
        if self._waiting:  # those still in line need later turns
            self._schedule_end()
