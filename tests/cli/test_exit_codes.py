"""Every bad input the daemons can get ends with status 2 and one line naming it; a reader
that closes the output pipe ends any command with status 1 and no traceback.

Table-driven: each case runs the real ``flowsched`` command in a subprocess (as a user would)
and checks the exit status, that stderr is exactly one line without a traceback, and that the
line names the problem.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import flowsched
from flowsched.protocol import write_token

ROOT = Path(__file__).resolve().parents[2]
TAKEN = "{taken}"  # replaced by a port that a listening socket holds during the test


@pytest.fixture(scope="module")
def taken_port() -> Iterator[int]:
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    write_token(tmp_path / "token")
    (tmp_path / "bad.toml").write_text("[policy]\nname = 'rmlq'\n[classes.kv]\ndeadline = -1\n")
    (tmp_path / "binary.toml").write_bytes(b"\xff\xfe[policy]\n")
    return tmp_path


def _run(
    args: list[str], workdir: Path, taken: int, *, prefix: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    argv = [a.replace(TAKEN, str(taken)).replace("{dir}", str(workdir)) for a in args]
    env = {**os.environ, "HOME": str(workdir), "FLOWSCHED_NO_UVLOOP": "1"}
    return subprocess.run(
        [*prefix, sys.executable, "-m", "flowsched", *argv],
        capture_output=True, text=True, timeout=60, cwd=workdir, env=env,
    )  # fmt: skip


AGENT = ["agent", "--table", "{dir}/table", "--socket", "{dir}/agent.sock", "--metrics-port", "0"]
COORD = ["coordinator", "--token-file", "{dir}/token", "--listen", "127.0.0.1:0",
         "--metrics-port", "0"]  # fmt: skip
UP = ["up", "--token-file", "{dir}/token", "--table", "{dir}/table", "--socket",
      "{dir}/agent.sock", "--listen", "127.0.0.1:0", "--metrics-port", "0",
      "--agent-metrics-port", "0"]  # fmt: skip

CASES = {
    # flowsched coordinator
    "coordinator-listen-taken": ([*COORD, "--listen", f"127.0.0.1:{TAKEN}"], "already in use"),
    "coordinator-listen-port-range": ([*COORD, "--listen", "127.0.0.1:99999"], "0..65535"),
    "coordinator-listen-unresolvable": (
        [*COORD, "--listen", "no-such-host.invalid:0"], "cannot resolve host"),
    "coordinator-listen-foreign-address": (
        [*COORD, "--listen", "192.0.2.1:0"], "not an address of this machine"),
    "coordinator-metrics-taken": ([*COORD, "--metrics-port", TAKEN], "already in use"),
    "coordinator-metrics-port-range": ([*COORD, "--metrics-port", "99999"], "0..65535"),
    "coordinator-missing-policy": (
        [*COORD, "--policy", "{dir}/nope.toml"], "--policy {dir}/nope.toml: cannot read"),
    "coordinator-invalid-policy": (
        [*COORD, "--policy", "{dir}/bad.toml"], "--policy {dir}/bad.toml: classes.kv.deadline"),
    "coordinator-min-agent-version-range": (
        [*COORD, "--min-agent-version", "9"], "--min-agent-version: expected 1..5"),
    "coordinator-missing-token": (
        [*COORD, "--token-file", "{dir}/missing-token"], "missing-token"),
    # flowsched agent
    "agent-metrics-taken": ([*AGENT, "--metrics-port", TAKEN], "already in use"),
    "agent-metrics-port-range": ([*AGENT, "--metrics-port", "99999"], "0..65535"),
    "agent-metrics-bind-unresolvable": (
        [*AGENT, "--metrics-bind", "no-such-host.invalid"], "--metrics-bind: cannot resolve"),
    "agent-metrics-bind-foreign-address": (
        [*AGENT, "--metrics-bind", "192.0.2.1:0"],
        "--metrics-bind 192.0.2.1:0: 192.0.2.1 is not an address of this machine"),
    "agent-metrics-bind-taken": (
        [*AGENT[:-2], "--metrics-bind", f"127.0.0.1:{TAKEN}"],
        f"--metrics-bind 127.0.0.1:{TAKEN}: port {TAKEN} is already in use"),
    "coordinator-metrics-bind-foreign-address": (
        [*COORD, "--metrics-bind", "192.0.2.1:0"],
        "--metrics-bind 192.0.2.1:0: 192.0.2.1 is not an address of this machine"),
    "coordinator-metrics-bind-taken": (
        [*COORD[:-2], "--metrics-bind", f"127.0.0.1:{TAKEN}"],
        f"--metrics-bind 127.0.0.1:{TAKEN}: port {TAKEN} is already in use"),
    "coordinator-metrics-bind-port-range": (
        [*COORD, "--metrics-bind", "127.0.0.1:99999"], "--metrics-bind"),
    "agent-slots-zero": ([*AGENT, "--slots", "0"], "--slots"),
    "agent-qos-check-interval-zero": (
        [*AGENT, "--qos-check-interval", "0"], "--qos-check-interval: expected a finite number"),
    "agent-missing-policy": (
        [*AGENT, "--policy", "{dir}/nope.toml"], "--policy {dir}/nope.toml: cannot read"),
    "agent-policy-not-utf8": (
        [*AGENT, "--policy", "{dir}/binary.toml"], "--policy {dir}/binary.toml: cannot read"),
    "agent-invalid-policy": (
        [*AGENT, "--policy", "{dir}/bad.toml"], "--policy {dir}/bad.toml: classes.kv.deadline"),
    "agent-slots-too-many": ([*AGENT, "--slots", str(1 << 25)], "--slots"),
    "agent-table-missing-dir": (
        [*AGENT, "--table", "{dir}/missing/table"], "does not exist"),
    "agent-table-too-long": (
        [*AGENT, "--table", "{dir}/" + "t" * 260], "reads a table path of at most 255"),
    "agent-socket-too-long": (
        [*AGENT, "--socket", "{dir}/" + "s" * 120], "unix socket path has at most 107"),
    "agent-interface-missing": (
        [*AGENT, "--interface", "nosuchif0"], "no network interface named 'nosuchif0'"),
    "agent-qos-dev-missing": ([*AGENT, "--qos-dev", "nosuchif0"], "--qos-dev"),
    "agent-qos-rate-bad": ([*AGENT, "--qos-rate", "fast"], "--qos-rate"),
    "agent-group-missing": ([*AGENT, "--group", "no-such-group-x"], "no group named"),
    "agent-coordinator-unresolvable": (
        [*AGENT, "--token-file", "{dir}/token", "--coordinator", "no-such-host.invalid:7711"],
        "--coordinator: cannot resolve host"),
    "agent-coordinators-none-resolve": (
        [*AGENT, "--token-file", "{dir}/token", "--coordinator",
         "a.no-such-host.invalid:7711,b.no-such-host.invalid:7711"],
        "no other --coordinator resolves either"),
    "agent-coordinator-port-range": (
        [*AGENT, "--coordinator", "127.0.0.1:70000"], "0..65535"),
    # flowsched up
    "up-listen-taken": ([*UP, "--listen", f"127.0.0.1:{TAKEN}"], "already in use"),
    "up-metrics-taken": ([*UP, "--metrics-port", TAKEN], "already in use"),
    "up-agent-metrics-taken": ([*UP, "--agent-metrics-port", TAKEN], "--agent-metrics-port"),
    "up-metrics-port-range": ([*UP, "--metrics-port", "99999"], "0..65535"),
    "up-table-missing-dir": ([*UP, "--table", "{dir}/missing/table"], "does not exist"),
    "up-table-too-long": ([*UP, "--table", "{dir}/" + "t" * 260], "--table: the path is"),
    "up-slots-in-policy-missing": (
        [*UP, "--policy", "{dir}/nope.toml"], "--policy {dir}/nope.toml: cannot read"),
    "up-invalid-policy": (
        [*UP, "--policy", "{dir}/bad.toml"], "--policy {dir}/bad.toml: classes.kv.deadline"),
    "up-token-file-under-a-file": (
        [*UP, "--token-file", "{dir}/bad.toml/token"],
        "--token-file {dir}/bad.toml/token: cannot create it"),
    # flowsched flows
    "flows-table-missing": (["flows", "--table", "{dir}/table"], "cannot open flow table"),
    "flows-interval-negative": (["flows", "--interval", "-1"], "--interval"),
    # others
    "qos-dev-missing": (["qos", "show", "--dev", "nosuchif0"], "no network interface"),
    "unknown-subcommand": (["frobnicate"], "invalid choice"),
}  # fmt: skip


@pytest.mark.parametrize(("args", "message"), list(CASES.values()), ids=list(CASES))
def test_bad_input_exits_2_with_one_line(
    args: list[str], message: str, workdir: Path, taken_port: int
) -> None:
    proc = _run(args, workdir, taken_port)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert message.replace("{dir}", str(workdir)).replace(TAKEN, str(taken_port)) in proc.stderr
    assert not (workdir / "table").exists()  # refused before anything started


@pytest.fixture
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


#: two listeners of one command given the same port: (arguments with {port}, the line's start)
SAME_PORT = {
    "coordinator-listen-and-metrics": (
        [*COORD, "--listen", "127.0.0.1:{port}", "--metrics-port", "{port}"],
        "--metrics-port 127.0.0.1:{port}: the same port as --listen 127.0.0.1:{port}"),
    "coordinator-wildcard-and-metrics-bind": (
        ["coordinator", "--token-file", "{dir}/token", "--listen", "0.0.0.0:{port}",
         "--metrics-bind", "127.0.0.1:{port}"],
        "--metrics-bind 127.0.0.1:{port}: the same port as --listen 0.0.0.0:{port}"),
    "up-listen-and-metrics": (
        [*UP, "--listen", "127.0.0.1:{port}", "--metrics-port", "{port}"],
        "--metrics-port 127.0.0.1:{port}: the same port as --listen 127.0.0.1:{port}"),
    "up-both-metrics": (
        [*UP, "--metrics-port", "{port}", "--agent-metrics-port", "{port}"],
        "--agent-metrics-port 127.0.0.1:{port}: the same port as --metrics-port"),
}  # fmt: skip


@pytest.mark.parametrize(("args", "message"), list(SAME_PORT.values()), ids=list(SAME_PORT))
def test_one_port_for_two_listeners_is_refused_naming_both_flags(
    args: list[str], message: str, workdir: Path, taken_port: int, free_port: int
) -> None:
    """Each port passed its own bind probe, so the second real bind failed with only
    '[Errno 98] ... address already in use', naming neither flag."""
    proc = _run([a.replace("{port}", str(free_port)) for a in args], workdir, taken_port)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert message.replace("{port}", str(free_port)) in proc.stderr
    assert not (workdir / "table").exists()


@pytest.mark.parametrize(
    ("listeners", "clash"),
    [
        ([("--a", "127.0.0.1", 7), ("--b", "127.0.0.1", 7)], True),
        ([("--a", "0.0.0.0", 7), ("--b", "127.0.0.1", 7)], True),
        ([("--a", "127.0.0.1", 7), ("--b", "", 7)], True),  # "" = every address
        ([("--a", "127.0.0.1", 7), ("--b", "127.0.0.1", 8)], False),
        ([("--a", "127.0.0.1", 0), ("--b", "127.0.0.1", 0)], False),  # any free port, twice
        ([("--a", "127.0.0.1", 7), ("--b", "127.0.0.2", 7)], False),
        ([("--a", "::", 7), ("--b", "127.0.0.1", 7)], False),  # IPv6 only (V6ONLY)
    ],
)
def test_listeners_clash_only_on_one_port_of_overlapping_addresses(
    listeners: list[tuple[str, str, int]], clash: bool
) -> None:
    from flowsched.cli._common import UsageError, check_distinct_ports

    if clash:
        with pytest.raises(UsageError, match=r"--b .*: the same port as --a "):
            check_distinct_ports(listeners)
    else:
        check_distinct_ports(listeners)


def test_up_fails_at_once_when_its_port_is_taken(workdir: Path, taken_port: int) -> None:
    started = time.monotonic()
    proc = _run([*UP, "--listen", f"127.0.0.1:{TAKEN}"], workdir, taken_port)
    assert proc.returncode == 2
    assert time.monotonic() - started < 5.0  # it used to wait 10 s for the coordinator


@pytest.mark.parametrize("command", ["coordinator", "agent"])
def test_privileged_port_is_named(command: str, workdir: Path, taken_port: int) -> None:
    prefix: tuple[str, ...] = ()
    if os.geteuid() == 0:  # root may bind port 80: take the capability away
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv cannot drop CAP_NET_BIND_SERVICE")
        prefix = ("setpriv", "--bounding-set", "-net_bind_service")
    if command == "coordinator":
        args = [*COORD, "--listen", "127.0.0.1:80"]
    else:
        args = [*AGENT, "--metrics-port", "80"]
    proc = _run(args, workdir, taken_port, prefix=prefix)
    assert proc.returncode == 2, proc.stderr
    assert "port 80 is privileged" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "command", [[], ["up"], ["coordinator"], ["agent"], ["flows"], ["sim"], ["bench"],
                ["policy"], ["plugin"], ["qos"], ["plugin-path"],
                # the actions of a subcommand too (``plugin info --version N`` is its own flag)
                ["bench", "contention"], ["bench", "serving"], ["policy", "check"],
                ["policy", "show"], ["policy", "list"], ["plugin", "path"], ["qos", "apply"],
                ["qos", "show"], ["qos", "clear"]],
)  # fmt: skip
def test_version_everywhere(command: list[str], workdir: Path, taken_port: int) -> None:
    proc = _run([*command, "--version"], workdir, taken_port)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"flowsched {flowsched.__version__} ")


@pytest.mark.parametrize("command", [[], ["bench", "serving"], ["policy", "check"]])
def test_help_documents_the_exit_statuses(
    command: list[str], workdir: Path, taken_port: int
) -> None:
    proc = _run([*command, "--help"], workdir, taken_port)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "exit status: 0 success; 1 failure at run time" in text
    assert "2 bad input" in text


def test_a_closed_pipe_ends_quietly(workdir: Path) -> None:
    # ``flowsched policy show F | head -1``: the reader is gone before the first write here
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "flowsched", "policy", "show",
             str(ROOT / "policies" / "default.toml")],
            stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60, cwd=workdir,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert proc.returncode == 1
    assert proc.stderr == ""


def test_an_unresolvable_replica_among_several_coordinators_is_a_warning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # a replica's DNS name exists only while its pod does (a rollout): the agent starts
    from flowsched.cli.agent import check_coordinators_resolve

    check_coordinators_resolve(["127.0.0.1", "gone.no-such-host.invalid"])
    err = capsys.readouterr().err
    assert "warning: --coordinator: cannot resolve host 'gone.no-such-host.invalid'" in err


@pytest.mark.parametrize(
    ("hosts", "error", "starts"),
    [
        # no DNS server answers (a node's boot, a cluster's cold start before its DNS pods):
        # the name may well be right, and the agent's uplink retries it
        pytest.param(["coord.example"], socket.EAI_AGAIN, True, id="one-dns-down"),
        pytest.param(["a.example", "b.example"], socket.EAI_AGAIN, True, id="several-dns-down"),
        # the DNS answered that the name does not exist: a typo
        pytest.param(["coord.example"], socket.EAI_NONAME, False, id="one-no-such-name"),
        pytest.param(["a.example", "b.example"], socket.EAI_NONAME, False, id="none-exists"),
    ],
)
def test_an_agent_starts_while_dns_cannot_answer(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hosts: list[str],
    error: int,
    starts: bool,
) -> None:
    from flowsched.cli._common import UsageError
    from flowsched.cli.agent import check_coordinators_resolve

    def getaddrinfo(*args: object, **kwargs: object) -> list[object]:
        raise socket.gaierror(error, "resolver says no")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    if starts:
        check_coordinators_resolve(hosts)
        err = capsys.readouterr().err
        assert all(f"warning: --coordinator: cannot resolve host '{h}'" in err for h in hosts)
    else:
        with pytest.raises(UsageError, match="--coordinator: cannot resolve host"):
            check_coordinators_resolve(hosts)


#: a table or socket path that the agent refuses only once it starts (after the checks): a
#: directory, or a file that is not a flow table / not a socket
IN_THE_WAY = {
    "table-a-directory": (["--table", "{dir}/adir"], "cannot open flow table {dir}/adir"),
    "table-not-a-table": (["--table", "{dir}/text"], "flow table {dir}/text has size 5"),
    "socket-a-directory": (["--socket", "{dir}/adir"], "{dir}/adir exists and is not a socket"),
    "socket-a-file": (["--socket", "{dir}/text"], "{dir}/text exists and is not a socket"),
}


@pytest.mark.parametrize("command", ["agent", "up"])
@pytest.mark.parametrize(("args", "message"), list(IN_THE_WAY.values()), ids=list(IN_THE_WAY))
def test_a_table_or_socket_in_the_way_exits_2_with_one_line(
    command: str, args: list[str], message: str, workdir: Path, taken_port: int
) -> None:
    (workdir / "adir").mkdir()
    (workdir / "text").write_text("hello")
    base = [*AGENT, "--log-level", "WARNING"] if command == "agent" else UP
    proc = _run([*base, *args], workdir, taken_port)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert message.replace("{dir}", str(workdir)) in proc.stderr
