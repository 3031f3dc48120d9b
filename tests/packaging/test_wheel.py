"""A built wheel works outside the checkout, runs its hot modules compiled and decides as the
checkout does, and the daemons import no plotting library.

The wheel is built from a copy of the working tree (tracked and untracked, not ignored files)
without the C plugin (``FLOWSCHED_SKIP_PLUGIN=1``: this is about the Python package and its
data), with flowsched/compiled.py's modules compiled by mypyc as every wheel has them,
installed into a fresh virtual environment whose only other path is the site-packages of the
interpreter running the tests (for msgpack, matplotlib, pytest, ...: no network), and run from
an unrelated directory: ``flowsched sim pd-serving`` and the contention benchmark's
simulator-only mode must find their bundled scenarios and policy files. The policy, flow-table,
protocol and simulator tests then run again on the compiled modules (the protocol tests also
compare the compiled codec and framing with their Python source, frame by frame), and the
simulator's results of both builds are compared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import wheel_helpers

from flowsched.compiled import GROUP, MODULES, module_names

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "flowsched" / "data"


@pytest.fixture(scope="module")
def wheel(request: pytest.FixtureRequest) -> Path:
    return wheel_helpers.wheel(request.config)


@pytest.fixture(scope="module")
def installed(request: pytest.FixtureRequest) -> Path:
    return wheel_helpers.installed(request.config)


def test_the_wheel_carries_every_shipped_data_file(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {
        str(p.relative_to(ROOT))
        for pattern in ("policies/*.toml", "scenarios/*.toml", "contention/**/*.toml")
        for p in DATA.glob(pattern)
    }
    assert {"flowsched/data/scenarios/pd-serving.toml",
            "flowsched/data/contention/scenario.toml",
            "flowsched/data/contention/policies/rmlq.toml"} <= shipped  # fmt: skip
    assert shipped <= names


def test_the_wheel_carries_the_compiled_modules(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    for module in MODULES:
        stem = module.removesuffix(".py")
        assert any(n.startswith(f"{stem}.cpython-") and n.endswith(".so") for n in names), module
        assert module in names  # the source too, as mypyc's wheels have it
    assert any(n.startswith(f"{GROUP}__mypyc.") for n in names)  # their shared library


def _installed_python(env_dir: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the installed wheel's interpreter without the current directory on its path
    (``-P``): run from the checkout, its modules must not shadow the wheel's."""
    return subprocess.run(
        [str(env_dir / "bin" / "python"), "-P", *args],
        cwd=cwd, capture_output=True, text=True, timeout=600,
        env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
    )  # fmt: skip


def test_the_installed_wheel_runs_the_compiled_modules(installed: Path, tmp_path: Path) -> None:
    probe = _installed_python(installed, ROOT, "-c", (
        "from prometheus_client import CollectorRegistry, generate_latest\n"
        "from flowsched.compiled import compiled_modules\n"
        "from flowsched.coordinator.metrics import register_standard_collectors\n"
        "registry = CollectorRegistry(); register_standard_collectors(registry)\n"
        "print(','.join(compiled_modules()))\n"
        "print(generate_latest(registry).decode())"
    ))  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    compiled, metrics = probe.stdout.split("\n", 1)
    assert compiled.split(",") == module_names()
    assert 'flowsched_build_info{compiled="true",' in metrics


def test_the_compiled_modules_pass_the_policy_flow_table_protocol_and_simulator_tests(
    request: pytest.FixtureRequest,
) -> None:
    """The same tests as the checkout's, on the wheel's compiled modules (mypyc checks types
    at run time and forbids patching or subclassing its classes: these tests would show it);
    they run in the background from the install on (:mod:`wheel_helpers`)."""
    code, out, err = wheel_helpers.compiled_tests(request.config)
    assert code == 0, out[-4000:] + err[-2000:]
    assert " passed" in out.splitlines()[-1], out[-2000:]


def test_the_compiled_and_interpreted_builds_decide_the_same(
    installed: Path, tmp_path: Path
) -> None:
    """The contention trace in the simulator, rmlq and edf: identical results either way."""
    command = ["bench", "contention", "--simulate-only", "--seeds", "1", "--duration", "5",
               "--policies", "rmlq,edf", "--sim-policies", ""]  # fmt: skip
    compiled = _flowsched(installed, tmp_path, *command, "--out", "compiled")
    assert compiled.returncode == 0, compiled.stderr
    interpreted = subprocess.run(
        [sys.executable, "-m", "flowsched", *command, "--out", str(tmp_path / "interpreted")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert interpreted.returncode == 0, interpreted.stderr
    results = [
        json.loads((tmp_path / build / "results.json").read_text())
        for build in ("compiled", "interpreted")
    ]
    assert results[0]["policies"]["rmlq"]["sim"]["flows"] > 0
    assert results[0]["policies"] == results[1]["policies"]
    assert results[0]["promotion"] == results[1]["promotion"]


def _flowsched(env_dir: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(env_dir / "bin" / "flowsched"), *args],
        cwd=cwd, capture_output=True, text=True, timeout=300,
        env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
    )  # fmt: skip


def test_the_installed_package_runs_outside_the_checkout(installed: Path, tmp_path: Path) -> None:
    where = subprocess.run(
        [str(installed / "bin" / "python"), "-c", "import flowsched; print(flowsched.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert where.startswith(str(installed)), where  # the wheel's copy, not the checkout

    sim = _flowsched(installed, tmp_path, "sim", "pd-serving", "--policies", "fair",
                     "--loads", "0.1", "--quiet", "--out", "sim")  # fmt: skip
    assert sim.returncode == 0, sim.stderr
    assert (tmp_path / "sim" / "results.json").is_file()

    bench = _flowsched(installed, tmp_path, "bench", "contention", "--simulate-only",
                       "--seeds", "1", "--duration", "5", "--policies", "fair,rmlq",
                       "--sim-policies", "", "--out", "bench")  # fmt: skip
    assert bench.returncode == 0, bench.stderr
    assert (tmp_path / "bench" / "results.json").is_file()

    listing = _flowsched(installed, tmp_path, "policy", "list")
    assert "policies/default.toml" in listing.stdout


def test_the_daemons_import_no_plotting_or_array_library() -> None:
    code = (
        "import sys\n"
        "from flowsched.cli import build_parser\n"
        "import flowsched.agent, flowsched.coordinator, flowsched.client, flowsched.qos\n"
        "build_parser()\n"
        "heavy = sorted(m for m in ('matplotlib', 'numpy', 'torch') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == ""
