"""scripts/setup.sh against fake programs: what it installs, what it leaves on the host, and
when it fails.

Each run uses a copy of the script in a scratch "repository", a PATH of fakes (apt-get, gcc,
make, python3 and a venv whose python answers pip and ``flowsched plugin path`` as told), and a
private mount namespace in which /usr/sbin (where the script puts policy-rc.d) is a scratch
folder: nothing on this machine is installed or changed. Needs root and ``unshare``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNSHARE = shutil.which("unshare")
MOUNT = shutil.which("mount")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or UNSHARE is None or MOUNT is None,
    reason="needs root, unshare and mount (a private mount namespace)",
)

#: the programs the script finds on PATH, present unless a test removes them
TOOLS = ("ip", "tc", "sysctl", "gcc", "ethtool", "nm", "prometheus", "promtool", "etcd")
TOOLS += ("iperf3", "openssl")
#: real programs the script runs
REAL = ("dirname", "id", "chmod", "rm", "cat")

_APT = """\
#!/bin/bash
echo "apt-get $*" >> "$LOG"
case "$1" in
  update) exit 0 ;;
  install)
    [ -e /usr/sbin/policy-rc.d ] && echo "policy-rc.d present during install" >> "$LOG"
    case "${APT_MODE:-ok}" in
      fail) exit 100 ;;
      term) kill -TERM "$PPID"; exit 1 ;;
    esac ;;
esac
"""
#: an interpreter on PATH (python3, or the one PYTHON names): it logs under its own name
_PYTHON3 = """\
#!/bin/bash
echo "${0##*/} $*" >> "$LOG"
if [ "$1" = -c ]; then [ "${ENSUREPIP:-1}" = 1 ]; exit; fi
if [ "$1 $2" = "-m venv" ]; then
  venv="${!#}"; /bin/mkdir -p "$venv/bin"; /bin/cp "$STUB_PYTHON" "$venv/bin/python"; exit 0
fi
exit 1
"""
#: the venv's python: pip works (unless NO_PIP names this venv), the plugin is there or not
_VENV_PYTHON = """\
#!/bin/bash
echo "venv-python $*" >> "$LOG"
case "$*" in
  "-m pip --version") [ "${NO_PIP:-}" != "$0" ] ;;
  "-m pip install"*) exit 0 ;;
  "-m flowsched plugin path") [ "${PLUGIN:-ok}" = ok ] ;;
  *) exit 1 ;;
