"""`flowsched plugin-path` and `flowsched plugin ...`: the NCCL net plugin from the command line.

``flowsched plugin-path`` prints the absolute path of ``libnccl-net-flowsched.so``, so that
``NCCL_NET_PLUGIN=$(flowsched plugin-path) NCCL_NET=flowsched`` enables the plugin.
``flowsched plugin info`` loads it and prints what NCCL would see (name, devices, properties).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from flowsched.nccl import PluginNotFoundError, plugin_path


def register(sub: Any) -> None:
    """Add the `plugin-path` and `plugin` subcommands."""
    path_parser = sub.add_parser(
        "plugin-path", help="print the absolute path of the NCCL net plugin library"
    )
    path_parser.set_defaults(func=_run_path)
    parser = sub.add_parser("plugin", help="the NCCL net plugin (path, info)")
    actions = parser.add_subparsers(dest="plugin_command", metavar="ACTION", required=True)
    actions.add_parser("path", help="print the library path").set_defaults(func=_run_path)
    info = actions.add_parser("info", help="load the plugin and print its devices")
    info.add_argument(
        "--version",
        type=int,
        default=11,
        choices=(10, 11, 12),
        help="which exported table to use (default 11)",
    )
    info.set_defaults(func=_run_info)


def _run_path(args: argparse.Namespace) -> int:
    try:
        print(plugin_path())
    except PluginNotFoundError as exc:
        print(f"flowsched: {exc}", file=sys.stderr)
        return 1
    return 0


def _run_info(args: argparse.Namespace) -> int:
    from flowsched.nccl.harness import Plugin, PluginError, PluginRejected

    try:
        plugin = Plugin(plugin_path(), version=args.version)
        ctx = plugin.init()
        devices = [plugin.properties(dev) for dev in range(plugin.devices())]
        ctx.finalize()
    except PluginRejected as exc:  # e.g. no interface matches: NCCL would not use it
        print(f"flowsched: NCCL would not use the plugin: {exc}", file=sys.stderr)
        return 1
    except (PluginNotFoundError, PluginError, OSError) as exc:
        print(f"flowsched: {exc}", file=sys.stderr)
        return 1
    print(
        json.dumps(
            {"path": plugin.path, "name": plugin.name, "api": args.version, "devices": devices},
            indent=2,
        )
    )
    plugin.close()
    return 0
