"""TLS files renewed on disk while a ``flowsched coordinator`` leads through https etcd.

Each test runs a real etcd that requires client certificates, lets a coordinator lead through
it, replaces the coordinator's ``--etcd-*`` files the way renewal tools do (rewritten in place,
renamed over, or a Kubernetes-style symlinked directory swapped), then restarts etcd with the
same data and URL: its old connections die, and the coordinator must keep its leadership (the
same epoch, the same process) through new ones.
"""

from __future__ import annotations

import contextlib
import os
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from ha_helpers import (
    Daemon,
    etcd_certificate,
    leads,
    need_etcd,
    start_coordinator,
    total,
    wait_for,
)

from flowsched import tls
from flowsched.protocol import write_token
from flowsched.testbed.daemons import free_ports
from flowsched.testbed.etcd import EtcdServerTls, local_etcd

if TYPE_CHECKING:
    from conftest import TlsFiles

pytestmark = pytest.mark.timeout(90)

#: the coordinator's lease TTL: a keepalive every 4 s, and it keeps leading through 12 s
#: without one (the first keepalive to fail, at most 4 s after etcd stops, restarts etcd, and
#: the next one, 4 s later, must get through)
LEASE_TTL = 16
#: the coordinator's files, in --etcd-cacert, --etcd-cert, --etcd-key order
NAMES = ("ca.pem", "client.pem", "client.key")
FLAGS = ("--etcd-cacert", "--etcd-cert", "--etcd-key")
#: logged by the leader when a keepalive fails, and once etcd answers them again
FAILED, RECOVERED = ": keepalive failed", ": keepalive succeeded again"


@pytest.fixture(scope="session")
def pki(tls_files: TlsFiles) -> Path:
    """The folder of the test PKI (tests/conftest.py's names, ``NAME.pem`` and ``NAME.key``),
    plus etcd certificates from each CA and a bundle of both CAs."""
    folder = tls_files.ca.parent
    both = tls_files.ca.read_bytes() + tls_files.other_ca.read_bytes()
    (folder / "both-cas.pem").write_bytes(both)
    etcd_certificate(tls_files.ca, "etcd-ca")
    etcd_certificate(tls_files.other_ca, "etcd-other-ca")
    return folder


@dataclass(frozen=True)
class Etcd:
    """etcd's settings, as names in :func:`pki`: its certificate, the CAs it trusts for client
    certificates (and its health check for its own), the health check's client pair."""

    cert: str
    trusted: str
    client: str

    def files(self, pki: Path) -> EtcdServerTls:
        return EtcdServerTls(
            pki / f"{self.cert}.pem", pki / f"{self.cert}.key", pki / f"{self.trusted}.pem",
            pki / f"{self.client}.pem", pki / f"{self.client}.key",
        )  # fmt: skip


@dataclass(frozen=True)
class Renewal:
    """etcd before and after its restart; the coordinator's (CA, client pair) before and after
    the renewal (names in :func:`pki`)."""

    etcd_before: Etcd
    etcd_after: Etcd
    before: tuple[str, str]
    after: tuple[str, str]


RENEWALS = {
    # etcd's own certificate is from the new CA: etcd 3.4's gateway dials etcd with it
    "client-cert-under-a-new-ca": Renewal(
        Etcd("etcd-other-ca", "both-cas", "stranger"),
        Etcd("etcd-other-ca", "other-ca", "stranger"),
        before=("other-ca", "client"), after=("other-ca", "stranger"),
    ),
    "cacert-for-a-reissued-server-cert": Renewal(
        Etcd("etcd-ca", "both-cas", "client"),
        Etcd("etcd-other-ca", "both-cas", "client"),
        before=("ca", "client"), after=("other-ca", "client"),
    ),
}  # fmt: skip


def _sources(pki: Path, ca: str, pair: str) -> dict[str, Path]:
    return dict(
        zip(NAMES, (pki / f"{ca}.pem", pki / f"{pair}.pem", pki / f"{pair}.key"), strict=True)
    )


def _install(folder: Path, sources: dict[str, Path], mode: str) -> None:
    """Put ``sources`` in ``folder`` (first install or renewal) as ``mode`` does, the ways
    renewal tools do: "in-place", "rename" or "symlinked-dir"."""
    if mode == "in-place":  # truncated and rewritten, one after the other
        for name, source in sources.items():
            (folder / name).write_bytes(source.read_bytes())
    elif mode == "rename":  # each written aside, then renamed over the old one
        for name, source in sources.items():
            aside = folder / f".{name}.new"
            aside.write_bytes(source.read_bytes())
            os.replace(aside, folder / name)
    else:  # Kubernetes' secret volumes: NAME -> ..data/NAME, ..data -> ..VERSION, swapped
        version = folder / f"..v{len(list(folder.glob('..v*')))}"
        version.mkdir()
        for name, source in sources.items():
            (version / name).write_bytes(source.read_bytes())
            if not (folder / name).is_symlink():
                (folder / name).symlink_to(Path("..data") / name)
        (folder / "..data.new").symlink_to(version.name)
        os.replace(folder / "..data.new", folder / "..data")


