"""Shared-token authentication: token files, the HMAC-SHA256 challenge response, and the
MACs that seal every frame after the handshake (:class:`FrameSealer`, :class:`FrameOpener`)."""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from pathlib import Path

#: Domain-separation prefix of the MAC input: b"flowsched/1" + nonce + node (UTF-8).
MAC_PREFIX = b"flowsched/1"
#: Where the token lives when no ``--token-file`` is given.
DEFAULT_TOKEN_PATH = Path("~/.config/flowsched/token")
MIN_TOKEN_BYTES = 16
#: Placeholders that deployment files shipped in place of a token: public, so never a secret.
#: Earlier releases' deploy/kubernetes/token-secret.yaml put the first one into the
#: flowsched-token Secret on every ``kubectl apply -k deploy/kubernetes``.
PLACEHOLDER_TOKENS = frozenset({b"REPLACE-WITH-64-HEX-CHARACTERS-FROM-os.urandom-32"})


class TokenFileError(Exception):
    """The token file is missing, unsafe (group/other may access it), too short, or holds a
    shipped placeholder."""


def compute_mac(token: bytes, nonce: bytes, node: str) -> bytes:
    """The MAC an agent called ``node`` answers to ``nonce`` with (below protocol version 5)."""
    return hmac.new(token, MAC_PREFIX + nonce + node.encode(), hashlib.sha256).digest()


def verify_mac(token: bytes, nonce: bytes, node: str, mac: bytes) -> bool:
    """Constant-time check of ``mac`` against the expected one."""
    return hmac.compare_digest(compute_mac(token, nonce, node), mac)


#: Domain-separation label of a version-5 agent's ``auth`` MAC (no other MAC input starts
#: with it, nor it with theirs).
BOUND_MAC_LABEL = b"flowsched/auth"


def compute_bound_mac(
    token: bytes,
    *,
    agent_nonce: bytes,
    coordinator_nonce: bytes,
    node: str,
    offered: int,
    version: int,
) -> bytes:
    """The ``auth`` MAC of an agent that offered version 5 or more: bound to both nonces, the
    version it offered and the one agreed (two bytes each, big-endian), then the node name.
    Someone on the path who rewrites either version makes the coordinator refuse it, and no
    MAC of this form passes for the older form, so an agent's answer can never open an
    unsealed session in its name (a downgrade).

    Raises:
        ValueError: a nonce is not 32 bytes, or a version outside 0..65535.
    """
    fixed = (("agent_nonce", agent_nonce), ("coordinator_nonce", coordinator_nonce))
    return _handshake_mac(token, BOUND_MAC_LABEL, fixed, (offered, version), node)


def _handshake_mac(
    token: bytes,
    label: bytes,
    fixed: tuple[tuple[str, bytes], ...],
    versions: tuple[int, int],
    node: str,
) -> bytes:
    """HMAC-SHA256 with ``token`` over ``label``, the 32-byte ``fixed`` fields in order, the
    offered and agreed versions (two bytes each, big-endian) and the node name (UTF-8):
    everything but the name has a fixed size, so no two inputs read alike. The versions come
    after the nonces and before any other fixed field (the welcome's digest)."""
    for name, value in fixed:
        if len(value) != 32:
            raise ValueError(f"{name}: expected 32 bytes, got {len(value)}")
    nonces, rest = [v for _, v in fixed[:2]], [v for _, v in fixed[2:]]
    packed = [v.to_bytes(2, "big") for v in versions]
    message = b"".join((label, *nonces, *packed, *rest, node.encode()))
    return hmac.new(token, message, hashlib.sha256).digest()


