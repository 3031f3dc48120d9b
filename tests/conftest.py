"""Fixtures shared by every test directory: TLS certificates made with the openssl CLI, and
fresh SDK connections for tests that talk to several agents."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

#: subjectAltName of the server certificate: what a client may dial to reach a test server
SERVER_NAMES = "DNS:localhost,IP:127.0.0.1"


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """PEM files of a throw-away PKI: ``ca`` signed ``server`` and ``client``; ``other_ca``
    signed ``stranger``, a client certificate the first CA does not vouch for, and
    ``other_server``, a server certificate for the same names (a renewal under a new CA)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    stranger_cert: Path
    stranger_key: Path
    other_server_cert: Path
    other_server_key: Path


def _openssl(*args: str | Path, cwd: Path) -> None:
    subprocess.run(["openssl", *map(str, args)], cwd=cwd, check=True, capture_output=True)


def _make_ca(folder: Path, name: str) -> tuple[Path, Path]:
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", key, "-out", cert, "-days", "2", "-subj", f"/CN=flowsched test {name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=folder,
    )  # fmt: skip
    return cert, key


def _make_leaf(folder: Path, name: str, ca: tuple[Path, Path], usage: str) -> tuple[Path, Path]:
    cert, key, request = folder / f"{name}.pem", folder / f"{name}.key", folder / f"{name}.csr"
    extensions = folder / f"{name}.ext"
    extensions.write_text(
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature\n"
        f"extendedKeyUsage={usage}\n"
        f"subjectAltName=DNS:{name},{SERVER_NAMES}\n"
        "subjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid\n"
    )
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", key, "-out", request, "-subj", f"/CN={name}-cn",
        cwd=folder,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", request, "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial",
        "-out", cert, "-days", "2", "-extfile", extensions,
        cwd=folder,
    )  # fmt: skip
    key.chmod(0o600)
    return cert, key


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """A CA, a server certificate for localhost / 127.0.0.1, a client certificate, and a
    second CA with a client certificate of its own (skips when openssl is missing)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed (scripts/setup.sh installs it)")
    folder = tmp_path_factory.mktemp("tls")
    ca = _make_ca(folder, "ca")
    other = _make_ca(folder, "other-ca")
    server = _make_leaf(folder, "server", ca, "serverAuth")
    client = _make_leaf(folder, "client", ca, "clientAuth")
    stranger = _make_leaf(folder, "stranger", other, "clientAuth")
    other_server = _make_leaf(folder, "other-server", other, "serverAuth")
    return TlsFiles(ca[0], *server, *client, other[0], *stranger, *other_server)


@pytest.fixture
def fresh_sdk_connections() -> Iterator[None]:
    """Close the SDK's shared agent connections after the test (each test's agent has a socket
    of its own; a connection kept open would try to reconnect to a dead one)."""
    from flowsched import client

    yield
    for conn in list(client._connections.values()):
        conn.close()
    client._connections.clear()
