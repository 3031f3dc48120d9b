"""TLS for the agent <-> coordinator link: contexts built from PEM files.

The shared token authenticates the agent at the handshake, and from protocol version 3 the
coordinator too (its welcome MAC; docs/protocol.md). TLS adds what the token cannot: frames
nobody on the path can read, alter, inject or relay after the handshake, and a coordinator
the agent verifies by certificate, which is what authenticates a coordinator of an older
release (below version 3) to an agent. The coordinator serves TLS with ``--tls-cert``/
``--tls-key`` and, with ``--tls-client-ca``, also demands a client certificate signed by that
CA (mutual TLS); agents connect with ``--tls`` (system CAs) or ``--tls-ca FILE``, and present
``--tls-cert``/``--tls-key`` when the coordinator asks. TLS 1.2 is the lowest version either
side accepts.

Both sides re-read their files when they change (:class:`ReloadingContext`), so a renewed
certificate (cert-manager, an ACME client) takes effect for new connections without a
restart; so does the coordinator's link to etcd (flowsched.coordinator.election).
"""

from __future__ import annotations

import logging
import os
import re
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

log = logging.getLogger("flowsched.tls")

#: the oldest protocol version either side accepts
MINIMUM_VERSION = ssl.TLSVersion.TLSv1_2
#: seconds between two checks of the TLS files for a change
CHECK_INTERVAL = 1.0


class TlsConfigError(ValueError):
    """A TLS setting that cannot be used; ``field`` names it (``tls_cert``, ...)."""

    def __init__(self, field_name: str, problem: str) -> None:
        super().__init__(f"{field_name}: {problem}")
        self.field = field_name
        self.problem = problem


