"""The wheel the packaging tests install, built, installed and tested once per session, started
as early as it can be.

Building it (mypyc's code generation, then one C compile of the generated code) takes about
50 s on the 2-core CI machine with one core busy, and running the policy, flow-table, protocol
and simulator tests on its compiled modules about 60 s more: the longest steps of the suite.
conftest.py starts them in the background once collection has found a test that needs them,
so that they run beside the tests collected before the packaging tests: a thread waits for the
build, installs the wheel into a fresh virtual environment and starts those tests. The fixtures
of tests/packaging/test_wheel.py wait for each step (or start them all, when the hook did not).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import venv
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: seconds the build, and then the compiled modules' tests, may take before they are given up
STEP_TIMEOUT = 600
#: the config stash key of the session's build
KEY = pytest.StashKey["Build"]()
#: the checkout's tests that run again on the wheel's compiled modules (from the checkout, with
#: ``-P`` so that its modules do not shadow the wheel's)
COMPILED_TESTS = (
    "import sys, pytest\n"
    "from flowsched.compiled import is_compiled\n"
    "assert is_compiled(), 'not the compiled build'\n"
    "sys.exit(pytest.main(['-q', '-x', '-p', 'no:cacheprovider', 'tests/policies',"
    " 'tests/coordinator/test_coordinator_state.py', 'tests/protocol', 'tests/sim']))"
)


@dataclass
class Build:
    """The session's wheel: built, installed, its compiled modules tested, in the background."""

    folder: Path
    #: set when the wheel is built or its build failed (:attr:`wheel` or :attr:`failure`)
    built: threading.Event = field(default_factory=threading.Event)
    #: set when the wheel is installed or a step before failed (:attr:`env_dir`)
    installed: threading.Event = field(default_factory=threading.Event)
    wheel: Path | None = None
    env_dir: Path | None = None
    #: the first step that failed, with its output
    failure: str | None = None
    #: the compiled modules' tests, once started; their output in ``tests.out``/``tests.err``
    tests: subprocess.Popen[bytes] | None = None
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    stopped: bool = False


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
    """Start the session's build, install and tests (once); None when :func:`problem` says
    they cannot run."""
    if KEY in config.stash:
        return config.stash[KEY]
    if problem() is not None:
        return None
    build = config.stash[KEY] = Build(Path(tempfile.mkdtemp(prefix="flowsched-wheel-")))
    copy_checkout(build.folder / "src")
    threading.Thread(target=_run, args=(build,), name="wheel build", daemon=True).start()
    return build


def wheel(config: pytest.Config) -> Path:
    """The built wheel, waiting for the build; the test fails with pip's output if it did."""
    build = _started(config)
    _wait(build.built, "the wheel was not built")
    assert build.wheel is not None, build.failure
    return build.wheel


def installed(config: pytest.Config) -> Path:
    """The virtual environment the wheel is installed into, waiting for the install."""
    build = _started(config)
    _wait(build.installed, "the wheel was not installed")
    assert build.env_dir is not None, build.failure
    return build.env_dir


def compiled_tests(config: pytest.Config) -> tuple[int, str, str]:
    """The exit status, standard output and error of :data:`COMPILED_TESTS`, waiting for them."""
    installed(config)
    build = config.stash[KEY]
    assert build.tests is not None, build.failure
    try:
        code = build.tests.wait(timeout=STEP_TIMEOUT)
    except subprocess.TimeoutExpired:
        build.tests.kill()
        pytest.fail(f"the compiled modules' tests did not end within {STEP_TIMEOUT} s")
    out, err = (_read(build.folder / name) for name in ("tests.out", "tests.err"))
    return code, out, err


def stop(config: pytest.Config) -> None:
    """End whatever of the session's build still runs and remove its files."""
    build = config.stash.get(KEY, None)
    if build is None:
        return
    build.stopped = True
    for proc in build.processes:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    shutil.rmtree(build.folder, ignore_errors=True)


def _started(config: pytest.Config) -> Build:
    reason = problem()
    if reason is not None:
        pytest.skip(reason)
    build = start(config)
    assert build is not None
    return build


def _wait(event: threading.Event, what: str) -> None:
    if not event.wait(timeout=2 * STEP_TIMEOUT):
        pytest.fail(f"{what} within {2 * STEP_TIMEOUT} s")


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _run(build: Build) -> None:
    """The background steps; each records its result, or the failure that ends them."""
    try:
        build.wheel = _build_wheel(build)
        build.built.set()
        build.env_dir = _install(build.wheel, build.folder / "venv")
        build.installed.set()
        python = str(build.env_dir / "bin" / "python")
        outside = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        build.tests = _popen(build, [python, "-P", "-c", COMPILED_TESTS], "tests", outside)
    except Exception as exc:  # every waiter must learn it, not wait out its timeout
        build.failure = f"{type(exc).__name__}: {exc}"
    finally:
        build.built.set()
        build.installed.set()


def _popen(
    build: Build, argv: list[str], name: str, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    """``argv`` started from the checkout, its output to ``name``.out / ``name``.err."""
    if build.stopped:
        raise RuntimeError("the session ended")
    with (
        (build.folder / f"{name}.out").open("wb") as out,
        (build.folder / f"{name}.err").open("wb") as err,
    ):
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=err, env=env)
    build.processes.append(proc)
    return proc


def _build_wheel(build: Build) -> Path:
    dist = build.folder / "dist"
    dist.mkdir()
    proc = _popen(
        build,
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-w", str(dist), str(build.folder / "src")],
        "pip-wheel",
        env={**os.environ, "FLOWSCHED_SKIP_PLUGIN": "1", "FLOWSCHED_COMPILE": "auto"},
    )  # fmt: skip
    try:
        code = proc.wait(timeout=STEP_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise RuntimeError(f"pip wheel did not end within {STEP_TIMEOUT} s") from None
    out, err = (_read(build.folder / f"pip-wheel.{kind}") for kind in ("out", "err"))
    if code != 0:
        raise RuntimeError(f"pip wheel exited with status {code}:\n{out}{err}")
    if "Warning" in err:  # setuptools' deprecation warnings
        raise RuntimeError(f"pip wheel warned:\n{err}")
    (built,) = dist.glob("flowsched-*.whl")
    return built


def _install(wheel: Path, env_dir: Path) -> Path:
    """A fresh virtual environment with ``wheel`` installed; its dependencies come from the
    running interpreter's site-packages (a .pth line adds a path; the .pth files there, such
    as this checkout's editable install, are not processed)."""
    venv.create(env_dir, with_pip=False)
    purelib = Path(
        sysconfig.get_paths(vars={"base": str(env_dir), "platbase": str(env_dir)})["purelib"]
    )
    (purelib / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(env_dir / "bin" / "python"), "install",
         "--no-deps", "--no-index", str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if install.returncode != 0:
        raise RuntimeError(f"pip install exited with status {install.returncode}:\n"
                           f"{install.stdout}{install.stderr}")  # fmt: skip
    return env_dir


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
