"""The agent <-> coordinator wire protocol, sans-IO (this package never imports asyncio).

Frames are a 4-byte big-endian length and a msgpack map whose ``"t"`` key names the message
type. :class:`Connection` turns bytes into typed, immutable messages and back, enforces the
handshake (hello -> challenge -> auth -> welcome, HMAC-SHA256 over a shared token) and the
maximum frame size; the asyncio adapter for agents is :mod:`flowsched.protocol.aio`.

Versions (docs/protocol.md). ``hello.version`` is the highest version the agent speaks and
``challenge.version`` the one the connection then uses: the lower of that and the
coordinator's highest. Version 2 adds one thing: ``flows`` progress as two integer arrays
(``progress_ids``, ``progress_sent``) instead of ``{"id", "sent"}`` maps. A coordinator
decodes both forms from any agent; an agent sends the arrays only on a version-2 connection.
Agents of the previous release offer 1 and keep working. Coordinators of the previous release
refuse any other offer (error code ``version``); a newer agent then reconnects offering 1.

Version 3 makes the handshake mutual: the agent's ``hello`` carries a fresh nonce and the
coordinator's ``welcome`` a MAC over it (:func:`compute_welcome_mac`), which the agent checks.
A coordinator below version 3 cannot prove that it holds the token: :func:`aio.connect_agent
<flowsched.protocol.aio.connect_agent>` refuses it unless the link is verified TLS or the
caller allows it (``flowsched agent --allow-unproven-coordinator``, for rolling upgrades).

Version 4 lets ``job_progress`` say that a job ended (``done``): the coordinator forgets it at
once instead of after its TTL. An agent sends ``done`` only on a version-4 connection.

Version 5 seals every frame after the handshake with a MAC under a per-connection key drawn
from the token and both nonces (:class:`~flowsched.protocol.auth.FrameSealer`), and binds the
agent's ``auth`` MAC to both versions: without TLS, someone on the path can no longer alter,
inject, drop or replay a frame, or downgrade the connection, unnoticed. A coordinator with
``min_version`` 5 refuses agents of earlier releases, whose sessions are not sealed.
"""

from flowsched.protocol._codec import (
    I64_MAX,
    MAX_NAME,
    MAX_PROGRESS,
    U64_MAX,
    decode_body,
    encode_body,
    is_name,
    peek_type,
    welcome_digest,
)
from flowsched.protocol._connection import (
    NEED_DATA,
    PEER_CLOSED,
    Connection,
    Event,
    Sentinel,
    encode_frame,
)
from flowsched.protocol._framing import (
    DEFAULT_MAX_FRAME_SIZE,
    HANDSHAKE_MAX_FRAME_SIZE,
    ReceiveBuffer,
    frame,
)
from flowsched.protocol._messages import (
    FRAME_MAC_VERSION,
    JOB_END_VERSION,
    MESSAGE_TYPES,
    MIN_PROTOCOL_VERSION,
    MUTUAL_AUTH_VERSION,
    PACKED_PROGRESS_VERSION,
    PROTOCOL_VERSION,
    RESYNC_FRAME_OPENS,
    Auth,
    Challenge,
    Error,
    FlowClose,
    FlowOpen,
    Flows,
    Heartbeat,
    Hello,
    JobProgress,
    Levels,
    LevelUpdate,
    Message,
    NicLoad,
    NicLoadEntry,
    Resync,
    Welcome,
)
from flowsched.protocol._state import TRANSITIONS, Role, State
from flowsched.protocol._util import LocalProtocolError, ProtocolError, RemoteProtocolError
from flowsched.protocol.auth import (
    DEFAULT_TOKEN_PATH,
    TokenFileError,
    compute_mac,
    compute_welcome_mac,
    load_token,
    verify_mac,
    verify_welcome_mac,
    write_token,
)

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "DEFAULT_TOKEN_PATH",
    "FRAME_MAC_VERSION",
    "HANDSHAKE_MAX_FRAME_SIZE",
    "I64_MAX",
    "JOB_END_VERSION",
    "MAX_NAME",
    "MAX_PROGRESS",
    "MESSAGE_TYPES",
    "MIN_PROTOCOL_VERSION",
    "MUTUAL_AUTH_VERSION",
    "NEED_DATA",
    "PACKED_PROGRESS_VERSION",
    "PEER_CLOSED",
    "PROTOCOL_VERSION",
    "RESYNC_FRAME_OPENS",
    "TRANSITIONS",
    "U64_MAX",
    "Auth",
    "Challenge",
    "Connection",
    "Error",
    "Event",
    "FlowClose",
    "FlowOpen",
    "Flows",
    "Heartbeat",
    "Hello",
    "JobProgress",
    "LevelUpdate",
    "Levels",
    "LocalProtocolError",
    "Message",
    "NicLoad",
    "NicLoadEntry",
    "ProtocolError",
    "ReceiveBuffer",
    "RemoteProtocolError",
    "Resync",
    "Role",
    "Sentinel",
    "State",
    "TokenFileError",
    "Welcome",
    "compute_mac",
    "compute_welcome_mac",
    "decode_body",
    "encode_body",
    "encode_frame",
    "frame",
    "is_name",
    "load_token",
    "peek_type",
    "verify_mac",
    "verify_welcome_mac",
    "welcome_digest",
    "write_token",
]
