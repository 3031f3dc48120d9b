"""The Grafana dashboard JSON: the classic model's structure, and every query parses as PromQL
(promtool, offline). tests/deploy/test_prometheus.py runs them against a real Prometheus."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml
from deploy_helpers import concrete, dashboard, need, panel_targets


def test_dashboard_model() -> None:
    board = dashboard()
    assert board["uid"] and board["title"] and isinstance(board["schemaVersion"], int)
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert ref_ids and len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"] == panel["datasource"]


def test_every_variable_used_is_defined() -> None:
    board = dashboard()
    defined = {v["name"] for v in board["templating"]["list"]}
    builtin = {"__rate_interval", "__interval", "__range"}
    for title, expr in panel_targets():
        for name in re.findall(r"\$\{?(\w+)", expr):
            assert name in defined | builtin, f"{title}: ${name} is not defined"


def test_rates_use_the_rate_interval() -> None:
    for title, expr in panel_targets():
        assert not re.search(r"rate\([^)]*\[\d+[smh]\]", expr), f"{title}: fixed rate window"


def test_every_panel_query_parses(tmp_path: Path) -> None:
    promtool = need("promtool")
    rules = [
        {"record": f"dashboard:query_{i}", "expr": concrete(expr)}
        for i, (_, expr) in enumerate(panel_targets())
    ]
    file = tmp_path / "dashboard-queries.yml"
    file.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(file)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


def test_active_flows_stat_reads_zero_without_flows() -> None:
    # the gauge has no series while no flow is open: the stat shows 0, not "No data"
    (expr,) = [expr for title, expr in panel_targets() if title == "Active flows"]
    assert expr.replace(" ", "").endswith("orvector(0)")


def test_quantile_panels_plot_every_quantile_their_title_names() -> None:
    # "Lateness and earliness (p50, p99)" once plotted no earliness p99
    for panel in dashboard()["panels"]:
        named = re.search(r"\((p\d+(?:, p\d+)*)\)$", panel.get("title", ""))
        if panel["type"] == "row" or named is None:
            continue
        wanted = {str(int(q[1:]) / 100) for q in named.group(1).split(", ")}
        found: dict[str, set[str]] = {}
        for target in panel["targets"]:
            call = re.match(r"histogram_quantile\((0\.\d+),.*?(\w+)_bucket", target["expr"])
            assert call, target["expr"]
            found.setdefault(call.group(2), set()).add(call.group(1))
        for metric, quantiles in found.items():
            assert quantiles == wanted, (panel["title"], metric)


def test_agents_in_fallback_counts_only_agents_that_have_a_coordinator(tmp_path: Path) -> None:
    """A standalone agent (no --coordinator) runs the local policy by design: the alerts leave
    it out, and the stat counted it as an agent in fallback."""
    promtool = need("promtool")
    (expr,) = [expr for title, expr in panel_targets() if title == "Agents in fallback"]
    series = [
        ("n1", 1, 1),  # lost its coordinator
        ("n2", 0, 1),  # connected
        ("n3", 1, 0),  # standalone
    ]
    inputs = []
    for node, fallback, configured in series:
        labels = f'job="flowsched-agent",instance="{node}:19712"'
        inputs.append({"series": f"flowsched_agent_fallback_active{{{labels}}}",
                       "values": f"{fallback}x2"})  # fmt: skip
        inputs.append({"series": f"flowsched_agent_coordinators_configured{{{labels}}}",
                       "values": f"{configured}x2"})  # fmt: skip
    tests = [
        {"interval": "1m", "input_series": inputs,
         "promql_expr_test": [{"expr": expr, "eval_time": "1m", "exp_samples": [{"value": 1}]}]},
        {"interval": "1m", "input_series": inputs[4:],  # only the standalone agent: 0, not empty
         "promql_expr_test": [{"expr": expr, "eval_time": "1m", "exp_samples": [{"value": 0}]}]},
    ]  # fmt: skip
    file = tmp_path / "fallback-stat.test.yml"
    file.write_text(yaml.safe_dump({"rule_files": [], "tests": tests}))
    result = subprocess.run(
        [promtool, "test", "rules", str(file)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
