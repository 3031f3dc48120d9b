"""What the protocol allows, as data.

Rule 1: this module contains only the connection states and the table of legal transitions;
        no bytes, no I/O, no authentication logic (that is in ``_connection.py``).
Rule 2: a message is legal only if the table has an entry for (sender role, current state,
        message type); anything else is a protocol error and the connection enters ``ERROR``.

Theory of operation. Both ends of a connection hold a copy of one shared state, advanced by
every message either side sends, because the handshake is lock-step::

    START --hello(A)--> HELLO --challenge(C)--> CHALLENGED --auth(A)--> AUTHENTICATING
          --welcome(C)--> ESTABLISHED

In ``ESTABLISHED`` the agent (A) may send flows, job_progress, nic_load, resync and heartbeat;
the coordinator (C) may send levels and heartbeat. Either side may send ``error`` in any state
(including ``ERROR``, to explain to the peer why it is being dropped); the connection is then
``CLOSED``. The version negotiation and the HMAC checks happen on top of the table: a hello
offering no version this end speaks (or version 3 without its nonce), a challenge answering one
the agent did not offer, an auth with a wrong MAC, or (version 3 on) a welcome without the
coordinator's right MAC is rejected even though its type is legal.
"""

from __future__ import annotations

import enum


class Role(enum.Enum):
    """Which end of the connection a :class:`~flowsched.protocol.Connection` is."""

    AGENT = "agent"
    COORDINATOR = "coordinator"


class State(enum.Enum):
    """The shared connection state (see the module comment)."""

    START = "start"
    HELLO = "hello"
    CHALLENGED = "challenged"
    AUTHENTICATING = "authenticating"
    ESTABLISHED = "established"
    CLOSED = "closed"
    ERROR = "error"


_A = Role.AGENT
_C = Role.COORDINATOR

#: (sender, state) -> {message type: next state}. "error" is handled separately: always legal.
TRANSITIONS: dict[tuple[Role, State], dict[str, State]] = {
    (_A, State.START): {"hello": State.HELLO},
    (_C, State.HELLO): {"challenge": State.CHALLENGED},
    (_A, State.CHALLENGED): {"auth": State.AUTHENTICATING},
    (_C, State.AUTHENTICATING): {"welcome": State.ESTABLISHED},
    (_A, State.ESTABLISHED): {
        "flows": State.ESTABLISHED,
        "job_progress": State.ESTABLISHED,
        "nic_load": State.ESTABLISHED,
        "resync": State.ESTABLISHED,
        "heartbeat": State.ESTABLISHED,
    },
    (_C, State.ESTABLISHED): {
        "levels": State.ESTABLISHED,
        "heartbeat": State.ESTABLISHED,
    },
}


def next_state(sender: Role, state: State, message_type: str) -> State | None:
    """The state after ``sender`` sends ``message_type`` in ``state``; None when illegal."""
    if message_type == "error":
        return State.ERROR if state is State.ERROR else State.CLOSED
    return TRANSITIONS.get((sender, state), {}).get(message_type)
