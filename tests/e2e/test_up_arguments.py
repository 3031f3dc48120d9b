"""``flowsched up`` checks its arguments before it starts anything (in-process CLI calls)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowsched.cli import build_parser, main


@pytest.mark.parametrize(
    ("listen", "address"),
    [
        pytest.param("127.0.0.1:7711", ("127.0.0.1", 7711), id="ipv4"),
        pytest.param("[::1]:7711", ("::1", 7711), id="ipv6-brackets"),
        pytest.param(":0", ("127.0.0.1", 0), id="empty-host"),
    ],
)
def test_listen_address_is_parsed_like_the_coordinators(
    listen: str, address: tuple[str, int]
) -> None:
    assert build_parser().parse_args(["up", "--listen", listen]).listen == address


def test_bad_listen_address_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--listen", "localhost"])
    assert "HOST:PORT" in capsys.readouterr().err


def test_bad_node_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["up", "--listen", "127.0.0.1:0", "--metrics-port", "0", "--node", "bad node\n",
            "--token-file", str(tmp_path / "token"), "--table", str(tmp_path / "table"),
            "--socket", str(tmp_path / "agent.sock")]  # fmt: skip
    assert main(args) == 2
    assert "--node" in capsys.readouterr().err
    assert not (tmp_path / "table").exists()
