"""Other users on the node: the socket directory, --group, the table, tampered slots.

Tests that change file ownership or switch users need root (they skip with the reason
otherwise); the child processes that play the other user are forked and always reaped.
"""

from __future__ import annotations

import errno
import grp
import os
import select
import shutil
import socket
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from agent_helpers import shareable_group, wait_until

from flowsched import client, rundir
from flowsched.agent import AgentConfig
from flowsched.agent.sdk_server import SocketPathError
from flowsched.agent.threaded import AgentThread
from flowsched.protocol import sdk
from flowsched.shm import layout
from flowsched.shm.table import EmulatedPluginSlot, FlowTable, TableError

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="changes ownership / switches users")


def _config(tmp_path: Path, directory: Path, **overrides: object) -> AgentConfig:
    settings: dict[str, object] = dict(
        node="n1",
        socket_path=str(directory / "agent.sock"),
        table_path=str(tmp_path / "table"),
        num_slots=8,
        metrics_port=None,
        interfaces=("lo",),
    )
    settings.update(overrides)
    return AgentConfig(**settings)  # type: ignore[arg-type]


def _start_fails(config: AgentConfig) -> BaseException:
    running = AgentThread(config)
    with pytest.raises((SocketPathError, TableError)) as caught:
        running.start()
    running.stop()
    return caught.value


