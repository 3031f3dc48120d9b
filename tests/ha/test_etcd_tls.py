"""TLS to etcd: the flag checks (table-driven), and the election against a real https etcd that
requires client certificates (in process, then ``flowsched coordinator`` processes).

The etcd of these tests trusts ``tls_files.ca`` only; ``tls_files.other_ca`` signed the
"stranger" client certificate and verifies nothing of this etcd.
"""

from __future__ import annotations

import asyncio
import ssl
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from ha_helpers import Daemon, leads, start_coordinator, total, wait_for

from flowsched.coordinator.election import ElectionError, EtcdElection, check_tls
from flowsched.protocol import write_token

if TYPE_CHECKING:
    from conftest import TlsFiles

pytestmark = pytest.mark.timeout(90)

HTTPS = "https://127.0.0.1:2379"

#: id -> (--etcd URL, --etcd-cacert, --etcd-cert, --etcd-key, what the refusal must say);
#: file names are keys of :func:`_files`
REFUSED = {
    "cert-without-key": (HTTPS, None, "client.pem", None, "--etcd-cert: needs --etcd-key"),
    "key-without-cert": (HTTPS, None, None, "client.key", "--etcd-key: needs --etcd-cert"),
    "cacert-with-http": (
        "http://127.0.0.1:2379", "ca.pem", None, None, "--etcd-cacert: TLS files need an https"),
    "cert-with-http": (
        "http://127.0.0.1:2379", None, "client.pem", "client.key", "--etcd-cert: TLS files need"),
    "key-with-http": (
        "http://127.0.0.1:2379", "ca.pem", "client.pem", "client.key", "--etcd-cacert: TLS"),
    "cacert-with-schemeless-url": ("127.0.0.1:2379", "ca.pem", None, None, "is plain http"),
    "cacert-missing": (HTTPS, "missing.pem", None, None, "--etcd-cacert: cannot read"),
    "cacert-directory": (HTTPS, "dir", None, None, "--etcd-cacert: cannot read"),
    "cacert-not-pem": (HTTPS, "garbage.pem", None, None, "--etcd-cacert: is not a PEM CA bundle"),
    "cacert-is-a-key": (HTTPS, "client.key", None, None, "is not a PEM CA bundle"),
    "cert-missing": (HTTPS, None, "missing.pem", "client.key", "--etcd-cert: cannot read"),
    "cert-is-a-key": (
        HTTPS, None, "client.key", "client.key", "--etcd-cert: is not a PEM certificate"),
    "key-missing": (HTTPS, None, "client.pem", "missing.key", "--etcd-key: cannot read"),
    "key-not-pem": (
        HTTPS, None, "client.pem", "garbage.pem", "--etcd-key: is not a PEM private key"),
    "key-of-another-cert": (
        HTTPS, None, "client.pem", "stranger.key", "--etcd-key: is not the private key"),
    "key-encrypted": (HTTPS, None, "client.pem", "encrypted.key", "is encrypted"),
}  # fmt: skip


def _files(folder: Path, tls: TlsFiles) -> dict[str, str]:
    """The test PKI's files, plus broken ones made in ``folder``."""
    (folder / "garbage.pem").write_text("-----BEGIN CERTIFICATE-----\nnot base64\n")
    (folder / "dir").mkdir(exist_ok=True)
    encrypted = folder / "encrypted.key"
    subprocess.run(
        ["openssl", "pkey", "-in", str(tls.client_key), "-aes256", "-passout", "pass:secret",
         "-out", str(encrypted)],
        check=True, capture_output=True,
    )  # fmt: skip
    files = {name: str(folder / name) for name in ("garbage.pem", "dir", "encrypted.key")}
    files |= {"missing.pem": str(folder / "missing.pem"), "missing.key": str(folder / "no.key")}
    return files | {
        "ca.pem": str(tls.ca), "client.pem": str(tls.client_cert),
        "client.key": str(tls.client_key), "stranger.key": str(tls.stranger_key),
    }  # fmt: skip


