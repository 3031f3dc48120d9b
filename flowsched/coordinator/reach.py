"""Which agents cannot reach the leader: a standby's grounds for deposing a leader that etcd
still renews but the agents cannot talk to (a partition between them), sans-IO.

An agent that cannot reach the leader tries the other coordinators it knows, and a standby
refuses it (``not_leader``) once its handshake has proved the token: a *knock*. A node that
has kept knocking for :data:`KNOCK_SUSTAINED` seconds, knocks no more than :data:`KNOCK_GAP`
apart, is cut off from the leader. The leader publishes how many agents it serves, and how
many connections it turned away at its connection caps in the last :data:`KNOCK_GAP` seconds
(etcd key :data:`REACH_PREFIX` + election name, on its lease, whenever either changed). A
standby deposes it when more nodes are cut off from it than it serves and it turned none away
(:func:`should_depose`): the standby then reaches more of the cluster than the leader does.
Agents that the leader turns away at its caps reach it, and would knock here just the same:
deposing it for them would hand the same caps to the next leader, round after round. Strictly
more: with the agents split evenly nothing changes hands, and once the standby leads, the
nodes that reach only the old leader are fewer than those the new one serves, so it does not
flip back. docs/ha.md has the timeline.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

#: seconds a node must keep knocking before it counts as cut off from the leader: longer than
#: an agent's way to a new leader after a handover (a redirect, milliseconds), and than the
#: time the leader's published count takes to follow its sessions (:func:`sustained_for`)
KNOCK_SUSTAINED = 5.0
#: seconds a leader's session with an agent it lost may take to end (its idle timeout, 2 s by
#: default, with a margin) before the next keepalive publishes the count without it
SESSION_END_LAG = 2.5
#: a knock later than this after the node's previous one starts its streak anew (an agent that
#: cannot reach the leader knocks about every connect timeout, 2 s by default, plus its pause)
KNOCK_GAP = 10.0
#: nodes tracked at most (only agents that proved the token knock, but a token holder may
#: name as many nodes as it likes): beyond, new nodes are not counted until old streaks end
MAX_TRACKED = 100_000
#: the leader's published reach is the key ``REACH_PREFIX + election name``
REACH_PREFIX = "/flowsched/reach/"


def sustained_for(keepalive_period: float) -> float:
    """Seconds of knocking that count a node as cut off, for a leader that publishes its count
    every ``keepalive_period`` seconds: :data:`KNOCK_SUSTAINED`, or longer where the count may
    be older than that (a lease TTL above 10 s)."""
    return max(KNOCK_SUSTAINED, keepalive_period + SESSION_END_LAG)


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
        """The nodes whose knocks span :attr:`sustained_after` seconds and that still knock,
        sorted (streaks that ended are forgotten). The span is between knocks, not up to
        ``now``: one knock, say from an agent a new leader had not taken in yet when it
        published its count, is no streak however long ago it came."""
        self._forget_ended(now)
        return sorted(
            node
            for node, (first, last) in self._streaks.items()
            if last - first >= self.sustained_after
        )

    def clear(self) -> None:
        """Forget every streak (the leader they were evidence against changed)."""
        self._streaks.clear()

    def _forget_ended(self, now: float) -> None:
        ended = [node for node, (_, last) in self._streaks.items() if now - last > self.gap]
        for node in ended:
            del self._streaks[node]


@dataclass(frozen=True, slots=True)
class Reach:
    """What a leader publishes of its agents."""

    epoch: int
    #: agents with an established session now
    agents: int
    #: connections it turned away at its connection caps in the last KNOCK_GAP seconds
    turned_away: int = 0


def should_depose(cut_off: int, leader: Reach) -> bool:
    """Whether a standby that ``cut_off`` nodes cannot reach the leader through should depose
    a leader that publishes ``leader``."""
    return leader.turned_away == 0 and cut_off > leader.agents


def encode_reach(reach: Reach) -> str:
    """The leader's published reach (its epoch, so that a standby never reads a predecessor's)."""
    value = {"epoch": reach.epoch, "agents": reach.agents, "turned_away": reach.turned_away}
    return json.dumps(value, separators=(",", ":"))


def decode_reach(text: str) -> Reach | None:
    """The :class:`Reach` in :func:`encode_reach`'s text, None when it is not that."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    epoch, agents = value.get("epoch"), value.get("agents")
    turned_away = value.get("turned_away", 0)  # (absent in what earlier releases published)
    if type(epoch) is not int or epoch < 1:
        return None
    if type(agents) is not int or type(turned_away) is not int or min(agents, turned_away) < 0:
        return None
    return Reach(epoch, agents, turned_away)
