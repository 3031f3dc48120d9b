"""Logging a condition that repeats: once at once, then at a falling rate.

A peer that keeps failing the same way (a wrong token retried every second, a flood of
unauthenticated connections) must not fill the log, and must not vanish from it either.
:class:`RepeatLog` logs the first occurrence of a key, then at most once per interval, the
interval doubling after each message up to a ceiling; each message says how many occurrences
it stands for. :meth:`RepeatLog.clear` (the condition ended) starts the key afresh. At most
:data:`MAX_KEYS` keys are kept (the least recently logged goes first): keys may carry what a
peer chose (an address it redirects to), and must not grow the process without bound.
:func:`quoted` makes a peer's text safe for a log line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

#: keys a :class:`RepeatLog` keeps at most; beyond, the one logged least recently is forgotten
#: (its next occurrence is logged at once, as a first one)
MAX_KEYS = 1024


@dataclass(slots=True)
class _Key:
    next_at: float
    interval: float
    suppressed: int = 0


class RepeatLog:
    """Rate-limits repeated log messages per key (see the module docstring).

    Args:
        logger: where the messages go.
        first_interval: seconds between the first and the second message of a key.
        max_interval: the interval stops doubling here.
        clock: monotonic seconds (injected by tests).
        max_keys: keys kept at most (see :data:`MAX_KEYS`).
    """

    def __init__(
        self,
        logger: logging.Logger,
        *,
        first_interval: float = 1.0,
        max_interval: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = MAX_KEYS,
    ) -> None:
        self._log = logger
        self._first = first_interval
        self._max = max_interval
        self._clock = clock
        self._max_keys = max_keys
        #: least recently logged first (a key moves to the end each time it is logged)
        self._keys: dict[str, _Key] = {}

    def log(
        self, key: str, level: int, msg: str, *args: object, exc_info: BaseException | None = None
    ) -> bool:
        """Log ``msg % args`` unless ``key`` was logged too recently; True when logged.

        A message that stands for suppressed occurrences ends with ``(N more since the
        last message)``. ``exc_info``: an exception whose traceback the message carries.
        """
        now = self._clock()
        state = self._keys.get(key)
        if state is None:
            while len(self._keys) >= self._max_keys:
                del self._keys[next(iter(self._keys))]
            self._keys[key] = _Key(now + self._first, self._first)
            self._log.log(level, msg, *args, exc_info=exc_info)
            return True
        if now < state.next_at:
            state.suppressed += 1
            return False
        self._keys[key] = self._keys.pop(key)  # logged now: the last to be forgotten
        suppressed, state.suppressed = state.suppressed, 0
        state.interval = min(state.interval * 2, self._max)
        state.next_at = now + state.interval
        if suppressed:
            self._log.log(
                level, msg + " (%d more since the last message)", *args, suppressed,
                exc_info=exc_info,
            )  # fmt: skip
        else:
            self._log.log(level, msg, *args, exc_info=exc_info)
        return True

    def clear(self, key: str) -> None:
        """The condition behind ``key`` ended: its next occurrence is logged at once."""
        self._keys.pop(key, None)

    def clear_matching(self, prefix: str) -> None:
        """:meth:`clear` every key that starts with ``prefix``."""
        for key in [k for k in self._keys if k.startswith(prefix)]:
            del self._keys[key]


#: characters of a peer's text (an error frame's reason, a name) that a log line shows
PEER_TEXT_LIMIT = 200


def quoted(text: str, limit: int = PEER_TEXT_LIMIT) -> str:
    """``text`` for a log line: quoted with every control character escaped (``repr``), so that
    it cannot forge a line, and cut to ``limit`` characters."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"
