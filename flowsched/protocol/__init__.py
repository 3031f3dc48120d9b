"""The agent <-> coordinator wire protocol, sans-IO (this package never imports asyncio).

Frames are a 4-byte big-endian length and a msgpack map whose ``"t"`` key names the message
type. :class:`Connection` turns bytes into typed, immutable messages and back, enforces the
handshake (hello -> challenge -> auth -> welcome, HMAC-SHA256 over a shared token) and the
maximum frame size; the asyncio adapter for agents is :mod:`flowsched.protocol.aio`.
"""

from flowsched.protocol._codec import (
    I64_MAX,
    MAX_NAME,
    U64_MAX,
    decode_body,
    encode_body,
    is_name,
    peek_type,
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
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Auth,
    Challenge,
    Error,
    FlowClose,
    FlowOpen,
    FlowProgress,
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
    load_token,
    verify_mac,
    write_token,
)

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "DEFAULT_TOKEN_PATH",
    "HANDSHAKE_MAX_FRAME_SIZE",
    "I64_MAX",
    "MAX_NAME",
    "MESSAGE_TYPES",
    "NEED_DATA",
    "PEER_CLOSED",
    "PROTOCOL_VERSION",
    "TRANSITIONS",
    "U64_MAX",
    "Auth",
    "Challenge",
    "Connection",
    "Error",
    "Event",
    "FlowClose",
    "FlowOpen",
    "FlowProgress",
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
    "decode_body",
    "encode_body",
    "encode_frame",
    "frame",
    "is_name",
    "load_token",
    "peek_type",
    "verify_mac",
    "write_token",
]
