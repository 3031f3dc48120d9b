"""The SDK client uses only an agent it can trust (audit M3): the socket's directory must be
owned by root or the user (or ``$FLOWSCHED_AGENT_UID``) and not writable by others, and the
process serving it must run as one of them. Otherwise: static defaults and a warning."""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path

import pytest

from flowsched import client, rundir
from flowsched.agent.threaded import AgentThread

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown/setuid need root")


def _forget_connections() -> None:
    for conn in list(client._connections.values()):
        conn.close()
    client._connections.clear()


def test_a_trusted_agent_is_used(agent: AgentThread) -> None:
    with client.flow("bulk", socket_path=agent.ready.socket) as handle:  # type: ignore[union-attr]
        assert handle.connected


@needs_root
def test_a_socket_in_a_directory_another_user_owns_is_not_used(
    agent: AgentThread, caplog: pytest.LogCaptureFixture
) -> None:
    path = agent.ready.socket  # type: ignore[union-attr]
    os.chown(os.path.dirname(path), NOBODY, -1)  # what an attacker's pre-created directory is
    with (
        caplog.at_level(logging.WARNING, "flowsched.client"),
        client.flow("bulk", socket_path=path) as handle,
    ):
        assert not handle.connected
        assert handle.marking == client.static_marking(handle.cls)
    assert f"owned by uid {NOBODY}" in caplog.text and "static default" in caplog.text
    assert agent.agent.registry is not None and not agent.agent.registry.flows


@needs_root
def test_a_socket_in_a_directory_others_can_write_is_not_used(
    agent: AgentThread, caplog: pytest.LogCaptureFixture
) -> None:
    path = agent.ready.socket  # type: ignore[union-attr]
    os.chmod(os.path.dirname(path), 0o777)
    with (
        caplog.at_level(logging.WARNING, "flowsched.client"),
        client.flow("bulk", socket_path=path) as handle,
    ):
        assert not handle.connected
    assert "writable by group or others" in caplog.text


@needs_root
def test_an_agent_uid_named_by_the_environment_is_trusted(
    agent: AgentThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = agent.ready.socket  # type: ignore[union-attr]
    os.chown(os.path.dirname(path), NOBODY, -1)  # an agent running as a service account
    monkeypatch.setenv(rundir.AGENT_UID_ENV, str(NOBODY))
    with client.flow("bulk", socket_path=path) as handle:
        assert handle.connected


@needs_root
def test_a_server_running_as_another_user_is_not_trusted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(tmp_path / "agent.sock")  # a root-owned directory: only the peer is wrong
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    pid = os.fork()
    if pid == 0:  # the impostor: SO_PEERCRED reports the credentials at listen()
        try:
            os.setuid(NOBODY)
            listener.listen()
            while True:  # the probe below, then the client, until killed
                conn, _ = listener.accept()
                conn.recv(1)  # until that one hangs up
                conn.close()
        finally:
            os._exit(0)
    listener.close()
    try:
        _wait_listening(path)
        with (
            caplog.at_level(logging.WARNING, "flowsched.client"),
            client.flow("bulk", socket_path=path) as handle,
        ):
            assert not handle.connected
        assert f"runs as uid {NOBODY}" in caplog.text
    finally:
        _forget_connections()
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def _wait_listening(path: str) -> None:
    end = time.monotonic() + 5
    while True:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
            return
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.01)
        finally:
            probe.close()


@needs_root
def test_client_path_skips_a_runtime_directory_another_user_owns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    user = 4242
    monkeypatch.delenv("FLOWSCHED_SOCKET", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.delenv(rundir.AGENT_UID_ENV, raising=False)
    monkeypatch.setattr(rundir.os, "geteuid", lambda: user)
    own = Path(f"/tmp/flowsched-{user}")
    shared = tmp_path / "run-flowsched"
    monkeypatch.setattr(rundir, "ROOT_DIR", str(shared))
    shared.mkdir()
    (shared / rundir.SOCKET_NAME).touch()
    own.mkdir(mode=0o700)
    try:
        (own / rundir.SOCKET_NAME).touch()
        os.chown(own, user, -1)
        assert client.default_socket_path() == str(own / rundir.SOCKET_NAME)
        os.chown(own, NOBODY, -1)  # pre-created by another user
        assert client.default_socket_path() == str(shared / rundir.SOCKET_NAME)
    finally:
        (own / rundir.SOCKET_NAME).unlink()
        own.rmdir()
