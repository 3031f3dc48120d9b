"""The Makefile's setup steps, as `make -n` prints them (nothing is run)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAKE = shutil.which("make")

pytestmark = pytest.mark.skipif(MAKE is None, reason="needs make")


def _dry_run(*args: str) -> str:
    """What ``make -n ARGS`` in the repository would run."""
    assert MAKE is not None
    return subprocess.run(
        [MAKE, "-n", *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    ).stdout


@pytest.mark.parametrize(("stamp", "extras"), [(".installed", ""), (".installed-demo", " plot")])
def test_setup_passes_python_to_the_setup_script(tmp_path: Path, stamp: str, extras: str) -> None:
    """`make PYTHON=python3.13 VENV=... test` makes that venv with that interpreter."""
    venv = tmp_path / "venv-3.13"
    printed = _dry_run("-B", "PYTHON=python3.13", f"VENV={venv}", f"{venv}/{stamp}")
    assert f'PYTHON="python3.13" bash scripts/setup.sh {venv}{extras}\n' in printed


def test_the_plugin_check_runs_its_python_test_in_the_venv(tmp_path: Path) -> None:
    """With another PYTHON and VENV the plugin's layout test still runs under the venv's
    python (where pytest is), not the bare interpreter nor ./.venv's."""
    venv = tmp_path / "venv-3.13"
    printed = _dry_run("PYTHON=python3.13", f"VENV={venv}", "plugin-test")
    assert f"cd .. && {venv}/bin/python -m pytest" in printed
