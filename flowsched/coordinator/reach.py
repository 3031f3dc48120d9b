"""Which agents cannot reach the leader: a standby's grounds for deposing a leader that etcd
still renews but the agents cannot talk to (a partition between them), sans-IO.

An agent that cannot reach the leader tries the other coordinators it knows, and a standby
refuses it (``not_leader``) once its handshake has proved the token: a *knock*. A node that
has kept knocking for :data:`KNOCK_SUSTAINED` seconds, knocks no more than :data:`KNOCK_GAP`
apart, is cut off from the leader. The leader publishes how many agents it serves (etcd key
:data:`REACH_PREFIX` + election name, on its lease, whenever the count changed), and a standby
deposes it when more nodes are cut off from it than it serves (:func:`should_depose`): the
standby then reaches more of the cluster than the leader does. Strictly more: with the agents
split evenly nothing changes hands, and once the standby leads, the nodes that reach only the
old leader are fewer than those the new one serves, so it never flips back. docs/ha.md has
the timeline.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

#: seconds a node must keep knocking before it counts as cut off from the leader: longer than
#: an agent's way to a new leader after a handover (a redirect, milliseconds), and than the
#: leader's keepalive period, at which its published count follows its sessions
KNOCK_SUSTAINED = 5.0
#: a knock later than this after the node's previous one starts its streak anew (an agent that
#: cannot reach the leader knocks about every connect timeout, 2 s by default, plus its pause)
KNOCK_GAP = 10.0
#: nodes tracked at most (only agents that proved the token knock, but a token holder may
#: name as many nodes as it likes): beyond, new nodes are not counted until old streaks end
MAX_TRACKED = 100_000
#: the leader's published reach is the key ``REACH_PREFIX + election name``
REACH_PREFIX = "/flowsched/reach/"


@dataclass
class Knocks:
    """The nodes a standby refused, each with its streak of knocks (first, last: monotonic)."""

    sustained_after: float = KNOCK_SUSTAINED
    gap: float = KNOCK_GAP
    limit: int = MAX_TRACKED
    _streaks: dict[str, tuple[float, float]] = field(default_factory=dict)

    def note(self, node: str, now: float) -> None:
        """``node`` was refused at ``now``."""
        streak = self._streaks.get(node)
        if streak is not None and now - streak[1] <= self.gap:
            self._streaks[node] = (streak[0], now)
            return
        if streak is None and len(self._streaks) >= self.limit:
            self._forget_ended(now)
            if len(self._streaks) >= self.limit:
                return
        self._streaks[node] = (now, now)

    def cut_off(self, now: float) -> list[str]:
        """The nodes that have knocked for :attr:`sustained_after` seconds and still do,
        sorted (streaks that ended are forgotten)."""
        self._forget_ended(now)
        return sorted(
            node
            for node, (first, _) in self._streaks.items()
            if now - first >= self.sustained_after
        )

    def clear(self) -> None:
        """Forget every streak (this coordinator leads now)."""
        self._streaks.clear()

    def _forget_ended(self, now: float) -> None:
        ended = [node for node, (_, last) in self._streaks.items() if now - last > self.gap]
        for node in ended:
            del self._streaks[node]


def should_depose(cut_off: int, leader_agents: int) -> bool:
    """Whether a standby that ``cut_off`` nodes cannot reach the leader through should depose
    a leader that serves ``leader_agents``."""
    return cut_off > leader_agents


def encode_reach(epoch: int, agents: int) -> str:
    """The leader's published reach: its epoch (so that a standby never reads a predecessor's)
    and the agents it serves."""
    return json.dumps({"epoch": epoch, "agents": agents}, separators=(",", ":"))


def decode_reach(text: str) -> tuple[int, int] | None:
    """(epoch, agents) from :func:`encode_reach`'s text, None when it is not that."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    epoch, agents = value.get("epoch"), value.get("agents")
    if type(epoch) is not int or type(agents) is not int or epoch < 1 or agents < 0:
        return None
    return epoch, agents
