"""The alert rules and the Grafana dashboard under docker/: valid, tested, and about real metrics.

promtool (Debian's prometheus package; ``.ci/run`` installs it) checks the rules and runs their unit
tests; the dashboard's queries are checked as PromQL by promtool too. Every metric either file
names must be one that kvroute exposes: a renamed metric would otherwise leave an alert that can
never fire and a panel that stays empty.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.api.conftest import ADMIN, register
from tests.api.documents import rank_document

DOCKER = Path(__file__).resolve().parents[2] / "docker"
RULES = DOCKER / "prometheus" / "kvroute-alerts.yaml"
RULE_TESTS = DOCKER / "prometheus" / "kvroute-alerts.test.yaml"
DASHBOARD = DOCKER / "grafana" / "kvroute-dashboard.json"
METRIC = re.compile(r"\bkvroute_[a-z_]+\b")
HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing: .ci/run installs Debian's prometheus package")
        pytest.skip("needs promtool (apt-get install prometheus)")
    return found


def _promtool_run(*args: str, cwd: Path) -> None:
    result = subprocess.run(
        [_promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def _alert_queries() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def test_alert_rules_pass_promtool_check_and_their_unit_tests() -> None:
    _promtool_run("check", "rules", RULES.name, cwd=RULES.parent)
    _promtool_run("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    alerts = {
        rule["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for rule in g["rules"]
    }
    tested = {
        case["alertname"]
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test["alert_rule_test"]
    }
    assert alerts == tested


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    # promtool parses the queries as recording rules; Grafana's variables become plain matchers.
    queries = [q.replace("$deployment", ".*") for q in _dashboard_queries()]
    rules = [{"record": f"kvroute:dashboard_{i}", "expr": q} for i, q in enumerate(queries)]
    (tmp_path / "dashboard.yaml").write_text(
        yaml.safe_dump({"groups": [{"name": "d", "rules": rules}]})
    )
    _promtool_run("check", "rules", "dashboard.yaml", cwd=tmp_path)


def test_dashboard_is_importable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "kvroute"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {item["name"] for item in dashboard["templating"]["list"]}
    assert variables == {"datasource", "deployment"}
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]


async def test_every_metric_they_name_is_exposed(client) -> None:
    await register(client, "ctx0", 0, rank_document(head_dim=16))
    await register(client, "gen0", 0, rank_document(role="generation", head_dim=32))  # refused
    assert (await client.get("/v1/deployments", headers=ADMIN)).status == 200
    text = await (await client.get("/metrics")).text()
    exposed = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
        exposed.add(name)
        if kind == "histogram":
            exposed.update(name + suffix for suffix in HISTOGRAM_SUFFIXES)
    named = {m for q in _alert_queries() + _dashboard_queries() for m in METRIC.findall(q)}
    assert named
    assert named <= exposed, named - exposed
