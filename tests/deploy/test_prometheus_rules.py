"""The shipped Prometheus alert rules (``deploy/prometheus``) and Grafana dashboard
(``deploy/grafana``): ``promtool check rules`` passes on the rules and on the
dashboard's queries, ``promtool test rules`` fires every alert on a synthetic series,
and every metric the rules and the dashboard read exists in a real scrape of a
running gateway's ``/metrics``, which ``promtool check metrics`` accepts."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ncap.testing.fake_upstream import FakeState
from tests.support import gateway, gateway_config
from tests.tools import REPO, require_tool

RULES = REPO / "deploy/prometheus/ncap-alerts.yml"
RULE_TESTS = REPO / "deploy/prometheus/ncap-alerts.test.yml"
DASHBOARD = REPO / "deploy/grafana/ncap-dashboard.json"
_METRIC = re.compile(r"\b(ncap_[a-z0-9_]+)\b")


def _promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    tool = require_tool("promtool")
    return subprocess.run(
        [str(tool), *args], input=stdin, capture_output=True, text=True, timeout=60
    )


def _dashboard_queries() -> list[str]:
    """Every panel's PromQL and every variable's query, Grafana's variables given
    values (``$__rate_interval`` a range, ``$workload``/``$route`` any value)."""
    data = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for panel in data["panels"] for t in panel["targets"]]
    queries += [v["definition"] for v in data["templating"]["list"] if "definition" in v]
    return [
        q.replace("$__rate_interval", "5m").replace("$workload", ".*").replace("$route", ".*")
        for q in queries
    ]


def _rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(RULES.read_text())
    return [rule for group in data["groups"] for rule in group["rules"]]


def test_promtool_check_rules() -> None:
    result = _promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in result.stdout


def test_promtool_test_rules_fires_every_alert() -> None:
    result = _promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    # every alert of the file has a case where it fires
    fired = {
        case["alertname"]
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert fired == {rule["alert"] for rule in _rules()}


def test_promtool_test_rules_can_fail(tmp_path: Path) -> None:
    """The unit tests are not vacuous: a changed expectation fails them."""
    (tmp_path / RULES.name).write_text(RULES.read_text())
    changed = RULE_TESTS.read_text().replace("route primary is failing", "route x is failing")
    assert changed != RULE_TESTS.read_text()
    (tmp_path / RULE_TESTS.name).write_text(changed)
    result = _promtool("test", "rules", str(tmp_path / RULE_TESTS.name))
    assert result.returncode != 0 and "NcapRouteDown" in result.stdout + result.stderr


def _exposed(text: str) -> set[str]:
    """Every series name a scrape exposes: its samples, and for families without a
    sample yet (labelled ones before first use) the names their type gives them."""
    names: set[str] = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    for family in text_string_to_metric_families(text):
        names.update(s.name for s in family.samples)
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names


def test_rule_metrics_exist_in_a_real_scrape(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    config = gateway_config(fake[0], tmp_path, server={"metrics_cache_s": 0})
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    with gateway(config) as gw:
        assert httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=10).is_success
        denied = httpx.post(gw.url + "/v1/chat/completions", json={**body, "n": 9}, timeout=10)
        assert denied.status_code == 400
        text = httpx.get(gw.url + "/metrics", timeout=10).text
    checked = _promtool("check", "metrics", stdin=text)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    exposed = _exposed(text)
    assert "ncap_route_up" in exposed and "ncap_requests_total" in exposed
    used = {m for rule in _rules() for m in _METRIC.findall(rule["expr"])}
    assert len(used) >= 10
    assert used <= exposed, sorted(used - exposed)
    on_dashboard = {m for q in _dashboard_queries() for m in _METRIC.findall(q)}
    assert len(on_dashboard) >= 15
    assert on_dashboard <= exposed, sorted(on_dashboard - exposed)


def test_dashboard_queries_parse(tmp_path: Path) -> None:
    """promtool parses every panel's query (as recording rules of a scratch file)."""
    queries = [q for q in _dashboard_queries() if not q.startswith("label_values(")]
    assert len(queries) >= 14
    rules = [{"record": f"ncap:dashboard:q{i}", "expr": q} for i, q in enumerate(queries)]
    scratch = tmp_path / "dashboard-queries.yml"
    scratch.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = _promtool("check", "rules", str(scratch))
    assert result.returncode == 0, result.stdout + result.stderr
    # and the harness is not vacuous: a broken query fails
    scratch.write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [
        {"record": "ncap:broken", "expr": "sum by (route) (rate(ncap_tokens_total[5m])"}
    ]}]}))  # fmt: skip
    assert _promtool("check", "rules", str(scratch)).returncode != 0
