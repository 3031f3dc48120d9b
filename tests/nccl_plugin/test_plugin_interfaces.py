"""Interface and address-family selection, and where the library is looked up."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowsched.nccl import PATH_ENV, PluginNotFoundError, plugin_path
from flowsched.nccl.harness import Plugin, PluginRejected, connect_pair, loopback_message


def device_names(lib: Path, version: int = 11) -> list[str]:
    """The plugin's device names; [] when it has none (NCCL then disables it: the harness's
    init raises PluginRejected, as NCCL's init gives up on it)."""
    plugin = Plugin(lib, version)
    try:
        ctx = plugin.init()
    except PluginRejected as rejected:
        assert "devices returned 0" in str(rejected)
        plugin.close()
        return []
    names = [plugin.properties(d)["name"] for d in range(plugin.devices())]
    ctx.finalize()
    plugin.close()
    return names


@pytest.mark.parametrize(
    "flowsched_ifname,nccl_ifname,expected",
    [
        ("lo", None, ["lo"]),
        (None, "lo", ["lo"]),
        ("=lo", "nothing-like-this", ["lo"]),
        ("nothing-like-this", "lo", []),
        ("^lo,e,v,d,b,w,t,s,i", None, []),
    ],
    ids=["flowsched", "nccl-fallback", "flowsched-wins", "no-match", "exclude"],
)
def test_interface_selection(
    plugin_env: Path,
    fresh_lib: Path,
    monkeypatch: pytest.MonkeyPatch,
    flowsched_ifname: str | None,
    nccl_ifname: str | None,
    expected: list[str],
) -> None:
    monkeypatch.delenv("FLOWSCHED_SOCKET_IFNAME")
    if flowsched_ifname is not None:
        monkeypatch.setenv("FLOWSCHED_SOCKET_IFNAME", flowsched_ifname)
    if nccl_ifname is not None:
        monkeypatch.setenv("NCCL_SOCKET_IFNAME", nccl_ifname)
    assert device_names(fresh_lib) == expected


def test_ipv6_transfer(plugin_env: Path, fresh_lib: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOWSCHED_SOCKET_FAMILY", "6")
    if (
        not Path("/proc/net/if_inet6").exists()
        or "lo" not in Path("/proc/net/if_inet6").read_text()
    ):
        pytest.skip("no IPv6 on lo")
    plugin = Plugin(fresh_lib, 12)
    ctx = plugin.init()
    send, recv = connect_pair(ctx)
    for size in (0, 100, 3 << 20):
        data = bytes(i % 251 for i in range(size))
        assert loopback_message(send, recv, data) == data
    send.close()
    recv.close()
    ctx.finalize()
    plugin.close()


def test_plugin_path_env_override(plugin_lib: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PATH_ENV, str(plugin_lib))
    assert plugin_path() == plugin_lib.resolve()
    monkeypatch.setenv(PATH_ENV, "/nonexistent/libnccl-net-flowsched.so")
    with pytest.raises(PluginNotFoundError, match=PATH_ENV):
        plugin_path()


def _usable_ipv4_interface() -> str | None:
    """A non-loopback interface that is up with a carrier and has an IPv4 address."""
    import fcntl
    import socket
    import struct

    for _, name in socket.if_nameindex():
        if name == "lo" or not Path(f"/sys/class/net/{name}/carrier").exists():
            continue
        try:
            if Path(f"/sys/class/net/{name}/carrier").read_text().strip() != "1":
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                req = struct.pack("256s", name.encode()[:15])
                fcntl.ioctl(s.fileno(), 0x8915, req)  # SIOCGIFADDR: has an IPv4 address
        except OSError:
            continue
        return name
    return None


def test_connect_is_bound_to_the_chosen_device(
    plugin_env: Path, fresh_lib: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection leaves from the device NCCL chose, whatever source address routing would
    pick: the handle points at a listener on 127.0.0.1 (routing alone would use 127.0.0.1 as
    the source), yet every socket arrives from the chosen interface's address."""
    import socket

    name = _usable_ipv4_interface()
    if name is None:
        pytest.skip("no non-loopback interface with IPv4 and a carrier")
    monkeypatch.setenv("FLOWSCHED_SOCKET_IFNAME", f"={name}")
    monkeypatch.setenv("FLOWSCHED_SOCKET_FAMILY", "4")
    plugin = Plugin(fresh_lib, 11)
    ctx = plugin.init()
    listener = ctx.listen(0)
    handle = bytearray(listener.handle)
    device_ip = socket.inet_ntoa(bytes(handle[24:28]))
    nsocks = int.from_bytes(handle[40:44], "little")
    with socket.create_server(("127.0.0.1", 0), backlog=64) as server:
        handle[18:20] = server.getsockname()[1].to_bytes(2, "big")
        handle[24:28] = socket.inet_aton("127.0.0.1")
        send = ctx.connect(bytes(handle))  # the kernel completes handshakes before accept()
        sources = set()
        for _ in range(nsocks + 1):
            conn, peer = server.accept()
            sources.add(peer[0])
            conn.close()
    assert sources == {device_ip} and device_ip != "127.0.0.1"
    send.close()
    listener.close()
    ctx.finalize()
    plugin.close()
