"""Fixtures of the end-to-end tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowsched.protocol import write_token


@pytest.fixture
def token(tmp_path: Path) -> Path:
    """A fresh agent-coordinator token file."""
    path = tmp_path / "token"
    write_token(path)
    return path
