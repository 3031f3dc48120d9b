"""A throwaway single-member etcd (Debian's ``etcd-server``) for the HA tests and benchmark.

It listens on free loopback ports, keeps its data in a temporary directory, and is killed with
that directory removed on exit. Nothing here is used by the coordinator itself.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

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


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
            return b'"true"' in response.read()
    except OSError:
        return False


@contextlib.contextmanager
def local_etcd(log: Path | None = None) -> Iterator[str]:
    """Run etcd on 127.0.0.1 until the block ends; yields its client URL.

    Raises:
        RuntimeError: etcd is not installed or did not become healthy.
    """
    binary = etcd_binary()
    if binary is None:
        raise RuntimeError("etcd is not installed (Debian: apt-get install etcd-server)")
    with tempfile.TemporaryDirectory(prefix="flowsched-etcd-") as data:
        client, peer = f"http://127.0.0.1:{_free_port()}", f"http://127.0.0.1:{_free_port()}"
        command = [
            binary, "--name", "ha-test", "--data-dir", data,
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"ha-test={peer}", "--log-level", "warn",
        ]  # fmt: skip
        out = log.open("ab") if log is not None else subprocess.DEVNULL
        process = subprocess.Popen(command, stdout=out, stderr=out)
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while not _healthy(client):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"etcd did not start (exit status {process.poll()})")
                time.sleep(0.05)
            yield client
        finally:
            process.kill()
            process.wait()
            if log is not None and not isinstance(out, int):
                out.close()
