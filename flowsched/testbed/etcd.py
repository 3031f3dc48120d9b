"""Throwaway etcd servers (Debian's ``etcd-server``) for the HA tests and benchmark.

:func:`local_etcd` runs one member, :func:`local_etcd_cluster` a cluster of several on one
machine, :func:`etcd_cluster_in_namespaces` one member in each of several network namespaces
(the netns testbed's hosts, so that a member can be cut off). They keep their data in
temporary directories, and are killed with those directories removed on exit; with
:class:`EtcdServerTls` the client URL is https and etcd requires client certificates. Nothing
here is used by the coordinator itself.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from flowsched.testbed.daemons import free_ports
from flowsched.tls import client_context

#: seconds allowed for etcd to answer /health after its start
START_TIMEOUT = 20.0
#: bytes of a member's log quoted when it fails to start
LOG_TAIL = 2000


def etcd_binary() -> str | None:
    """Path of the ``etcd`` server binary, None when it is not installed."""
    return shutil.which("etcd")


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
        return client_context(str(self.trusted_ca), str(self.client_cert), str(self.client_key))


def _healthy(url: str, tls: EtcdServerTls | None = None) -> bool:
    context = tls.context() if tls is not None else None
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1, context=context) as response:
            return b'"true"' in response.read()
    except OSError:
        return False


@contextlib.contextmanager
def local_etcd(
    log: Path | None = None,
    tls: EtcdServerTls | None = None,
    *,
    data_dir: Path | None = None,
    ports: Sequence[int] | None = None,
) -> Iterator[str]:
    """Run etcd on 127.0.0.1 until the block ends; yields its client URL (https with ``tls``).

    ``data_dir`` and ``ports`` (client, peer) given again make a restart of the same member:
    its keys and leases, at the same URL (``data_dir`` is then the caller's to remove).

    Raises:
        RuntimeError: etcd is not installed or did not become healthy.
    """
    binary = _binary()
    client_port, peer_port = ports or free_ports(2)
    scheme = "https" if tls is not None else "http"
    client, peer = f"{scheme}://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    with contextlib.ExitStack() as stack:
        data = str(data_dir) if data_dir is not None else stack.enter_context(
            tempfile.TemporaryDirectory(prefix="flowsched-etcd-")
        )  # fmt: skip
        command = _member_command(binary, "ha-test", data, client, peer, f"ha-test={peer}")
        command += tls.flags() if tls is not None else []
        log = log or _scratch_logs(stack) / "etcd.log"
        out = stack.enter_context(log.open("ab"))
        process = subprocess.Popen(command, stdout=out, stderr=out)
        try:
            _wait_healthy(process, client, tls, log)
            yield client
        finally:
            _kill(process)


def _member_command(
    binary: str, name: str, data: str, client: str, peer: str, cluster: str
) -> list[str]:
    # the token is the member list: clusters started side by side (other ports) never join
    return [
        binary, "--name", name, "--data-dir", data,
        "--listen-client-urls", client, "--advertise-client-urls", client,
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
        "--initial-cluster", cluster, "--initial-cluster-token", cluster,
        "--log-level", "warn",
    ]  # fmt: skip


class EtcdCluster:
    """The members of a :func:`local_etcd_cluster`: their client URLs, which one leads, and
    ways to kill or stop one."""

    def __init__(
        self,
        urls: list[str],
        processes: list[subprocess.Popen[bytes]],
        tls: EtcdServerTls | None = None,
    ) -> None:
        self.urls = urls
        self._processes = processes
        self._tls = tls

    @property
    def endpoints(self) -> str:
        """Every member's client URL, comma-separated (the coordinator's ``--etcd``)."""
        return ",".join(self.urls)

    def raft_leader(self) -> int:
        """The member that leads etcd's own (raft) consensus now; killing it makes the others
        elect a new one, about one to two of etcd's election timeouts (1 s by default)."""
        context = self._tls.context() if self._tls is not None else None
        for url in self.urls:
            request = urllib.request.Request(f"{url}/v3/maintenance/status", data=b"{}")
            try:
                with urllib.request.urlopen(request, timeout=2, context=context) as response:
                    status = json.load(response)
            except OSError:
                continue  # a killed member
            if status.get("leader") == status["header"]["member_id"]:
                return self.urls.index(url)
        raise RuntimeError("no etcd member says it leads")

    def kill(self, member: int) -> None:
        """``kill -9`` member ``member`` (the others keep quorum while a majority lives)."""
        self._processes[member].kill()
        self._processes[member].wait()

    def signal(self, member: int, number: int) -> None:
        """Send signal ``number`` to member ``member`` (SIGSTOP: a hung member whose
        connections stay open)."""
        self._processes[member].send_signal(number)


