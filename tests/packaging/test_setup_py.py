"""setup.py runs mypyc's code generation only for the commands that compile extensions: pip's
metadata steps and editable installs (``make setup``) get none and leave no generated C behind.
(A wheel that does carry the compiled modules: tests/packaging/test_wheel.py.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: what setup.py needs to run: its metadata, the package (for compiled.py) and itself
_FILES = ("setup.py", "pyproject.toml", "README.md")


def _copy(dest: Path) -> None:
    for name in _FILES:
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, dest / name)
    shutil.copytree(
        ROOT / "flowsched",
        dest / "flowsched",
        symlinks=True,
        ignore=shutil.ignore_patterns("__pycache__", "*.so"),
    )


@pytest.mark.parametrize(
    "hook", ["prepare_metadata_for_build_editable", "prepare_metadata_for_build_wheel"]
)
def test_pips_metadata_step_generates_no_c(tmp_path: Path, hook: str) -> None:
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    _copy(src)
    code = textwrap.dedent(
        f"""
        import sys
        from setuptools import build_meta
        print(build_meta.{hook}(sys.argv[1]))
        """
    )
    (tmp_path / "meta").mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "meta")],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "FLOWSCHED_SKIP_PLUGIN": "1", "FLOWSCHED_COMPILE": "auto"},
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert list((tmp_path / "meta").glob("*.dist-info")), proc.stdout
    generated = (
        sorted(p.name for p in (src / "build").glob("__native*"))
        if (src / "build").exists()
        else []
    )
    assert generated == [], "mypyc ran for a metadata step"


@pytest.mark.parametrize(
    ("argv", "compile_mode", "compiled"),
    [
        (["setup.py", "dist_info", "--output-dir", "x"], "auto", False),
        (["setup.py", "egg_info"], "1", False),
        (["setup.py", "editable_wheel", "--dist-dir", "x"], "auto", False),
        (["setup.py", "editable_wheel", "--dist-dir", "x"], "1", True),
        (["setup.py", "bdist_wheel", "--dist-dir", "x"], "auto", True),
        (["setup.py", "bdist_wheel", "--dist-dir", "x"], "0", False),
        (["setup.py", "build_ext", "--inplace"], "auto", True),
    ],
    ids=[
        "dist-info",
        "egg-info-even-when-forced",
        "editable",
        "editable-forced",
        "wheel",
        "wheel-without",
        "build-ext",
    ],
)
def test_which_commands_compile(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], compile_mode: str, compiled: bool
) -> None:
    """compiled_extensions() of setup.py, with the mypyc step itself replaced by a marker."""
    import runpy

    import setuptools

    calls: list[str] = []
    real_run_path = runpy.run_path

    def fake_run_path(path: str, *args: object, **kwargs: object) -> dict[str, object]:
        if path.endswith("compiled.py"):
            calls.append(path)
            return {"extensions": lambda: ["ext"]}
        return real_run_path(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(runpy, "run_path", fake_run_path)
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: None)
    monkeypatch.setattr(sys, "argv", ["setup.py", "--name"])
    monkeypatch.setenv("FLOWSCHED_COMPILE", compile_mode)
    namespace = runpy.run_path(str(ROOT / "setup.py"), run_name="setup_under_test")
    calls.clear()  # what loading setup.py itself asked for is not the question
    assert bool(namespace["compiled_extensions"](argv)) is compiled
    assert bool(calls) is compiled