def _as_other_user(groups: list[int], action: Callable[[], None], uid: int = NOBODY) -> int:
    """Run ``action`` in a child as ``uid`` (default nobody), gid nobody, with supplementary
    ``groups``; return its exit status (0: the action raised nothing; errno of an OSError; 99
    otherwise)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 99
        try:
            os.setgroups(groups)
            os.setgid(NOBODY)
            os.setuid(uid)
            action()
            code = 0
        except OSError as exc:
            code = exc.errno or 98
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.fixture
def other_group() -> Iterator[grp.struct_group]:
    """A group the test can hand the socket to (not root's)."""
    group = shareable_group()
    if group is None:
        pytest.skip("no group among users/nogroup/daemon/staff on this machine")
    yield group


# -- the socket directory -----------------------------------------------------------------------


def test_a_directory_writable_by_others_is_refused(tmp_path: Path) -> None:
    squatted = tmp_path / "flowsched-squat"
    squatted.mkdir()
    squatted.chmod(0o777)
    error = _start_fails(_config(tmp_path, squatted))
    assert f"{squatted} is writable by group or others (mode 0777)" in str(error)
    assert not (squatted / "agent.sock").exists()


@needs_root
def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    squatted = tmp_path / "flowsched-squat"
    squatted.mkdir(mode=0o700)
    os.chown(squatted, NOBODY, NOBODY)
    error = _start_fails(_config(tmp_path, squatted))
    assert f"{squatted} is owned by uid {NOBODY}, not by this user" in str(error)


def test_a_symlinked_directory_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    error = _start_fails(_config(tmp_path, tmp_path / "link"))
    assert "is a symbolic link" in str(error)


def test_a_missing_directory_is_created_private(tmp_path: Path) -> None:
    with AgentThread(_config(tmp_path, tmp_path / "run" / "flowsched")) as running:
        assert running.ready is not None
        info = os.stat(tmp_path / "run" / "flowsched")
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
        assert stat.S_IMODE(os.stat(running.ready.socket).st_mode) == 0o600


@pytest.mark.parametrize(
    ("euid", "xdg", "expected"),
    [
        (0, "/run/user/0", "/run/flowsched"),
        (1000, "/run/user/1000", "/run/user/1000/flowsched"),
        (1000, None, "/tmp/flowsched-1000"),
    ],
)
def test_default_runtime_directory(
    monkeypatch: pytest.MonkeyPatch, euid: int, xdg: str | None, expected: str
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: euid)
    if xdg is None:
        monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    else:
        monkeypatch.setenv("XDG_RUNTIME_DIR", xdg)
    monkeypatch.delenv("FLOWSCHED_TABLE", raising=False)
    assert rundir.agent_runtime_dir() == expected
    assert rundir.agent_path("table", "FLOWSCHED_TABLE") == f"{expected}/table"


@pytest.mark.parametrize(
    ("name", "env", "limit"),
    [
        (rundir.TABLE_NAME, "FLOWSCHED_TABLE", rundir.TABLE_PATH_MAX),
        (rundir.SOCKET_NAME, "FLOWSCHED_SOCKET", rundir.SOCKET_PATH_MAX),
    ],
)
def test_a_default_path_too_long_names_xdg_runtime_dir(
    monkeypatch: pytest.MonkeyPatch, name: str, env: str, limit: int
) -> None:
    # the plugin refuses a table path longer than 255 bytes (it would map another file than
    # the one written here if it truncated it), bind() a socket path longer than sun_path
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.delenv(env, raising=False)
    tail = len(f"/flowsched/{name}")
    fits = "/" + "x" * (limit - tail - 1)
    monkeypatch.setenv("XDG_RUNTIME_DIR", fits)
    assert len(rundir.agent_path(name, env)) == limit
    monkeypatch.setenv("XDG_RUNTIME_DIR", fits + "x")
    with pytest.raises(rundir.RuntimeDirError) as refused:
        rundir.agent_path(name, env)
    assert "XDG_RUNTIME_DIR" in str(refused.value) and str(limit) in str(refused.value)
    assert env in str(refused.value)  # the way out
    monkeypatch.setenv(env, "/short/path")
    assert rundir.agent_path(name, env) == "/short/path"


def test_a_default_table_path_is_measured_as_the_plugin_builds_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the plugin writes "$XDG_RUNTIME_DIR/flowsched/table" as such: with a trailing slash its
    # path is a byte longer than os.path.join's, so at the limit the agent took a table path
    # the plugin refuses (jobs never saw the agent's table)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.delenv("FLOWSCHED_TABLE", raising=False)
    fits = "/" + "x" * (rundir.TABLE_PATH_MAX - len("/flowsched/table") - 1)
    monkeypatch.setenv("XDG_RUNTIME_DIR", fits)
    assert len(rundir.agent_path(rundir.TABLE_NAME, "FLOWSCHED_TABLE")) == rundir.TABLE_PATH_MAX
    monkeypatch.setenv("XDG_RUNTIME_DIR", fits + "/")  # os.path.join's path as long: it fits
    with pytest.raises(rundir.RuntimeDirError, match="XDG_RUNTIME_DIR"):
        rundir.agent_path(rundir.TABLE_NAME, "FLOWSCHED_TABLE")


def test_a_user_client_finds_a_root_agent_serving_its_group(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    monkeypatch.delenv("FLOWSCHED_SOCKET", raising=False)
    shared = tmp_path / "run-flowsched"
    monkeypatch.setattr(rundir, "ROOT_DIR", str(shared))
    own = f"{tmp_path}/xdg/flowsched/agent.sock"
    assert rundir.client_path("agent.sock", "FLOWSCHED_SOCKET") == own  # nothing anywhere
    shared.mkdir()
    (shared / "agent.sock").touch()
    assert rundir.client_path("agent.sock", "FLOWSCHED_SOCKET") == f"{shared}/agent.sock"
    Path(own).parent.mkdir(parents=True)
    Path(own).touch()
    assert rundir.client_path("agent.sock", "FLOWSCHED_SOCKET") == own  # the user's own first


# -- --group ------------------------------------------------------------------------------------


@needs_root
def test_group_members_can_connect_and_others_cannot(
    tmp_path: Path, other_group: grp.struct_group, request: pytest.FixtureRequest
) -> None:
    # pytest's tmp_path is under a 0700 directory the other user cannot traverse
    reachable = Path(tempfile.mkdtemp(prefix="flowsched-group-test-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(reachable, ignore_errors=True))
    reachable.chmod(0o755)
    directory = reachable / "flowsched"
    config = _config(tmp_path, directory, group=other_group.gr_name)
    with AgentThread(config) as running:
        info = os.stat(directory)
        assert (stat.S_IMODE(info.st_mode), info.st_gid) == (0o750, other_group.gr_gid)
        path = config.socket_path

        def open_a_flow() -> None:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(5)
                sock.connect(path)
                sock.sendall(sdk.encode(sdk.Open(1, "bulk")))
                decoder = sdk.SdkDecoder("client")
                decoder.feed(sock.recv(65536))
                if not isinstance(decoder.next_message(), sdk.Opened):
                    raise OSError(errno.EPROTO, "no opened")

        assert _as_other_user([other_group.gr_gid], open_a_flow) == 0
        assert _as_other_user([], open_a_flow) == errno.EACCES
        wait_until(lambda: running.agent.sdk is not None and running.agent.sdk.clients_total >= 1)


@needs_root
@pytest.mark.parametrize("uid", [NOBODY, 3_000_000_000], ids=["nobody", "uid-above-2**31"])
def test_a_user_lists_its_own_sdk_flows_and_root_lists_everyones(
    tmp_path: Path,
    other_group: grp.struct_group,
    request: pytest.FixtureRequest,
    fresh_sdk_connections: None,
    uid: int,
) -> None:
    reachable = Path(tempfile.mkdtemp(prefix="flowsched-group-test-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(reachable, ignore_errors=True))
    reachable.chmod(0o755)
    config = _config(tmp_path, reachable / "flowsched", group=other_group.gr_name)
    opened, go_on = os.pipe(), os.pipe()
    with AgentThread(config), client.flow("bulk", job="mine", socket_path=config.socket_path):

        def hold_a_flow_and_list() -> None:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(5)
                sock.connect(config.socket_path)
                sock.sendall(sdk.encode(sdk.Open(1, "bulk", job="theirs")))
                decoder = sdk.SdkDecoder("client")
                decoder.feed(sock.recv(65536))
                if not isinstance(decoder.next_message(), sdk.Opened):
                    raise OSError(errno.EPROTO, "no opened")
                listing = client.list_flows(config.socket_path)
                if listing.everyone or [(f.job, f.uid) for f in listing.flows] != [("theirs", uid)]:
                    raise OSError(errno.EPERM, "saw more than its own flows")
                os.write(opened[1], b"x")
                os.read(go_on[0], 1)  # holds its flow while root lists

        child = threading.Thread(
            target=lambda: results.append(
                _as_other_user([other_group.gr_gid], hold_a_flow_and_list, uid)
            )
        )
        results: list[int] = []
        child.start()
        try:
            ready, _, _ = select.select([opened[0]], [], [], 30)
            assert ready, "the other user's process never got its flow listed"
            listing = client.list_flows(config.socket_path)
            assert listing.everyone
            assert sorted((f.job, f.uid) for f in listing.flows) == [
                ("mine", 0),
                ("theirs", uid),
            ]
        finally:
            os.write(go_on[1], b"x")
            child.join(30)
        assert results == [0]
    for fd in (*opened, *go_on):
        os.close(fd)


# -- the table ----------------------------------------------------------------------------------


def _table(tmp_path: Path) -> str:
    path = str(tmp_path / "flowsched" / "table")
    table, _ = FlowTable.create_or_attach(path, num_slots=4)
    table.close()
    return path


@needs_root
def test_a_table_of_another_user_is_refused_by_readers(tmp_path: Path) -> None:
    path = _table(tmp_path)
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(TableError, match=f"owned by uid {NOBODY}, neither root nor this user"):
        FlowTable.open(path)


def test_a_table_writable_by_others_or_symlinked_is_refused_by_readers(tmp_path: Path) -> None:
    path = _table(tmp_path)
    os.chmod(path, 0o666)
    with pytest.raises(TableError, match="writable by others"):
        FlowTable.open(path)
    os.chmod(path, 0o600)
    (tmp_path / "link").symlink_to(path)
    with pytest.raises(TableError, match="cannot open flow table"):
        FlowTable.open(str(tmp_path / "link"))


@needs_root
def test_the_agent_refuses_a_table_directory_of_another_user(tmp_path: Path) -> None:
    squatted = tmp_path / "flowsched"
    squatted.mkdir(mode=0o755)
    os.chown(squatted, NOBODY, NOBODY)
    with pytest.raises(TableError, match=f"owned by uid {NOBODY}"):
        FlowTable.create_or_attach(str(squatted / "table"), num_slots=4)


# -- tampering ----------------------------------------------------------------------------------


def test_a_tampered_slot_level_and_marking_table_are_repaired(tmp_path: Path) -> None:
    with AgentThread(_config(tmp_path, tmp_path / "flowsched")) as running:
        agent = running.agent
        with FlowTable.open(agent.config.table_path, writable=True) as table:
            slot = EmulatedPluginSlot(table)
            wait_until(lambda: slot.raw_level() != layout.LEVEL_UNSET)
            decided = slot.raw_level()
            config = table.read_config()
            assert running.run(agent.reassert_levels) == 0  # nothing to repair: no false alarm
            assert agent.stats["tampered_repaired"] == 0
            # another process with write access to the table (a --group member) rewrites them
            table.set_level(slot.index, 0 if decided else 1)
            table.write_config(
                type(config)(config.num_levels, (config.markings[0],) * config.num_levels,
                             config.class_map, config.fallback_class, config.default_levels)
            )  # fmt: skip
            wait_until(lambda: slot.raw_level() == decided, timeout=3)
            wait_until(lambda: table.read_config() == config, timeout=3)
            assert agent.stats["tampered_repaired"] >= 2
            slot.close()


def _markings_swapped_and_put_back(table: FlowTable) -> None:
    """Bad markings written under the seqlock (plugins take them: config_seq moved), then the
    bytes put back without moving config_seq: the plugins keep the bad ones."""
    from flowsched.shm import table as table_module

    area = slice(table_module._CONFIG_START, table_module._CONFIG_END)
    good, config = bytes(table._mm[area]), table.read_config()
    bad = (config.markings[0],) * config.num_levels
    table.write_config(type(config)(config.num_levels, bad, config.class_map,
                                    config.fallback_class, config.default_levels))  # fmt: skip
    table._mm[area] = good


def _config_seq_left_odd(table: FlowTable) -> None:
    """A write that never finished: every reader retries, or keeps an older copy."""
    from flowsched.shm import table as table_module

    table._u32[table_module._H32["config_seq"]] |= 1


@pytest.mark.parametrize(
    "tamper",
    [_markings_swapped_and_put_back, _config_seq_left_odd],
    ids=["bytes-put-back", "seq-left-odd"],
)
def test_a_marking_table_whose_seqlock_word_was_moved_is_rewritten(
    tmp_path: Path, tamper: Callable[[FlowTable], None]
) -> None:
    """The word counts, not only the bytes: a plugin keeps its copy of the marking table for as
    long as config_seq stays what it was when it read it."""
    with AgentThread(_config(tmp_path, tmp_path / "flowsched")) as running:
        agent = running.agent
        with FlowTable.open(agent.config.table_path, writable=True) as table:
            config = table.read_config()
            assert running.run(agent.reassert_levels) == 0
            tamper(table)
            tampered = table.header()["config_seq"]
            assert running.run(agent.reassert_levels) == 1
            seq = table.header()["config_seq"]
            # moved on (every plugin reads the table again) and even (stable)
            assert seq != tampered and seq % 2 == 0
            assert table.read_config() == config
            assert running.run(agent.reassert_levels) == 0  # and then left alone
