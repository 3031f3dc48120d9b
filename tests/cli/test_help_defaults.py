"""What the subcommands' ``--help`` says about a default or a choice, checked against what the
code does with it: the help is what users read."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from flowsched import rundir
from flowsched.cli import agent as agent_cli
from flowsched.cli import build_parser


def option_help(command: str, option: str) -> str:
    """The help text of ``flowsched COMMAND OPTION``, on one line, ``%(default)s`` filled."""
    subcommands = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    parser = subcommands.choices[command]
    action = parser._option_string_actions[option]
    return " ".join(str(action.help % {"default": action.default}).split())


@pytest.mark.parametrize("given_by", ["--table", "FLOWSCHED_TABLE"])
def test_agent_socket_help_names_where_the_default_socket_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given_by: str
) -> None:
    """Without --socket the SDK socket is in the agent's runtime directory, where the SDK looks
    for it, whatever table is given: the help must not send users to the table's directory."""
    monkeypatch.delenv("FLOWSCHED_SOCKET", raising=False)
    monkeypatch.delenv("FLOWSCHED_TABLE", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    table = tmp_path / "elsewhere" / "table"
    if given_by == "--table":
        args = build_parser().parse_args(["agent", "--table", str(table)])
    else:
        monkeypatch.setenv("FLOWSCHED_TABLE", str(table))
        args = build_parser().parse_args(["agent"])
    config = agent_cli._config(args, None, {})
    assert config.table_path == str(table)
    assert config.socket_path == os.path.join(rundir.agent_runtime_dir(), rundir.SOCKET_NAME)
    text = option_help("agent", "--socket")
    assert "$FLOWSCHED_SOCKET" in text and "runtime directory" in text, text
    assert "next to the table" not in text, text