@pytest.mark.parametrize(
    ("url", "cacert", "cert", "key", "message"), list(REFUSED.values()), ids=list(REFUSED)
)
def test_unusable_tls_settings_are_refused_naming_the_flag(
    url: str,
    cacert: str | None,
    cert: str | None,
    key: str | None,
    message: str,
    tmp_path: Path,
    tls_files: TlsFiles,
) -> None:
    files = _files(tmp_path, tls_files)
    paths = [files[name] if name is not None else None for name in (cacert, cert, key)]
    with pytest.raises(ElectionError) as refused:
        check_tls(url, *paths)
    text = str(refused.value)
    for part in message.split(": "):  # "--etcd-key: is not..." -> flag, then the reason
        assert part in text, text


@pytest.mark.parametrize(
    ("cacert", "cert", "key"),
    [(None, None, None), ("ca", None, None), (None, "cert", "key"), ("ca", "cert", "key")],
)
def test_usable_tls_settings_pass(
    cacert: str | None, cert: str | None, key: str | None, tls_files: TlsFiles
) -> None:
    check_tls(
        HTTPS,
        str(tls_files.ca) if cacert else None,
        str(tls_files.client_cert) if cert else None,
        str(tls_files.client_key) if key else None,
    )


def _verify_error(code: int, message: str) -> ssl.SSLCertVerificationError:
    error = ssl.SSLCertVerificationError(1, f"[SSL: CERTIFICATE_VERIFY_FAILED] {message}")
    error.verify_code, error.verify_message = code, message
    return error


def _wrapped(error: BaseException) -> BaseException:
    """``error`` as etcd3gw raises it: its text in ``detail_text`` only, the cause chained."""
    from etcd3gw.exceptions import ConnectionFailedError

    try:
        raise error
    except BaseException:
        try:
            raise ConnectionFailedError(f"HTTPSConnectionPool(...) (Caused by {error!r})")
        except ConnectionFailedError as wrapped:
            return wrapped


#: id -> (the error, what the explanation must say)
EXPLAINED = {
    "unknown-ca": (
        _verify_error(20, "unable to get local issuer certificate"),
        "not signed by a CA in --etcd-cacert /ca.pem (unable to get local issuer certificate)"),
    "hostname-mismatch": (
        _verify_error(62, "Hostname mismatch, certificate is not valid for '127.0.0.1'."),
        "does not name 127.0.0.1"),
    "expired": (
        _verify_error(10, "certificate has expired"),
        "refused (certificate has expired; verified with --etcd-cacert /ca.pem)"),
    "plain-http-etcd": (
        ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1006)"),
        "does not speak TLS"),
    "client-cert-refused": (
        ssl.SSLError(1, "[SSL: SSLV3_ALERT_BAD_CERTIFICATE] sslv3 alert bad certificate"),
        "refused the client certificate --etcd-cert /client.pem"),
    "not-tls": (ConnectionRefusedError(111, "Connection refused"), "Connection refused"),
}  # fmt: skip


