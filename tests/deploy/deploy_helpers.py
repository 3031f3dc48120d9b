"""Paths and loaders shared by the deployment tests."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "flowsched-rules.yml"
RULES_TEST = ROOT / "deploy" / "prometheus" / "flowsched-rules.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "flowsched-dashboard.json"
DAEMONSET = ROOT / "agent" / "kubernetes" / "daemonset.yaml"
EXAMPLE_JOB = ROOT / "agent" / "kubernetes" / "example-job.yaml"
COORDINATOR = ROOT / "deploy" / "kubernetes" / "coordinator.yaml"
HA_COORDINATOR = ROOT / "deploy" / "kubernetes-ha" / "coordinator.yaml"
MANIFEST_DIRS = [
    ROOT / "deploy" / "kubernetes",
    ROOT / "deploy" / "kubernetes-ha",
    ROOT / "agent" / "kubernetes",
]
MANIFESTS = sorted(
    p for folder in MANIFEST_DIRS for p in folder.glob("*.yaml") if p.name != "kustomization.yaml"
)
KUSTOMIZATIONS = [folder / "kustomization.yaml" for folder in MANIFEST_DIRS]


def need(tool: str) -> str:
    """The path of ``tool``, or skip the test saying it is missing."""
    found = shutil.which(tool)
    if found is None:
        pytest.skip(f"{tool} is not installed (Debian package: see scripts/setup.sh)")
    return found


def documents(path: Path) -> list[dict[str, Any]]:
    """Every YAML document of ``path``."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def find(path: Path, kind: str) -> dict[str, Any]:
    """The one document of ``kind`` in ``path``."""
    (doc,) = [d for d in documents(path) if d["kind"] == kind]
    return doc


def alert_rules() -> list[dict[str, Any]]:
    """Every alerting rule of the shipped rule file."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def panel_targets() -> Iterator[tuple[str, str]]:
    """(panel title, expression) of every query of every panel."""
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def concrete(expr: str, rate_interval: str = "5m") -> str:
    """A dashboard expression with Grafana's variables replaced by values Prometheus takes."""
    expr = expr.replace("$__rate_interval", rate_interval)
    return re.sub(r"\$\{?instance\}?", ".*", expr)


def without_threshold(expr: str) -> str:
    """An alert expression without its final comparison (and an ``or absent(...)``), i.e. the
    quantity the alert watches, which must return series while the system runs; of a lone
    ``absent(x)``, ``x``."""
    expr = re.sub(r"\s+or\s+absent\(.*\)\s*$", "", expr.strip(), flags=re.S)
    expr = re.sub(r"^absent\((.*)\)$", r"\1", expr, flags=re.S)
    return re.sub(r"\s*(==|!=|>=|<=|>|<)\s*[0-9.e+-]+\s*$", "", expr).strip()


class Daemon:
    """A ``python -m flowsched ...`` process started by a test; ``stop()`` always reaps it."""

    def __init__(self, args: list[str], log: Path, ready: str, timeout: float = 30.0) -> None:
        import os
        import select
        import subprocess
        import sys
        import time

        self.log = log
        env = dict(os.environ, PYTHONUNBUFFERED="1", FLOWSCHED_NO_UVLOOP="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flowsched", *args],
            stdout=subprocess.PIPE,
            stderr=log.open("a"),
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            readable, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if not readable:
                continue
            line = self.proc.stdout.readline()
            match = re.search(ready, line)
            if match:
                self.fields = match.groupdict()
                return
        self.stop()
        raise AssertionError(f"{args[0]} did not become ready:\n{log.read_text()[-3000:]}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        import subprocess

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def http_status(url: str) -> tuple[int, str]:
    """(status, body) of a GET, HTTP errors included."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


AGENT_READY = r"ready node=(?P<node>\S+) .*metrics=(?P<mhost>[\d.]+):(?P<mport>\d+)"
COORDINATOR_READY = (
    r"listening on (?P<host>[\d.]+):(?P<port>\d+) metrics (?P<mhost>[\d.]+):(?P<mport>\d+)"
)
