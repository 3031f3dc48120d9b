"""A real Prometheus (Debian's) scraping a real `flowsched up` coordinator and agent, with SDK
flows and one emulated plugin connection moving bytes: every dashboard query and every alert
rule evaluates without error and returns series."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_helpers import (
    AGENT_READY,
    COORDINATOR_READY,
    RULES,
    Daemon,
    alert_rules,
    concrete,
    http_status,
    need,
    panel_targets,
    without_threshold,
)

from flowsched import client
from flowsched.protocol import write_token
from flowsched.shm.table import EmulatedPluginSlot, FlowTable
from flowsched.testbed.daemons import free_ports

UP_READY = (
    r"coordinator [\d.]+:\d+ metrics (?P<chost>[\d.]+):(?P<cport>\d+); "
    r"agent node=\S+ metrics (?P<ahost>[\d.]+):(?P<aport>\d+)"
)
#: $__rate_interval for the dashboard queries: a few 1 s scrapes
RATE_INTERVAL = "10s"


def wait_until(what: str, check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


class PromAPI:
    """The HTTP API of a running Prometheus."""

    def __init__(self, base: str) -> None:
        self.base = base

    def get(self, path: str, **params: str) -> Any:
        url = f"{self.base}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as error:  # 400/422: a bad query, with its error
            body = json.load(error)
        return body

    def query(self, expr: str) -> list[dict[str, Any]]:
        body = self.get("/api/v1/query", query=expr)
        assert body["status"] == "success", f"{expr}: {body.get('error')}"
        return body["data"]["result"]  # type: ignore[no-any-return]

    def value(self, expr: str) -> float:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else float("nan")


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PromAPI]:
    prometheus = need("prometheus")
    tmp = tmp_path_factory.mktemp("prom")
    os.environ.setdefault("FLOWSCHED_NO_UVLOOP", "1")
    env_home = tmp / "home"
    env_home.mkdir()
    args = ["up", "--listen", "127.0.0.1:0", "--metrics-port", "0", "--agent-metrics-port", "0"]
    args += ["--token-file", str(tmp / "token"), "--table", str(tmp / "table")]
    args += ["--socket", str(tmp / "agent.sock"), "--node", "n1"]
    up = Daemon(args, tmp / "up.log", UP_READY)
    stop = threading.Event()
    traffic = threading.Thread(target=_plugin_traffic, args=(tmp / "table", stop), daemon=True)
    prom: subprocess.Popen[bytes] | None = None
    try:
        traffic.start()
        targets = {
            "flowsched-coordinator": f"{up.fields['chost']}:{up.fields['cport']}",
            "flowsched-agent": f"{up.fields['ahost']}:{up.fields['aport']}",
        }
        prom, api = _start_prometheus(prometheus, tmp, targets)
        # flows closed before the agent's first session would never reach the coordinator
        readyz = f"http://{up.fields['ahost']}:{up.fields['aport']}/readyz"
        wait_until("the agent ready (connected)", lambda: http_status(readyz)[0] == 200)
        _sdk_flows(str(tmp / "agent.sock"))
        _wait_for_data(api, prom, tmp)
        yield api
    finally:
        stop.set()
        traffic.join(timeout=5)
        if prom is not None:
            prom.terminate()
            prom.wait(timeout=15)
        up.stop()


def _start_prometheus(
    prometheus: str, tmp: Path, targets: dict[str, str]
) -> tuple[subprocess.Popen[bytes], PromAPI]:
    """A Prometheus with the shipped rules, scraping each target (job name -> host:port)
    every second; its log is ``tmp/prometheus.log``."""
    (port,) = free_ports(1)
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [target]}]}
            for job, target in targets.items()
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    prom = subprocess.Popen(
        [
            prometheus,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp / "prometheus.log").open("w"),
    )
    return prom, PromAPI(f"http://127.0.0.1:{port}")


def _plugin_traffic(table_path: Path, stop: threading.Event) -> None:
    """One plugin connection (the plugin's emulation) sending 1 MB every 20 ms."""
    deadline = time.monotonic() + 30
    while not table_path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    table = FlowTable.open(str(table_path), writable=True)
    slot = EmulatedPluginSlot(table, class_id=0)
    try:
        while not stop.wait(0.02):
            slot.send(1 << 20)
        slot.close()
    finally:
        table.close()


def _sdk_flows(sock: str) -> None:
    """Two kv flows with deadlines: one closes in time, one after its deadline."""
    with client.flow("kv", bytes=10, deadline=time.time() + 60, socket_path=sock):
        pass
    with client.flow("kv", bytes=10, deadline=time.time() - 1, socket_path=sock):
        pass


def _wait_for_data(api: PromAPI, prom: subprocess.Popen[bytes], tmp: Path) -> None:
    def ready(expr: str, least: float = 1) -> Callable[[], bool]:
        def check() -> bool:
            assert prom.poll() is None, (tmp / "prometheus.log").read_text()[-2000:]
            try:
                return api.value(expr) >= least
            except (OSError, AssertionError, ValueError):  # ValueError: a starting Prometheus
                return False  # answers 503 "Service Unavailable", not JSON

        return check

    wait_until("both targets up", ready("sum(up)", 2))
    wait_until(
        "completions met and missed",
        ready('count(flowsched_coordinator_completed_flows_total{deadline=~"met|missed"})', 2),
    )
    applied = "sum(flowsched_agent_level_apply_latency_seconds_count)"
    wait_until("a level applied by the plugin", ready(applied))
    at_level = 'sum(flowsched_agent_sent_bytes_total{level!="unset"})'
    wait_until("bytes sent at a level", ready(at_level))
    # a few samples of every series inside the shortest rate window
    samples = "count_over_time(flowsched_agent_level_apply_latency_seconds_count[10s])"
    wait_until("counters over a few scrapes", ready(samples, 3))


def test_every_dashboard_query_returns_series(system: PromAPI) -> None:
    empty = []
    for title, expr in panel_targets():
        if not system.query(concrete(expr, RATE_INTERVAL)):
            empty.append(f"{title}: {expr}")
    assert not empty, "queries without series:\n" + "\n".join(empty)


#: alerts on series that only a coordinator with --etcd exports (`flowsched up` runs without):
#: tests/ha/test_etcd_cluster.py and tests/ha/test_takeover_e2e.py read those series from real
#: coordinators of an election
ETCD_ONLY = {"FlowschedEtcdMemberFailing", "FlowschedAgentsCutOffFromLeader"}


def test_every_alert_expression_evaluates_and_watches_live_series(system: PromAPI) -> None:
    for rule in alert_rules():
        system.query(rule["expr"])  # evaluates without error (series only when firing)
        if rule["alert"] not in ETCD_ONLY:
            assert system.query(without_threshold(rule["expr"])), rule["alert"]


def test_prometheus_loaded_and_evaluated_every_rule_cleanly(system: PromAPI) -> None:
    def rules_now() -> list[dict[str, Any]]:
        groups = system.get("/api/v1/rules")["data"]["groups"]
        return [rule for group in groups for rule in group["rules"]]

    # lastEvaluation is an RFC 3339 time; the zero time (0001-...) means not yet evaluated
    wait_until("every rule evaluated", lambda: all(r["lastEvaluation"] > "2" for r in rules_now()))
    groups = system.get("/api/v1/rules")["data"]["groups"]
    rules = {rule["name"]: rule for group in groups for rule in group["rules"]}
    assert rules.keys() == {rule["alert"] for rule in alert_rules()}
    for name, rule in rules.items():
        assert rule["health"] == "ok" and not rule.get("lastError"), (name, rule.get("lastError"))


def test_a_healthy_system_fires_only_the_missed_deadline_alert_pending(system: PromAPI) -> None:
    # coordinator up and connected, no fallback, table nearly empty: nothing pending or firing
    # except the deadline-miss ratio (one of the two kv flows missed on purpose)
    alerts = system.get("/api/v1/alerts")["data"]["alerts"]
    names = {alert["labels"]["alertname"] for alert in alerts}
    assert names <= {"FlowschedDeadlineMissRatioHigh"}, alerts


def test_scraped_families_pass_promtool_lint(system: PromAPI) -> None:
    promtool = need("promtool")
    for target in system.query("up"):
        url = f"http://{target['metric']['instance']}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            body = response.read()
        text = body.decode()
        assert 'le="-' not in text, "a histogram with negative bucket bounds"
        assert " -1.0\n" not in text, "a -1 sentinel"
        if target["metric"]["job"] == "flowsched-agent":
            assert 'node="' not in text  # the target already names the node
        lint = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True)
        assert lint.returncode == 0, (url, lint.stdout + lint.stderr)