def certificate_names(peer: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The names a verified peer certificate (``SSLSocket.getpeercert()``) vouches for: its
    subjectAltName DNS entries, or, only when it has none, its subject's common names (RFC
    6125, 6.4.4: a CA that fills in the SAN may have put anything in the CN); () for no
    certificate."""
    if not peer:
        return ()
    names = [value for kind, value in peer.get("subjectAltName", ()) if kind == "DNS"]
    if names:
        return tuple(names)
    return tuple(
        value for rdn in peer.get("subject", ()) for key, value in rdn if key == "commonName"
    )


def check_pair(cert: str | None, key: str | None, prefix: str = "tls") -> None:
    """Refuse a certificate without its key, or a key without its certificate.

    Raises:
        TlsConfigError: naming ``{prefix}_cert`` or ``{prefix}_key``.
    """
    if cert is not None and key is None:
        raise TlsConfigError(f"{prefix}_key", "missing: the certificate needs its private key")
    if key is not None and cert is None:
        raise TlsConfigError(f"{prefix}_cert", "missing: the private key needs its certificate")


def server_context(cert: str, key: str, client_ca: str | None = None) -> ssl.SSLContext:
    """The coordinator's context: its certificate chain and key; with ``client_ca``, every
    agent must present a certificate that CA (and no other) signed.

    Raises:
        TlsConfigError: a file is missing, unreadable, or not a usable PEM certificate/key
            (``field`` is ``tls_cert``, ``tls_key`` or ``tls_client_ca``).
    """
    # not create_default_context: it would trust the system's CAs for client certificates too
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = MINIMUM_VERSION
    # a TLS 1.2 peer's renegotiation would be a handshake outside the coordinator's pacing
    # (OpenSSL 3 refuses client-started ones already; older builds did not)
    context.options |= ssl.OP_NO_RENEGOTIATION
    _load_chain(context, cert, key, "tls")
    if client_ca is not None:
        _load_ca(context, client_ca, "tls_client_ca")
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(
    ca: str | None, cert: str | None = None, key: str | None = None
) -> ssl.SSLContext:
    """An agent's context: verify the coordinator's certificate and name against ``ca`` alone
    (None: the system's CAs); present ``cert``/``key`` when the coordinator asks for one.

    Raises:
        TlsConfigError: as :func:`server_context` (``tls_ca``, ``tls_cert``, ``tls_key``).
    """
    check_pair(cert, key)
    if ca is None:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    else:  # this CA alone: the system's would vouch for any name they certified
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the peer and its name
        _load_ca(context, ca, "tls_ca")
    context.minimum_version = MINIMUM_VERSION
    if cert is not None and key is not None:
        _load_chain(context, cert, key, "tls")
    return context


class ReloadingContext:
    """A TLS context rebuilt from its files when they change (a renewed certificate).

    :meth:`current` compares the files' inode numbers, change and modification times and
    sizes with the last build (so a file rewritten in place, renamed over, or reached through a
    swapped symlink all count), at most once per :data:`CHECK_INTERVAL`; a set that fails to
    build (say, the certificate renewed but its key not yet) is logged once, naming the
    setting as ``names`` spells it (``{"tls_key": "--etcd-key"}``; default: the field), and
    the previous context kept until the files change again. Each connection takes the context
    current at its start: live ones keep theirs. Threads may share one.
    """

    def __init__(
        self,
        build: Callable[[], ssl.SSLContext],
        paths: Iterable[str | None],
        *,
        names: Mapping[str, str] | None = None,
    ) -> None:
        self._build = build
        self._paths = tuple(path for path in paths if path is not None)
        self._names = dict(names or {})
        self._lock = threading.Lock()
        self._context = build()
        self._stamp = _stamp(self._paths)
        self._checked = time.monotonic()

    def current(self) -> ssl.SSLContext:
        """The context to use for a new connection."""
        if time.monotonic() - self._checked < CHECK_INTERVAL:
            return self._context
        with self._lock:  # one thread checks the files; the others see its result
            now = time.monotonic()
            if now - self._checked >= CHECK_INTERVAL:
                self._checked = now
                self._check()
            return self._context

    def _check(self) -> None:
        stamp = _stamp(self._paths)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            self._context = self._build()
        except TlsConfigError as exc:
            name = self._names.get(exc.field, exc.field)
            log.warning("kept the previous TLS settings: %s: %s", name, exc.problem)
        else:
            log.info("re-read the TLS files %s", ", ".join(self._paths))


def reloading_server(cert: str, key: str, client_ca: str | None = None) -> ReloadingContext:
    """:func:`server_context`, rebuilt when its files change."""
    return ReloadingContext(lambda: server_context(cert, key, client_ca), (cert, key, client_ca))


def reloading_client(
    ca: str | None,
    cert: str | None = None,
    key: str | None = None,
    *,
    names: Mapping[str, str] | None = None,
) -> ReloadingContext:
    """:func:`client_context`, rebuilt when its files change (without ``ca``: when the system's
    default CA file or directory does); ``names``: as :class:`ReloadingContext`."""
    defaults = ssl.get_default_verify_paths()
    trust = (ca,) if ca is not None else (defaults.cafile, defaults.capath)
    return ReloadingContext(lambda: client_context(ca, cert, key), (*trust, cert, key), names=names)


def _stamp(paths: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    found: list[tuple[int, ...]] = []
    for path in paths:
        try:
            status = os.stat(path)  # through symlinks: a swapped link is a change
        except OSError:
            found.append((-1,))
        else:
            found.append((status.st_ino, status.st_ctime_ns, status.st_mtime_ns, status.st_size))
    return tuple(found)


def _load_chain(context: ssl.SSLContext, cert: str, key: str, prefix: str) -> None:
    """Load ``cert`` and ``key`` into ``context``; errors name ``{prefix}_cert`` or
    ``{prefix}_key`` and say which of the two is wrong."""
    cert_field, key_field = f"{prefix}_cert", f"{prefix}_key"
    _check_readable(cert_field, cert)
    _check_readable(key_field, key)
    try:  # parsed alone first, so that a bad certificate is not blamed on the key
        with open(cert, encoding="ascii", errors="replace") as file:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=file.read())
    except ssl.SSLError as exc:
        raise TlsConfigError(
            cert_field, f"{cert} is not a PEM certificate ({ssl_reason(exc)})"
        ) from None
    except ValueError:  # an empty file (cadata=""): a rewrite in place, say, not yet written
        raise TlsConfigError(cert_field, f"{cert} is not a PEM certificate (empty)") from None
    except OSError as exc:  # gone since the check above (a renewal replacing it)
        raise TlsConfigError(cert_field, f"cannot read {cert}: {exc.strerror or exc}") from None

    def no_password() -> bytes:  # else OpenSSL would prompt for one on the terminal
        raise TlsConfigError(
            key_field, f"{key} is encrypted: a daemon cannot type its passphrase (decrypt it: "
            f"openssl pkey -in {key} -out KEY, and keep KEY mode 0600)",
        )  # fmt: skip

    try:
        context.load_cert_chain(cert, key, password=no_password)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            problem = f"{key} is not the private key of the certificate {cert}"
        else:
            problem = f"{key} is not a PEM private key ({ssl_reason(exc)})"
        raise TlsConfigError(key_field, problem) from None
    except OSError as exc:  # one of them gone since its check (a renewal replacing it)
        raise TlsConfigError(
            key_field, f"cannot read {cert} and {key}: {exc.strerror or exc}"
        ) from None


def _load_ca(context: ssl.SSLContext, path: str, field_name: str) -> None:
    _check_readable(field_name, path)
    try:
        context.load_verify_locations(cafile=path)
    except ssl.SSLError as exc:
        raise TlsConfigError(
            field_name, f"{path} is not a PEM CA bundle ({ssl_reason(exc)})"
        ) from None
    except OSError as exc:  # gone since the check above (a renewal replacing it)
        raise TlsConfigError(field_name, f"cannot read {path}: {exc.strerror or exc}") from None


def ssl_reason(exc: ssl.SSLError) -> str:
    """OpenSSL's reason (``NO_CERTIFICATE_OR_CRL_FOUND``), else the message without its
    ``(_ssl.c:2427)``."""
    reason = getattr(exc, "reason", None) or exc.strerror or exc
    return re.sub(r" \(_ssl\.c:\d+\)$", "", str(reason))


def _check_readable(field_name: str, path: str) -> None:
    try:
        with open(path, "rb") as file:
            file.read(1)
    except OSError as exc:
        raise TlsConfigError(field_name, f"cannot read {path}: {exc.strerror or exc}") from None
