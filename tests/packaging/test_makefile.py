"""The Makefile's setup steps, as `make -n` prints them (nothing is run)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAKE = shutil.which("make")

pytestmark = pytest.mark.skipif(MAKE is None, reason="needs make")


@pytest.mark.parametrize(("stamp", "extras"), [(".installed", ""), (".installed-demo", " plot")])
def test_setup_passes_python_to_the_setup_script(tmp_path: Path, stamp: str, extras: str) -> None:
    """`make PYTHON=python3.13 VENV=... test` makes that venv with that interpreter."""
    assert MAKE is not None
    venv = tmp_path / "venv-3.13"
    printed = subprocess.run(
        [MAKE, "-n", "-B", "PYTHON=python3.13", f"VENV={venv}", f"{venv}/{stamp}"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert f'PYTHON="python3.13" bash scripts/setup.sh {venv}{extras}\n' in printed
