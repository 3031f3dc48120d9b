"""The plugin driven through the ctypes harness, as NCCL drives it: two processes over
127.0.0.1, one thread alternating connect and accept, two contexts, init/finalize and
dlclose/dlopen cycles, every exported table version, and NCCL error codes on misuse."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
from plugin_table import TestTable

from flowsched.nccl.harness import (
    Plugin,
    PluginError,
    PluginRejected,
    connect_pair,
    loopback_message,
    stream,
)
from flowsched.shm import layout

PEER = Path(__file__).with_name("plugin_peer.py")
VERSIONS = [10, 11, 12]
SIZES = [0, 1, 8, 1000, 1024, 1025, 70_001, 0, 1 << 20, (8 << 20) + 3, 64 << 20, 5]


def peers(version: int, sizes: list[int], comm_id: int = 7) -> None:
    sizes_text = ",".join(map(str, sizes))
    recv = subprocess.Popen(
        [sys.executable, str(PEER), "recv", str(version), sizes_text, str(comm_id)],
        stdout=subprocess.PIPE,
        text=True,
    )
    send = None
    try:
        assert recv.stdout is not None
        handle = recv.stdout.readline().strip()
        send = subprocess.Popen(
            [sys.executable, str(PEER), "send", str(version), sizes_text, handle, str(comm_id)],
            stdout=subprocess.PIPE,
            text=True,
        )
        send_out, _ = send.communicate(timeout=120)
        recv_out, _ = recv.communicate(timeout=120)
        assert send.returncode == 0 and recv.returncode == 0
        assert f"ok {len(sizes)}" in send_out and f"ok {len(sizes)}" in recv_out
    finally:
        for proc in (recv, send):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("version", VERSIONS, ids=[f"v{v}" for v in VERSIONS])
def test_two_processes_all_sizes_byte_for_byte(
    plugin_env: Path, plugin_lib: Path, version: int
) -> None:
    peers(version, SIZES)


def test_many_small_messages_in_flight(plugin_env: Path, plugin_lib: Path) -> None:
    peers(11, [i % 300 for i in range(200)])


@pytest.mark.parametrize("version", VERSIONS, ids=[f"v{v}" for v in VERSIONS])
def test_one_thread_alternating_connect_and_accept(
    plugin_env: Path, plugin_lib: Path, version: int
) -> None:
    plugin = Plugin(plugin_lib, version)
    ctx = plugin.init(comm_id=1)
    send, recv = connect_pair(ctx)
    for size in (0, 3, 5000, 1 << 20, (4 << 20) + 1):
        data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
        assert loopback_message(send, recv, data, capacity=size + 10) == data
    send.close()
    recv.close()
    ctx.finalize()
    plugin.close()


@pytest.mark.parametrize("version", [11, 12], ids=["v11", "v12"])
def test_two_contexts_at_once(plugin_env: Path, plugin_lib: Path, version: int) -> None:
    plugin = Plugin(plugin_lib, version)
    ctxs = [plugin.init(comm_id=100 + i, traffic_class=i) for i in range(2)]
    pairs = [connect_pair(ctx) for ctx in ctxs]
    requests = []
    for _send, recv in pairs:
        buffer = recv.register(64)
        requests.append((buffer, recv.post(buffer, 64)))
    for i, (send, _recv) in enumerate(pairs):
        send.send_message(f"context {i}".encode())
    for i, (buffer, request) in enumerate(requests):
        assert buffer.read(request.wait()) == f"context {i}".encode()
    for (send, recv), ctx in zip(pairs, ctxs, strict=True):
        send.close()
        recv.close()
        ctx.finalize()
    plugin.close()


@pytest.mark.parametrize("version", VERSIONS, ids=[f"v{v}" for v in VERSIONS])
def test_init_finalize_and_reload_cycles(plugin_env: Path, plugin_lib: Path, version: int) -> None:
    for reload in range(3):
        plugin = Plugin(plugin_lib, version)
        for cycle in range(1 if version == 10 else 3):
            ctx = plugin.init(comm_id=cycle)
            send, recv = connect_pair(ctx)
            buffer = recv.register(100)
            request = recv.post(buffer, 100)
            send.send_message(b"cycle %d/%d" % (reload, cycle))
            assert buffer.read(request.wait()) == b"cycle %d/%d" % (reload, cycle)
            send.close()
            recv.close()
            ctx.finalize()
        plugin.close()


def test_truncated_receive_is_invalid_usage(plugin_env: Path, plugin_lib: Path) -> None:
    plugin = Plugin(plugin_lib, 11)
    ctx = plugin.init()
    send, recv = connect_pair(ctx)
    small = recv.register(10)
    big = send.register(100)
    sreq = send.post(big, 100)
    with pytest.raises(PluginError) as err:
        request = recv.post(small, 10)
        request.wait(timeout=10)
    assert err.value.code == 5  # ncclInvalidUsage
    del sreq
    send.close()
    recv.close()
    ctx.finalize()
    plugin.close()


@pytest.mark.parametrize("retries", [0, 2], ids=["no-retry", "after-retries"])
def test_refused_connect_is_remote_error(
    plugin_env: Path, fresh_lib: Path, monkeypatch: pytest.MonkeyPatch, retries: int
) -> None:
    """A peer that refuses the connection (also after the retries) is ncclRemoteError, as in
    NCCL's own socket transport, not a local ncclSystemError."""
    monkeypatch.setenv("FLOWSCHED_CONNECT_RETRIES", str(retries))
    plugin = Plugin(fresh_lib, 11)
    ctx = plugin.init(comm_id=3)
    listener = ctx.listen()
    listener.close()  # nothing listens on that port any more
    try:
        with pytest.raises(PluginError) as err:
            ctx.connect(listener.handle, timeout=10)
        assert err.value.call == "connect" and err.value.code == 6  # ncclRemoteError
    finally:
        ctx.finalize()
        plugin.close()


