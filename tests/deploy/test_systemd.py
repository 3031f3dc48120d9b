"""systemd units and the environment file they read: `systemd-analyze verify` accepts them
(ExecStart pointed at this checkout's flowsched), and the flags in the file parse with the CLI."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from deploy_helpers import ROOT, need

from flowsched.cli import build_parser

DEPLOY_DOC = ROOT / "docs" / "deploy.md"
UNITS = sorted((ROOT / "agent" / "systemd").glob("*.service"))
ENV_FILE = ROOT / "agent" / "systemd" / "flowsched.env"
#: the venv docs/deploy.md installs into (Debian's system Python refuses pip installs)
UNIT_EXECUTABLE = "/opt/flowsched/bin/flowsched"


def _env() -> dict[str, str]:
    pairs = (line.split("=", 1) for line in ENV_FILE.read_text().splitlines())
    return {k: v for k, v in ((p[0], p[1]) for p in pairs if len(p) == 2 and p[0][:1] != "#")}


def _executable() -> str:
    found = shutil.which("flowsched") or str(Path(sys.executable).parent / "flowsched")
    if not Path(found).exists():
        pytest.skip("no flowsched executable in this environment")
    return found


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_unit_verifies(unit: Path, tmp_path: Path) -> None:
    analyze = need("systemd-analyze")
    text = unit.read_text().replace(UNIT_EXECUTABLE, _executable())
    (tmp_path / unit.name).write_text(text)
    result = subprocess.run(
        [analyze, "verify", f"./{unit.name}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if result.returncode != 0 and "Failed to" in result.stderr and "bus" in result.stderr.lower():
        pytest.skip(f"systemd-analyze cannot run here: {result.stderr.strip()}")
    # unknown keys only warn (exit 0), so stderr must be empty too
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


def test_unit_never_deletes_the_table() -> None:
    # RemoveIPC= (implied by DynamicUser=) deletes the user's /dev/shm files at stop
    for unit in UNITS:
        settings = [line for line in unit.read_text().splitlines() if not line.startswith("#")]
        assert not {"DynamicUser=yes", "RemoveIPC=yes"} & set(settings), unit.name


@pytest.mark.parametrize(
    ("variable", "command"),
    [
        ("FLOWSCHED_AGENT_ARGS", ["agent"]),
        ("FLOWSCHED_COORDINATOR_ARGS", ["coordinator"]),
        ("FLOWSCHED_QOS_ARGS", ["qos", "apply", "--dev", "eth0"]),
    ],
)
def test_environment_file_flags_parse(variable: str, command: list[str]) -> None:
    env = _env()
    assert any(f"${variable}" in unit.read_text() for unit in UNITS)
    build_parser().parse_args([*command, *shlex.split(env[variable])])


def test_units_name_the_fixed_metrics_ports() -> None:
    from flowsched.cli._common import AGENT_METRICS_PORT, COORDINATOR_METRICS_PORT

    env = _env()
    assert f":{AGENT_METRICS_PORT}" in env["FLOWSCHED_AGENT_ARGS"]
    assert f":{COORDINATOR_METRICS_PORT}" in env["FLOWSCHED_COORDINATOR_ARGS"]


def test_units_run_the_venv_the_docs_install() -> None:
    for unit in UNITS:
        execs = [line for line in unit.read_text().splitlines() if line.startswith("Exec")]
        commands = [line.split("=", 1)[1].split()[0] for line in execs]
        flowsched = [c for c in commands if c.endswith("/flowsched")]
        assert flowsched and set(flowsched) == {UNIT_EXECUTABLE}, unit.name
    assert f"{Path(UNIT_EXECUTABLE).parent.parent}/bin/pip install" in DEPLOY_DOC.read_text()


def test_agent_keeps_table_and_socket_where_the_plugin_and_sdk_look_by_default() -> None:
    # a job that sets neither FLOWSCHED_TABLE nor FLOWSCHED_SOCKET finds both (root agent)
    from flowsched.rundir import ROOT_DIR, SOCKET_NAME, TABLE_NAME

    args = build_parser().parse_args(["agent", *shlex.split(_env()["FLOWSCHED_AGENT_ARGS"])])
    assert args.table == f"{ROOT_DIR}/{TABLE_NAME}" and args.socket == f"{ROOT_DIR}/{SOCKET_NAME}"
    agent = (ROOT / "agent" / "systemd" / "flowsched-agent.service").read_text()
    assert f"RuntimeDirectory={Path(ROOT_DIR).name}" in agent.splitlines()


def test_units_that_change_qdiscs_can_write_the_qos_locks() -> None:
    """ProtectSystem=strict leaves /run read-only but for a unit's RuntimeDirectory=: a unit
    that runs `flowsched qos` or the agent (--qos-dev) must have the locks' directory, or its
    applies take no lock (the agent and an operator's apply could interleave)."""
    from flowsched.qos import LOCK_DIR

    assert LOCK_DIR.parent == Path("/run")
    changing = 0
    for unit in UNITS:
        lines = unit.read_text().splitlines()
        starts = " ".join(line for line in lines if line.startswith("ExecStart="))
        if " qos apply " not in starts and " agent " not in starts:
            continue
        changing += 1
        assert "ProtectSystem=strict" in lines, unit.name
        assert f"RuntimeDirectory={LOCK_DIR.name}" in lines, unit.name
        assert "RuntimeDirectoryPreserve=yes" in lines, unit.name  # another may hold a lock
    assert changing == 2


def _instantiate(command: str, instance: str) -> list[str]:
    """``command`` of a template unit as systemd runs it for ``instance`` (man systemd.unit:
    ``%i`` is the instance as written after the ``@``, ``%I`` the same with its escaping undone,
    which systemd-escape --unescape does: ``-`` becomes ``/``, ``\\xNN`` the character)."""
    escape = need("systemd-escape")
    unescaped = subprocess.run(
        [escape, "--unescape", instance], capture_output=True, text=True, check=True
    ).stdout.strip()
    return shlex.split(command.replace("%I", unescaped).replace("%i", instance))


@pytest.mark.parametrize("interface", ["eth0", "enp1s0f0np0", "br-ex", "bond-data", "eth0.100"])
def test_qos_template_applies_to_the_interface_its_instance_names(interface: str) -> None:
    # `systemctl enable --now flowsched-qos@IFACE` with the name `ip link` shows (docs/deploy.md)
    unit = (ROOT / "agent" / "systemd" / "flowsched-qos@.service").read_text().splitlines()
    commands = [
        line.split("=", 1)[1] for line in unit if line.startswith(("ExecStart=", "ExecStop="))
    ]
    assert len(commands) == 2
    for command in commands:
        argv = _instantiate(command.replace("$FLOWSCHED_QOS_ARGS", ""), interface)
        args = build_parser().parse_args(argv[1:])
        assert args.dev == interface, command
