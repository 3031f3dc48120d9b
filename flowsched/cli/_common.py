"""Helpers shared by the subcommands: the exit-status convention, argument types, checks of
addresses and paths made before a daemon starts, logging and the event loop.

Every subcommand exits 0 on success, 1 on a failure at run time and 2 on bad input (a flag,
a file, an address), always with one line on stderr that names the problem. A command that is
interrupted exits 130 (``bench`` 143 on SIGTERM, 129 on SIGHUP); the daemons treat Ctrl-C and
SIGTERM as the request to stop and exit 0, as a service manager expects of a clean stop.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import grp
import logging
import math
import os
import socket
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, NoReturn

import flowsched
from flowsched import rundir

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

EXIT_STATUS_HELP = (
    "exit status: 0 success; 1 failure at run time (a daemon that failed after it started, a "
    "tc or plugin error); 2 bad input (an invalid flag, file, address or port: one line names "
    "it); 130 interrupted by Ctrl-C (bench: 143 on SIGTERM, 129 on SIGHUP); the daemons "
    "(coordinator, agent, up) stop cleanly on Ctrl-C or SIGTERM and exit 0."
)

#: longest unix socket path (sun_path is 108 bytes with its terminating NUL)
MAX_UNIX_PATH = rundir.SOCKET_PATH_MAX
#: errno values that mean "this address cannot be bound" (bad input, not a crash)
_BIND_ERRORS = {errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL, errno.EPERM}


class UsageError(ValueError):
    """Bad input: the message names the flag and the problem (exit status 2)."""


class ResolverUnavailable(UsageError):
    """A host name could not be resolved because no DNS server answered (``EAI_AGAIN``), not
    because it does not exist: the name may well be right."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``flowsched agent: --slots: ... (see --help)``."""

    def error(self, message: str) -> NoReturn:
        """Print one line naming the problem and exit 2 (argparse prints the whole usage)."""
        print(f"{self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def version() -> str:
    """``flowsched X.Y.Z`` (Python and platform too: what a bug report needs)."""
    return f"flowsched {flowsched.__version__} (Python {sys.version.split()[0]}, {sys.platform})"


def add_version(parser: argparse.ArgumentParser) -> None:
    """Add ``--version`` to ``parser``."""
    parser.add_argument("--version", action="version", version=version())


# -- argument types ---------------------------------------------------------------------------


def port(text: str) -> int:
    """argparse type for a TCP port, 0 (any free port) .. 65535."""
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a port 0..65535, got {text!r}")
    return int(text)


def port_or_off(text: str) -> int:
    """A port, or -1 for "off"."""
    return -1 if text.strip() == "-1" else port(text)


def positive_int(text: str) -> int:
    """argparse type for an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def host_port(text: str) -> tuple[str, int]:
    """argparse type for ``HOST:PORT`` (``[v6addr]:PORT`` too; an empty host is 127.0.0.1)."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit() or int(port_text) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port 0..65535, got {text!r}")
    return unbracketed(host, text) or "127.0.0.1", int(port_text)


def unbracketed(host: str, text: str) -> str:
    """``host`` without the brackets of ``[v6addr]``; ``text`` is the whole value, for the
    message. Brackets anywhere else (``[::1``, ``::1]``) are refused: a typo, not a host.

    Raises:
        argparse.ArgumentTypeError: misplaced or unbalanced brackets.
    """
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if "[" in host or "]" in host:
        raise argparse.ArgumentTypeError(
            f"unbalanced or misplaced brackets in {text!r} (an IPv6 address goes as [ADDR] or "
            "[ADDR]:PORT)"
        )
    return host


# -- checks before a daemon starts (raise UsageError) ----------------------------------------


