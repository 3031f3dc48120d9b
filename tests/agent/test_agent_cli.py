"""``flowsched agent`` refuses unsafe inputs with a clear message (in-process CLI calls)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flowsched.cli import main
from flowsched.protocol import write_token


def _agent(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "agent",
        "--node",
        "n1",
        "--table",
        str(tmp_path / "table"),
        "--socket",
        str(tmp_path / "agent.sock"),
        "--metrics-port",
        "-1",
        *extra,
    ]


def test_loose_token_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    token = tmp_path / "token"
    write_token(token)
    os.chmod(token, 0o644)
    args = _agent(tmp_path, "--coordinator", "127.0.0.1:1", "--token-file", str(token))
    assert main(args) == 2
    assert "token" in capsys.readouterr().err


def test_invalid_policy_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "bad.toml"
    policy.write_text('[policy]\nname = "nope"\n')
    assert main(_agent(tmp_path, "--policy", str(policy))) == 2
    assert "nope" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a file of another user")
def test_table_of_another_user_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table = tmp_path / "table"
    table.write_bytes(b"")
    os.chown(table, 65534, 65534)
    assert main(_agent(tmp_path)) == 2
    assert "owned by uid 65534" in capsys.readouterr().err


def test_bad_fallback_after_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_agent(tmp_path, "--fallback-after", "0")) == 2
    assert "--fallback-after" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "field"),
    [
        ("--link-capacity", "25000000", "link_capacity"),
        ("--nic-interval", "0.1", "nic_interval"),
        ("--first-level-wait", "0.15", "first_level_wait"),
    ],
    ids=["link-capacity", "nic-interval", "first-level-wait"],
)
def test_flag_values_reach_the_config(tmp_path: Path, flag: str, value: str, field: str) -> None:
    from flowsched.cli import build_parser
    from flowsched.cli.agent import config_from_args

    config = config_from_args(build_parser().parse_args(_agent(tmp_path, flag, value)))
    assert getattr(config, field) == float(value)


@pytest.mark.parametrize("flag", ["--link-capacity", "--nic-interval"])
def test_non_positive_nic_overrides_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    assert main(_agent(tmp_path, flag, "0")) == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        pytest.param(("--fallback-after", "nan"), "--fallback-after", id="nan-fallback"),
        pytest.param(("--link-capacity", "inf"), "--link-capacity", id="inf-capacity"),
        pytest.param(("--link-bandwidth", "0"), "--link-bandwidth", id="zero-bandwidth"),
        pytest.param(("--nic-interval", "inf"), "--nic-interval", id="inf-nic-interval"),
        pytest.param(("--first-level-wait", "-1"), "--first-level-wait", id="negative-wait"),
        pytest.param(("--first-level-wait", "nan"), "--first-level-wait", id="nan-wait"),
        pytest.param(("--node", " n1"), "--node", id="node-with-blank"),
        pytest.param(("--node", "n" * 129), "--node", id="node-too-long"),
    ],
)
def test_values_that_would_fail_later_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: tuple[str, str], named: str
) -> None:
    assert main(_agent(tmp_path, *flags)) == 2
    assert named in capsys.readouterr().err


def _daemon_args(command: str, tmp_path: Path) -> list[str]:
    """``flowsched agent`` or ``flowsched up`` with its files in ``tmp_path`` and every port 0
    (the table path comes from the environment)."""
    socket_flags = ["--socket", str(tmp_path / "agent.sock")]
    if command == "agent":
        return ["agent", "--node", "n1", *socket_flags, "--metrics-port", "-1"]
    return ["up", "--token-file", str(tmp_path / "token"), *socket_flags, "--listen",
            "127.0.0.1:0", "--metrics-port", "0", "--agent-metrics-port", "0"]  # fmt: skip


@pytest.mark.parametrize("command", ["agent", "up"])
def test_a_default_table_path_too_long_for_the_plugin_is_refused(
    command: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # a user (root's default directory is /run/flowsched) whose XDG_RUNTIME_DIR is so long
    # that the default table path would pass the plugin's 255 bytes: refused before anything
    # starts, naming the variable, rather than serving a table the plugin never finds
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.delenv("FLOWSCHED_TABLE", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / ("x" * 250)))
    assert main(_daemon_args(command, tmp_path)) == 2
    err = capsys.readouterr().err
    assert "XDG_RUNTIME_DIR" in err and "at most 255" in err, err
    assert not (tmp_path / ("x" * 250)).exists()


@pytest.mark.parametrize("command", ["agent", "up"])
def test_a_flowsched_table_too_long_for_the_plugin_is_refused(
    command: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # $FLOWSCHED_TABLE is the agent's default table path, and the jobs' (`up` exports it): the
    # plugin ignores one over 255 bytes as it would a --table path, so it is refused the same
    long_path = tmp_path / ("d" * 120) / ("d" * 120) / "table"
    monkeypatch.setenv("FLOWSCHED_TABLE", str(long_path))
    assert main(_daemon_args(command, tmp_path)) == 2
    err = capsys.readouterr().err
    assert "FLOWSCHED_TABLE: the path is" in err and "at most 255" in err, err
    assert not (tmp_path / ("d" * 120)).exists()
