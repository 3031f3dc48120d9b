"""A throwaway single-member etcd (Debian's ``etcd-server``) for the HA tests and benchmark.

It listens on free loopback ports, keeps its data in a temporary directory, and is killed with
that directory removed on exit; with :class:`EtcdServerTls` its client URL is https and it
requires client certificates. Nothing here is used by the coordinator itself.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from flowsched import tls

#: seconds allowed for etcd to answer /health after its start
START_TIMEOUT = 20.0


def etcd_binary() -> str | None:
    """Path of the ``etcd`` server binary, None when it is not installed."""
    return shutil.which("etcd")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass(frozen=True)
class EtcdServerTls:
    """PEM files of an https etcd that requires client certificates.

    ``cert`` must allow clientAuth as well as serverAuth: etcd 3.4's HTTP gateway dials the
    gRPC server on the same port with it, and ``--client-cert-auth`` checks that dial too
    (without clientAuth every /v3 request fails with "connection closed"). ``client_cert``
    and ``client_key`` are what the health check presents.
    """

    cert: Path
    key: Path
    trusted_ca: Path
    client_cert: Path
    client_key: Path

    def flags(self) -> list[str]:
        """etcd's command-line flags for TLS on its client URL."""
        return [
            "--cert-file", str(self.cert), "--key-file", str(self.key),
            "--trusted-ca-file", str(self.trusted_ca), "--client-cert-auth",
        ]  # fmt: skip

    def context(self) -> ssl.SSLContext:
        """A client context that trusts etcd and presents the client certificate."""
        return tls.client_context(str(self.trusted_ca), str(self.client_cert), str(self.client_key))


def _healthy(url: str, tls: EtcdServerTls | None = None) -> bool:
    context = tls.context() if tls is not None else None
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1, context=context) as response:
            return b'"true"' in response.read()
    except OSError:
        return False


@contextlib.contextmanager
def local_etcd(log: Path | None = None, tls: EtcdServerTls | None = None) -> Iterator[str]:
    """Run etcd on 127.0.0.1 until the block ends; yields its client URL (https with ``tls``).

    Raises:
        RuntimeError: etcd is not installed or did not become healthy.
    """
    binary = etcd_binary()
    if binary is None:
        raise RuntimeError("etcd is not installed (Debian: apt-get install etcd-server)")
    scheme = "https" if tls is not None else "http"
    with tempfile.TemporaryDirectory(prefix="flowsched-etcd-") as data:
        client, peer = f"{scheme}://127.0.0.1:{_free_port()}", f"http://127.0.0.1:{_free_port()}"
        command = [
            binary, "--name", "ha-test", "--data-dir", data,
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"ha-test={peer}", "--log-level", "warn",
            *(tls.flags() if tls is not None else []),
        ]  # fmt: skip
        out = log.open("ab") if log is not None else subprocess.DEVNULL
        process = subprocess.Popen(command, stdout=out, stderr=out)
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while not _healthy(client, tls):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"etcd did not start (exit status {process.poll()})")
                time.sleep(0.05)
            yield client
        finally:
            process.kill()
            process.wait()
            if log is not None and not isinstance(out, int):
                out.close()