@contextlib.contextmanager
def local_etcd_cluster(
    size: int = 3, log_dir: Path | None = None, tls: EtcdServerTls | None = None
) -> Iterator[EtcdCluster]:
    """Run a cluster of ``size`` etcd members on 127.0.0.1 until the block ends (member ``i``
    logs to ``log_dir/etcd-i.log``). With ``tls``, every member serves https on its client URL
    with those files (the members' own peer traffic stays plain http).

    Raises:
        RuntimeError: etcd is not installed or a member did not become healthy.
    """
    ports = free_ports(2 * size)
    scheme = "https" if tls is not None else "http"
    clients = [f"{scheme}://127.0.0.1:{port}" for port in ports[:size]]
    peers = [f"http://127.0.0.1:{port}" for port in ports[size:]]
    with contextlib.ExitStack() as stack:
        folder = log_dir or _scratch_logs(stack)
        logs = [folder / f"etcd-{i}.log" for i in range(size)]
        extra = tls.flags() if tls is not None else []
        processes = stack.enter_context(_members(clients, peers, logs, extra=extra))
        for process, client, log in zip(processes, clients, logs, strict=True):
            _wait_healthy(process, client, tls, log)  # (healthy once a quorum has formed)
        yield EtcdCluster(clients, processes, tls)


#: the client and peer ports of :func:`etcd_cluster_in_namespaces`' members (etcd's own)
NAMESPACE_PORTS = (2379, 2380)


@contextlib.contextmanager
def etcd_cluster_in_namespaces(
    members: Sequence[tuple[str, str]], log_dir: Path
) -> Iterator[list[str]]:
    """Run one member of a cluster in each network namespace of ``members`` ((namespace, IPv4
    address) each; as root) until the block ends; yields their client URLs, in order.

    Their health is not awaited: nothing outside those namespaces' network reaches them, so the
    caller checks from there (member ``i`` logs to ``log_dir/etcd-i.log``).

    Raises:
        RuntimeError: etcd is not installed.
    """
    client_port, peer_port = NAMESPACE_PORTS
    clients = [f"http://{address}:{client_port}" for _, address in members]
    peers = [f"http://{address}:{peer_port}" for _, address in members]
    logs = [log_dir / f"etcd-{i}.log" for i in range(len(members))]
    # ``ip netns exec`` execs etcd: the process is etcd itself
    wrappers = [["ip", "netns", "exec", netns] for netns, _ in members]
    with _members(clients, peers, logs, wrappers=wrappers):
        yield clients


@contextlib.contextmanager
def _members(
    clients: list[str],
    peers: list[str],
    logs: list[Path],
    *,
    extra: Sequence[str] = (),
    wrappers: Sequence[Sequence[str]] | None = None,
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Start member ``i`` of one cluster on ``clients[i]`` and ``peers[i]`` (its command after
    ``wrappers[i]``, with ``extra`` flags; logging to ``logs[i]``); every started member is
    killed when the block ends, also when a later one fails to start."""
    binary = _binary()
    cluster = ",".join(f"m{i}={peer}" for i, peer in enumerate(peers))
    processes: list[subprocess.Popen[bytes]] = []
    with contextlib.ExitStack() as stack:
        for i, (client, peer) in enumerate(zip(clients, peers, strict=True)):
            data = stack.enter_context(tempfile.TemporaryDirectory(prefix="flowsched-etcd-"))
            out = stack.enter_context(logs[i].open("ab"))
            command = _member_command(binary, f"m{i}", data, client, peer, cluster)
            wrapper = wrappers[i] if wrappers is not None else []
            process = subprocess.Popen([*wrapper, *command, *extra], stdout=out, stderr=out)
            stack.callback(_kill, process)
            processes.append(process)
        yield processes


def _kill(process: subprocess.Popen[bytes]) -> None:
    process.kill()
    process.wait()


def _binary() -> str:
    """:func:`etcd_binary`, or RuntimeError saying how to install it."""
    binary = etcd_binary()
    if binary is None:
        raise RuntimeError("etcd is not installed (Debian: apt-get install etcd-server)")
    return binary


def _scratch_logs(stack: contextlib.ExitStack) -> Path:
    """A folder for logs nobody asked for, gone with ``stack`` (kept for a failed start's
    message)."""
    return Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="flowsched-etcd-log-")))


def _wait_healthy(
    process: subprocess.Popen[bytes], url: str, tls: EtcdServerTls | None, log: Path
) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while not _healthy(url, tls):
        if process.poll() is not None or time.monotonic() > deadline:
            tail = log.read_bytes()[-LOG_TAIL:].decode(errors="replace")
            raise RuntimeError(
                f"etcd at {url} did not start (exit status {process.poll()}); {log} ends:\n{tail}"
            )
        time.sleep(0.05)
