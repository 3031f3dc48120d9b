"""Leader election of coordinators through etcd 3.4+ (lease + transaction), with fencing.

Every coordinator started with ``--etcd`` is a candidate. The recipe (docs/ha.md has the why):

* campaign: grant a *fresh* lease (TTL ``lease_ttl``), then one transaction "if the leader key
  does not exist, put it (value: this coordinator's agent address) on that lease, else read
  it". Winning makes the key's create revision this leadership's **epoch**, the fencing token
  stamped on every message to agents (revisions only grow in an etcd cluster), within a
  **fencing scope**: etcd's cluster id mixed with the election's incarnation, a random id the
  first campaign on an etcd data set stores (an etcd rebuilt empty, whose revisions start
  over, keeps its cluster id when its members and token are the same, but gets a new
  incarnation, so agents do not compare the new epochs with the old ones);
* standby: watch the key from the revision after the losing read, for its deletion only
  (lease expired, revoked, or deleted), then campaign again; every TTL/4 it also reads the
  key on the watch's member, so that a member that hangs or is cut off from etcd's quorum
  (its watch stays open and silent) is left within a fraction of the TTL;
* leader: keep the lease alive every TTL/4 and give up once a keepalive reports the lease gone,
  the key read after it is gone or another's (deleted: the standbys campaign), or no keepalive
  succeeded for TTL minus a margin (the lease may have expired at etcd);
* graceful stop revokes the lease: a standby's watch sees the deletion within milliseconds;
* :meth:`EtcdElection.depose` revokes a leader's lease when a standby found that nothing
  listens on its address any more, or that more agents cannot reach it than it serves (it
  publishes that count: :mod:`flowsched.coordinator.reach`): leases are fresh per campaign, so
  this can only end the leadership it names.

``--etcd`` lists every member of the etcd cluster: a request that fails on one member goes to
the next, and later ones start there; the lease TTL defaults to 10 s then, to outlast a change
of etcd's own leader (docs/ha.md, "Several etcd members").

The client is ``etcd3gw`` (HTTP/JSON gateway, no gRPC), an optional dependency
(``pip install 'flowsched[ha]'``) imported only here and only when ``--etcd`` is used. Its
calls block, so they run in worker threads; the standby's watch reads its stream itself
(etcd3gw's watch iterator never returns once the stream has ended).

TLS (an ``https://`` URL): etcd's certificate is verified against ``--etcd-cacert``, else the
system trust store (OpenSSL's default paths, as etcdctl does); ``--etcd-cert``/``--etcd-key``
are the client certificate etcd's ``--client-cert-auth`` asks for. :func:`check_tls` loads the
files at preflight time; :meth:`EtcdElection.explain` names the TLS cause of a failed request.
The files are re-read when they change (a renewal: :class:`flowsched.tls.ReloadingContext`,
checked at most once a second as requests start); a set that does not load is logged naming
the flag, and the previous one kept.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import secrets
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

from flowsched import tls
from flowsched.coordinator import reach
from flowsched.lograte import RepeatLog
from flowsched.tls import ssl_reason

if TYPE_CHECKING:
    from etcd3gw.client import Etcd3Client
    from requests import Response, Session

    from flowsched.coordinator.config import CoordinatorConfig

log = logging.getLogger("flowsched.coordinator.election")
T = TypeVar("T")

#: the election key is ``KEY_PREFIX + name``
KEY_PREFIX = "/flowsched/leader/"
#: the election's incarnation (a random id, stored once per etcd data set, no lease) is kept
#: at ``INCARNATION_PREFIX + name``
INCARNATION_PREFIX = "/flowsched/incarnation/"
#: keepalives per TTL (etcd3's own clients renew at TTL/3; more often costs nothing here)
KEEPALIVES_PER_TTL = 4
#: a leader steps down this share of the TTL before its lease may have expired at etcd
STEP_DOWN_MARGIN = 0.25
#: seconds at most between campaigns that failed (every member tried; TTL/4 below that)
MAX_CAMPAIGN_PAUSE = 1.0
#: seconds before the next keepalive after a failed one (every member tried), and before the
#: next campaign after a watch that failed or ended: the first keepalive after etcd answers
#: again renews the lease, well before the leader would give up
RETRY_AFTER_FAILURE = 0.25
#: etcd requests of a won campaign attempt (the incarnation, the grant, the transaction)
CAMPAIGN_REQUESTS = 3
#: the lease TTL (s) with one etcd URL, and with several: a change of etcd's own (raft) leader
#: takes one to two of etcd's election timeouts (1 s each by default), during which no
#: keepalive succeeds, and a leader waits only 0.75 TTL for one (docs/ha.md, "Several etcd
#: members", has the measurements)
SINGLE_MEMBER_TTL, CLUSTER_TTL = 2, 10


#: OpenSSL verify codes of a server certificate whose CA is not trusted (self-signed leaf,
#: self-signed chain, unknown issuer, leaf signature unverifiable); and of a name mismatch
UNKNOWN_ISSUER = frozenset({18, 19, 20, 21})
HOSTNAME_MISMATCH = 62


class ElectionError(RuntimeError):
    """etcd is unusable for the election (bad URL, missing client library, refused)."""


@dataclass(frozen=True, slots=True)
class Leader:
    """Who leads, as read from the leader key."""

    address: str
    #: the key's create revision: the leadership's fencing token
    epoch: int
    lease: int


@dataclass(frozen=True, slots=True)
class Leadership:
    """This candidate's won leadership."""

    epoch: int
    #: the fencing scope (:func:`fencing_scope`): epochs compare only within one
    cluster: int
    lease: int


def fencing_scope(cluster_id: int, incarnation: str | None) -> int:
    """The id within which agents compare epochs (the welcome's ``cluster``): etcd's cluster
    id mixed with the election's incarnation. etcd derives its cluster id from the members
    and the cluster token, so a cluster rebuilt empty with the same ones keeps it while its
    revisions, hence epochs, start over; the incarnation, stored by the first campaign on an
    etcd data set, is new there. Without one (etcd refused its key) the cluster id alone, as
    coordinators of earlier releases stamp it. Never 0 (0: no election) unless etcd says 0."""
    if incarnation is None:
        return cluster_id
    digest = hashlib.blake2b(f"{cluster_id}/{incarnation}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") or 1


