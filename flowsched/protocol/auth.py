"""Shared-token authentication: token files and the HMAC-SHA256 challenge response."""

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


class TokenFileError(Exception):
    """The token file is missing, unsafe (group/other may access it) or too short."""


def compute_mac(token: bytes, nonce: bytes, node: str) -> bytes:
    """The MAC an agent called ``node`` answers to ``nonce`` with."""
    return hmac.new(token, MAC_PREFIX + nonce + node.encode(), hashlib.sha256).digest()


def verify_mac(token: bytes, nonce: bytes, node: str, mac: bytes) -> bool:
    """Constant-time check of ``mac`` against the expected one."""
    return hmac.compare_digest(compute_mac(token, nonce, node), mac)


def load_token(path: str | os.PathLike[str] | None = None) -> bytes:
    """Read the shared token (surrounding whitespace stripped) from ``path``.

    Args:
        path: the token file; ``~/.config/flowsched/token`` when None.

    Raises:
        TokenFileError: the file cannot be read, is accessible by group or others
            (``mode & 0o077``), is not a regular file, or holds fewer than 16 bytes.
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
    return token


def write_token(path: str | os.PathLike[str], token: bytes | None = None) -> bytes:
    """Create ``path`` (mode 0600, parent 0700 if created) holding ``token`` or a fresh one."""
    file = Path(path).expanduser()
    file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    token = token if token is not None else os.urandom(32).hex().encode()
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        os.fchmod(handle.fileno(), 0o600)
        handle.write(token + b"\n")
    return token
