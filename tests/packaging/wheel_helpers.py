"""The wheel the packaging tests install: built once per session, started as early as it can be.

Building it (mypyc's code generation, then one C compile of the generated code) takes about
50 s on the 2-core CI machine with one core busy, the longest step of the suite. conftest.py
starts it in the background once collection has found a test that needs it, so that it runs
beside the tests collected before the packaging tests; the ``wheel`` fixture then waits for it
(or starts it, when the hook did not).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: seconds the build may take before the fixture gives it up
BUILD_TIMEOUT = 600
#: the config stash key of the session's build
KEY = pytest.StashKey["Build"]()


@dataclass
class Build:
    """One background ``pip wheel`` of a copy of the checkout."""

    proc: subprocess.Popen[bytes]
    folder: Path
    dist: Path
    #: pip's standard output and error
    out: Path
    err: Path


def problem() -> str | None:
    """Why no wheel can be built here (the tests then skip), or None."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return "needs a git checkout to list the source files"
    try:
        import setuptools  # noqa: F401
    except ImportError:
        return "building the wheel needs setuptools"
    return None


def start(config: pytest.Config) -> Build | None:
    """Start the session's build (once); None when :func:`problem` says it cannot run."""
    if KEY in config.stash:
        return config.stash[KEY]
    if problem() is not None:
        return None
    folder = Path(tempfile.mkdtemp(prefix="flowsched-wheel-"))
    src, dist, out, err = (folder / name for name in ("src", "dist", "pip.out", "pip.err"))
    dist.mkdir()
    copy_checkout(src)
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
             "--no-index", "-w", str(dist), str(src)],
            stdout=stdout, stderr=stderr,
            env={**os.environ, "FLOWSCHED_SKIP_PLUGIN": "1", "FLOWSCHED_COMPILE": "auto"},
        )  # fmt: skip
    build = config.stash[KEY] = Build(proc, folder, dist, out, err)
    return build


def wheel(config: pytest.Config) -> Path:
    """The built wheel, waiting for the build; the test fails with pip's output if it did."""
    reason = problem()
    if reason is not None:
        pytest.skip(reason)
    build = start(config)
    assert build is not None
    try:
        code = build.proc.wait(timeout=BUILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        build.proc.kill()
        build.proc.wait()
        pytest.fail(f"the wheel was not built within {BUILD_TIMEOUT} s")
    stdout, stderr = (path.read_text(errors="replace") for path in (build.out, build.err))
    assert code == 0, stdout + stderr
    assert "Warning" not in stderr, stderr  # setuptools' deprecation warnings
    (built,) = build.dist.glob("flowsched-*.whl")
    return built


def stop(config: pytest.Config) -> None:
    """End the session's build if it still runs and remove its files."""
    build = config.stash.get(KEY, None)
    if build is None:
        return
    if build.proc.poll() is None:
        build.proc.kill()
        build.proc.wait()
    shutil.rmtree(build.folder, ignore_errors=True)


def copy_checkout(dest: Path) -> None:
    """The working tree's tracked and untracked, not ignored files, copied to ``dest``."""
    listing = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listing):
        source = ROOT / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the working tree
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        elif source.is_file():
            shutil.copy2(source, target)