@contextlib.contextmanager
def _etcd(tmp: Path, settings: EtcdServerTls, ports: list[int]) -> Iterator[str]:
    """etcd with ``settings``; run again with the same ``ports``: the same member, restarted."""
    need_etcd()
    data = tmp / "etcd-data"
    with local_etcd(tmp / "etcd.log", settings, data_dir=data, ports=ports) as url:
        yield url


def _start(tmp: Path, url: str, files: Path) -> Daemon:
    token = tmp / "token"
    write_token(token)
    flags = [
        part for flag, name in zip(FLAGS, NAMES, strict=True) for part in (flag, str(files / name))
    ]
    return start_coordinator(tmp, token, url, "coord", "--lease-ttl", str(LEASE_TTL), *flags)


def _epoch(coordinator: Daemon) -> float:
    return total(coordinator.metrics(), "flowsched_coordinator_epoch")


def _logged(log: Path, *parts: str) -> bool:
    return any(all(part in line for part in parts) for line in log.read_text().splitlines())


def _health(url: str, sources: dict[str, Path]) -> None:
    context = tls.client_context(*(str(sources[name]) for name in NAMES))
    with urllib.request.urlopen(f"{url}/health", timeout=2, context=context) as response:
        response.read()


def _etcd_stopped(log: Path) -> None:
    """etcd was stopped: wait until the leader notices (its next keepalive fails), so that
    the next keepalive surely needs a new connection to the restarted etcd."""
    wait_for(lambda: _logged(log, FAILED), LEASE_TTL / 2, "a keepalive to fail")


def _keeps_leading(coordinator: Daemon, epoch: float, log: Path) -> None:
    wait_for(lambda: _logged(log, RECOVERED), LEASE_TTL, "the leader's keepalives to get through")
    assert leads(coordinator) and _epoch(coordinator) == epoch
    assert coordinator.proc.poll() is None
    assert not _logged(log, "lost leadership")


#: each renewal with each way of putting files in place once (every way against every change
#: of the files' identity: tests/test_tls.py)
CASES = [
    ("client-cert-under-a-new-ca", "symlinked-dir"),
    ("client-cert-under-a-new-ca", "in-place"),
    ("cacert-for-a-reissued-server-cert", "rename"),
]


@pytest.mark.parametrize(("case", "mode"), CASES)
def test_a_leader_keeps_leading_through_renewed_etcd_tls_files(
    case: str, mode: str, tmp_path: Path, pki: Path
) -> None:
    renewal = RENEWALS[case]
    files, ports = tmp_path / "etcd-tls", free_ports(2)
    files.mkdir()
    _install(files, _sources(pki, *renewal.before), mode)
    coordinator: Daemon | None = None
    try:
        with _etcd(tmp_path, renewal.etcd_before.files(pki), ports) as url:
            coordinator = _start(tmp_path, url, files)
            wait_for(lambda: leads(coordinator), 15, "the coordinator to lead")
            epoch = _epoch(coordinator)
            _install(files, _sources(pki, *renewal.after), mode)
        _etcd_stopped(tmp_path / "coord.log")
        with _etcd(tmp_path, renewal.etcd_after.files(pki), ports) as url:
            with pytest.raises(OSError):  # the files it had no longer get through
                _health(url, _sources(pki, *renewal.before))
            _keeps_leading(coordinator, epoch, tmp_path / "coord.log")
    finally:
        if coordinator is not None:
            coordinator.stop()


#: id -> (the file overwritten, what with, what the leader must log)
BROKEN = {
    "cert-renewed-before-its-key": (
        "client.pem", "stranger.pem", ("--etcd-key: ", "client.key is not the private key")),
    "cacert-cut-short": (
        "ca.pem", "garbage", ("--etcd-cacert: ", "ca.pem is not a PEM CA bundle")),
}  # fmt: skip


@pytest.mark.parametrize(("name", "source", "message"), list(BROKEN.values()), ids=list(BROKEN))
def test_broken_renewed_files_are_logged_and_the_previous_ones_kept(
    name: str, source: str, message: tuple[str, ...], tmp_path: Path, pki: Path
) -> None:
    files, ports = tmp_path / "etcd-tls", free_ports(2)
    files.mkdir()
    _install(files, _sources(pki, "ca", "client"), "in-place")
    settings, log = Etcd("etcd-ca", "ca", "client").files(pki), tmp_path / "coord.log"
    coordinator: Daemon | None = None
    try:
        with _etcd(tmp_path, settings, ports) as url:
            coordinator = _start(tmp_path, url, files)
            wait_for(lambda: leads(coordinator), 15, "the coordinator to lead")
            epoch = _epoch(coordinator)
            broken = (pki / source).read_bytes() if source != "garbage" else b"-----BEGIN C"
            (files / name).write_bytes(broken)
            wait_for(lambda: _logged(log, "kept the previous", *message), 15, f"{message!r}")
        _etcd_stopped(log)
        with _etcd(tmp_path, settings, ports):  # etcd still accepts what the leader had
            _keeps_leading(coordinator, epoch, log)
    finally:
        if coordinator is not None:
            coordinator.stop()