@pytest.mark.parametrize(("error", "cause"), list(EXPLAINED.values()), ids=list(EXPLAINED))
def test_a_failed_request_is_explained_by_its_cause(
    error: BaseException, cause: str, tls_files: TlsFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("etcd3gw", reason="the etcd3gw client is not installed")
    monkeypatch.setattr("flowsched.coordinator.election.check_tls", lambda *args: None)
    monkeypatch.setattr("flowsched.tls.reloading_client", lambda *args, **names: None)
    election = EtcdElection(
        "https://127.0.0.1:2379", "t", "a:1", cacert="/ca.pem", cert="/client.pem", key="/k"
    )
    assert cause in election.explain(_wrapped(error)), election.explain(_wrapped(error))
    assert str(_wrapped(error)) == ""  # etcd3gw's quirk: the text is in detail_text only


# -- the election against an https etcd that requires client certificates --------------------


def _election(
    url: str, tls: TlsFiles, address: str, lease_ttl: int = 2, **files: Path | None
) -> EtcdElection:
    """A candidate with the good CA and client certificate unless ``files`` says otherwise."""
    settings = {"cacert": tls.ca, "cert": tls.client_cert, "key": tls.client_key} | files
    paths = {name: str(path) if path is not None else None for name, path in settings.items()}
    return EtcdElection(url, "t", address, lease_ttl, **paths)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_elected_through_https_with_a_client_certificate(
    etcd_tls_url: str, tls_files: TlsFiles
) -> None:
    first = _election(etcd_tls_url, tls_files, "first:1")
    # a TTL of 20 s: the standby reads the key every 5 s, so only its watch can see a resign
    # within a second
    second = _election(etcd_tls_url, tls_files, "second:1", lease_ttl=20)
    won = await asyncio.wait_for(first.campaign(), 10)
    waiting = asyncio.ensure_future(second.campaign())
    holding = asyncio.ensure_future(first.hold(won))
    while second.leader is None:  # its losing read over TLS
        await asyncio.sleep(0.01)
    assert second.leader.address == "first:1" and second.leader.epoch == won.epoch
    assert not waiting.done() and not holding.done()
    holding.cancel()
    resigned = time.monotonic()
    await first.resign(won)
    taken = await asyncio.wait_for(waiting, 5)
    assert taken.epoch > won.epoch
    # the standby's watch (etcd3gw's own session.post) works over TLS: the deletion arrives at
    # once, not at its next read of the key
    assert time.monotonic() - resigned < 1.0
    await second.resign(taken)


@pytest.mark.asyncio
async def test_a_ca_bundle_variable_of_requests_does_not_replace_etcd_cacert(
    etcd_tls_url: str, tls_files: TlsFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    # requests lets REQUESTS_CA_BUNDLE replace a session's CA bundle on every request: with
    # etcd3gw's own ca_cert handling, --etcd-cacert would be ignored wherever it is set
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(tls_files.other_ca))
    monkeypatch.setenv("CURL_CA_BUNDLE", str(tls_files.other_ca))
    election = _election(etcd_tls_url, tls_files, "a:1")
    won = await asyncio.wait_for(election.campaign(), 10)
    await election.resign(won)


@pytest.mark.asyncio
async def test_without_etcd_cacert_the_system_trust_store_verifies_etcd(
    etcd_tls_url: str, tls_files: TlsFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    # OpenSSL's default paths (SSL_CERT_FILE here, as etcdctl honours it), not requests' own
    # certifi bundle nor its REQUESTS_CA_BUNDLE
    monkeypatch.setenv("SSL_CERT_FILE", str(tls_files.ca))
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(tls_files.other_ca))
    election = _election(etcd_tls_url, tls_files, "a:1", cacert=None)
    won = await asyncio.wait_for(election.campaign(), 10)
    await election.resign(won)


#: id -> (what differs from the good settings, what the explanation must say)
REJECTED = {
    "no-client-cert": (
        {"cert": None, "key": None}, "refused the connection without a client certificate"),
    "stranger-client-cert": ("stranger", "refused the client certificate --etcd-cert"),
    "wrong-cacert": ({"cacert": "other_ca"}, "is not signed by a CA in --etcd-cacert"),
    "no-cacert": ({"cacert": None}, "not signed by a CA in the system trust store (no --etcd-"),
}  # fmt: skip


def _rejected_files(tls: TlsFiles, change: object) -> dict[str, Path | None]:
    if change == "stranger":
        return {"cert": tls.stranger_cert, "key": tls.stranger_key}
    assert isinstance(change, dict)
    return {k: getattr(tls, v) if v is not None else None for k, v in change.items()}


@pytest.mark.parametrize(("change", "cause"), list(REJECTED.values()), ids=list(REJECTED))
@pytest.mark.asyncio
async def test_a_rejected_tls_connection_is_explained_and_neverleads(
    change: object, cause: str, etcd_tls_url: str, tls_files: TlsFiles
) -> None:
    bad = _election(etcd_tls_url, tls_files, "bad:1", **_rejected_files(tls_files, change))
    with pytest.raises(Exception) as failed:
        await asyncio.to_thread(bad._try_once)
    assert cause in bad.explain(failed.value), bad.explain(failed.value)
    # the key is free: a good candidate wins it (so the bad one had every chance)
    good = _election(etcd_tls_url, tls_files, "good:1")
    won = await asyncio.wait_for(good.campaign(), 10)
    assert good.leader is not None and good.leader.address == "good:1"
    await good.resign(won)


# -- flowsched coordinator processes ---------------------------------------------------------


def _tls_flags(cacert: Path | None, cert: Path | None, key: Path | None) -> list[str]:
    flags = [("--etcd-cacert", cacert), ("--etcd-cert", cert), ("--etcd-key", key)]
    return [part for flag, path in flags if path is not None for part in (flag, str(path))]


def _logged(log: Path, text: str) -> Callable[[], bool]:
    return lambda: text in log.read_text()


def test_coordinators_elect_one_leader_through_https_etcd_and_hand_over(
    tmp_path: Path, etcd_tls_url: str, tls_files: TlsFiles
) -> None:
    token = tmp_path / "token"
    write_token(token)
    flags = _tls_flags(tls_files.ca, tls_files.client_cert, tls_files.client_key)
    started: list[Daemon] = []
    try:
        for name in ("coord-a", "coord-b"):
            started.append(start_coordinator(tmp_path, token, etcd_tls_url, name, *flags))
        wait_for(lambda: sum(map(leads, started)) == 1, 15, "one of two coordinators to lead")
        leader = next(c for c in started if leads(c))
        standby = next(c for c in started if c is not leader)
        epoch = total(leader.metrics(), "flowsched_coordinator_epoch")
        assert not leads(standby)
        leader.stop()  # SIGTERM: resigns, the standby's watch sees it
        wait_for(lambda: leads(standby), 5, "the standby to take over")
        assert total(standby.metrics(), "flowsched_coordinator_epoch") > epoch
    finally:
        for coordinator in started:
            coordinator.stop()


#: name -> (--etcd-cacert, --etcd-cert, --etcd-key as TlsFiles attributes, a line of its log)
BAD_COORDINATORS = {
    "no-client-cert": (
        "ca", None, None, "refused the connection without a client certificate"),
    "stranger": (
        "ca", "stranger_cert", "stranger_key", "refused the client certificate --etcd-cert"),
    "wrong-cacert": (
        "other_ca", "client_cert", "client_key", "etcd's server certificate is not signed by"),
}  # fmt: skip


def test_coordinators_with_rejected_tls_log_the_cause_and_never_lead(
    tmp_path: Path, etcd_tls_url: str, tls_files: TlsFiles
) -> None:
    token = tmp_path / "token"
    write_token(token)
    started: dict[str, Daemon] = {}
    try:
        for name, (*files, _) in BAD_COORDINATORS.items():
            paths = [getattr(tls_files, f) if f is not None else None for f in files]
            started[name] = start_coordinator(
                tmp_path, token, etcd_tls_url, name, *_tls_flags(*paths)
            )
        for name, (*_, cause) in BAD_COORDINATORS.items():
            wait_for(_logged(tmp_path / f"{name}.log", cause), 15, f"{name} to log {cause!r}")
        assert not any(leads(c) for c in started.values())
        # etcd and the key were there to take: a coordinator with good settings leads at once
        good_flags = _tls_flags(tls_files.ca, tls_files.client_cert, tls_files.client_key)
        good = start_coordinator(tmp_path, token, etcd_tls_url, "good", *good_flags)
        started["good"] = good
        wait_for(lambda: leads(good), 10, "the coordinator with good TLS settings to lead")
        assert not any(leads(c) for name, c in started.items() if name != "good")
        assert all(c.proc.poll() is None for c in started.values())  # standbys, still running
    finally:
        for coordinator in started.values():
            coordinator.stop()