def resolve(flag: str, host: str) -> list[tuple[int, str]]:
    """(family, address) of every address ``host`` resolves to; UsageError if none
    (ResolverUnavailable when the resolver could not answer)."""
    try:
        infos = socket.getaddrinfo(
            host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        again = isinstance(exc, socket.gaierror) and exc.errno == socket.EAI_AGAIN
        error = ResolverUnavailable if again else UsageError
        raise error(f"{flag}: cannot resolve host {host!r} ({reason})") from None
    return list(dict.fromkeys((family, str(addr[0])) for family, _, _, _, addr in infos))


def check_bindable(flag: str, host: str, port_number: int, host_flag: str | None = None) -> None:
    """Bind ``host:port`` once and release it, so that a taken or privileged port, or an
    address of another machine, is reported before anything starts: the port's problems
    under ``flag``, the host's under ``host_flag`` (default ``flag``)."""
    host_flag = host_flag or flag
    for family, address in resolve(host_flag, host):
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio does
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind((address, port_number))
            except OSError as exc:
                name = host_flag if exc.errno == errno.EADDRNOTAVAIL else flag
                raise UsageError(bind_problem(name, host, port_number, exc)) from None


#: the addresses that bind every address of their family
_WILDCARDS = ("0.0.0.0", "::")


def check_distinct_ports(listeners: list[tuple[str, str, int]]) -> None:
    """UsageError naming both flags when two of ``listeners`` ((flag, host, port), as the
    daemons will bind them) ask for the same port on overlapping addresses (equal, or one of
    them a wildcard of the same family). Each binds alone in :func:`check_bindable`'s probe,
    so only the second real bind found it: an ``address already in use`` naming no flag.
    Port 0 (any free port) never clashes."""
    seen: list[tuple[str, str, int, set[tuple[int, str]]]] = []
    for flag, host, port_number in listeners:
        addresses = set(resolve(flag, host))
        for other_flag, other_host, other_port, other in seen:
            if port_number and port_number == other_port and _overlap(addresses, other):
                raise UsageError(
                    f"{flag} {host}:{port_number}: the same port as {other_flag} "
                    f"{other_host}:{other_port} (two listeners need two ports; 0 = any free one)"
                )
        seen.append((flag, host, port_number, addresses))


def _overlap(first: set[tuple[int, str]], second: set[tuple[int, str]]) -> bool:
    """The two (family, address) sets share an address, or a wildcard meets its family's."""
    return any(
        family == other_family
        and (address == other or address in _WILDCARDS or other in _WILDCARDS)
        for family, address in first
        for other_family, other in second
    )


def bind_problem(flag: str, host: str, port_number: int, exc: OSError) -> str:
    """One line for a failed bind, naming the flag."""
    where = f"{flag} {host}:{port_number}"
    if exc.errno == errno.EADDRINUSE:
        return f"{where}: port {port_number} is already in use (another flowsched?)"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (
            f"{where}: port {port_number} is privileged: it needs root (CAP_NET_BIND_SERVICE);"
            " use a port >= 1024"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{where}: {host} is not an address of this machine"
    return f"{where}: cannot bind ({exc.strerror or exc})"


def check_parent_dir(flag: str, path: str) -> None:
    """UsageError unless the directory that will hold ``path`` exists."""
    parent = Path(path).expanduser().absolute().parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: directory {parent} does not exist")


def prepare_out_dir(flag: str, path: str | Path) -> Path:
    """Create the output directory ``path`` (and its parents) now, before a long computation;
    UsageError naming ``flag`` when it cannot be created or written (a file, no permission)."""
    out = Path(path).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UsageError(f"{flag} {path}: exists and is not a directory") from None
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot create it ({exc.strerror or exc})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: the directory is not writable")
    return out


def finite_fractions(
    flag: str, text: str, upper: float | None = None, lower: float | None = None
) -> list[float]:
    """The comma-separated numbers of ``text``, each finite, > 0, (with ``lower``) at least
    ``lower`` and (with ``upper``) below ``upper``; UsageError naming ``flag`` otherwise (none
    given included)."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise UsageError(f"{flag}: no value given")
    low = f">= {lower:g}" if lower is not None else "> 0"
    bound = f" and < {upper:g}" if upper is not None else ""
    for value in values:
        if (
            not math.isfinite(value)
            or value <= 0
            or (lower is not None and value < lower)
            or (upper is not None and value >= upper)
        ):
            raise UsageError(f"{flag}: expected finite numbers {low}{bound}, got {value:g}")
    return values


def check_socket_path(flag: str, path: str) -> None:
    """UsageError when ``path`` is too long for a unix socket."""
    size = len(os.fsencode(os.path.abspath(path)))
    if size > MAX_UNIX_PATH:
        raise UsageError(
            f"{flag}: the path is {size} bytes long; a unix socket path has at most {MAX_UNIX_PATH}"
        )


def check_table_path(flag: str, path: str) -> None:
    """UsageError when ``path`` is longer than the NCCL plugin reads ``FLOWSCHED_TABLE``: the
    plugin would ignore it, and jobs would never see the agent's table."""
    size = len(os.fsencode(os.path.abspath(path)))
    if size > rundir.TABLE_PATH_MAX:
        raise UsageError(
            f"{flag}: the path is {size} bytes long; the NCCL plugin reads a table path of at "
            f"most {rundir.TABLE_PATH_MAX}"
        )


def check_interface(flag: str, name: str) -> None:
    """UsageError unless ``name`` is a network interface of this namespace."""
    try:
        socket.if_nametoindex(name)
    except OSError:
        raise UsageError(f"{flag}: no network interface named {name!r}") from None


def check_group(flag: str, name: str) -> None:
    """UsageError unless ``name`` is a group of this machine."""
    try:
        grp.getgrnam(name)
    except KeyError:
        raise UsageError(f"{flag}: no group named {name!r}") from None


# -- running ----------------------------------------------------------------------------------


def setup_logging(level: str) -> None:
    """Log to stderr with timestamps, as every daemon does."""
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def loop_factory(disabled: bool) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop factory unless disabled (flag or FLOWSCHED_NO_UVLOOP) or not installed.

    uvloop is chosen here, in the CLI runner only, so that tests run on the plain asyncio loop.
    """
    if disabled or os.environ.get("FLOWSCHED_NO_UVLOOP"):
        return None
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run_daemon(prog: str, main: Callable[[], Coroutine[Any, Any, None]], no_uvloop: bool) -> int:
    """Run ``main()`` on the event loop; a bind that failed anyway (a race with the checks)
    ends with one line and status 2, not a traceback."""
    try:
        with asyncio.Runner(loop_factory=loop_factory(no_uvloop)) as runner:
            runner.run(main())
    except UsageError as exc:
        return fail(prog, str(exc))
    except OSError as exc:
        if exc.errno not in _BIND_ERRORS:
            raise
        return fail(prog, str(exc))
    return EXIT_OK


def fail(prog: str, message: str, status: int = EXIT_USAGE) -> int:
    """Print ``prog: message`` on one line and return ``status``."""
    print(f"{prog}: {' '.join(message.split())}", file=sys.stderr)
    return status


# -- metrics endpoint flags (B1) ---------------------------------------------------------------

#: fixed default metrics ports, so that the port in Prometheus's ``instance`` label stays put;
#: outside 9100-9999, which the Prometheus wiki's default port allocations fill (exporters of
#: internal applications should stay out of it; docs/deploy.md)
COORDINATOR_METRICS_PORT = 19711
AGENT_METRICS_PORT = 19712


def add_metrics_flags(parser: argparse.ArgumentParser, default_port: int) -> None:
    """``--metrics-bind HOST[:PORT]`` and ``--metrics-port N`` (``/metrics``, ``/healthz``,
    ``/readyz``); read them back with :func:`metrics_address`."""
    parser.add_argument(
        "--metrics-bind",
        default=None,
        metavar="HOST[:PORT]",
        help=f"address of /metrics, /healthz and /readyz (default 127.0.0.1:{default_port}; "
        "0.0.0.0 or [::] = every address)",
    )
    parser.add_argument(
        "--metrics-port",
        type=port_or_off,
        default=None,
        metavar="N",
        help="port only, overriding --metrics-bind's (0 = any free port, -1 = off)",
    )
    parser.add_argument("--metrics-host", default=None, help=argparse.SUPPRESS)  # older flag
    parser.set_defaults(metrics_default_port=default_port)


def metrics_port_flag(args: argparse.Namespace) -> str:
    """The flag that set the metrics port: ``--metrics-bind`` when it alone was given (with
    or without a port), else ``--metrics-port`` (also for the default port: it changes it)."""
    return "--metrics-bind" if args.metrics_port is None and args.metrics_bind else "--metrics-port"


def metrics_address(args: argparse.Namespace) -> tuple[str, int] | None:
    """(host, port) of the metrics endpoint the flags ask for, None when it is off.

    Raises UsageError naming the flag for a malformed ``--metrics-bind``.
    """
    host, port_number = args.metrics_host or "127.0.0.1", int(args.metrics_default_port)
    if args.metrics_bind is not None:
        text = args.metrics_bind
        with_port = "]:" in text if text.startswith("[") else text.count(":") == 1
        # HOST:PORT or [V6]:PORT; else a bare host (a bare IPv6 has 2+ colons)
        try:
            host = unbracketed(text.rpartition(":")[0] if with_port else text, text)
        except argparse.ArgumentTypeError as exc:
            raise UsageError(f"--metrics-bind: {exc}") from None
        if with_port:
            try:
                host, port_number = host_port(text)
            except argparse.ArgumentTypeError:
                raise UsageError(f"--metrics-bind: expected HOST[:PORT], got {text!r}") from None
        if not host:
            raise UsageError(f"--metrics-bind: no host in {text!r}")
    if args.metrics_port is not None:
        if args.metrics_port < 0:
            return None
        port_number = args.metrics_port
    return host, port_number
