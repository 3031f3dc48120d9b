"""The etcd election against a real etcd: campaign, standby, resign, expiry, depose, fencing."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast
from unittest import mock

import pytest
from ha_helpers import etcd_call, need_etcd

from flowsched.coordinator.config import Addresses, CoordinatorConfig
from flowsched.coordinator.election import (
    ETCD_ERROR_LIMIT,
    Candidacy,
    ElectionError,
    EtcdElection,
    Leader,
    Leadership,
    LeadershipLost,
    _b64,
    fencing_scope,
    lease_ttl,
    refuses_connections,
    short_lease_warning,
    split_address,
)
from flowsched.coordinator.reach import Reach, encode_reach
from flowsched.coordinator.service import serve
from flowsched.protocol.aio import AgentLink, HandshakeError, LinkClosed, connect_agent
from flowsched.testbed.daemons import closed_port, free_ports, wait_for, wait_until
from flowsched.testbed.etcd import local_etcd

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("ftp://x", "n", "a:1", 2), "--etcd"),
        (("http://x:99999", "n", "a:1", 2), "--etcd"),
        (("http://x", "a/b", "a:1", 2), "--election-name"),
        (("http://x", "", "a:1", 2), "--election-name"),
        (("http://x", "n", "a:1", 0), "--lease-ttl"),
        (("http://x", "n", "no-port", 2), "--advertise"),
    ],
)
def test_bad_settings_are_refused_naming_the_flag(args: tuple[object, ...], message: str) -> None:
    with pytest.raises(ElectionError, match=message):
        EtcdElection(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("h:1", ("h", 1)),
        ("[::1]:7711", ("::1", 7711)),
        ("h", None),
        ("h:0", None),
        (":7711", None),
        ("h:x", None),
    ],
)
def test_split_address(text: str, expected: tuple[str, int] | None) -> None:
    assert split_address(text) == expected


@pytest.mark.asyncio
async def test_one_leads_the_other_waits_and_takes_over_on_resign(etcd_url: str) -> None:
    first = EtcdElection(etcd_url, "t", "first:1")
    second = EtcdElection(etcd_url, "t", "second:1")
    won = await first.campaign()
    waiting = asyncio.ensure_future(second.campaign())
    holding = asyncio.ensure_future(first.hold(won))
    await asyncio.sleep(2.5)  # longer than the TTL: the keepalives hold the lease
    assert not waiting.done() and not holding.done()
    assert second.leader is not None and second.leader.address == "first:1"
    assert second.leader.epoch == won.epoch
    holding.cancel()
    resigned = time.monotonic()
    await first.resign(won)
    taken = await asyncio.wait_for(waiting, 5)
    handover = time.monotonic() - resigned
    assert taken.epoch > won.epoch  # the fencing token only grows
    assert taken.lease != won.lease  # a fresh lease per campaign
    assert taken.cluster == won.cluster != 0
    assert handover < 1.0, handover  # a watch round trip, not a TTL
    print(f"\nhandover after resign: {handover * 1e3:.0f} ms")


@pytest.mark.asyncio
async def test_a_restarted_etcd_keeps_the_fencing_scope_and_one_rebuilt_empty_does_not(
    tmp_path: Path,
) -> None:
    need_etcd()
    ports = free_ports(2)
    scopes, epochs = [], []
    for data in ("etcd-a", "etcd-a", "etcd-b"):  # the same member twice, then rebuilt empty
        with local_etcd(tmp_path / "etcd.log", data_dir=tmp_path / data, ports=ports) as url:
            election = EtcdElection(url, "t", "a:1")
            won = await election.campaign()
            await election.resign(won)
        scopes.append(won.cluster)
        epochs.append(won.epoch)
    assert scopes[0] == scopes[1] != 0 and epochs[1] > epochs[0]  # restarted: compared
    assert scopes[2] not in (0, scopes[0]) and epochs[2] <= epochs[0]  # rebuilt: a new scope


def _coordinator_user(url: str, keys: list[str]) -> str:
    """Turn etcd's authentication on with a user granted read-write on ``keys`` alone; its
    token."""
    for path, body in [
        ("auth/user/add", {"name": "root", "password": "root-pw"}),
        ("auth/user/grant", {"user": "root", "role": "root"}),
        ("auth/user/add", {"name": "coordinator", "password": "pw"}),
        ("auth/role/add", {"name": "coordinator"}),
        *[("auth/role/grant", {"name": "coordinator", "perm": {"permType": "READWRITE",
                                                               "key": _b64(key)}})
          for key in keys],
        ("auth/user/grant", {"user": "coordinator", "role": "coordinator"}),
        ("auth/enable", {}),
    ]:  # fmt: skip
        etcd_call(url, path, body)
    return str(
        etcd_call(url, "auth/authenticate", {"name": "coordinator", "password": "pw"})["token"]
    )


@pytest.mark.asyncio
@pytest.mark.parametrize("incarnation_granted", [True, False])
async def test_without_the_incarnation_key_granted_the_scope_is_the_cluster_id(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, incarnation_granted: bool
) -> None:
    """An etcd role that grants the keys of earlier releases only: the leader still wins,
    fencing within etcd's cluster id alone (what earlier releases stamp), and says which key
    to grant."""
    need_etcd()
    keys = ["/flowsched/leader/t", "/flowsched/reach/t"]
    keys += ["/flowsched/incarnation/t"] if incarnation_granted else []
    with local_etcd(tmp_path / "etcd.log") as url:
        token = _coordinator_user(url, keys)
        cluster_id = int(
            etcd_call(url, "kv/range", {"key": _b64(keys[0])}, token)["header"]["cluster_id"]
        )
        election = EtcdElection(url, "t", "a:1")
        original = election._new_client

        def with_token(member: int) -> Any:  # flowsched itself authenticates by certificate
            client = original(member)
            client.session.headers["Authorization"] = token
            return client

        election._new_client = with_token  # type: ignore[method-assign]
        election._clients.clear()
        won = await asyncio.wait_for(election.campaign(), 10)
        await election.resign(won)
    denied = "etcd denies /flowsched/incarnation/t" in caplog.text
    assert denied is not incarnation_granted
    assert (won.cluster == cluster_id) is not incarnation_granted


def test_the_fencing_scope_mixes_the_cluster_id_with_the_incarnation() -> None:
    scope = fencing_scope(7, "a")
    assert scope == fencing_scope(7, "a") != 0
    assert len({scope, fencing_scope(8, "a"), fencing_scope(7, "b")}) == 3
    assert scope < 2**64  # the welcome's field is a uint64


@pytest.mark.asyncio
async def test_a_silent_leader_is_replaced_once_its_lease_expires(etcd_url: str) -> None:
    dead = EtcdElection(etcd_url, "t", "dead:1", lease_ttl=2)
    await dead.campaign()  # and never a keepalive: a crashed host
    started = time.monotonic()
    taken = await asyncio.wait_for(EtcdElection(etcd_url, "t", "b:1").campaign(), 10)
    elapsed = time.monotonic() - started
    assert taken.epoch > 0
    assert 1.0 < elapsed < 6.0, elapsed  # about the TTL plus etcd's expiry scan
    print(f"\ntakeover by lease expiry at TTL 2: {elapsed:.2f} s")


@pytest.mark.asyncio
async def test_a_watch_whose_start_revision_was_compacted_is_no_failure_of_its_member(
    etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # etcd cancels a watch whose start revision it compacted before the watch began (here:
    # the key rewritten and the history compacted between the standby's read and its watch).
    # The member works: the standby reads the key again and watches from there, neither
    # counting a failure of the member (its alert) nor moving on to the next one.
    leader = EtcdElection(etcd_url, "t", "leader:1", lease_ttl=4)
    won = await leader.campaign()
    holding = asyncio.ensure_future(leader.hold(won))
    standby = EtcdElection(etcd_url, "t", "standby:1", lease_ttl=4)
    open_watch, starts, compacted = standby._open_watch, [], []

    def compact_first(revision: int, member: int) -> Any:
        if not compacted:
            put = {"key": _b64(standby.key), "value": _b64("leader:1"), "lease": won.lease}
            for _ in range(3):  # (on the same lease: the same leader and epoch)
                written = int(etcd_call(etcd_url, "kv/put", put)["header"]["revision"])
            etcd_call(etcd_url, "kv/compaction", {"revision": written})
            compacted.append(written)
        starts.append(revision + 1)
        return open_watch(revision, member)

    waiting: asyncio.Future[Leadership] | None = None
    try:
        with (
            mock.patch.object(standby, "_open_watch", compact_first),
            caplog.at_level("INFO", "flowsched.coordinator.election"),
        ):
            waiting = asyncio.ensure_future(standby.campaign())
            await wait_until(lambda: len(starts) == 2 and standby.watching, 5, "a second watch")
        assert starts[0] <= compacted[0] < starts[1], (starts, compacted)
        assert standby.failures == {etcd_url: 0}, caplog.text
        assert "watch ended" not in caplog.text
        holding.cancel()
        await leader.resign(won)
        taken = await asyncio.wait_for(waiting, 5)  # it still sees the leader go
        assert taken.epoch > won.epoch
        await standby.resign(taken)
    finally:
        holding.cancel()
        if waiting is not None:
            waiting.cancel()


def _lease_ttl_left(url: str, lease: int) -> int:
    """Whole seconds etcd gives ``lease`` before it expires; -1 once it is gone."""
    return int(etcd_call(url, "kv/lease/timetolive", {"ID": lease}).get("TTL", -1))


@pytest.mark.asyncio
async def test_a_leader_steps_down_before_a_lease_granted_by_a_slow_campaign_expires(
    etcd_url: str,
) -> None:
    # The lease's TTL runs from its grant, not from the win: when etcd answers the campaign's
    # transaction late, a leader whose keepalives then fail must give up 0.75 TTL after the
    # grant was sent, before etcd can expire the lease and let a successor lead.
    ttl = 6
    election = EtcdElection(etcd_url, "t", "slow:1", lease_ttl=ttl)
    post, granted = election._post, []

    def slow_answers(path: str, body: dict[str, Any], role: str = "campaign") -> dict[str, Any]:
        reply = post(path, body, role)
        if path == "/lease/grant":
            granted.append(int(reply["ID"]))
        elif path == "/kv/txn" and granted:  # the campaign's answer comes half a TTL late
            wait_for(lambda: _lease_ttl_left(etcd_url, granted[0]) <= ttl // 2, ttl, "ttl/2")
        return reply

    with mock.patch.object(election, "_post", slow_answers):
        won = await election.campaign()
    assert won.lease == granted[0]

    def unreachable(lease: int) -> int:
        raise ConnectionError("etcd unreachable")

    with mock.patch.object(election, "_keepalive", unreachable):
        await asyncio.wait_for(election.hold(won), 2 * ttl)
    assert _lease_ttl_left(etcd_url, won.lease) >= 0, "led on after its lease expired"


class _StallingProxy:
    """A TCP proxy to etcd, on the test's event loop, that can stall one answer: that of the
    next request naming ``path`` trickles in a byte every 0.1 s for ``seconds`` (within the
    client's read timeout: the request neither fails nor ends). It notes each request that
    starts while a stalled answer is unfinished."""

    #: seconds between the trickled bytes
    TRICKLE = 0.1

    def __init__(self, upstream: str) -> None:
        self._upstream = split_address(upstream.removeprefix("http://"))
        self.url = ""
        self._path: bytes | None = None
        self._seconds = 0.0
        #: stalled answers unfinished, and finished
        self.stalling = self.stalled = 0
        #: the first lines of the requests that started while an answer was stalled
        self.overlapping: list[bytes] = []
        self._writers: list[asyncio.StreamWriter] = []
        self._connections: list[asyncio.Task[Any]] = []

    def stall(self, path: bytes, seconds: float) -> None:
        """Stall the answer to the next request for ``path`` for ``seconds``."""
        self._path, self._seconds = path, seconds

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._upstream is not None
        self._connections.append(cast(asyncio.Task[Any], asyncio.current_task()))
        up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        self._writers += [writer, up_writer]
        stall_until: list[float] = []  # this connection's answer to stall, until then
        requests = asyncio.ensure_future(self._forward_requests(reader, up_writer, stall_until))
        try:
            while data := await up_reader.read(65536):
                while stall_until and data and time.monotonic() < stall_until[0]:
                    writer.write(data[:1])
                    data = data[1:]
                    await asyncio.sleep(self.TRICKLE)
                writer.write(data)
                if stall_until and time.monotonic() >= stall_until[0]:
                    stall_until.clear()
                    self.stalling, self.stalled = self.stalling - 1, self.stalled + 1
        except ConnectionError:
            pass
        finally:
            requests.cancel()
            writer.close()
            up_writer.close()

    async def _forward_requests(
        self, reader: asyncio.StreamReader, up_writer: asyncio.StreamWriter, stall: list[float]
    ) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                if data.startswith(b"POST "):
                    if self.stalling:
                        self.overlapping.append(data.split(b"\r\n", 1)[0])
                    if self._path is not None and self._path in data.split(b"\r\n", 1)[0]:
                        self._path, self.stalling = None, self.stalling + 1
                        stall.append(time.monotonic() + self._seconds)
                up_writer.write(data)
        up_writer.close()


@contextlib.asynccontextmanager
async def _stalling_proxy(upstream: str) -> AsyncIterator[_StallingProxy]:
    """A :class:`_StallingProxy` to ``upstream`` on a free loopback port, closed at the end."""
    proxy = _StallingProxy(upstream)
    server = await asyncio.start_server(proxy._serve, "127.0.0.1", 0)
    proxy.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield proxy
    finally:
        server.close()
        for writer in proxy._writers:
            writer.close()
        await asyncio.gather(*proxy._connections)  # (their sockets closed: they end)
        await server.wait_closed()


@pytest.mark.asyncio
async def test_a_renewal_that_outlives_its_wait_is_waited_on_again_never_doubled(
    etcd_url: str,
) -> None:
    # A renewal (keepalive, then a read of the key) runs in a thread that the keepalive loop's
    # timeout cannot stop. Here etcd's answer to its read trickles in past that timeout: a
    # second renewal started meanwhile would run beside it (two requests in flight, answers
    # out of order); the loop must wait on the first again instead, and keep the leadership.
    async with _stalling_proxy(etcd_url) as proxy:
        leader = EtcdElection(proxy.url, "t", "leader:1", lease_ttl=4)
        won = await leader.campaign()
        holding = asyncio.ensure_future(leader.hold(won))
        try:
            await wait_until(lambda: leader.renewed_at > 0, 5, "a first keepalive")
            # longer than the loop waits for a renewal, shorter than it waits for a success
            proxy.stall(b"/v3/kv/range", 1.5 * leader.call_timeout)
            await wait_until(lambda: proxy.stalled == 1, 10, "the stalled answer's end")
            renewed = leader.renewed_at
            await wait_until(lambda: leader.renewed_at > renewed, 5, "a keepalive after it")
            assert proxy.overlapping == [], "requests sent while a renewal was in flight"
            assert not holding.done()
        finally:
            holding.cancel()
            await leader.resign(won)


def test_a_campaign_whose_answer_is_lost_does_not_keep_the_key_on_its_lease(
    etcd_url: str,
) -> None:
    # etcd may apply the campaign's transaction and its answer never arrive (a timeout, a
    # member dying after the commit): the key then names this candidate on a lease nobody
    # renews, and without the revocation every candidate, this one too, stands by for a TTL.
    election = EtcdElection(etcd_url, "t", "lost:1", lease_ttl=10)
    post = election._post

    def answer_lost(path: str, body: dict[str, Any], role: str = "campaign") -> Any:
        reply = post(path, body, role)
        if path == "/kv/txn" and "lease" in str(body):  # the campaign's, applied at etcd
            raise ConnectionError("read timed out")
        return reply

    with mock.patch.object(election, "_post", answer_lost), pytest.raises(ConnectionError):
        election._try_once()
    won, _ = election._try_once()
    assert won is not None, f"the key is still held: {election.leader}"


@pytest.mark.parametrize("etcd_answers", [True, False])
@pytest.mark.asyncio
async def test_a_resignation_is_logged_as_one_only_when_the_lease_was_revoked(
    etcd_url: str, caplog: pytest.LogCaptureFixture, etcd_answers: bool
) -> None:
    # A leader stopped while etcd does not answer keeps its lease until it expires: its log
    # must say so, not that it resigned (the standbys wait out the TTL).
    won = await EtcdElection(etcd_url, "t", "a:1").campaign()
    with closed_port() as port:
        url = etcd_url if etcd_answers else f"http://127.0.0.1:{port}"
        with caplog.at_level("INFO", "flowsched.coordinator.election"):
            await EtcdElection(url, "t", "a:1").resign(won)
    assert ("resigned leadership" in caplog.text) is etcd_answers, caplog.text
    assert ("could not revoke" in caplog.text) is not etcd_answers, caplog.text


async def _agent_of_the_leader(address: Addresses, token: bytes) -> AgentLink:
    """An agent link to the coordinator at ``address`` once it leads (it refuses before)."""
    while True:
        try:
            return await connect_agent(address.host, address.port, node="n1", token=token)
        except HandshakeError as exc:
            assert exc.code == "not_leader", exc
            await asyncio.sleep(0.05)


async def _still_served(link: AgentLink) -> bool:
    """Whether the coordinator keeps ``link`` open (its heartbeats come) for a second."""
    try:
        async with asyncio.timeout(1.0):
            while True:
                await link.recv()
    except TimeoutError:
        return True
    except (LinkClosed, ConnectionError):
        return False


@pytest.mark.asyncio
async def test_a_stopping_leader_stops_serving_before_it_resigns(etcd_url: str) -> None:
    # Once the lease is revoked a standby may lead at once: by then the old leader must send
    # nothing more (levels decided next to its successor's) and take no new agent.
    token = b"test-token-0123456789abcdef"
    ready: asyncio.Future[Addresses] = asyncio.get_running_loop().create_future()
    config = CoordinatorConfig.from_policy_file(
        None, token, etcd=etcd_url, election_name="t", metrics_port=None,
        on_ready=ready.set_result,
    )  # fmt: skip
    stop = asyncio.Event()
    running = asyncio.ensure_future(serve(config, shutdown_trigger=stop.wait))
    address = await asyncio.wait_for(ready, 10)
    link = await asyncio.wait_for(_agent_of_the_leader(address, token), 10)
    resign, seen = EtcdElection.resign, []

    async def look_then_resign(election: EtcdElection, leadership: Leadership) -> None:
        seen.append(await _still_served(link))
        seen.append(not await refuses_connections(f"{address.host}:{address.port}"))
        await resign(election, leadership)

    try:
        with mock.patch.object(EtcdElection, "resign", look_then_resign):
            stop.set()
            await asyncio.wait_for(running, 10)
    finally:
        stop.set()
        await link.close()
        await asyncio.wait_for(running, 10)
    assert seen == [False, False]  # (agent still served, listener still open) at the revoke


@pytest.mark.asyncio
async def test_deposing_revokes_only_the_named_leadership(etcd_url: str) -> None:
    old = EtcdElection(etcd_url, "t", "old:1")
    won = await old.campaign()
    standby = EtcdElection(etcd_url, "t", "standby:1")
    waiting = asyncio.ensure_future(standby.campaign())
    while standby.leader is None:
        await asyncio.sleep(0.01)
    stale = standby.leader
    started = time.monotonic()
    await standby.depose(stale)
    taken = await asyncio.wait_for(waiting, 5)
    assert taken.epoch > won.epoch
    assert time.monotonic() - started < 1.0
    # the old leader learns it at its next keepalive: the lease is gone
    await asyncio.wait_for(old.hold(won), 5)
    # deposing the stale leadership again cannot touch the new one (a different lease)
    await EtcdElection(etcd_url, "t", "late:1").depose(stale)
    assert await asyncio.to_thread(standby._keepalive, taken.lease) > 0


@pytest.mark.asyncio
async def test_candidacy_raises_when_its_lease_is_revoked(etcd_url: str) -> None:
    candidacy = Candidacy(EtcdElection(etcd_url, "t", "c:1"))
    never = asyncio.get_running_loop().create_future()
    running = asyncio.ensure_future(candidacy.run(never))
    while candidacy.leadership is None:
        await asyncio.sleep(0.01)
    assert candidacy.refusal() is None and candidacy.epoch > 0
    leadership = candidacy.leadership
    other = EtcdElection(etcd_url, "t", "other:1")
    await asyncio.to_thread(other._revoke, leadership.lease)
    with pytest.raises(LeadershipLost):
        await asyncio.wait_for(running, 5)


@pytest.mark.asyncio
async def test_a_campaign_that_wins_while_the_candidate_stops_revokes_its_lease(
    etcd_url: str,
) -> None:
    # A campaign's requests run in a thread that a shutdown cannot stop: when its transaction
    # wins as the candidate stops, the lease must still be revoked, or the standbys wait a
    # whole TTL, redirecting agents to a coordinator that is gone.
    election = EtcdElection(etcd_url, "t", "stopping:1", lease_ttl=10)
    candidacy = Candidacy(election)
    post, granted = election._post, []
    won_at_etcd, abandoned = threading.Event(), threading.Event()

    def answer_once_abandoned(path: str, body: dict[str, Any], role: str = "campaign") -> Any:
        reply = post(path, body, role)
        if path == "/lease/grant":
            granted.append(reply)
        elif path == "/kv/txn" and granted:  # won at etcd; the answer is still on its way
            won_at_etcd.set()
            abandoned.wait(10)
        return reply

    async def campaign() -> Leadership:
        try:
            return await EtcdElection.campaign(election)
        except asyncio.CancelledError:
            abandoned.set()
            raise

    stop = asyncio.get_running_loop().create_future()
    with (
        mock.patch.object(election, "_post", answer_once_abandoned),
        mock.patch.object(election, "campaign", campaign),
    ):
        running = asyncio.ensure_future(candidacy.run(stop))
        await wait_until(won_at_etcd.is_set, 10, "the campaign's transaction")
        stop.set_result(None)
        await asyncio.wait_for(running, 10)
    assert candidacy.leadership is None
    other = EtcdElection(etcd_url, "t", "other:1")
    taken, _ = await asyncio.to_thread(other._try_once)
    assert taken is not None, f"the stopped candidate still holds the key: {other.leader}"
    await other.resign(taken)


@pytest.mark.parametrize("replaced", [False, True])
@pytest.mark.asyncio
async def test_a_leader_whose_key_is_deleted_steps_down(etcd_url: str, replaced: bool) -> None:
    # `etcdctl del /flowsched/leader/NAME` (say, to force an election) leaves the leader's
    # lease alive: the standbys see the deletion and one leads, so the old leader must stop,
    # or two lead for as long as its keepalives succeed.
    candidacy = Candidacy(EtcdElection(etcd_url, "t", "c:1"))
    never = asyncio.get_running_loop().create_future()
    running = asyncio.ensure_future(candidacy.run(never))
    await wait_until(lambda: candidacy.leadership is not None, 5, "the leadership")
    key = _b64(candidacy.election.key)
    await asyncio.to_thread(etcd_call, etcd_url, "kv/deleterange", {"key": key})
    if replaced:  # and put again by someone else (a successor's campaign)
        await asyncio.to_thread(etcd_call, etcd_url, "kv/put", {"key": key, "value": key})
    with pytest.raises(LeadershipLost):
        await asyncio.wait_for(running, 5)


@pytest.mark.asyncio
async def test_a_candidate_never_deposes_the_leadership_it_has_just_won(etcd_url: str) -> None:
    # The campaign records the new leader (this candidate's own address) before run() takes
    # the leadership; an agent refused in that window must not make it revoke its own lease
    # (seen in a CI run: "nothing listens on the leader's address <own> any more").
    candidacy = Candidacy(EtcdElection(etcd_url, "t", "127.0.0.1:1"))
    won = await candidacy.election.campaign()  # won, and run() has not seen it
    assert candidacy.leadership is None and candidacy.election.leader is not None
    assert candidacy.refusal() == f"leader=127.0.0.1:1 epoch={won.epoch}"
    assert candidacy._probe is None  # no probe of our own address was started
    holding = asyncio.ensure_future(candidacy.election.hold(won))
    await asyncio.sleep(0)
    assert not holding.done()
    other = EtcdElection(etcd_url, "t", "other:1")
    assert await asyncio.to_thread(other._try_once) == (None, mock.ANY)  # the lease still holds
    holding.cancel()
    await candidacy.election.resign(won)


@pytest.mark.asyncio
async def test_a_standby_redirects_and_deposes_a_leader_whose_port_is_closed(
    etcd_url: str,
) -> None:
    with closed_port() as port:  # a crashed coordinator's address
        dead_address = f"127.0.0.1:{port}"
        assert await refuses_connections(dead_address)
        dead = EtcdElection(etcd_url, "t", dead_address)
        won = await dead.campaign()
        standby = Candidacy(EtcdElection(etcd_url, "t", "127.0.0.1:1"))
        never = asyncio.get_running_loop().create_future()
        running = asyncio.ensure_future(standby.run(never))
        while standby.election.leader is None:
            await asyncio.sleep(0.01)
        started = time.monotonic()
        assert standby.refusal() == f"leader={dead_address} epoch={won.epoch}"  # and a probe
        while standby.leadership is None:
            await asyncio.sleep(0.005)
        elapsed = time.monotonic() - started
        assert standby.leadership.epoch > won.epoch
        assert elapsed < 1.0, elapsed  # not the 2 s TTL
        never.set_result(None)
        await asyncio.wait_for(running, 5)  # stops and resigns


@pytest.mark.asyncio
async def test_a_listening_leader_is_not_deposed(etcd_url: str) -> None:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        assert not await refuses_connections(address)
        leader = EtcdElection(etcd_url, "t", address)
        won = await leader.campaign()
        holding = asyncio.ensure_future(leader.hold(won))
        standby = Candidacy(EtcdElection(etcd_url, "t", "127.0.0.1:2"))
        never = asyncio.get_running_loop().create_future()
        running = asyncio.ensure_future(standby.run(never))
        while standby.election.leader is None:
            await asyncio.sleep(0.01)
        for _ in range(3):
            assert standby.refusal() is not None
            await asyncio.sleep(0.3)
        assert standby.leadership is None and not holding.done()
        never.set_result(None)
        await asyncio.wait_for(running, 5)
        holding.cancel()
    finally:
        server.close()


@pytest.mark.asyncio
async def test_without_etcd_a_candidate_keeps_trying_and_never_leads() -> None:
    with closed_port() as port:  # no etcd there
        election = EtcdElection(f"http://127.0.0.1:{port}", "t", "127.0.0.1:1")
        candidacy = Candidacy(election)
        stop = asyncio.get_running_loop().create_future()
        with mock.patch.object(election, "_try_once", wraps=election._try_once) as tries:
            running = asyncio.ensure_future(candidacy.run(stop))
            await wait_until(lambda: tries.call_count >= 3, 10, "three failed campaigns")
        assert not running.done() and candidacy.leadership is None
        assert candidacy.refusal() == "no leader elected yet"
        stop.set_result(None)
        await asyncio.wait_for(running, 5)


@pytest.mark.asyncio
async def test_a_campaign_etcd_refuses_is_logged_with_etcds_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """etcd answers a refused request with an HTTP status and its reason in the body: the log
    gives both (here etcd's authentication, which the coordinator cannot log in to), not the
    status alone."""
    need_etcd()
    with local_etcd(tmp_path / "etcd.log") as url:
        for path, body in [
            ("auth/user/add", {"name": "root", "password": "root-pw"}),
            ("auth/user/grant", {"user": "root", "role": "root"}),
            ("auth/enable", {}),
        ]:
            etcd_call(url, path, body)
        election = EtcdElection(url, "t", "127.0.0.1:1")
        campaign = asyncio.ensure_future(election.campaign())
        try:
            await wait_until(lambda: "campaign failed" in caplog.text, 10, "a failed campaign")
        finally:
            campaign.cancel()
            await election.withdraw()
    assert "campaign failed: Bad Request: etcdserver: user name is empty" in caplog.text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("http://a,https://b", "mixes http:// and https://"),
        ("http://a,,http://b", "comma-separated"),
        ("http://a,http://a:2379", "listed twice"),
        ("http://a,http://b:x", "bad port in 'http://b:x'"),
        ("http://a,ftp://b", "got 'ftp://b'"),
    ],
)
def test_bad_member_lists_are_refused_naming_the_flag(text: str, message: str) -> None:
    with pytest.raises(ElectionError, match=r"^--etcd: ") as refused:
        EtcdElection(text, "n", "a:1")
    assert message in str(refused.value)


def _fake_members(
    election: EtcdElection, answer: Callable[[int], dict[str, object]]
) -> contextlib.AbstractContextManager[object]:
    """Patch ``election`` so that each member's client answers every POST with
    ``answer(member index)`` (which may raise, as a failing member does)."""

    class Member:
        def __init__(self, index: int) -> None:
            self.index = index

        def get_url(self, path: str) -> str:
            return path

        def post(self, url: str, json: object) -> dict[str, object]:
            return answer(self.index)

    election._clients.clear()
    return mock.patch.object(election, "_new_client", Member)


def test_a_request_goes_to_the_next_members_in_turn_until_one_answers() -> None:
    election = EtcdElection("http://a:1,http://b:2,http://c:3", "t", "x:1")
    dead: set[int] = set()
    tried: list[int] = []

    def answer(index: int) -> dict[str, object]:
        tried.append(index)
        if index in dead:
            raise ConnectionError(f"member {index} refused")
        return {"result": {"TTL": "5"}}

    with _fake_members(election, answer):
        assert election._keepalive(1) == 5 and tried == [0]
        dead.add(0)
        assert election._keepalive(1) == 5 and tried == [0, 0, 1]
        assert election.url == "http://b:2" and election.failed_url == "http://a:1"
        assert election._keepalive(1) == 5 and tried == [0, 0, 1, 1]  # later ones start at b
        dead.update({1, 2})
        with pytest.raises(ConnectionError, match="member 0"):  # the last one's error
            election._keepalive(1)
        assert tried[4:] == [1, 2, 0]
        dead.clear()
        assert election._keepalive(1) == 5 and tried[7:] == [1]
    assert election.failures == {"http://a:1": 2, "http://b:2": 1, "http://c:3": 1}


def test_an_answer_that_faults_the_request_is_no_failure_of_the_member() -> None:
    """Revoking a lease that is already gone (a second depose, a resign after expiry) gets
    etcd's 404: the member answered, so it is neither counted as failing nor left."""
    pytest.importorskip("etcd3gw", reason="the etcd3gw client is not installed")
    from etcd3gw.exceptions import ConnectionFailedError, Etcd3Exception

    election = EtcdElection("http://a:1,http://b:2", "t", "x:1")
    answers: list[BaseException] = []
    tried: list[int] = []

    def answer(index: int) -> dict[str, object]:
        tried.append(index)
        raise answers[len(tried) - 1]

    with _fake_members(election, answer):
        answers.append(
            Etcd3Exception('{"error":"etcdserver: requested lease not found"}', "Not Found")
        )
        election._revoke(7)  # (suppressed: a lease gone is as good as revoked)
        assert tried == [0] and election.url == "http://a:1"
        assert election.failures == {"http://a:1": 0, "http://b:2": 0}
        answers += [ConnectionFailedError("no leader"), Etcd3Exception("x", "Not Found")]
        election._revoke(7)  # a 503 is the member's: the next one is asked
        assert tried == [0, 0, 1] and election.url == "http://b:2"
        assert election.failures == {"http://a:1": 1, "http://b:2": 0}


def test_a_failed_request_is_explained_with_etcds_words() -> None:
    pytest.importorskip("etcd3gw", reason="the etcd3gw client is not installed")
    from etcd3gw.exceptions import ConnectionFailedError, Etcd3Exception

    explain = EtcdElection("http://a:1", "t", "x:1").explain
    no_leader = ConnectionFailedError(
        '{"error":"etcdserver: no leader","code":14}\n', "Service Unavailable"
    )
    assert explain(no_leader) == "Service Unavailable: etcdserver: no leader"
    long = explain(Etcd3Exception("proxy\n said\tno " * 40, "Bad Gateway"))  # one line, cut
    assert long.startswith("Bad Gateway: proxy said no proxy") and long.endswith("...")
    assert len(long) == len("Bad Gateway: ") + ETCD_ERROR_LIMIT + 3 and "\n" not in long
    refused = "HTTPConnectionPool(host='a', port=1): ... [Errno 111] Connection refused'))"
    assert explain(ConnectionFailedError(refused)) == refused  # (no status: the text as it came)


@pytest.mark.parametrize(
    ("etcd", "given", "ttl", "warned"),
    [
        ("http://a", None, 2, False),
        ("http://a,http://b,http://c", None, 10, False),
        ("http://a,http://b,http://c", 2, 2, True),
        ("http://a,http://b,http://c", 5, 5, True),
        ("http://a,http://b,http://c", 10, 10, False),
        ("http://a", 1, 1, False),
    ],
)
def test_the_lease_ttl_outlasts_an_etcd_leader_change_with_several_members(
    etcd: str, given: int | None, ttl: int, warned: bool
) -> None:
    config = CoordinatorConfig(
        token=b"t" * 32,
        policy_factory=object,  # type: ignore[arg-type]
        etcd=etcd,
        lease_ttl=given,
    )
    assert lease_ttl(config) == ttl
    assert EtcdElection.from_config(config, "x:1").ttl == ttl
    warning = short_lease_warning(config)
    assert (warning is not None) == warned
    if warning is not None:
        assert warning.startswith(f"--lease-ttl {given} with 3 etcd members")


async def _leader_serving(
    etcd_url: str, serves: int | None, turned_away: int = 0
) -> tuple[EtcdElection, asyncio.Future[None], asyncio.base_events.Server]:
    """A leader whose process lives (its address has a listener) and that publishes that it
    serves ``serves`` agents and turned ``turned_away`` away at its caps (None: publishes
    nothing, as an earlier release)."""
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    leader = EtcdElection(etcd_url, "t", f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
    won = await leader.campaign()
    counting = None if serves is None else (lambda: (serves, turned_away))
    holding = asyncio.ensure_future(leader.hold(won, counting))
    if serves is not None:
        published = Reach(won.epoch, serves, turned_away)
        await wait_until(lambda: leader.read_reach() == published, 5, "the reach", 0.1)
    return leader, holding, server


@contextlib.asynccontextmanager
async def _standing_by(etcd_url: str) -> AsyncIterator[Candidacy]:
    """A standby candidacy (knocks count after 0.5 s) that has seen the leader; stopped at
    the end."""
    standby = Candidacy(EtcdElection(etcd_url, "t", "127.0.0.1:2"))
    standby.knocks.sustained_after = 0.5
    never = asyncio.get_running_loop().create_future()
    running = asyncio.ensure_future(standby.run(never))
    try:
        await wait_until(lambda: standby.election.leader is not None, 5, "the standby")
        yield standby
    finally:
        never.set_result(None)
        await asyncio.wait_for(running, 5)


async def _knock_until(standby: Candidacy, nodes: list[str], seconds: float) -> None:
    """``nodes`` knock on ``standby`` (refused each time) every 0.1 s for ``seconds``, or until
    it leads."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and standby.leadership is None:
        for node in nodes:
            standby.refusal(node)
        await asyncio.sleep(0.1)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("serves", "turned_away", "knocking", "deposed"),
    [
        pytest.param(0, 0, ["n1"], True, id="serves-none"),
        pytest.param(1, 0, ["n1", "n2"], True, id="serves-fewer"),
        pytest.param(2, 0, ["n1", "n2"], False, id="serves-as-many"),
        pytest.param(None, 0, ["n1", "n2"], False, id="publishes-nothing"),
        # the knocking agents reach the leader and are turned away at its caps
        pytest.param(1, 2, ["n1", "n2"], False, id="turns-agents-away"),
    ],
)
async def test_a_standby_deposes_a_live_leader_that_fewer_agents_reach(
    etcd_url: str, serves: int | None, turned_away: int, knocking: list[str], deposed: bool
) -> None:
    _, holding, server = await _leader_serving(etcd_url, serves, turned_away)
    try:
        async with _standing_by(etcd_url) as standby:
            await _knock_until(standby, knocking, 3.0)
            assert (standby.leadership is not None) is deposed
            if deposed:
                await asyncio.wait_for(holding, 5)  # the old leader finds its lease gone
                assert standby.agents_cut_off() == 0  # it leads
            else:
                assert not holding.done()
                assert standby.agents_cut_off() == len(knocking)  # the standby's gauge
    finally:
        holding.cancel()
        server.close()


@pytest.mark.asyncio
async def test_the_leader_publishes_the_agents_it_serves_as_they_change(etcd_url: str) -> None:
    serving = [0]
    leader = EtcdElection(etcd_url, "t", "127.0.0.1:1")
    won = await leader.campaign()
    holding = asyncio.ensure_future(leader.hold(won, lambda: (serving[0], 0)))
    try:
        first = Reach(won.epoch, 0)
        await wait_until(lambda: leader.read_reach() == first, 5, "the first count", 0.1)
        serving[0] = 7
        changed = Reach(won.epoch, 7)
        await wait_until(lambda: leader.read_reach() == changed, 5, "the new count", 0.1)
    finally:
        holding.cancel()
        await leader.resign(won)
    assert leader.read_reach() is None  # on the leader's lease: gone with it


@pytest.mark.asyncio
@pytest.mark.parametrize("before", ["no-leader", "previous-leader"])
async def test_knocks_toward_no_leader_or_its_predecessor_do_not_depose_a_new_leader(
    etcd_url: str, before: str
) -> None:
    """A third coordinator saw every agent knock during a leaderless spell (or while the
    previous leader's host was dead and its lease alive); a fresh leader that serves only some
    of them yet is not deposed when a straggler knocks."""
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    standby = Candidacy(EtcdElection(etcd_url, "t", "127.0.0.1:2"))
    standby.knocks.sustained_after = 0.5
    previous = EtcdElection(etcd_url, "t", address)
    old = await previous.campaign() if before == "previous-leader" else None
    standby.election.leader = previous.leader  # what the standby's watch would say
    await _knock_until(standby, ["n1", "n2", "n3"], 1.0)
    if old is not None:
        await previous.resign(old)
    successor = EtcdElection(etcd_url, "t", address)
    won = await successor.campaign()
    holding = asyncio.ensure_future(successor.hold(won, lambda: (1, 0)))  # one agent back yet
    try:
        published = Reach(won.epoch, 1)
        await wait_until(lambda: successor.read_reach() == published, 5, "the reach", 0.1)
        standby.election.leader = successor.leader
        await _knock_until(standby, ["n3"], 2.0)  # a straggler, redirected to the successor
        assert not holding.done(), "deposed on knocks toward another leader"
        assert standby.agents_cut_off() == 1  # the straggler's streak is the successor's
    finally:
        holding.cancel()
        await successor.resign(won)
        server.close()


@pytest.mark.asyncio
async def test_a_reach_published_under_another_epoch_deposes_nobody(etcd_url: str) -> None:
    """What the key holds must be the current leader's: one left under another epoch (a
    predecessor's, or written by hand) says nothing of this leader."""
    leader, holding, server = await _leader_serving(etcd_url, None)  # publishes nothing itself
    assert leader.leader is not None
    stale = encode_reach(Reach(leader.leader.epoch + 100, 0))
    await asyncio.to_thread(
        leader._post, "/kv/put", {"key": _b64(leader.reach_key), "value": _b64(stale)}
    )
    assert leader.read_reach() == Reach(leader.leader.epoch + 100, 0)
    try:
        async with _standing_by(etcd_url) as standby:
            await _knock_until(standby, ["n1"], 2.5)
            assert standby.leadership is None and not holding.done()
    finally:
        holding.cancel()
        server.close()
        await asyncio.to_thread(leader._post, "/kv/deleterange", {"key": _b64(leader.reach_key)})


def test_knocks_count_after_the_time_the_lease_ttl_asks_for() -> None:
    """With a long lease the leader publishes its count less often: knocks count later."""
    for ttl, sustained in ((10, 5.0), (30, 10.0)):
        candidacy = Candidacy(EtcdElection("http://127.0.0.1:1", "t", "127.0.0.1:2", ttl))
        assert candidacy.knocks.sustained_after == sustained


@pytest.mark.asyncio
async def test_the_gauge_counts_no_knocks_made_toward_a_previous_leader() -> None:
    standby = Candidacy(EtcdElection("http://127.0.0.1:1", "t", "127.0.0.1:2"))
    standby.knocks.sustained_after = 0.0
    standby._last_probe = time.monotonic() + 3600  # no probes of these made-up leaders
    old = Leader("127.0.0.1:3", epoch=5, lease=1)
    standby.election.leader = old
    assert standby.refusal("n1") is not None
    assert standby.agents_cut_off() == 1
    standby.election.leader = Leader("127.0.0.1:4", epoch=9, lease=2)  # no knock since
    assert standby.agents_cut_off() == 0
