"""What the subcommands' ``--help`` says about a default or a choice, checked against what the
code does with it: the help is what users read."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import pytest

from flowsched import policies, rundir
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


def _per_flow_clause(text: str, head: str) -> set[str]:
    """The policy names listed after ``head`` (``true of``/``not of``) up to ``;`` or ``)``,
    an ``rmlq unless ...`` entry counted as ``rmlq``."""
    match = re.search(rf"{head} ([^;)]*)", text)
    assert match, text
    entries = [e.strip().removeprefix("and ") for e in match.group(1).split(",")]
    return {e.split()[0] for e in entries if e}


def test_per_flow_policy_help_lists_what_each_policy_says() -> None:
    """``--per-flow-policy yes`` forces per-flow re-evaluation: wrong for a policy whose decisions
    depend on other flows, so the help must name the policies that are per-flow and those
    that are not, as the policy objects themselves say (what ``auto`` asks)."""
    text = option_help("coordinator", "--per-flow-policy")
    per_flow = _per_flow_clause(text, "true of")
    not_per_flow = _per_flow_clause(text, "not of")
    for name in policies.names():
        policy = policies.module(name).new({}, num_levels=8)
        decides_alone = getattr(policy, "per_flow_decisions", False) is True  # optional
        assert name in (per_flow if decides_alone else not_per_flow), (name, text)


@pytest.mark.parametrize(
    ("args", "named_in_help"),
    [
        ({"red_tiers": 2}, "red_tiers > 1"),
        ({"feasibility_check": "mlu"}, 'feasibility_check = "mlu"'),
    ],
)
def test_per_flow_policy_help_names_the_rmlq_arguments_that_end_it(
    args: dict[str, object], named_in_help: str
) -> None:
    assert policies.module("rmlq").new(args, num_levels=12).per_flow_decisions is False
    assert named_in_help in option_help("coordinator", "--per-flow-policy")