def test_scrapes_stay_small(system: PromAPI) -> None:
    # a guard on cardinality: per-flow or per-request labels would grow a scrape with the load
    for sample in system.query("scrape_samples_scraped"):
        job, samples = sample["metric"]["job"], float(sample["value"][1])
        print(f"{job}: {samples:.0f} samples per scrape")
        assert samples < 300, (job, samples)


#: (scrape job, the daemon's flags but for its files, its ready line, its alert when down)
STOPPED = [
    ("flowsched-agent", ["agent", "--node", "n9", "--slots", "64", "--interface", "lo"],
     AGENT_READY, "FlowschedAgentDown"),
    ("flowsched-coordinator", ["coordinator", "--listen", "127.0.0.1:0"],
     COORDINATOR_READY, "FlowschedCoordinatorInstanceDown"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("job", "args", "ready", "alertname"), STOPPED, ids=[s[0] for s in STOPPED]
)
def test_a_stopped_daemon_raises_its_down_alert(
    tmp_path: Path, job: str, args: list[str], ready: str, alertname: str
) -> None:
    """A stopped daemon exports nothing: only its scrape target's `up` shows it is gone."""
    prometheus = need("prometheus")
    write_token(tmp_path / "token")
    args = [*args, "--token-file", str(tmp_path / "token"), "--metrics-port", "0"]
    if args[0] == "agent":
        args += ["--table", str(tmp_path / "table"), "--socket", str(tmp_path / "agent.sock")]
    daemon = Daemon(args, tmp_path / "daemon.log", ready)
    target = f"{daemon.fields['mhost']}:{daemon.fields['mport']}"
    prom: subprocess.Popen[bytes] | None = None
    try:
        prom, api = _start_prometheus(prometheus, tmp_path, {job: target})

        def scraped(value: float) -> Callable[[], bool]:
            def check() -> bool:
                assert prom is not None and prom.poll() is None, "prometheus exited"
                try:
                    return api.value(f'up{{instance="{target}"}}') == value
                except (OSError, AssertionError, ValueError):  # still starting
                    return False

            return check

        wait_until("the daemon scraped", scraped(1))
        down = f'ALERTS{{alertname="{alertname}",instance="{target}"}}'
        assert not api.query(down)
        daemon.stop()
        wait_until("the daemon's scrape failing", scraped(0))
        wait_until(f"{alertname} pending", lambda: bool(api.query(down)))
        (alert,) = api.query(down)
        assert alert["metric"]["alertstate"] == "pending"  # firing after its 2m
        assert alert["metric"]["job"] == job
    finally:
        daemon.stop()
        if prom is not None:
            prom.terminate()
            prom.wait(timeout=15)
