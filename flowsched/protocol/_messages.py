"""The typed, immutable messages of the agent <-> coordinator protocol.

Each top-level message has a wire type string ``TYPE`` (the ``"t"`` key of its msgpack map).
Entry types (:class:`FlowOpen`, :class:`FlowClose`, ...) only appear inside batches.
Times are wall-clock seconds (``time.time()``); sizes are bytes; bandwidths bytes/s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from flowsched.model import FlowClass

#: The highest protocol version this implementation speaks: an agent offers it in
#: ``hello.version``, the coordinator answers with the version both speak in
#: ``challenge.version`` (see :mod:`flowsched.protocol`).
PROTOCOL_VERSION = 5
#: The lowest version spoken (agents and coordinators of the previous release speak only 1).
MIN_PROTOCOL_VERSION = 1
#: The first version whose ``flows`` frames may carry progress as two parallel arrays
#: (``progress_ids`` / ``progress_sent``) instead of a list of ``{"id", "sent"}`` maps.
PACKED_PROGRESS_VERSION = 2
#: The first version whose handshake is mutual: the agent's ``hello`` carries a nonce, and
#: the coordinator's ``welcome`` a MAC proving that it holds the token
#: (:func:`flowsched.protocol.auth.compute_welcome_mac`). Below it the coordinator proves
#: nothing, and an agent accepts it only over verified TLS or when told to.
MUTUAL_AUTH_VERSION = 3
#: The first version whose ``job_progress`` may carry ``done``: the job ended (a serving
#: batch's prefill finished), so the coordinator forgets it and re-evaluates its flows. An
#: agent never sends ``done`` on an older connection (the coordinator would refuse the field).
JOB_END_VERSION = 4
#: The first version whose frames after the handshake are sealed: each carries a MAC under a
#: key drawn from the token and both handshake nonces, so that nobody on the path can alter,
#: inject, drop or replay one without the token (:class:`flowsched.protocol.auth.FrameSealer`).
#: The agent seals what it sends after its ``auth``, the coordinator after its ``welcome``.
FRAME_MAC_VERSION = 5


@dataclass(frozen=True, slots=True)
class FlowOpen:
    """A flow the agent sees open.

    ``level`` is only meaningful in a :class:`Resync`: the level the agent currently applies
    (e.g. decided by its local fallback policy), so that the coordinator only sends changes.
    """

    id: int
    cls: FlowClass
    opened_at: float
    sent: int = 0
    size: int | None = None
    deadline: float | None = None
    job: str | None = None
    consumer_index: int | None = None
    request: str | None = None
    links: tuple[str, ...] = ()
    level: int | None = None


@dataclass(frozen=True, slots=True)
class FlowClose:
    """A flow that finished (or was abandoned) at ``closed_at``."""

    id: int
    sent: int
    closed_at: float


@dataclass(frozen=True, slots=True)
class NicLoadEntry:
    """Capacity (bytes/s) and measured utilization (0..1) of one link."""

    link: str
    bandwidth: float
    load: float


@dataclass(frozen=True, slots=True)
class LevelUpdate:
    """A new level (and optional rate cap, bytes/s) for one of the receiving agent's flows.

    ``decided_at`` (wall-clock seconds, ``time.time()``) and ``decided_ns`` (CLOCK_MONOTONIC
    nanoseconds of the coordinator's host) say when the coordinator decided the level. Both are
    optional on the wire (absent from older senders) and ignored by equality. ``decided_ns`` is
    only comparable with monotonic times taken on the same machine (e.g. every network
    namespace of one testbed host); ``decided_at`` across machines only as far as their clocks
    are synchronized.
    """

    id: int
    level: int
    rate: float | None = None
    decided_at: float | None = field(default=None, compare=False)
    decided_ns: int | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Hello:
    """agent -> coordinator: first frame of a connection.

    ``nonce`` is the agent's fresh 32-byte challenge to the coordinator, sent when the agent
    offers version :data:`MUTUAL_AUTH_VERSION` or higher (empty, and absent on the wire,
    below it): the coordinator's ``welcome`` answers it.
    """

    TYPE: ClassVar[str] = "hello"
    version: int
    node: str
    nonce: bytes = b""


@dataclass(frozen=True, slots=True)
class Challenge:
    """coordinator -> agent: a fresh 32-byte nonce to authenticate against."""

    TYPE: ClassVar[str] = "challenge"
    version: int
    nonce: bytes


@dataclass(frozen=True, slots=True)
class Auth:
    """agent -> coordinator: HMAC-SHA256(token, b"flowsched/1" + nonce + node)."""

    TYPE: ClassVar[str] = "auth"
    mac: bytes


@dataclass(frozen=True, slots=True)
class Welcome:
    """coordinator -> agent: the handshake succeeded.

    ``policy_toml`` is the coordinator's policy file text (the agent runs the same policy when
    it falls back); ``heartbeat_interval`` is how often both sides send a heartbeat.
    """

    TYPE: ClassVar[str] = "welcome"
    policy_toml: str
    timer_period: float
    server_time: float
    heartbeat_interval: float = 0.2
    #: the leadership's fencing token (etcd create revision of the leader key; 0 = no
    #: election): an agent refuses a coordinator whose epoch is below one it already followed
    epoch: int = 0
    #: the fencing scope ``epoch`` belongs to (etcd's cluster id and the election's
    #: incarnation: :func:`flowsched.coordinator.election.fencing_scope`); epochs compare
    #: only within one
    cluster: int = 0
    #: from version :data:`MUTUAL_AUTH_VERSION`: the coordinator's proof that it holds the
    #: token, over both nonces, the node, the versions and every other field of this welcome
    #: (:func:`flowsched.protocol.auth.compute_welcome_mac`); filled in by the coordinator's
    #: :class:`~flowsched.protocol.Connection` when it sends the welcome, empty (and absent on
    #: the wire) below that version. Ignored by equality.
    mac: bytes = field(default=b"", compare=False)


@dataclass(frozen=True, slots=True)
class Error:
    """Either side: the connection is about to be closed because of ``code``/``reason``."""

    TYPE: ClassVar[str] = "error"
    code: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Flows:
    """agent -> coordinator: a batch of flow opens, progress reports and closes.

    Progress is two parallel arrays, whichever form it had on the wire: report ``i`` says
    that flow ``progress_ids[i]`` has sent ``progress_sent[i]`` bytes so far (no object per
    report: the coordinator receives ~100,000 of them a second). Build one with keywords,
    e.g. ``Flows(progress_ids=(1, 2), progress_sent=(10, 20))``.

    Raises:
        ValueError: the two progress arrays differ in length.
    """

    TYPE: ClassVar[str] = "flows"
    opens: tuple[FlowOpen, ...] = ()
    progress_ids: tuple[int, ...] = ()
    progress_sent: tuple[int, ...] = ()
    closes: tuple[FlowClose, ...] = ()

    def __post_init__(self) -> None:
        # decode_body builds its messages without __init__, after the same check
        if len(self.progress_ids) != len(self.progress_sent):
            raise ValueError(
                f"Flows: {len(self.progress_ids)} progress_ids but"
                f" {len(self.progress_sent)} progress_sent"
            )

    def reports(self) -> zip[tuple[int, int]]:
        """The progress reports as ``(id, sent)`` pairs."""
        return zip(self.progress_ids, self.progress_sent, strict=True)


@dataclass(frozen=True, slots=True)
class JobProgress:
    """agent -> coordinator: job ``job`` reached ``step`` (and ``layer`` within it); with
    ``done`` (from :data:`JOB_END_VERSION`) the job ended and is forgotten."""

    TYPE: ClassVar[str] = "job_progress"
    job: str
    step: int
    layer: int | None = None
    done: bool = False


@dataclass(frozen=True, slots=True)
class NicLoad:
    """agent -> coordinator: capacity and utilization of the node's links."""

    TYPE: ClassVar[str] = "nic_load"
    entries: tuple[NicLoadEntry, ...] = ()


