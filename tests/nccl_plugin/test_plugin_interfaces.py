"""Interface and address-family selection, and where the library is looked up."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowsched.nccl import PATH_ENV, PluginNotFoundError, plugin_path
from flowsched.nccl.harness import Plugin, connect_pair, loopback_message


def device_names(lib: Path, version: int = 11) -> list[str]:
    plugin = Plugin(lib, version)
    ctx = plugin.init()
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