def parse_endpoint(url: str) -> tuple[str, str, int]:
    """``http://host:2379`` -> (protocol, host, port).

    Raises:
        ElectionError: not an http(s) URL with a host.
    """
    parsed = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ElectionError(f"--etcd: expected http(s)://HOST[:PORT], got {url!r}")
    try:
        port = parsed.port or 2379
    except ValueError:
        raise ElectionError(f"--etcd: bad port in {url!r}") from None
    return parsed.scheme, parsed.hostname, port


def parse_endpoints(urls: str) -> list[tuple[str, str, int]]:
    """``--etcd``: one client URL per etcd member, comma-separated (as ``etcdctl
    --endpoints``) -> [(protocol, host, port)], in the order given.

    Raises:
        ElectionError: a bad URL, an empty item, a member given twice, or http mixed with
            https (one set of TLS files serves every member).
    """
    members = [parse_endpoint(url.strip()) for url in urls.split(",") if url.strip()]
    if not members or len(members) != len(urls.split(",")):
        raise ElectionError(f"--etcd: expected comma-separated http(s)://HOST[:PORT], got {urls!r}")
    if len(set(members)) != len(members):
        raise ElectionError(f"--etcd: a member is listed twice in {urls!r}")
    if len({protocol for protocol, _, _ in members}) > 1:
        raise ElectionError(f"--etcd: mixes http:// and https:// members in {urls!r}")
    return members


def lease_ttl(config: CoordinatorConfig) -> int:
    """``config.lease_ttl``, or when unset :data:`SINGLE_MEMBER_TTL` for one etcd URL and
    :data:`CLUSTER_TTL` for several."""
    if config.lease_ttl is not None:
        return config.lease_ttl
    several = config.etcd is not None and len(parse_endpoints(config.etcd)) > 1
    return CLUSTER_TTL if several else SINGLE_MEMBER_TTL


def short_lease_warning(config: CoordinatorConfig) -> str | None:
    """Why ``config``'s lease TTL may cost the leadership whenever etcd's own leader changes
    (several members, a TTL below :data:`CLUSTER_TTL` given), or None."""
    if config.etcd is None or config.lease_ttl is None or config.lease_ttl >= CLUSTER_TTL:
        return None
    members = len(parse_endpoints(config.etcd))
    if members == 1:
        return None
    return (
        f"--lease-ttl {config.lease_ttl} with {members} etcd members: a change of etcd's own "
        f"leader (1-2 s at etcd's default election timeout; an etcd upgrade restarts every "
        f"member) can outlast the {0.75 * config.lease_ttl:g} s this coordinator waits for a "
        f"keepalive, and it would step down; {CLUSTER_TTL} s, the default with several "
        f"members, rides it out"
    )


def member_url(member: tuple[str, str, int]) -> str:
    """(protocol, host, port) -> the client URL."""
    protocol, host, port = member
    host = f"[{host}]" if ":" in host else host
    return f"{protocol}://{host}:{port}"


def check_tls(url: str, cacert: str | None, cert: str | None, key: str | None) -> None:
    """Refuse TLS settings that cannot work, naming the flag: a client certificate without its
    key (or the reverse), TLS files with a plain-http URL, files that are unreadable, not PEM,
    a key that does not match its certificate or that needs a passphrase.

    Raises:
        ElectionError: naming the flag.
    """
    flags = {"--etcd-cacert": cacert, "--etcd-cert": cert, "--etcd-key": key}
    given = [flag for flag, path in flags.items() if path is not None]
    if not given:
        return
    if key is None and cert is not None:
        raise ElectionError("--etcd-cert: needs --etcd-key, the client certificate's private key")
    if cert is None and key is not None:
        raise ElectionError("--etcd-key: needs --etcd-cert, the client certificate of that key")
    if parse_endpoints(url)[0][0] != "https":
        raise ElectionError(
            f"{given[0]}: TLS files need an https:// etcd URL for each member, and --etcd "
            f"{url!r} is plain http (write https://...)"
        )
    try:
        tls.client_context(cacert, cert, key)  # loads the files: what TLS would use
    except tls.TlsConfigError as exc:
        raise ElectionError(f"{_FLAGS[exc.field]}: {exc.problem}") from None


#: flowsched.tls's names of the settings -> the coordinator's flags for etcd
_FLAGS = {"tls_ca": "--etcd-cacert", "tls_cert": "--etcd-cert", "tls_key": "--etcd-key"}


def _ssl_cause(exc: BaseException) -> ssl.SSLError | None:
    """The ssl error behind ``exc``: etcd3gw, requests and urllib3 wrap it a few levels deep,
    as the cause or context, as an argument, or as a MaxRetryError's ``reason``."""
    pending: list[object] = [exc]
    seen: set[int] = set()
    while pending:
        cause = pending.pop(0)
        if not isinstance(cause, BaseException) or id(cause) in seen:
            continue
        if isinstance(cause, ssl.SSLError):
            return cause
        seen.add(id(cause))
        pending += [cause.__cause__, cause.__context__, getattr(cause, "reason", None)]
        pending += cause.args
    return None


def _mount_tls(session: Session, contexts: tls.ReloadingContext) -> None:
    """Make each new https connection of ``session`` take ``contexts.current()``; live
    connections keep theirs.

    Not requests' ``verify``/``cert``: with them urllib3 loads the files at every new connection
    (``ssl_wrap_socket``: ``load_verify_locations``, ``load_cert_chain``), so a renewal caught
    half done (the certificate before its key) fails every connection until it is complete,
    and ``REQUESTS_CA_BUNDLE``/``CURL_CA_BUNDLE`` would replace ``--etcd-cacert``. One pool per
    host, whose new connections get the context through its ``conn_kw``.
    """
    from requests.adapters import HTTPAdapter

    adapter = HTTPAdapter()
    host_key = adapter.build_connection_pool_key_attributes

    def pool_key(request: Any, verify: Any, cert: Any = None) -> tuple[Any, dict[str, Any]]:
        host: dict[str, Any] = host_key(request, verify, None)[0]
        return host, {"cert_reqs": "CERT_REQUIRED"}

    def use_current(pool: Any, url: str, verify: Any, cert: Any) -> None:
        pool.conn_kw["ssl_context"] = contexts.current()  # (called before every request)

    # (cast: the wheel's build checks this module without requests' type stubs)
    cast(Any, adapter).build_connection_pool_key_attributes = pool_key
    cast(Any, adapter).cert_verify = use_current
    session.mount("https://", adapter)


