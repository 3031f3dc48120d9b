"""``flowsched policy``: validate policy files and show their effective level tables.

* ``flowsched policy check FILE...``: validate each file; prints ``FILE: ok (...)`` or one line
  per error (``FILE: classes.kv.deadline: ...``); exit status 2 if any file has an error.
  Notes (reserved DSCPs) and warnings (what only the simulator applies) leave the status 0.
* ``flowsched policy show [FILE]``: the level -> hardware queue -> DSCP / SO_PRIORITY table and
  the class rules of a file (default: the packaged ``default.toml``).
* ``flowsched policy list``: the registered policies and the shipped policy files (absolute
  paths, valid from any directory).

A FILE that does not exist but names a shipped policy file (``pd-serving`` or
``pd-serving.toml``) is that file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from flowsched import policies, policyfile
from flowsched.data import data_path
from flowsched.policyfile import PolicyConfig, PolicyFileError

#: exit status when a policy file is invalid
EXIT_INVALID = 2


def register(sub: Any) -> None:
    """Add the ``policy`` subcommand and its ``check``/``show``/``list`` actions."""
    parser = sub.add_parser("policy", help="validate and inspect policy files")
    actions = parser.add_subparsers(dest="policy_action", metavar="ACTION", required=True)
    check = actions.add_parser("check", help="validate policy files (exit 2 on any error)")
    check.add_argument(
        "files", nargs="+", metavar="FILE", help="policy TOML files or shipped names (pd-serving)"
    )
    check.set_defaults(func=run_check)
    show = actions.add_parser("show", help="print the effective level table of a policy file")
    show.add_argument(
        "file",
        nargs="?",
        metavar="FILE",
        help="policy file or shipped name, e.g. pd-serving (default: the built-in default)",
    )
    show.set_defaults(func=run_show)
    listing = actions.add_parser("list", help="list policies and shipped policy files")
    listing.set_defaults(func=run_list)


def run_check(args: argparse.Namespace) -> int:
    """Validate every file; print one verdict per file, then its notes and warnings (which
    leave the status alone); 2 if any is invalid."""
    status = 0
    for name in args.files:
        try:
            config = policyfile.load(resolve(name))
        except PolicyFileError as exc:
            status = EXIT_INVALID
            for error in exc.errors:
                print(f"{name}: {error}")
            continue
        print(f"{name}: ok ({config.summary()})")
        for note in roce_notes(config):
            print(f"{name}: note: {note}")
        for warning in live_warnings(config):
            print(f"{name}: warning: {warning}")
    return status


def live_warnings(config: PolicyConfig) -> list[str]:
    """Warnings (not errors) for what a policy does in the simulator but not live.

    Returns:
        One line per difference: today karuna's rate caps (``Decision.rate``), which only the
        simulator applies (the agent applies a decision's level, nothing paces a flow).
    """
    if config.policy != "karuna":
        return []
    return [
        "karuna's rate caps (each deadline flow paced at its minimum rate) apply only in the "
        "simulator; live, the agent applies levels only: deadline flows are strictly first "
        "at level 0, unpaced"
    ]


#: DSCP ranges RoCE fabrics usually reserve: 26 (lossless, PFC priority 3) and 48 (CNP,
#: priority 6); a switch mapping DSCP >> 3 to priorities puts the whole ranges there
ROCE_RANGES = ((24, 31, "RoCE's usual lossless priority 3 (DSCP 26)"),
               (48, 55, "RoCE's usual CNP priority 6 (DSCP 48)"))  # fmt: skip


def roce_notes(config: PolicyConfig) -> list[str]:
    """Warnings (not errors) for queues marked with DSCPs that RoCE fabrics usually reserve."""
    notes = []
    for q, marking in enumerate(config.queues):
        for low, high, what in ROCE_RANGES:
            if low <= marking.dscp <= high:
                notes.append(
                    f"queues[{q}].dscp = {marking.dscp} is in {low}-{high}, {what}: on a RoCE "
                    "fabric this TCP traffic would share that queue (see docs/qos.md)"
                )
    return notes


def run_show(args: argparse.Namespace) -> int:
    """Print the level table and class rules of one file."""
    try:
        config = policyfile.load(resolve(args.file)) if args.file else policyfile.embedded_default()
    except PolicyFileError as exc:  # on stderr, as every command's bad input (check's verdicts
        for error in exc.errors:  # are its report: stdout)
            print(f"{args.file}: {error}", file=sys.stderr)
        return EXIT_INVALID
    print("\n".join(describe(config)))
    return 0


def run_list(args: argparse.Namespace) -> int:
    """Print the registered policies and the shipped policy files."""
    for name in policies.names():
        print(f"policy {name}{' (oracle: reference only)' if name in policies.ORACLES else ''}")
    for name in policyfile.shipped_files():
        print(f"file   {shipped_path(name)}")
    return 0


def shipped_path(name: str) -> Path:
    """The absolute path of the shipped policy file ``name`` (``pd-serving.toml``)."""
    return data_path("policies", name)


def resolve(name: str) -> Path:
    """``name`` as a path when it exists (or looks like a path), else the shipped policy file
    it names (``pd-serving`` or ``pd-serving.toml``), else ``name`` (the load says why not)."""
    path = Path(name)
    if path.exists() or "/" in name:
        return path
    file = name if name.endswith(".toml") else f"{name}.toml"
    return shipped_path(file) if file in policyfile.shipped_files() else path


def describe(config: PolicyConfig) -> list[str]:
    """Human-readable lines: summary, level table, class rules."""
    meanings = _level_meanings(config)
    lines = [f"{config.source}: {config.summary()}"]
    if config.description:
        lines.append(f"  {config.description}")
    lines.append("level  queue  dscp  so_priority  meaning")
    for level, marking in enumerate(config.levels):
        queue = config.level_queue[level] if config.level_queue else level
        meaning = meanings[level] if level < len(meanings) else ""
        lines.append(
            f"{level:>5}  {queue:>5}  {marking.dscp:>4}  {marking.so_priority:>11}  {meaning}"
        )
    lines.append("class        trafficClass  default_level  deadline")
    for cls, rule in config.classes.items():
        tcs = ",".join(map(str, rule.traffic_classes)) or "-"
        deadline = "-" if rule.deadline is None else f"{rule.deadline:g} s"
        lines.append(f"{cls.label:<12} {tcs:>12}  {rule.default_level:>13}  {deadline}")
    return lines


def _level_meanings(config: PolicyConfig) -> list[str]:
    describe_levels = getattr(config.make_policy(), "describe_levels", None)
    if describe_levels is None:
        return []
    meanings: list[str] = describe_levels()
    return meanings