@pytest.mark.parametrize("version", [11, 12], ids=["v11", "v12"])
def test_finalize_before_listen_and_connections_are_closed(
    plugin_env: Path, fresh_lib: Path, version: int
) -> None:
    """finalize may come before closeListen and before the context's connections close: the
    listen comm still accepts for the finalized context (its commId and trafficClass reach the
    accepted connection's slot) and the connections keep working. The ASan harness
    (`harness lifetime`, run by `make -C nccl_plugin check`) checks the same for memory."""
    table = TestTable(plugin_env)
    plugin = Plugin(fresh_lib, version)
    owner = plugin.init(comm_id=0xA1, traffic_class=2)
    peer = plugin.init(comm_id=0xB2)
    listener = owner.listen()
    owner.finalize()
    connector = peer.connector(listener.handle)
    send, recv = None, None
    while send is None or recv is None:
        send = send or connector.step()
        recv = recv or listener.accept_step()
    listener.close()
    assert loopback_message(send, recv, b"after finalize" * 1000) == b"after finalize" * 1000
    accepted = [s for _, s in table.slots() if s["direction"] == layout.DIR_RECV]
    assert [(s["comm_id"], s["traffic_class"]) for s in accepted] == [(0xA1, 2)]
    send.close()
    recv.close()
    peer.finalize()
    plugin.close()
    table.close()


@pytest.mark.parametrize("version", VERSIONS, ids=[f"v{v}" for v in VERSIONS])
def test_properties_as_nccl_requires(plugin_env: Path, plugin_lib: Path, version: int) -> None:
    """Each exported version fills its own properties struct: check every one."""
    plugin = Plugin(plugin_lib, version)
    ctx = plugin.init()
    props = plugin.properties(0)
    assert props["name"] == "lo" and props["ptrSupport"] == 1  # NCCL_PTR_HOST only
    assert 0 < props["maxP2pBytes"] <= 1 << 40 and 0 < props["maxCollBytes"] <= 1 << 40
    assert props["maxRecvs"] == 1 and props["netDeviceType"] == 0 and props["vProps"] == [0]
    if version >= 11:
        assert props["maxMultiRequestSize"] == 1
    if version == 12:
        assert props["railId"] == -1 and props["planeId"] == -1
    ctx.finalize()
    plugin.close()


@pytest.mark.parametrize(
    "bad",
    [{"maxCollBytes": 0}, {"maxP2pBytes": (1 << 40) + 1}, {"netDeviceType": 2}],
    ids=["no-coll-bytes", "p2p-over-1TiB", "gin-device"],
)
def test_init_rejects_properties_nccl_refuses(
    plugin_env: Path, plugin_lib: Path, monkeypatch: pytest.MonkeyPatch, bad: dict[str, int]
) -> None:
    """The harness checks what NCCL checks after init, so a plugin that reports such
    properties fails the tests instead of passing them (NCCL would skip it or fail setup)."""
    plugin = Plugin(plugin_lib, 11)
    real = plugin.properties
    monkeypatch.setattr(plugin, "properties", lambda dev: {**real(dev), **bad})
    with pytest.raises(PluginRejected):
        plugin.init(comm_id=9)
    monkeypatch.setattr(plugin, "properties", real)
    monkeypatch.setattr(plugin, "devices", lambda: 0)
    with pytest.raises(PluginRejected, match="devices returned 0"):
        plugin.init(comm_id=10)
    monkeypatch.undo()
    plugin.close()


def test_stream_keeps_messages_in_flight(plugin_env: Path, plugin_lib: Path) -> None:
    plugin = Plugin(plugin_lib, 11)
    ctx = plugin.init()
    send, recv = connect_pair(ctx)
    sizes: list[int] = []
    target = 200
    sender = threading.Thread(
        target=stream, args=(send, 10_000), kwargs={"until": lambda: len(sizes) >= target}
    )
    sender.start()
    got = stream(recv, 10_000, until=lambda: len(sizes) >= target, on_complete=sizes.append)
    sender.join(timeout=30)
    assert got == target and set(sizes) == {10_000}
    send.close()
    recv.close()
    ctx.finalize()
    plugin.close()


@pytest.mark.parametrize("version", [11, 12])
def test_finalize_of_a_null_context_is_quiet(
    plugin_env: Path, fresh_lib: Path, version: int, caplog: pytest.LogCaptureFixture
) -> None:
    """NCCL may call finalize(NULL) after an init that failed: success, and no warning."""
    plugin = Plugin(fresh_lib, version)
    ctx = plugin.init(comm_id=5)  # sets the logger
    assert plugin.table.finalize(None) == 0
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == []
    ctx.finalize()
    plugin.close()
