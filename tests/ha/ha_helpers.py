"""TEST SUPPORT for the HA tests: a real etcd per test (skipped with the reason when absent)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from flowsched.testbed import daemons, netns
from flowsched.testbed.daemons import Daemon, spawn
from flowsched.testbed.etcd import EtcdServerTls, etcd_binary, local_etcd

if TYPE_CHECKING:
    from conftest import TlsFiles


def need_etcd() -> None:
    """Skip the calling test, with the reason, where etcd or its client cannot run."""
    if etcd_binary() is None:
        pytest.skip("etcd is not installed (Debian: apt-get install etcd-server)")
    if importlib.util.find_spec("etcd3gw") is None:
        pytest.skip("the etcd3gw client is not installed (pip install 'flowsched[ha]')")


@contextlib.contextmanager
def etcd_testbed(prefix: str, hosts: int) -> Iterator[netns.Topology]:
    """The netns testbed with ``hosts`` hosts (namespace names start with ``prefix``), for
    tests that run etcd members and coordinators in host namespaces; skips the test, with the
    reason, where etcd or the testbed cannot run."""
    need_etcd()
    spec = netns.TopologySpec(prefix=prefix, hosts=hosts)
    try:
        with netns.testbed(spec) as built:
            yield built
    except netns.TestbedUnavailable as unavailable:
        pytest.skip(f"testbed unavailable: {unavailable}")


def etcd_call(url: str, path: str, body: dict[str, Any], token: str = "") -> dict[str, Any]:
    """POST ``body`` to etcd's v3 JSON gateway at ``url``/v3/``path`` (``token``: an etcd
    authentication token); the decoded answer."""
    request = urllib.request.Request(
        f"{url}/v3/{path}", json.dumps(body).encode(), {"Authorization": token} if token else {}
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=5) as answer:
        reply: dict[str, Any] = json.load(answer)
    return reply


@pytest.fixture
def etcd_url(tmp_path: Path) -> Iterator[str]:
    """A fresh single-member etcd on free loopback ports (its log: tmp_path/etcd.log)."""
    need_etcd()
    with local_etcd(tmp_path / "etcd.log") as url:
        yield url


def etcd_certificate(ca: Path, name: str) -> tuple[Path, Path]:
    """A certificate and key for etcd, signed by ``ca`` (its key next to it, as
    tests/conftest.py keeps them) for serverAuth *and* clientAuth: etcd 3.4's HTTP gateway
    presents it to its own gRPC port (see EtcdServerTls)."""
    ca_key = ca.with_suffix(".key")
    assert ca_key.exists(), ca_key
    folder = ca.parent
    cert, key, request = folder / f"{name}.pem", folder / f"{name}.key", folder / f"{name}.csr"
    extensions = folder / f"{name}.ext"
    extensions.write_text(
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n"
    )
    for args in (
        ["req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", key, "-out", request, "-subj", f"/CN={name}"],
        ["x509", "-req", "-in", request, "-CA", ca, "-CAkey", ca_key,
         "-CAcreateserial", "-out", cert, "-days", "2", "-extfile", extensions],
    ):  # fmt: skip
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)
    return cert, key


@pytest.fixture(scope="session")
def etcd_server_tls(tls_files: TlsFiles) -> EtcdServerTls:
    """TLS files for an etcd that requires client certificates signed by ``tls_files.ca``
    (its own certificate: :func:`etcd_certificate` of that CA)."""
    cert, key = etcd_certificate(tls_files.ca, "etcd")
    return EtcdServerTls(cert, key, tls_files.ca, tls_files.client_cert, tls_files.client_key)


@pytest.fixture
def etcd_tls_url(tmp_path: Path, etcd_server_tls: EtcdServerTls) -> Iterator[str]:
    """A fresh https etcd that requires a client certificate of ``tls_files.ca``."""
    need_etcd()
    with local_etcd(tmp_path / "etcd.log", etcd_server_tls) as url:
        yield url


# -- real processes --------------------------------------------------------------------------

E2E = Path(__file__).resolve().parents[1] / "e2e"


def total(metrics: dict[str, float], prefix: str) -> float:
    """Sum of the samples of metric ``prefix`` (every label set)."""
    return sum(v for k, v in metrics.items() if k.split("{")[0] == prefix)


def leads(coordinator: Daemon) -> bool:
    """Whether ``coordinator`` reports itself the leader on its metrics endpoint."""
    return total(coordinator.metrics(), "flowsched_coordinator_leader") == 1


def start_coordinator(
    tmp: Path, token: Path, etcd: str, name: str, *flags: str, fd_limit: int | None = None
) -> Daemon:
    """A coordinator of the election ``ha`` on free ports (``flags``: more of its flags;
    ``fd_limit``: its open-file limit, which sizes its connection caps)."""
    return spawn(
        name,
        ["coordinator", "--listen", "127.0.0.1:0", "--metrics-port", "0", "--token-file",
         str(token), "--etcd", etcd, "--election-name", "ha", "--log-level", "INFO", *flags],
        tmp / f"{name}.log",
        r"listening on (?P<host>[\d.]+):(?P<port>\d+) metrics [\d.]+:(?P<mport>\d+)",
        fd_limit=fd_limit,
    )  # fmt: skip


def start_agent(tmp: Path, token: Path, coordinators: list[Daemon], node: str) -> Daemon:
    """An agent that knows every coordinator's address."""
    addresses = ",".join(f"127.0.0.1:{c.fields['port']}" for c in coordinators)
    return spawn(
        node,
        ["agent", "--coordinator", addresses, "--node", node, "--token-file", str(token),
         "--table", str(tmp / f"{node}.table"), "--socket", str(tmp / f"{node}.sock"),
         "--slots", "64", "--metrics-port", "0", "--interface", "lo", "--log-level", "INFO"],
        tmp / f"agent-{node}.log",
        r"ready node=(?P<node>\S+) table=(?P<table>\S+) socket=(?P<socket>\S+) "
        r"metrics=[\d.]+:(?P<mport>\d+)",
    )  # fmt: skip


def emulated_plugin(
    tmp: Path, table: str, to: tuple[str, int], name: str, messages: int, gap: float
) -> subprocess.Popen[str]:
    """tests/e2e/plugin_emulator.py: plugin-like traffic on a table slot, verified bytes."""
    return subprocess.Popen(
        [sys.executable, str(E2E / "plugin_emulator.py"), "--table", table,
         "--to", f"{to[0]}:{to[1]}", "--class-id", "0", "--messages", str(messages),
         "--gap", str(gap), "--out", str(tmp / f"{name}.json")],
        stderr=(tmp / f"{name}.log").open("w"), text=True,
    )  # fmt: skip


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> float:
    """Poll every 5 ms until true; the seconds it took (AssertionError naming ``what``)."""
    return daemons.wait_for(predicate, timeout, what, interval=0.005)