#: Opens in a full ``resync`` frame. A flow set larger than one frame holds goes as a
#: ``resync`` of the first RESYNC_FRAME_OPENS opens, then ``flows`` frames of opens alone with
#: the rest (every release's agent splits it so). So a ``resync`` of at least this many opens
#: may be continued: the coordinator keeps the node's flows it did not name until the first
#: frame that is not a ``flows`` frame of opens alone, and a flow named in between keeps its
#: state (see docs/protocol.md, "A resync in several frames").
RESYNC_FRAME_OPENS = 200


@dataclass(frozen=True, slots=True)
class Resync:
    """agent -> coordinator: the agent's complete current flow set (after each (re)connect);
    with :data:`RESYNC_FRAME_OPENS` opens or more, possibly continued in ``flows`` frames."""

    TYPE: ClassVar[str] = "resync"
    opens: tuple[FlowOpen, ...] = ()


@dataclass(frozen=True, slots=True)
class Levels:
    """coordinator -> agent: level changes of that agent's flows only."""

    TYPE: ClassVar[str] = "levels"
    updates: tuple[LevelUpdate, ...] = ()
    #: the sender's leadership epoch (see :class:`Welcome`); agents drop stale ones
    epoch: int = 0


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Either side, every ``heartbeat_interval`` seconds: "I am alive"."""

    TYPE: ClassVar[str] = "heartbeat"
    t_sent: float
    #: coordinator -> agent: the leadership epoch (see :class:`Welcome`); agents send 0
    epoch: int = 0


Message = (
    Hello
    | Challenge
    | Auth
    | Welcome
    | Error
    | Flows
    | JobProgress
    | NicLoad
    | Resync
    | Levels
    | Heartbeat
)

#: wire type string -> message class
MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Hello,
        Challenge,
        Auth,
        Welcome,
        Error,
        Flows,
        JobProgress,
        NicLoad,
        Resync,
        Levels,
        Heartbeat,
    )
}
