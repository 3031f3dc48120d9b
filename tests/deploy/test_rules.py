"""The Prometheus alerting rules: promtool's checks, and a unit test of every alert firing and
not firing (deploy/prometheus/flowsched-rules.test.yml)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from deploy_helpers import ROOT, RULES, RULES_TEST, alert_rules, need, without_threshold

#: what an operator must be told about (issue: deploy and operate)
REQUIRED = {
    "FlowschedCoordinatorDown",
    "FlowschedAgentDown",
    "FlowschedCoordinatorInstanceDown",
    "FlowschedCoordinatorUnreachable",
    "FlowschedAgentInFallback",
    "FlowschedDeadlineMissRatioHigh",
    "FlowschedFlowTableNearlyFull",
    "FlowschedDecisionLatencyHigh",
    "FlowschedLevelApplyLatencyHigh",
}


def test_the_required_alerts_exist_with_severity_and_summary() -> None:
    rules = {rule["alert"]: rule for rule in alert_rules()}
    assert rules.keys() >= REQUIRED
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
        assert rule.get("for"), f"{name} fires on a single evaluation"


def test_promtool_check_rules() -> None:
    promtool = need("promtool")
    result = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    promtool = need("promtool")
    result = subprocess.run(
        [promtool, "test", "rules", RULES_TEST.name],
        cwd=RULES_TEST.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    cases = [
        case
        for test in yaml.safe_load(RULES_TEST.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
    ]
    for rule in alert_rules():
        mine = [case for case in cases if case["alertname"] == rule["alert"]]
        assert any(case["exp_alerts"] for case in mine), f"{rule['alert']}: no firing case"
        assert any(not case["exp_alerts"] for case in mine), f"{rule['alert']}: no quiet case"


def test_a_broken_rule_fails_promtool(tmp_path: Path) -> None:
    # the check above can fail: promtool refuses a malformed expression
    promtool = need("promtool")
    bad = tmp_path / "bad.yml"
    bad.write_text(
        yaml.safe_dump({"groups": [{"name": "x", "rules": [{"alert": "A", "expr": "sum(("}]}]})
    )
    result = subprocess.run([promtool, "check", "rules", str(bad)], capture_output=True)
    assert result.returncode != 0


def test_without_threshold_strips_only_the_comparison() -> None:
    assert without_threshold("a / b > 0.9") == "a / b"
    assert without_threshold("x == 0") == "x"
    assert without_threshold('sum(up{job="c"}) == 0 or absent(up{job="c"})') == 'sum(up{job="c"})'
    assert without_threshold('absent(up{job="a"})') == 'up{job="a"}'
    assert without_threshold("histogram_quantile(0.99, rate(h[5m]))\n  > 2") == (
        "histogram_quantile(0.99, rate(h[5m]))"
    )


def test_every_alert_is_in_the_docs_alert_table() -> None:
    doc = (ROOT / "docs" / "deploy.md").read_text()
    table = set(re.findall(r"^\| (Flowsched\w+) \|", doc, flags=re.M))
    assert table == {rule["alert"] for rule in alert_rules()}


def test_the_table_full_alert_says_running_connections_follow_a_re_created_table() -> None:
    """Following the alert (re-creating the table for a larger --slots) needs no drain: running
    jobs move their open connections to the new table. The alert must say what to expect."""
    rule = next(r for r in alert_rules() if r["alert"] == "FlowschedFlowTableNearlyFull")
    text = " ".join(rule["annotations"]["description"].split())
    assert "--slots" in text and "running jobs move their open connections" in text


@pytest.mark.parametrize(
    ("port", "alerts"),
    [
        (19712, ["FlowschedAgentDown", "FlowschedScrapeJobMissing"]),
        (19711, ["FlowschedCoordinatorInstanceDown", "FlowschedScrapeJobMissing"]),
    ],
)
def test_the_down_rules_watch_the_scrape_jobs_of_the_docs(port: int, alerts: list[str]) -> None:
    """A stopped daemon exports nothing: the rules that notice it select its scrape job by
    name, which must be the one docs/deploy.md's scrape config gives the daemons."""
    doc = (ROOT / "docs" / "deploy.md").read_text()
    block = re.search(r"```yaml\n(scrape_configs:.*?)```", doc, flags=re.S)
    assert block, "docs/deploy.md has no scrape config"
    jobs = {job["job_name"]: job for job in yaml.safe_load(block.group(1))["scrape_configs"]}
    (job,) = [name for name, config in jobs.items() if f":{port}" in str(config)]
    rules = {rule["alert"]: rule for rule in alert_rules()}
    for name in alerts:
        assert f'up{{job="{job}"}}' in rules[name]["expr"], name
