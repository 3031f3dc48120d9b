"""Token files and the HMAC challenge response."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flowsched.protocol import TokenFileError, compute_mac, load_token, verify_mac, write_token
from flowsched.protocol.auth import PLACEHOLDER_TOKENS


def test_write_then_load_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "cfg" / "token"
    token = write_token(path)
    assert load_token(path) == token
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_token_is_not_written_through_a_dangling_link(tmp_path: Path) -> None:
    # a link planted at a token path in a shared directory: Path.exists() is False for it
    target, path = tmp_path / "theirs", tmp_path / "token"
    path.symlink_to(target)
    with pytest.raises(OSError, match="symbolic links"):
        write_token(path)
    assert not target.exists()


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644, 0o606], ids=oct)
def test_group_or_other_accessible_token_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "token"
    write_token(path, b"s" * 32)
    os.chmod(path, mode)
    with pytest.raises(TokenFileError, match="chmod 600"):
        load_token(path)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        pytest.param(b"short\n", "shorter than 16", id="short"),
        pytest.param(b"   \n", "shorter than 16", id="blank"),
    ],
)
def test_bad_token_content(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "token"
    write_token(path, content.strip())
    with pytest.raises(TokenFileError, match=match):
        load_token(path)


@pytest.mark.parametrize("placeholder", sorted(PLACEHOLDER_TOKENS))
def test_shipped_placeholder_is_refused_naming_the_file(tmp_path: Path, placeholder: bytes) -> None:
    # what `kubectl apply -k deploy/kubernetes` put into the Secret before the Secret left the
    # kustomization: long enough for the length check, and printed in the repository
    path = tmp_path / "secret" / "token"
    write_token(path, placeholder)
    with pytest.raises(TokenFileError, match="placeholder") as caught:
        load_token(path)
    assert str(path) in str(caught.value) and "os.urandom" in str(caught.value)


def test_the_placeholder_the_kubernetes_secret_shipped_is_known() -> None:
    assert b"REPLACE-WITH-64-HEX-CHARACTERS-FROM-os.urandom-32" in PLACEHOLDER_TOKENS


def test_missing_token_file(tmp_path: Path) -> None:
    with pytest.raises(TokenFileError, match="No such file"):
        load_token(tmp_path / "absent")


def test_mac_binds_token_nonce_and_node() -> None:
    token, nonce = b"t" * 32, b"n" * 32
    mac = compute_mac(token, nonce, "node-a")
    assert verify_mac(token, nonce, "node-a", mac)
    assert not verify_mac(token, nonce, "node-b", mac)
    assert not verify_mac(token, b"m" * 32, "node-a", mac)
    assert not verify_mac(b"u" * 32, nonce, "node-a", mac)