esac
"""
_MAKE = """\
#!/bin/bash
echo "make $*" >> "$LOG"
echo "param.c:1: error: this is not C" >&2
exit 2
"""


@dataclass
class Setup:
    returncode: int
    output: str
    log: list[str]
    policy_rc_left: bool


def _script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def _run_setup(
    tmp_path: Path,
    env: dict[str, str] | None = None,
    *,
    missing: tuple[str, ...] = (),
    venv_ready: bool = True,
    hide_pyverbs: bool = False,
    extras: str = "plot",
    pythons: tuple[str, ...] = ("python3",),
) -> Setup:
    """Run a copy of scripts/setup.sh as described in the module docstring."""
    repo, bin_dir, sbin = tmp_path / "repo", tmp_path / "bin", tmp_path / "sbin"
    for folder in (repo / "scripts", repo / "nccl_plugin", bin_dir, sbin):
        folder.mkdir(parents=True, exist_ok=True)
    shutil.copy2(ROOT / "scripts" / "setup.sh", repo / "scripts" / "setup.sh")
    stub = tmp_path / "venv-python"
    _script(stub, _VENV_PYTHON)
    _script(bin_dir / "apt-get", _APT)
    for python in pythons:
        _script(bin_dir / python, _PYTHON3)
    _script(bin_dir / "make", _MAKE)
    for tool in TOOLS:
        if tool not in missing:
            _script(bin_dir / tool, "#!/bin/sh\nexit 0\n")
    for tool in REAL:
        real = shutil.which(tool)
        assert real is not None
        if not (bin_dir / tool).exists():  # a test's own fake wins
            (bin_dir / tool).symlink_to(real)
    venv = tmp_path / "venv"
    if venv_ready:
        (venv / "bin").mkdir(parents=True)
        shutil.copy2(stub, venv / "bin" / "python")
    log = tmp_path / "log"
    log.touch()
    hide = ""
    if hide_pyverbs:
        empty = tmp_path / "dist-packages"
        empty.mkdir()
        hide = f"{MOUNT} --bind {empty} /usr/lib/python3/dist-packages && "
    inner = (
        f"{MOUNT} --bind {sbin} /usr/sbin && {hide}"
        f"exec /bin/bash {repo}/scripts/setup.sh {venv} {extras}"
    )
    run_env = {
        "PATH": str(bin_dir),
        "LOG": str(log),
        "STUB_PYTHON": str(stub),
        "HOME": str(tmp_path),
        **(env or {}),
    }
    assert UNSHARE is not None
    proc = subprocess.run(
        [UNSHARE, "-m", "--propagation", "private", "/bin/bash", "-c", inner],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return Setup(
        proc.returncode,
        proc.stdout + proc.stderr,
        log.read_text().splitlines(),
        (sbin / "policy-rc.d").exists(),
    )


def _installed(setup: Setup) -> list[str]:
    lines = [line for line in setup.log if line.startswith("apt-get install")]
    return [w for w in lines[0].split()[2:] if not w.startswith("-")] if lines else []


@pytest.mark.parametrize("mode", ["ok", "fail", "term"])
def test_policy_rc_is_removed_on_every_exit_path(tmp_path: Path, mode: str) -> None:
    """The policy-rc.d that keeps packages' daemons stopped exists while apt-get installs and
    is gone afterwards, also when the install fails or the script is terminated."""
    setup = _run_setup(tmp_path, {"APT_MODE": mode}, missing=("ip", "tc"))
    assert "policy-rc.d present during install" in setup.log
    assert not setup.policy_rc_left, setup.output
    expected = {"ok": 0, "fail": 100, "term": -signal.SIGTERM}[mode]
    assert setup.returncode == expected, setup.output


def test_a_policy_rc_of_the_machine_is_left_alone(tmp_path: Path) -> None:
    sbin = tmp_path / "sbin"
    sbin.mkdir()
    (sbin / "policy-rc.d").write_text("#!/bin/sh\nexit 0\n")
    setup = _run_setup(tmp_path, {"APT_MODE": "fail"}, missing=("ip",))
    assert setup.policy_rc_left
    assert (sbin / "policy-rc.d").read_text() == "#!/bin/sh\nexit 0\n"


def test_sysctl_is_installed_with_procps(tmp_path: Path) -> None:
    setup = _run_setup(tmp_path, missing=("sysctl",))
    assert setup.returncode == 0, setup.output
    assert _installed(setup) == ["procps"]


def test_dev_installs_debians_pyverbs_when_missing(tmp_path: Path) -> None:
    setup = _run_setup(tmp_path, hide_pyverbs=True, extras="dev,plot")
    assert setup.returncode == 0, setup.output
    assert "python3-pyverbs" in _installed(setup)


def test_a_venv_without_pip_is_made_again(tmp_path: Path) -> None:
    """A venv left without pip (python3-venv was missing) is recreated, not used as it is."""
    venv_python = tmp_path / "venv" / "bin" / "python"
    setup = _run_setup(tmp_path, {"NO_PIP": str(venv_python)})
    assert setup.returncode == 0, setup.output
    assert f"python3 -m venv --clear {tmp_path / 'venv'}" in setup.log
    assert _installed(setup) == []


def test_python3_venv_is_installed_when_ensurepip_is_missing(tmp_path: Path) -> None:
    setup = _run_setup(tmp_path, {"ENSUREPIP": "0"}, venv_ready=False)
    assert setup.returncode == 0, setup.output
    assert _installed(setup) == ["python3-venv"]
    assert f"python3 -m venv {tmp_path / 'venv'}" in setup.log


@pytest.mark.parametrize("venv_ready", [False, True])
def test_the_venv_is_made_with_the_interpreter_python_names(
    tmp_path: Path, venv_ready: bool
) -> None:
    """`make PYTHON=python3.13 VENV=... test`: a new venv, or one made again, is that
    interpreter's; Debian's python3-venv is not asked for on its behalf."""
    venv_python = tmp_path / "venv" / "bin" / "python"
    env = {"PYTHON": "python3.13", "ENSUREPIP": "0", "NO_PIP": str(venv_python)}
    setup = _run_setup(tmp_path, env, venv_ready=venv_ready, pythons=("python3", "python3.13"))
    assert setup.returncode == 0, setup.output
    made = [line for line in setup.log if " -m venv " in line]
    clear = "--clear " if venv_ready else ""
    assert made == [f"python3.13 -m venv {clear}{tmp_path / 'venv'}"]
    assert not any(line.startswith("python3 ") for line in setup.log)
    assert _installed(setup) == []


def test_a_plugin_that_did_not_build_fails_the_setup(tmp_path: Path) -> None:
    setup = _run_setup(tmp_path, {"PLUGIN": "missing"})
    assert setup.returncode == 1, setup.output
    assert "the NCCL plugin did not build" in setup.output
    assert "error: this is not C" in setup.output  # make's own words
    assert "FLOWSCHED_SKIP_PLUGIN=1" in setup.output


@pytest.mark.parametrize(
    ("env", "status"),
    [({"PLUGIN": "ok"}, 0), ({"PLUGIN": "missing", "FLOWSCHED_SKIP_PLUGIN": "1"}, 0)],
    ids=["built", "skipped-on-request"],
)
def test_a_built_or_skipped_plugin_passes(tmp_path: Path, env: dict[str, str], status: int) -> None:
    setup = _run_setup(tmp_path, env)
    assert setup.returncode == status, setup.output


def test_without_build_tools_and_root_the_missing_plugin_is_a_warning(tmp_path: Path) -> None:
    """Not root (a user namespace's nobody) and no gcc: nothing can build the plugin, so the
    setup warns and goes on, as it does for the other tools it cannot install."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _script(bin_dir / "id", '#!/bin/sh\n[ "$1" = -u ] && echo 65534 || /usr/bin/id "$@"\n')
    setup = _run_setup(tmp_path, {"PLUGIN": "missing"}, missing=("gcc",))
    assert setup.returncode == 0, setup.output
    assert "not root: the NCCL plugin was not built" in setup.output
    assert _installed(setup) == []


def test_setup_sh_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "setup.sh")], check=True)
