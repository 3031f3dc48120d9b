"""Coordinator names resolved at most once per :data:`NAME_TTL` while the agent reconnects.

With nothing answering at the coordinator's address, the agent tries again every
``reconnect_interval`` (0.1 s), so that a restarted coordinator gets its agents back at once.
Each try resolved the name anew, and under Kubernetes' resolver settings (a search list and
``ndots:5``) one name costs up to six queries: about 60 a second from every node, 60,000 from
1,000 nodes, on the cluster's DNS for as long as the coordinator is away (each rollout of a
single coordinator). :class:`NameCache` keeps a name's addresses, or its resolution's failure,
for :data:`NAME_TTL`. An address that did not answer in time is forgotten at once: the name
may have moved (a re-created pod).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Awaitable, Callable

#: seconds a name's addresses (or its failure to resolve) are used before it is resolved again
NAME_TTL = 1.0

Resolve = Callable[[str, int], Awaitable[list[str]]]


async def resolve_stream(host: str, port: int) -> list[str]:
    """The addresses ``host`` resolves to for a TCP connection, in the resolver's order.

    Raises:
        OSError: (``socket.gaierror``) the name does not resolve.
    """
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found = []
    for _, _, _, _, sockaddr in infos:
        address = str(sockaddr[0])
        if len(sockaddr) == 4 and sockaddr[3]:  # an IPv6 link-local address: keep its scope
            address = f"{address}%{sockaddr[3]}"
        found.append(address)
    return list(dict.fromkeys(found))


def is_address(host: str) -> bool:
    """Whether ``host`` is an IP address already (nothing to resolve)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class NameCache:
    """Each (name, port)'s addresses, or the error resolving it gave, for ``ttl`` seconds.

    Args:
        resolve: the resolver (:func:`resolve_stream`; injected by tests).
        ttl: seconds an answer is used.
        clock: monotonic seconds (injected by tests).
    """

    def __init__(
        self,
        resolve: Resolve = resolve_stream,
        *,
        ttl: float = NAME_TTL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._resolve = resolve
        self._ttl = ttl
        self._clock = clock
        #: (name, port) -> (until when, its addresses or the error resolving it gave); names
        #: a coordinator redirected to are among them, so expired answers are dropped as
        #: others come in
        self._answers: dict[tuple[str, int], tuple[float, list[str] | OSError]] = {}

    async def addresses(self, host: str, port: int) -> list[str]:
        """The addresses to try for ``host``: itself when it is an address, else the cached
        answer, resolving when there is none or it expired.

        Raises:
            OSError: the name did not resolve (now, or within the last ``ttl`` seconds).
        """
        if is_address(host):
            return [host]
        now = self._clock()
        cached = self._answers.get((host, port))
        if cached is not None and now < cached[0]:
            answer = cached[1]
            if isinstance(answer, OSError):
                raise type(answer)(*answer.args)  # a fresh exception: no traceback piles up
            return answer
        try:
            found = await self._resolve(host, port)
        except OSError as exc:
            self._keep(host, port, exc)
            raise
        self._keep(host, port, found)
        return found

    def forget(self, host: str, port: int) -> None:
        """Drop ``host``'s answer: the next try resolves it again."""
        self._answers.pop((host, port), None)

    def _keep(self, host: str, port: int, answer: list[str] | OSError) -> None:
        now = self._clock()
        for key in [key for key, (until, _) in self._answers.items() if until <= now]:
            del self._answers[key]
        self._answers[host, port] = (now + self._ttl, answer)
