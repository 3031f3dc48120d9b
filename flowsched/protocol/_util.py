"""Protocol errors.

Internally the protocol code always raises :class:`LocalProtocolError`; the single receive path
(:meth:`Connection.next_event`) converts it into :class:`RemoteProtocolError`, because there the
bad input came from the peer. After either error the connection is in state ``ERROR`` and the
caller must close it (it may still send one :class:`~flowsched.protocol.Error` frame first).
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base class of the two protocol errors; never raised itself.

    ``code`` is a short machine-readable reason (``"frame_too_large"``, ``"bad_field"``,
    ``"auth_failed"``, ...) suitable for the ``error{code, reason}`` frame sent to the peer.
    """

    def __init__(self, reason: str, code: str = "protocol") -> None:
        if type(self) is ProtocolError:
            raise TypeError("ProtocolError is abstract: raise Local/RemoteProtocolError")
        super().__init__(reason)
        self.reason = reason
        self.code = code


class LocalProtocolError(ProtocolError):
    """We tried to do something the protocol forbids (or, internally, found bad input)."""

    def _reraise_as_remote(self) -> RemoteProtocolError:
        return RemoteProtocolError(self.reason, self.code)


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol forbids."""
