"""TLS between real ``flowsched agent`` and ``flowsched coordinator`` processes."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import (
    agent_in_session,
    cleanup,
    start_agent,
    start_coordinator,
    total,
    wait_for,
)

from flowsched.cli import main
from flowsched.protocol import write_token

COORDINATOR = "flowsched_coordinator"


def test_mutual_tls_admits_the_agent_its_certificate_names_and_names_the_others(
    tmp_path: Path, tls_files: Any
) -> None:
    token = tmp_path / "token"
    write_token(token)
    server = ("--tls-cert", str(tls_files.server_cert), "--tls-key", str(tls_files.server_key),
              "--tls-client-ca", str(tls_files.ca))  # fmt: skip
    with cleanup() as started:
        coordinator = start_coordinator(tmp_path, token, extra=server)
        started.append(coordinator)
        port = int(coordinator.fields["port"])
        trusted = ("--tls-ca", str(tls_files.ca), "--tls-cert", str(tls_files.client_cert),
                   "--tls-key", str(tls_files.client_key))  # fmt: skip
        # "client" is a DNS alt name of its certificate: it may log in as that node
        admitted = start_agent(tmp_path, token, port, node="client", extra=trusted)
        started.append(admitted)
        # no client certificate: TLS (it verifies the coordinator) but refused by it
        refused = start_agent(
            tmp_path, token, port, node="refused", extra=("--tls-ca", str(tls_files.ca))
        )
        started.append(refused)
        # a trusted certificate that does not name the node it logs in as
        impostor = start_agent(tmp_path, token, port, node="impostor", extra=trusted)
        started.append(impostor)

        def coordinator_metric(name: str, **labels: str) -> float:
            return total(coordinator.metrics(), f"{COORDINATOR}_{name}", **labels)

        wait_for(lambda: coordinator_metric("agents_connected") == 1, 20, "the trusted agent")
        # its log says "over TLSv1.3" once it took the welcome, after the coordinator counts it
        wait_for(lambda: agent_in_session(admitted), 20, "the trusted agent's session")
        assert "over TLSv1.3" in (tmp_path / "agent-client.log").read_text()
        wait_for(
            lambda: coordinator_metric("closed_connections_total", reason="tls") >= 1, 20,
            "the refused agent's handshake counted",
        )  # fmt: skip
        agent_log = tmp_path / "agent-refused.log"
        wait_for(lambda: "client certificate it trusts" in agent_log.read_text(), 20, "its log")
        assert total(refused.metrics(), "flowsched_agent_coordinator_connected") == 0
        coordinator_log = (tmp_path / "coordinator.log").read_text()
        assert "TLS handshake with 127.0.0.1:" in coordinator_log
        assert "peer did not return a certificate" in coordinator_log
        wait_for(
            lambda: coordinator_metric("closed_connections_total", reason="auth_failed") >= 1, 20,
            "the impostor refused",
        )  # fmt: skip
        impostor_log = tmp_path / "agent-impostor.log"
        wait_for(
            lambda: "node 'impostor' is not a name of the client certificate"
            in impostor_log.read_text(), 20, "the impostor's log",
        )  # fmt: skip
        assert total(impostor.metrics(), "flowsched_agent_coordinator_connected") == 0
        assert coordinator_metric("agents_connected") == 1


@pytest.mark.parametrize(
    ("command", "flags", "named"),
    [
        ("coordinator", ["--tls-cert", "{server_cert}"], "--tls-key:"),
        ("coordinator", ["--tls-key", "{server_key}"], "--tls-cert:"),
        (
            "coordinator",
            ["--tls-cert", "{server_cert}", "--tls-key", "{client_key}"],
            "--tls-key:",
        ),
        ("coordinator", ["--tls-client-ca", "{ca}"], "--tls-client-ca:"),
        (
            "coordinator",
            [
                "--tls-cert",
                "{server_cert}",
                "--tls-key",
                "{server_key}",
                "--tls-client-ca",
                "{server_key}",
            ],
            "--tls-client-ca:",
        ),
        ("agent", ["--tls-cert", "{client_cert}"], "--tls-key:"),
        ("agent", ["--tls-ca", "{missing}"], "--tls-ca:"),
        ("agent", ["--tls-ca", "{client_key}"], "--tls-ca:"),
        ("agent", ["--tls-cert", "{client_cert}", "--tls-key", "{server_key}"], "--tls-key:"),
    ],
)
def test_refuses_an_unusable_tls_setting_naming_the_flag(
    tmp_path: Path, tls_files: Any, capsys: pytest.CaptureFixture[str],
    command: str, flags: list[str], named: str,
) -> None:  # fmt: skip
    token = tmp_path / "token"
    write_token(token)
    files = {**{k: str(v) for k, v in vars(tls_files).items()}, "missing": str(tmp_path / "no")}
    args = [command, "--token-file", str(token), "--metrics-port", "0"]
    if command == "coordinator":
        args += ["--listen", "127.0.0.1:0"]
    else:
        args += ["--coordinator", "127.0.0.1:7711", "--table", str(tmp_path / "table"),
                 "--socket", str(tmp_path / "agent.sock")]  # fmt: skip
    assert main(args + [flag.format(**files) for flag in flags]) == 2
    assert named in capsys.readouterr().err


def test_max_unauthenticated_caps_handshakes_under_way(tmp_path: Path, tls_files: Any) -> None:
    # three silent TLS connections against a cap of two: the oldest makes room
    token = tmp_path / "token"
    write_token(token)
    server = ("--tls-cert", str(tls_files.server_cert), "--tls-key", str(tls_files.server_key),
              "--max-unauthenticated", "2", "--handshake-timeout", "30")  # fmt: skip
    with cleanup() as started:
        coordinator = start_coordinator(tmp_path, token, extra=server)
        started.append(coordinator)
        address = ("127.0.0.1", int(coordinator.fields["port"]))
        silent = [socket.create_connection(address, timeout=5) for _ in range(3)]
        try:
            wait_for(
                lambda: total(coordinator.metrics(), f"{COORDINATOR}_closed_connections_total",
                              reason="evicted") == 1,
                20, "the oldest handshake evicted",
            )  # fmt: skip
            silent[0].settimeout(5)
            with contextlib.suppress(ConnectionResetError):  # a reset is a close as well
                assert silent[0].recv(1) == b""  # the coordinator closed the oldest
        finally:
            for connection in silent:
                connection.close()
