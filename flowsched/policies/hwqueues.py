"""Compress K scheduling levels into the few hardware priority queues a fabric offers.

Switches expose 8 egress queues at best, and lossless (PFC) deployments often only 2-4 (see
reference/peers.md section 5), while a policy may use more levels. :func:`compress` maps a level
to a queue index (0 = most urgent queue). All rules are pure, monotone (a more urgent level never
lands in a less urgent queue) and map into ``0..hw_queues-1``; with ``hw_queues >= num_levels``
every rule is the identity.

Rules (``rule`` argument, ``hw_mapping`` in policy files):

* ``"ends"`` (default): level 0 alone in queue 0 and level K-1 alone in the last queue, the
  levels in between split into contiguous, nearly equal ranges over the middle queues. Why:
  level 0 holds what must never wait (RMLQ's reserved top level for urgent explicit deadlines,
  or TP collectives), and level K-1 is the scavenger level (bulk, pruned requests) that must
  never slow anything else. With 2 queues this degenerates to "level 0 vs the rest".
* ``"top"``: level 0 alone in queue 0, levels 1..K-1 split evenly over the other queues.
* ``"proportional"``: queue = level * hw_queues // num_levels (equal-sized ranges, no level kept
  alone).
"""

from __future__ import annotations

RULES = ("ends", "top", "proportional")


def compress(level: int, num_levels: int, hw_queues: int, rule: str = "ends") -> int:
    """The hardware queue (0 = most urgent) that carries scheduling ``level`` of ``num_levels``."""
    if not 0 <= level < num_levels:
        raise ValueError(f"level {level} outside 0..{num_levels - 1}")
    if hw_queues < 1:
        raise ValueError(f"hw_queues must be >= 1, got {hw_queues}")
    if hw_queues >= num_levels:
        return level
    if hw_queues == 1:
        return 0
    if rule == "proportional":
        return level * hw_queues // num_levels
    if rule == "top":
        return 0 if level == 0 else 1 + (level - 1) * (hw_queues - 1) // (num_levels - 1)
    if rule == "ends":
        return _ends(level, num_levels, hw_queues)
    raise ValueError(f"unknown hw-queue rule {rule!r} (known: {', '.join(RULES)})")


def _ends(level: int, num_levels: int, hw_queues: int) -> int:
    if hw_queues == 2:
        return 0 if level == 0 else 1
    if level == 0:
        return 0
    if level == num_levels - 1:
        return hw_queues - 1
    middle_queues = hw_queues - 2
    middle_levels = num_levels - 2
    return 1 + (level - 1) * middle_queues // middle_levels


def table(num_levels: int, hw_queues: int, rule: str = "ends") -> tuple[int, ...]:
    """``compress`` for every level 0..K-1."""
    return tuple(compress(level, num_levels, hw_queues, rule) for level in range(num_levels))
