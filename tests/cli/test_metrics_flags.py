"""``--metrics-bind`` / ``--metrics-port`` of the daemons: fixed defaults, overrides, errors."""

from __future__ import annotations

import argparse

import pytest

from flowsched.cli import build_parser
from flowsched.cli._common import (
    AGENT_METRICS_PORT,
    COORDINATOR_METRICS_PORT,
    UsageError,
    host_port,
    metrics_address,
)
from flowsched.cli.coordinator import _print_ready
from flowsched.coordinator import Addresses


@pytest.mark.parametrize(
    ("command", "flags", "expected"),
    [
        ("agent", [], ("127.0.0.1", AGENT_METRICS_PORT)),
        ("coordinator", [], ("127.0.0.1", COORDINATOR_METRICS_PORT)),
        ("agent", ["--metrics-bind", "0.0.0.0"], ("0.0.0.0", AGENT_METRICS_PORT)),
        ("agent", ["--metrics-bind", "0.0.0.0:9999"], ("0.0.0.0", 9999)),
        ("agent", ["--metrics-bind", "[::]:19999"], ("::", 19999)),
        ("agent", ["--metrics-bind", "[::1]"], ("::1", AGENT_METRICS_PORT)),
        ("agent", ["--metrics-bind", "::"], ("::", AGENT_METRICS_PORT)),
        ("agent", ["--metrics-bind", "10.0.0.1:1", "--metrics-port", "0"], ("10.0.0.1", 0)),
        ("agent", ["--metrics-port", "-1"], None),
        ("coordinator", ["--metrics-host", "0.0.0.0", "--metrics-port", "5"], ("0.0.0.0", 5)),
    ],
)
def test_metrics_address(command: str, flags: list[str], expected: tuple[str, int] | None) -> None:
    assert metrics_address(build_parser().parse_args([command, *flags])) == expected


@pytest.mark.parametrize("bind", ["host:notaport", "host:70000", "[::1]:x", ":"])
def test_bad_metrics_bind_names_the_flag(bind: str) -> None:
    with pytest.raises(ValueError, match="--metrics-bind"):
        metrics_address(build_parser().parse_args(["agent", "--metrics-bind", bind]))


#: --metrics-bind's address forms: (value, the address taken, or the start of the refusal)
BIND_FORMS = [
    ("[::1]", ("::1", AGENT_METRICS_PORT)),
    ("::1", ("::1", AGENT_METRICS_PORT)),
    ("127.0.0.1", ("127.0.0.1", AGENT_METRICS_PORT)),
    ("[::1]:80", ("::1", 80)),
    ("[::1", "--metrics-bind: unbalanced or misplaced brackets in '[::1'"),
    ("::1]", "--metrics-bind: unbalanced or misplaced brackets in '::1]'"),
    ("[::1]x", "--metrics-bind: unbalanced or misplaced brackets in '[::1]x'"),
    ("[::1]]:80", "--metrics-bind: unbalanced or misplaced brackets in '[::1]]:80'"),
    ("", "--metrics-bind: no host in ''"),
    ("[]", "--metrics-bind: no host in '[]'"),
]


@pytest.mark.parametrize(("bind", "expected"), BIND_FORMS, ids=[form for form, _ in BIND_FORMS])
def test_metrics_bind_takes_an_address_or_refuses_it_naming_the_flag(
    bind: str, expected: tuple[str, int] | str
) -> None:
    """A bracket without its pair (``[::1``) was taken as the address inside it."""
    args = build_parser().parse_args(["agent", "--metrics-bind", bind])
    if isinstance(expected, tuple):
        assert metrics_address(args) == expected
    else:
        with pytest.raises(UsageError) as refused:
            metrics_address(args)
        assert str(refused.value).startswith(expected)


@pytest.mark.parametrize("listen", ["[::1:7711", "::1]:7711", "[[::1]]:7711"])
def test_a_host_port_flag_refuses_unbalanced_brackets(listen: str) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["coordinator", "--listen", listen])
    assert exited.value.code == 2
    assert host_port("[::1]:7711") == ("::1", 7711)
    with pytest.raises(argparse.ArgumentTypeError, match="brackets"):
        host_port(listen)


def test_a_port_outside_0_65535_is_refused_by_the_parser() -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["agent", "--metrics-port", "99999"])
    assert exited.value.code == 2


def test_default_ports_are_outside_the_prometheus_allocations() -> None:
    # the wiki's default port allocations fill 9100-9999; exporters of internal applications
    # should stay out of that range (and out of Linux's ephemeral range, 32768-60999)
    for port in (AGENT_METRICS_PORT, COORDINATOR_METRICS_PORT):
        assert not 9100 <= port <= 9999 and port < 32768
    assert AGENT_METRICS_PORT != COORDINATOR_METRICS_PORT  # both run on one host with `up`


@pytest.mark.parametrize(
    ("host", "metrics", "expected"),
    [
        ("127.0.0.1", (None, None), "127.0.0.1:7711 metrics off"),
        ("127.0.0.1", ("127.0.0.1", 19711), "127.0.0.1:7711 metrics 127.0.0.1:19711"),
        # in brackets (RFC 3986), as a copied address is read unambiguously: ::1:7711 was printed
        ("::1", ("::", 19711), "[::1]:7711 metrics [::]:19711"),
    ],
)
def test_the_coordinators_ready_line_says_where_it_and_its_metrics_are(
    host: str,
    metrics: tuple[str | None, int | None],
    expected: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _print_ready(Addresses(host, 7711, *metrics))
    assert capsys.readouterr().out == f"flowsched-coordinator listening on {expected}\n"