def load_token(path: str | os.PathLike[str] | None = None) -> bytes:
    """Read the shared token (surrounding whitespace stripped) from ``path``.

    Args:
        path: the token file; ``~/.config/flowsched/token`` when None.

    Raises:
        TokenFileError: the file cannot be read, is accessible by group or others
            (``mode & 0o077``), is not a regular file, holds fewer than 16 bytes, or holds
            a placeholder of the deployment files (:data:`PLACEHOLDER_TOKENS`).
    """
    file = Path(path if path is not None else DEFAULT_TOKEN_PATH).expanduser()
    try:
        with open(file, "rb") as handle:
            info = os.fstat(handle.fileno())
            data = handle.read(1 << 16)
    except OSError as exc:
        raise TokenFileError(f"token file {file}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        raise TokenFileError(f"token file {file}: not a regular file")
    if info.st_mode & 0o077:
        raise TokenFileError(
            f"token file {file}: mode {stat.S_IMODE(info.st_mode):04o} lets group/other access it;"
            f" run: chmod 600 {file}"
        )
    token = data.strip()
    if len(token) < MIN_TOKEN_BYTES:
        raise TokenFileError(f"token file {file}: token shorter than {MIN_TOKEN_BYTES} bytes")
    if token in PLACEHOLDER_TOKENS:
        raise TokenFileError(
            f"token file {file}: holds the placeholder of the deployment files"
            f" ({token.decode()}), which is public; put a secret token there, e.g. the output of:"
            " python3 -c 'import os; print(os.urandom(32).hex())'"
        )
    return token


def write_token(path: str | os.PathLike[str], token: bytes | None = None) -> bytes:
    """Create ``path`` (mode 0600, parent 0700 if created) holding ``token`` or a fresh one."""
    file = Path(path).expanduser()
    file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    token = token if token is not None else os.urandom(32).hex().encode()
    # O_NOFOLLOW: a dangling link planted at the path would have the token written where
    # it points (Path.exists() is False for it, so callers create the token there)
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as handle:
        os.fchmod(handle.fileno(), 0o600)
        handle.write(token + b"\n")
    return token


#: Domain-separation label of the coordinator's welcome MAC (never a prefix of an agent's
#: ``auth`` MAC input, which starts with :data:`MAC_PREFIX`).
WELCOME_MAC_LABEL = b"flowsched/welcome"


def compute_welcome_mac(
    token: bytes,
    *,
    agent_nonce: bytes,
    coordinator_nonce: bytes,
    node: str,
    offered: int,
    version: int,
    digest: bytes,
) -> bytes:
    """The MAC with which a coordinator proves to agent ``node`` that it holds ``token``.

    The input is :data:`WELCOME_MAC_LABEL`, the agent's nonce (its ``hello``), the
    coordinator's (its ``challenge``), the version the agent offered and the one agreed (two
    bytes each, big-endian), ``digest`` (the SHA-256 of the welcome's other fields,
    :func:`flowsched.protocol.welcome_digest`), and the node name (UTF-8): everything but the
    name has a fixed size, so no two inputs read alike.

    Raises:
        ValueError: a nonce or the digest is not 32 bytes, or a version outside 0..65535.
    """
    fixed = (
        ("agent_nonce", agent_nonce), ("coordinator_nonce", coordinator_nonce), ("digest", digest)
    )  # fmt: skip
    return _handshake_mac(token, WELCOME_MAC_LABEL, fixed, (offered, version), node)


def verify_welcome_mac(
    token: bytes,
    mac: bytes,
    *,
    agent_nonce: bytes,
    coordinator_nonce: bytes,
    node: str,
    offered: int,
    version: int,
    digest: bytes,
) -> bool:
    """Constant-time check of a welcome's ``mac`` against :func:`compute_welcome_mac`."""
    expected = compute_welcome_mac(
        token, agent_nonce=agent_nonce, coordinator_nonce=coordinator_nonce, node=node,
        offered=offered, version=version, digest=digest,
    )  # fmt: skip
    return hmac.compare_digest(expected, mac)


#: Domain-separation label of the frame keys (never a prefix of the other MAC inputs).
FRAME_KEY_LABEL = b"flowsched/frames"
#: Bytes of the MAC that ends every sealed frame body (keyed BLAKE2b).
FRAME_TAG_SIZE = 16
#: The two directions of a connection, as the frame keys name them.
AGENT_TO_COORDINATOR = b"A"
COORDINATOR_TO_AGENT = b"C"


def frame_key(
    token: bytes, direction: bytes, *, agent_nonce: bytes, coordinator_nonce: bytes, node: str
) -> bytes:
    """The key that seals the frames one direction of a connection carries after the
    handshake: HMAC-SHA256 with ``token`` over :data:`FRAME_KEY_LABEL`, the direction (one
    byte), both handshake nonces (32 bytes each) and the node name (UTF-8). Fresh nonces make
    every connection's keys new, so a frame recorded on one connection is refused on another.

    Raises:
        ValueError: a nonce is not 32 bytes, or the direction is not one byte.
    """
    if len(direction) != 1:
        raise ValueError(f"direction: expected 1 byte, got {len(direction)}")
    for name, value in (("agent_nonce", agent_nonce), ("coordinator_nonce", coordinator_nonce)):
        if len(value) != 32:
            raise ValueError(f"{name}: expected 32 bytes, got {len(value)}")
    message = FRAME_KEY_LABEL + direction + agent_nonce + coordinator_nonce + node.encode()
    return hmac.new(token, message, hashlib.sha256).digest()


class _FrameMacs:
    """The MACs of the frames one direction of a connection carries after the handshake:
    BLAKE2b in its keyed mode (a MAC by design; one pass, a quarter of HMAC-SHA256's cost per
    frame here), :data:`FRAME_TAG_SIZE` bytes, under the direction's key (:func:`frame_key`),
    over the frame's sequence number (8 bytes, big-endian, from 0) and its body. The numbers
    are not sent: each end counts, so a frame dropped, repeated or moved on the way fails the
    next check."""

    __slots__ = ("_key", "_seq")

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._seq = 0

    def _next_tag(self, body: bytes) -> bytes:
        seq = self._seq.to_bytes(8, "big")
        mac = hashlib.blake2b(seq, key=self._key, digest_size=FRAME_TAG_SIZE)
        mac.update(body)
        self._seq += 1
        return mac.digest()


class FrameSealer(_FrameMacs):
    """Seals the frame bodies one end sends (see :class:`_FrameMacs`)."""

    __slots__ = ()

    def seal(self, body: bytes) -> bytes:
        """``body`` with its MAC appended."""
        return body + self._next_tag(body)


class FrameOpener(_FrameMacs):
    """Checks and strips the MACs of the frame bodies one end receives."""

    __slots__ = ()

    def open(self, sealed: bytes) -> bytes:
        """The body of ``sealed``.

        Raises:
            ValueError: ``sealed`` is shorter than a MAC, or its MAC is not the one this
                frame's key and sequence number give.
        """
        if len(sealed) <= FRAME_TAG_SIZE:
            raise ValueError(f"{len(sealed)} bytes: too short to carry a frame MAC")
        body = sealed[:-FRAME_TAG_SIZE]
        if not hmac.compare_digest(self._next_tag(body), sealed[-FRAME_TAG_SIZE:]):
            raise ValueError("wrong frame MAC")
        return body