def _in_daemon_thread(function: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """Run a blocking call in a new daemon thread; its result as a future of the running loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if not future.done():
            if error is None:
                future.set_result(result)  # type: ignore[arg-type]
            else:
                future.set_exception(error)

    def run() -> None:
        try:
            result, error = function(*args), None
        except BaseException as exc:  # handed to the waiter
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="flowsched-etcd-watch", daemon=True).start()
    return future


def _close_late_watch(opening: asyncio.Future[Response]) -> None:
    """Close a watch stream that opened after its waiter gave up on it."""
    if not opening.cancelled() and opening.exception() is None:
        _stop_watch(opening.result())


def _answered(exc: BaseException) -> bool:
    """Whether a failed request got an answer from etcd that names the request's fault, not
    the member's: an HTTP status that etcd3gw maps to no error of its own, such as 404 for a
    lease already revoked or expired (timeouts, 503 "no leader" and 5xx are the member's)."""
    try:
        from etcd3gw.exceptions import Etcd3Exception
    except ImportError:
        return False
    return type(exc) is Etcd3Exception


def _next_deletion(stream: Response) -> bool:
    """Block until the watch ``stream`` reports an event (its filter leaves deletions only):
    True; False when the stream ends first (its member died or closed it). Not etcd3gw's
    watch: its iterator waits forever once the stream has ended.

    True also when etcd cancels the watch because its start revision was compacted before the
    watch began (a compaction between the campaign's read and the watch): the member works,
    and a deletion may be among the revisions compacted away, so the caller campaigns again at
    once, as after one, and reads the key at the current revision."""
    for line in stream.iter_lines():
        if not line.strip():
            continue
        result = json.loads(line).get("result", {})
        if result.get("events"):
            return True
        compacted = int(result.get("compact_revision", 0))  # (with ``canceled``)
        if compacted:
            log.info("standby: etcd compacted the watch's start revision (history kept from "
                     "%d on): reading the leader key again", compacted)  # fmt: skip
            return True
        if result.get("canceled"):
            return False
    return False


def _stop_watch(stream: Response) -> None:
    """End ``stream`` from another thread: shutting the socket down wakes a blocked read."""
    with (
        contextlib.suppress(Exception),  # already closed
        socket.fromfd(stream.raw.fileno(), socket.AF_INET, socket.SOCK_STREAM) as dup,
    ):
        dup.shutdown(socket.SHUT_RDWR)
    stream.close()


#: characters of etcd's answer quoted in a log line at most
ETCD_ERROR_LIMIT = 200


def _etcd_error(detail: object) -> str:
    """What etcd said in a failed request's answer body (etcd3gw's ``detail_text``): the
    gateway's ``{"error": ..., "code": N}`` message, or the text as it came, on one line and
    cut."""
    text = str(detail).strip()
    with contextlib.suppress(ValueError, AttributeError):
        text = str(json.loads(text).get("error") or text)
    text = " ".join(text.split())
    return text if len(text) <= ETCD_ERROR_LIMIT else f"{text[:ETCD_ERROR_LIMIT]}..."


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark ``future``'s exception retrieved (a watch thread that ended after its waiter)."""
    if not future.cancelled():
        future.exception()


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class EtcdElection:
    """One candidate in the election ``name`` (see the module docstring).

    Args:
        endpoint: etcd's client URLs, comma-separated (``http://10.0.0.5:2379,...``): every
            member of the cluster, so that the election survives the loss of any one of
            them (requests go to one member and move to the next when one fails).
        name: the election (coordinators of one cluster share it).
        address: this coordinator's agent address, published while it leads.
        lease_ttl: lease TTL in whole seconds (etcd grants at least about 2 s).
        request_timeout: seconds allowed for each etcd request (default: TTL/4, at most
            0.5 s: a request sent while etcd elects its own leader is dropped, not answered,
            so a shorter wait tries the next member sooner).
        cacert: PEM CA bundle that verifies etcd's certificate (https; None: the system
            trust store).
        cert: PEM client certificate for etcd's ``--client-cert-auth`` (with ``key``).
        key: its PEM private key (unencrypted).

    Raises:
        ElectionError: a bad setting, naming its flag (TLS files are loaded: see
            :func:`check_tls`), or etcd3gw is not installed.
    """

    def __init__(
        self,
        endpoint: str,
        name: str,
        address: str,
        lease_ttl: int = 2,
        request_timeout: float | None = None,
        *,
        cacert: str | None = None,
        cert: str | None = None,
        key: str | None = None,
    ) -> None:
        if not isinstance(lease_ttl, int) or lease_ttl < 1:
            raise ElectionError(f"--lease-ttl: expected whole seconds >= 1, got {lease_ttl!r}")
        if not name or "/" in name or not name.isprintable():
            raise ElectionError(f"--election-name: expected a printable name without '/': {name!r}")
        if address and split_address(address) is None:
            raise ElectionError(f"--advertise: expected HOST:PORT, got {address!r}")
        #: etcd's members, (protocol, host, port) each; requests go to ``_member``'s
        self.members = parse_endpoints(endpoint)
        self._member = 0
        #: the member whose request failed last (named by :meth:`explain`)
        self._failed = 0
        #: member URL -> its failed requests and watch streams (each moved the next request
        #: on to the next member); ``flowsched_coordinator_etcd_failures_total``
        self.failures: dict[str, int] = {member_url(m): 0 for m in self.members}
        self._failures_lock = threading.Lock()  # the campaign's and keepalive's threads count
        self.protocol = self.members[0][0]
        check_tls(endpoint, cacert, cert, key)
        self.cacert, self.cert, self.cert_key = cacert, cert, key
        #: the https context, shared by every client, rebuilt when the files change, a failure
        #: logged naming the flag (None: plain http)
        self._tls = (
            tls.reloading_client(cacert, cert, key, names=_FLAGS)
            if self.protocol == "https"
            else None
        )
        self.key = KEY_PREFIX + name
        self.incarnation_key = INCARNATION_PREFIX + name
        #: where the leader publishes how many agents it serves (flowsched.coordinator.reach)
        self.reach_key = reach.REACH_PREFIX + name
        self.address = address
        self.ttl = lease_ttl
        self.timeout = request_timeout or min(max(0.2, lease_ttl / KEEPALIVES_PER_TTL), 0.5)
        #: the longest one request may take, through every member (connect and read each)
        self.call_timeout = 2 * self.timeout * len(self.members)
        #: (member, role) -> its client: one per thread that uses them ("campaign", the
        #: campaign and resign; "keepalive", the leader's keepalives), built on first use
        self._clients: dict[tuple[int, str], Etcd3Client] = {}
        self._clients[0, "campaign"] = self._new_client(0)  # (a missing etcd3gw fails here)
        #: the leader last seen (None: nobody, or not known yet)
        self.leader: Leader | None = None
        #: while leading: when (monotonic) the last keepalive that etcd answered was sent
        self.renewed_at = 0.0
        #: while standing by: whether a watch stream on the leader key is open
        self.watching = False
        #: the lease of this candidate's last won campaign (0: none yet)
        self.won_lease = 0
        #: when (monotonic) that lease's grant was sent: its TTL runs from about then, however
        #: late etcd answered the campaign, so the leader's first renewal is counted from it
        self.won_lease_sent = 0.0
        #: the last campaign attempt, in its thread (None: none yet, or withdrawn)
        self._attempt: asyncio.Future[tuple[Leadership | None, int]] | None = None
        self._recheck = asyncio.Event()
        self._repeat = RepeatLog(log)

    @classmethod
    def from_config(cls, config: CoordinatorConfig, address: str) -> EtcdElection:
        """The candidate ``config`` describes (``config.etcd`` and the election settings),
        publishing ``address``."""
        assert config.etcd is not None
        return cls(
            config.etcd, config.election_name, address, lease_ttl(config),
            cacert=config.etcd_cacert, cert=config.etcd_cert, key=config.etcd_key,
        )  # fmt: skip

    def _new_client(self, member: int) -> Etcd3Client:
        try:
            from etcd3gw.client import Etcd3Client
        except ImportError:
            raise ElectionError(
                "--etcd needs the etcd3gw package: pip install 'flowsched[ha]'"
            ) from None
        protocol, host, port = self.members[member]
        return Etcd3Client(
            host=host, port=port, protocol=protocol, timeout=self.timeout,
            api_path="/v3/",  # etcd >= 3.4; skips a /version round trip per client
            session=self._session(),
        )  # fmt: skip

    def _session(self) -> Session:
        """A requests session with this candidate's TLS context (:func:`_mount_tls`; not
        etcd3gw's ``ca_cert`` etc., which are requests' ``verify``/``cert``)."""
        import requests

        session = requests.Session()
        if self._tls is not None:
            _mount_tls(session, self._tls)
        return session

    @property
    def url(self) -> str:
        """The client URL of the member that requests go to now."""
        return member_url(self.members[self._member])

    @property
    def failed_url(self) -> str:
        """The client URL of the member whose request failed last."""
        return member_url(self.members[self._failed])

    def _client(self, role: str, member: int | None = None) -> tuple[int, Etcd3Client]:
        """The member that requests go to now (or ``member``) and its client for ``role``."""
        member = self._member if member is None else member
        client = self._clients.get((member, role))
        if client is None:
            client = self._clients[member, role] = self._new_client(member)
        return member, client

    def _next_member(self, failed: int) -> None:
        """A request to member ``failed`` failed: later requests go to the next member (unless
        another thread moved on already)."""
        self._failed = failed
        with self._failures_lock:
            self.failures[member_url(self.members[failed])] += 1
        if self._member == failed:
            self._member = (failed + 1) % len(self.members)

    def explain(self, exc: BaseException) -> str:
        """What a failed etcd request says, naming the TLS cause and the flag that fixes it
        (etcd3gw's exceptions keep the text in ``detail_text``: ``str()`` is empty, or only
        the HTTP status's reason when etcd answered, its own words in the body)."""
        ssl_error = _ssl_cause(exc)
        if isinstance(ssl_error, ssl.SSLCertVerificationError):
            return self._explain_verification(ssl_error)
        if ssl_error is not None:
            return self._explain_handshake(ssl_error)
        text, detail = str(exc), getattr(exc, "detail_text", None)
        if text and detail:  # an HTTP answer: its status, then etcd's words
            return f"{text}: {_etcd_error(detail)}"
        return text or (str(detail) if detail else "") or type(exc).__name__

    def _explain_verification(self, error: ssl.SSLCertVerificationError) -> str:
        trust = f"--etcd-cacert {self.cacert}" if self.cacert else "the system trust store"
        why = error.verify_message or ssl_reason(error)
        if error.verify_code in UNKNOWN_ISSUER:
            hint = "" if self.cacert else " (no --etcd-cacert)"
            return (
                f"TLS: etcd's server certificate is not signed by a CA in {trust}{hint} ({why}):"
                f" --etcd-cacert must name the CA that signed it"
            )
        if error.verify_code == HOSTNAME_MISMATCH:
            host = self.members[self._failed][1]
            return (
                f"TLS: etcd's server certificate does not name {host} ({why}): give "
                f"--etcd a host name or address that the certificate lists"
            )
        return f"TLS: etcd's server certificate was refused ({why}; verified with {trust})"

    def _explain_handshake(self, ssl_error: ssl.SSLError) -> str:
        reason = ssl_reason(ssl_error)
        if "WRONG_VERSION_NUMBER" in reason:
            return f"TLS: etcd at {self.failed_url} does not speak TLS ({reason}): use http://"
        if not isinstance(ssl_error, ssl.SSLEOFError) and "ALERT" not in reason:
            return f"TLS to etcd failed: {reason}"
        if self.cert is None:
            return (
                f"TLS: etcd refused the connection without a client certificate ({reason}): "
                f"it requires one (--client-cert-auth): give --etcd-cert and --etcd-key"
            )
        return (
            f"TLS: etcd refused the client certificate --etcd-cert {self.cert} ({reason}): "
            f"it must be signed by a CA in etcd's --trusted-ca-file and allow clientAuth"
        )

    # -- blocking etcd calls (run in threads) --------------------------------------------------

    def _post(self, path: str, body: dict[str, Any], role: str = "campaign") -> dict[str, Any]:
        """POST ``body`` with ``role``'s client ("once": a client of its own) to the current
        member, and on a failure to the next ones in turn (later requests start there); the
        last member's error when every one failed. A dead member fails fast (refused) or
        within the request timeout, so a request reaches a live member within
        :attr:`call_timeout`. An answer that faults the request (a lease not found) is raised
        at once and is no failure of the member."""
        for _ in self.members:
            if role == "once":
                member, client = self._member, self._new_client(self._member)
            else:
                member, client = self._client(role)
            try:
                result: dict[str, Any] = client.post(client.get_url(path), json=body)
            except Exception as exc:
                if _answered(exc):
                    raise  # the member works: the next one would give the same answer
                self._next_member(member)
                if self._member != member:
                    why = self.explain(exc)
                    self._repeat.log(f"member {member} {why}", logging.WARNING,
                                     "etcd %s failed (%s): trying %s", self.failed_url, why,
                                     self.url)  # fmt: skip
                error = exc
                continue
            return result
        raise error

    def _try_once(self) -> tuple[Leadership | None, int]:
        """Grant a fresh lease and run the campaign transaction once.

        Returns (leadership or None, the revision the read saw).
        """
        incarnation = self._incarnation()  # before the lease: a won leadership needs it
        grant_sent = time.monotonic()
        lease = int(self._post("/lease/grant", {"TTL": self.ttl})["ID"])
        key = _b64(self.key)
        txn = {
            "compare": [{"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": 0}],
            "success": [{"request_put": {"key": key, "value": _b64(self.address), "lease": lease}}],
            "failure": [{"request_range": {"key": key}}],
        }
        try:
            reply = self._post("/kv/txn", txn)
        except Exception:
            # etcd may have applied it and the answer been lost (a timeout, the member dying
            # after the commit): the key would name this candidate, on a lease nobody renews,
            # for a TTL in which no candidate leads
            self._revoke(lease)
            raise
        header = reply["header"]
        revision = int(header["revision"])
        if reply.get("succeeded"):
            self.won_lease, self.won_lease_sent = lease, grant_sent
            self.leader = Leader(self.address, revision, lease)
            scope = fencing_scope(int(header.get("cluster_id", 0)), incarnation)
            return Leadership(revision, scope, lease), revision
        self._revoke(lease)  # never used: do not leave it to expire
        self.leader = self._leader_from(reply["responses"][0]["response_range"])
        return None, revision

    def _incarnation(self) -> str | None:
        """The election's incarnation on this etcd data set: read, or stored (random) by one
        transaction when there is none yet (of candidates starting at once, one stores it
        and every other reads that one). None, logged, when etcd denies the key: an etcd role
        granting only the keys of earlier releases."""
        key, made = _b64(self.incarnation_key), secrets.token_hex(16)
        txn = {
            "compare": [{"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": 0}],
            "success": [{"request_put": {"key": key, "value": _b64(made)}}],
            "failure": [{"request_range": {"key": key}}],
        }
        try:
            reply = self._post("/kv/txn", txn)
        except Exception as exc:
            if not (_answered(exc) and "permission denied" in str(getattr(exc, "detail_text", ""))):
                raise
            self._repeat.log(
                "incarnation denied", logging.WARNING,
                "etcd denies %s: epochs are fenced within etcd's cluster id alone, as by "
                "earlier releases (an etcd rebuilt empty with the same members and token makes "
                "agents refuse the new leaders); grant the coordinators read-write on it",
                self.incarnation_key,
            )  # fmt: skip
            return None
        if reply.get("succeeded"):
            return made
        kvs = reply["responses"][0]["response_range"].get("kvs") or []
        if not kvs:  # deleted between the compare and the read: the next campaign stores one
            raise ElectionError(f"{self.incarnation_key} vanished while being read")
        return base64.b64decode(kvs[0].get("value", "")).decode(errors="replace")

    @staticmethod
    def _leader_from(response_range: dict[str, Any]) -> Leader | None:
        kvs = response_range.get("kvs") or []
        if not kvs:
            return None
        kv = kvs[0]
        address = base64.b64decode(kv.get("value", "")).decode(errors="replace")
        return Leader(address, int(kv["create_revision"]), int(kv.get("lease", 0)))

    def _revoke(self, lease: int, role: str = "campaign") -> bool:
        """Revoke ``lease``; False when no member answered (it then lives until it expires)."""
        try:
            self._post("/kv/lease/revoke", {"ID": lease}, role)
        except Exception as exc:
            return _answered(exc)  # (404: expired or revoked already, as good as revoked)
        return True

    def _publish_reach(self, leadership: Leadership, counts: tuple[int, int]) -> None:
        value = reach.encode_reach(reach.Reach(leadership.epoch, *counts))
        body = {"key": _b64(self.reach_key), "value": _b64(value), "lease": leadership.lease}
        # a client of its own per put: a put that timed out may still run in its thread
        self._post("/kv/put", body, "once")

    def read_reach(self) -> reach.Reach | None:
        """What the leader published of its agents, None when nothing is published (a leader
        of an earlier release, or none yet). Blocks: run it in a thread."""
        reply = self._post("/kv/range", {"key": _b64(self.reach_key)}, "once")
        kvs = reply.get("kvs") or []
        if not kvs:
            return None
        return reach.decode_reach(
            base64.b64decode(kvs[0].get("value", "")).decode("utf-8", "replace")
        )

    def _keepalive(self, lease: int) -> int:
        reply = self._post("/lease/keepalive", {"ID": lease}, "keepalive")
        return int(reply.get("result", {}).get("TTL", -1))

    def _renew(self, leadership: Leadership) -> int:
        """Keep the leadership's lease alive, then read the key: the lease's new TTL; -1 when
        the lease is gone; 0 when it lives but the key is gone or another's (deleted, say by
        an operator's ``etcdctl del``: the standbys saw that deletion and one may lead). A
        read that fails leaves the check to the next renewal: the keepalive succeeded."""
        ttl = self._keepalive(leadership.lease)
        if ttl <= 0:
            return ttl
        try:
            reply = self._post("/kv/range", {"key": _b64(self.key)}, "keepalive")
        except Exception:
            return ttl
        now = self._leader_from(reply)
        held = now is not None and (now.epoch, now.lease) == (leadership.epoch, leadership.lease)
        return ttl if held else 0

    def _open_watch(self, revision: int, member: int) -> Response:
        """Watch the key's deletions after ``revision`` on ``member``: the open stream (a
        session of its own: the stream keeps its connection while the standby waits). The
        caller moves to the next member when it fails."""
        request: dict[str, Any] = {
            "key": _b64(self.key), "start_revision": revision + 1, "filters": ["NOPUT"]
        }  # fmt: skip
        stream = self._session().post(
            f"{member_url(self.members[member])}/v3/watch",
            json={"create_request": request}, stream=True, timeout=(self.timeout, None),
        )  # fmt: skip
        if not stream.ok:
            stream.close()
            stream.raise_for_status()
        return stream

    # -- the election, as coroutines ----------------------------------------------------------

    async def campaign(self) -> Leadership:
        """Wait until this candidate leads; returns the leadership (epoch = fencing token).

        etcd errors are logged and retried every TTL/4 (at most every second): a coordinator
        that cannot reach etcd stays a standby.
        """
        while True:
            # shielded: a cancelled campaign leaves the attempt to :meth:`withdraw`
            attempt = self._attempt = asyncio.ensure_future(asyncio.to_thread(self._try_once))
            attempt.add_done_callback(_retrieve)
            try:
                won, revision = await asyncio.shield(attempt)
            except Exception as exc:
                why = self.explain(exc)
                self._repeat.log(f"campaign {why}", logging.WARNING,
                                 "etcd %s: campaign failed: %s", self.failed_url, why)  # fmt: skip
                await self._pause(min(self.ttl / KEEPALIVES_PER_TTL, MAX_CAMPAIGN_PAUSE))
                continue
            self._repeat.clear_matching("campaign ")
            if won is not None:
                log.info("elected leader of %s (epoch %d)", self.key, won.epoch)
                return won
            log.info("standby: %s leads (epoch %s)", self._leader_text(), self._epoch_text())
            await self._wait_for_vacancy(revision)

    async def withdraw(self) -> None:
        """Stop campaigning (a shutdown while standing by), after cancelling :meth:`campaign`.
        Its last attempt runs in a thread that cancelling cannot stop, and may have won, or
        still win: then that lease is revoked, so that a standby leads at once instead of
        redirecting agents for a TTL to a coordinator that is gone."""
        attempt, self._attempt = self._attempt, None
        if attempt is None:
            return
        try:
            async with asyncio.timeout(CAMPAIGN_REQUESTS * self.call_timeout):
                won, _ = await asyncio.shield(attempt)
        except Exception:  # it failed (nothing won), or hangs on past every request's timeout
            return
        if won is not None:
            await self.resign(won)

    async def _wait_for_vacancy(self, revision: int) -> None:
        self._recheck.clear()
        # the watch runs in daemon threads of its own: its stream has no read timeout, and a
        # hung open or read (etcd unreachable) must neither take the threads of the campaign
        # and the keepalives nor hold up the process's exit
        member = self._member
        opening = _in_daemon_thread(self._open_watch, revision, member)
        try:
            async with asyncio.timeout(self.timeout):
                stream = await asyncio.shield(opening)
        except Exception as exc:
            opening.add_done_callback(_close_late_watch)
            self._next_member(member)  # (the open may still hang in its thread)
            log.warning("etcd %s: watch failed: %s", self.failed_url, self.explain(exc))
            await self._pause(RETRY_AFTER_FAILURE)
            return
        deleted: asyncio.Future[bool] = _in_daemon_thread(_next_deletion, stream)
        recheck: asyncio.Future[Any] = asyncio.ensure_future(self._recheck.wait())
        self.watching = True
        try:
            done: set[asyncio.Future[Any]] = set()
            while not done:
                done, _ = await asyncio.wait(
                    {deleted, recheck}, timeout=self.ttl / KEEPALIVES_PER_TTL,
                    return_when=asyncio.FIRST_COMPLETED,
                )  # fmt: skip
                if not done and not await self._same_leader_on(member):
                    break
        finally:
            self.watching = False
            _stop_watch(stream)  # so the thread reading it returns
            recheck.cancel()
            deleted.add_done_callback(_retrieve)
        if deleted in done and (deleted.exception() is not None or not deleted.result()):
            # the stream ended without a deletion: its member died, or closed it
            self._next_member(member)
            error = deleted.exception()
            why = self.explain(error) if error is not None else "the stream ended"
            log.warning("etcd %s: watch ended: %s", self.failed_url, why)
            await self._pause(RETRY_AFTER_FAILURE)

    async def _same_leader_on(self, member: int) -> bool:
        """Whether ``member`` still answers that the leader last seen leads. A watch stream
        stays open and silent when its member hangs, or is cut off from etcd's quorum (it can
        no longer learn of the deletion): this read, linearizable, fails then, and the next
        campaign goes to the next member. False also when the key is gone or changed (a
        deletion the watch has not reported yet): campaign again."""
        try:
            async with asyncio.timeout(2 * self.timeout):
                now = await asyncio.to_thread(self._leader_on, member)
        except Exception as exc:
            if _answered(exc):  # the member works; the campaign reads the key again
                return False
            self._next_member(member)
            why = self.explain(exc) if not isinstance(exc, TimeoutError) else "no answer"
            log.warning("etcd %s: watch's member failed a read: %s", self.failed_url, why)
            await self._pause(RETRY_AFTER_FAILURE)
            return False
        seen = self.leader
        return now is not None and seen is not None and now.epoch == seen.epoch

    def _leader_on(self, member: int) -> Leader | None:
        """The leader key as ``member`` alone reads it (a linearizable range)."""
        _, client = self._client("campaign", member)
        reply = client.post(client.get_url("/kv/range"), json={"key": _b64(self.key)})
        return self._leader_from(reply)

    async def _pause(self, seconds: float) -> None:
        """Wait ``seconds`` before campaigning again, or less when :meth:`depose` asks for a
        campaign at once."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._recheck.wait()
        self._recheck.clear()

    async def hold(
        self, leadership: Leadership, agents: Callable[[], tuple[int, int]] | None = None
    ) -> None:
        """Keep the lease alive; returns once leadership is (or may be) lost. ``agents``: how
        many agents this leader serves and how many connections it turned away at its caps
        lately, published after each keepalive when they changed."""
        publisher = _ReachPublisher(self, leadership, agents)
        try:
            await self._keep_alive(leadership, publisher)
        finally:
            publisher.stop()

    async def _keep_alive(self, leadership: Leadership, publisher: _ReachPublisher) -> None:
        period = self.ttl / KEEPALIVES_PER_TTL
        give_up_after = self.ttl * (1.0 - STEP_DOWN_MARGIN)
        # the grant counts as the first renewal: a slow campaign transaction (etcd answering
        # late, or on the next member) has used up part of the lease already
        won_here = leadership.lease == self.won_lease
        last_good = self.won_lease_sent if won_here else time.monotonic()
        failed = 0
        # one renewal at a time: a wait that times out cannot stop the renewal's thread, so it
        # is waited on again (its answer counts from when it was sent), never joined by a
        # second renewal beside it whose answers could come back in either order
        renewal: asyncio.Future[int] | None = None
        while True:
            if renewal is None:
                sent = time.monotonic()
                renewal = asyncio.ensure_future(asyncio.to_thread(self._renew, leadership))
                renewal.add_done_callback(_retrieve)
            # bounded by the give-up time too, so that leadership ends in time even when etcd
            # stops answering in the middle of a request
            left = max(0.0, last_good + give_up_after - time.monotonic())
            wait = asyncio.timeout(min(self.call_timeout, left))
            try:
                async with wait:
                    ttl = await asyncio.shield(renewal)
            except Exception as exc:
                ttl, failed = None, failed + 1
                if wait.expired():
                    log.warning("etcd %s: keepalive unanswered after %.2f s: waiting on it",
                                self.url, time.monotonic() - sent)  # fmt: skip
                else:
                    log.warning("etcd %s: keepalive failed: %s", self.failed_url, self.explain(exc))
            if not wait.expired():
                renewal = None  # answered: the next keepalive is a new renewal
            if ttl is not None and ttl <= 0:
                why = "the lease is gone" if ttl < 0 else "its key was deleted or replaced"
                log.error("lost leadership (epoch %d): %s", leadership.epoch, why)
                return
            if ttl is not None:
                if failed:
                    log.info("etcd %s: keepalive succeeded again after %d failed (%.2f s since "
                             "the last one)", self.url, failed, sent - last_good)  # fmt: skip
                last_good, failed = sent, 0  # the lease runs at least TTL from when this was sent
                self.renewed_at = sent
                publisher.maybe_publish()
            elif time.monotonic() - last_good >= give_up_after:
                log.error(
                    "lost leadership (epoch %d): no keepalive succeeded for %.2f s",
                    leadership.epoch, time.monotonic() - last_good,
                )  # fmt: skip
                return
            pause = period if ttl is not None else min(period, RETRY_AFTER_FAILURE)
            await asyncio.sleep(max(0.0, sent + pause - time.monotonic()))

    async def resign(self, leadership: Leadership) -> None:
        """Give leadership up now (graceful stop): a standby takes over at once, or once the
        lease expires when etcd does not answer (logged)."""
        revoked = False
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.call_timeout):
                revoked = await asyncio.to_thread(self._revoke, leadership.lease)
        if revoked:
            log.info("resigned leadership (epoch %d)", leadership.epoch)
            return
        log.warning(
            "could not revoke the lease of leadership (epoch %d): etcd %s did not answer; a "
            "standby leads once the lease expires, within %d s",
            leadership.epoch, self.failed_url, self.ttl,
        )  # fmt: skip

    async def depose(self, leader: Leader, reason: str | None = None) -> None:
        """End ``leader``'s leadership by revoking its lease, then let the campaign re-check at
        once instead of waiting for the watch. ``reason``: why (None: its process is gone)."""
        if reason is None:
            log.warning(
                "nothing listens on the leader's address %s any more: revoking its lease "
                "(epoch %d) instead of waiting up to %d s for it to expire",
                leader.address, leader.epoch, self.ttl,
            )  # fmt: skip
        else:
            log.warning("deposing the leader at %s (epoch %d): %s", leader.address,
                        leader.epoch, reason)  # fmt: skip
        with contextlib.suppress(TimeoutError):  # (a client of its own: the campaign may be
            async with asyncio.timeout(self.call_timeout):  # using the others in its thread)
                await asyncio.to_thread(self._revoke, leader.lease, "once")
        self._recheck.set()

    def _leader_text(self) -> str:
        return self.leader.address if self.leader is not None else "nobody"

    def _epoch_text(self) -> str:
        return str(self.leader.epoch) if self.leader is not None else "-"


class _ReachPublisher:
    """Publishes how many agents the leader serves (:mod:`flowsched.coordinator.reach`), in a
    task of its own so that a slow put never delays a keepalive; one put at a time, and again
    after a failed one."""

    def __init__(
        self,
        election: EtcdElection,
        leadership: Leadership,
        agents: Callable[[], tuple[int, int]] | None,
    ) -> None:
        self._election = election
        self._leadership = leadership
        self._agents = agents
        self._published: tuple[int, int] | None = None
        self._task: asyncio.Task[None] | None = None

    def maybe_publish(self) -> None:
        """Publish the count if it changed since the last put that succeeded."""
        if self._agents is None or (self._task is not None and not self._task.done()):
            return
        counts = self._agents()
        if counts != self._published:
            self._task = asyncio.ensure_future(self._publish(counts))

    async def _publish(self, counts: tuple[int, int]) -> None:
        election = self._election
        try:
            async with asyncio.timeout(election.call_timeout):
                await asyncio.to_thread(election._publish_reach, self._leadership, counts)
        except Exception as exc:
            election._repeat.log("publish", logging.WARNING,
                                 "etcd %s: could not publish the agents served: %s",
                                 election.failed_url, election.explain(exc))  # fmt: skip
            return
        election._repeat.clear_matching("publish")
        self._published = counts

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


class LeadershipLost(RuntimeError):
    """This coordinator led and may no longer: it must stop deciding (and exits)."""


#: a standby checks the leader's address at most this often (agents knocking on its door)
PROBE_INTERVAL = 0.2
#: seconds a probe connection to the leader's address may take
PROBE_TIMEOUT = 0.5
#: a standby reads the leader's published reach at most this often (while agents that cannot
#: reach the leader knock)
REACH_READ_INTERVAL = 1.0


def split_address(address: str) -> tuple[str, int] | None:
    """``host:port`` or ``[v6]:port`` -> (host, port); None when malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) <= 65535 or not host:
        return None
    return host.strip("[]"), int(port)


async def refuses_connections(address: str) -> bool:
    """True only when a TCP connect to ``address`` is actively refused: no process listens
    there (a crashed coordinator on a live host). A timeout or unreachable host says nothing:
    the host may be partitioned with the coordinator alive, so only its lease may end it."""
    target = split_address(address)
    if target is None:
        return False
    try:
        async with asyncio.timeout(PROBE_TIMEOUT):
            _, writer = await asyncio.open_connection(*target)
    except ConnectionRefusedError:
        return True
    except (OSError, TimeoutError):
        return False
    writer.close()
    return False


class Candidacy:
    """A coordinator's part in the election: it leads, or it refuses agents with a redirect.

    While standing by it answers each agent's handshake with :meth:`refusal` (the leader's
    address and epoch), and checks at most every :data:`PROBE_INTERVAL` whether the leader's
    address still has a listener: agents knocking here usually means they lost the leader, and
    a refused connection means its process is gone, so the lease is revoked at once instead of
    running out (docs/ha.md). A leader whose process lives but that more agents cannot reach
    than it serves is deposed too (:mod:`flowsched.coordinator.reach`); ``agents`` says how
    many this coordinator serves, published while it leads.
    """

    def __init__(
        self, election: EtcdElection, agents: Callable[[], tuple[int, int]] | None = None
    ) -> None:
        self.election = election
        self.leadership: Leadership | None = None
        self._last_probe = 0.0
        self._probe: asyncio.Task[None] | None = None
        #: how many agents this coordinator serves, and how many connections it turned away at
        #: its caps lately (published while it leads)
        self._agents = agents
        #: the agents refused here, to tell those that cannot reach the leader
        self.knocks = reach.Knocks(reach.sustained_for(election.ttl / KEEPALIVES_PER_TTL))
        #: the epoch of the leader the knocks were refused toward: knocks are evidence against
        #: that leader only (those of a leaderless spell, or toward its predecessor, say nothing
        #: of a successor that the agents are still reaching)
        self._knocks_epoch = 0
        self._last_reach_read = -REACH_READ_INTERVAL

    @property
    def epoch(self) -> int:
        """The fencing token while leading, else 0."""
        return self.leadership.epoch if self.leadership is not None else 0

    @property
    def cluster(self) -> int:
        """The fencing scope (:func:`fencing_scope`) while leading, else 0."""
        return self.leadership.cluster if self.leadership is not None else 0

    def refusal(self, node: str | None = None) -> str | None:
        """None while leading; otherwise the ``not_leader`` reason sent to an agent (``node``,
        when its handshake proved the token: its knock counts, see
        :mod:`flowsched.coordinator.reach`)."""
        if self.leadership is not None:
            return None
        leader = self.election.leader
        if leader is None:
            return "no leader elected yet"
        if node is not None:
            if leader.epoch != self._knocks_epoch:
                self.knocks.clear()
                self._knocks_epoch = leader.epoch
            self.knocks.note(node, time.monotonic())
        self._check_leader(leader)
        return f"leader={leader.address} epoch={leader.epoch}"

    def agents_cut_off(self) -> int:
        """How many nodes cannot reach the leader, as the knocks here tell (0 while leading)."""
        leader = self.election.leader
        if self.leadership is not None or leader is None or leader.epoch != self._knocks_epoch:
            return 0
        return len(self.knocks.cut_off(time.monotonic()))

    def _check_leader(self, leader: Leader) -> None:
        if leader.lease == self.election.won_lease:
            # our own campaign just won and :meth:`run` has not taken the leadership yet (the
            # election records the leader before the campaign returns): never probe ourselves
            return
        now = time.monotonic()
        if (self._probe is not None and not self._probe.done()) or (
            now - self._last_probe < PROBE_INTERVAL
        ):
            return
        self._last_probe = now
        self._probe = asyncio.ensure_future(self._depose_if_gone(leader))

    async def _depose_if_gone(self, leader: Leader) -> None:
        # our own address on a key we do not hold: a previous run of this coordinator that
        # died within one TTL (the address is ours, so nothing else can be listening there)
        gone = leader.address == self.election.address
        gone = gone or await refuses_connections(leader.address)
        reason = None if gone else await self._cut_off_from_agents(leader)
        if (gone or reason is not None) and self.election.leader == leader:
            # (unless somebody replaced it meanwhile)
            await self.election.depose(leader, reason)

    async def _cut_off_from_agents(self, leader: Leader) -> str | None:
        """Why ``leader`` should go because agents cannot reach it, or None: more nodes have
        kept knocking here than it serves (it publishes how many; one that publishes nothing,
        an earlier release, is never deposed this way)."""
        if leader.epoch != self._knocks_epoch:
            return None  # knocks toward another leader
        now = time.monotonic()
        nodes = self.knocks.cut_off(now)
        if not nodes or now - self._last_reach_read < REACH_READ_INTERVAL:
            return None
        self._last_reach_read = now
        election = self.election
        try:
            async with asyncio.timeout(election.call_timeout):
                published = await asyncio.to_thread(election.read_reach)
        except Exception as exc:
            log.debug("etcd %s: reading the leader's reach failed: %s", election.failed_url,
                      election.explain(exc))  # fmt: skip
            return None
        if published is None or published.epoch != leader.epoch:
            return None
        if not reach.should_depose(len(nodes), published):
            return None
        serves = published.agents
        named = ", ".join(nodes[:5]) + (f" and {len(nodes) - 5} more" if len(nodes) > 5 else "")
        return (
            f"agents that cannot reach it, refused here for {self.knocks.sustained_after:g} s "
            f"or more: {len(nodes)} ({named}); it serves {serves}"
        )

    async def run(
        self,
        stop: Awaitable[object],
        quiesce: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        """Stand by, lead once elected, until ``stop`` completes (then resign).

        ``quiesce``: awaited when ``stop`` completes while leading, before the lease is revoked:
        the caller stops deciding and closes its agents' connections there, since a standby
        may lead as soon as the lease is gone (two leaders would send levels at once).

        Raises:
            LeadershipLost: leadership ended without ``stop`` (the lease is gone or could not
                be renewed in time): the caller must stop deciding at once.
        """
        stopping = asyncio.ensure_future(stop)
        campaign = asyncio.ensure_future(self.election.campaign())
        hold: asyncio.Future[None] | None = None
        try:
            await asyncio.wait({campaign, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not campaign.done():
                campaign.cancel()
                await self.election.withdraw()
                return
            self.leadership = campaign.result()
            self.knocks.clear()
            hold = asyncio.ensure_future(self.election.hold(self.leadership, self._agents))
            await asyncio.wait({hold, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not stopping.done():
                raise LeadershipLost(f"lost leadership (epoch {self.leadership.epoch})")
            hold.cancel()
            if quiesce is not None:
                await quiesce()
            await self.election.resign(self.leadership)
        finally:
            for task in (campaign, stopping, hold, self._probe):
                if task is not None:
                    task.cancel()
