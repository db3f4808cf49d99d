"""What ships for monitoring (issue 17): the alert rules, checked and unit-tested
by Debian's promtool; the Grafana dashboard; and docs/monitoring.md, whose
metric list must be the registry's. Every series an alert or a panel uses must
be one the agent serves (the live test, test_monitoring_live.py, then evaluates
them against a real Prometheus)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from recovery_agent.config import from_mapping
from recovery_agent.inputs.ingest import Ingest
from recovery_agent.interfaces.api import create_app
from recovery_agent.store import Store

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "contrib" / "prometheus" / "alerts.yml"
ALERTS_TEST = REPO / "tests" / "fixtures" / "prometheus" / "alerts_test.yml"
DASHBOARD = REPO / "contrib" / "grafana" / "slurm-recovery.json"
DOC = REPO / "docs" / "monitoring.md"
SERIES = re.compile(r"\b((?:slurm_recovery|process)_[a-z0-9_]+)")
REQUIRED_ALERTS = {"SlurmRecoveryAgentDown", "SlurmRecoveryWatchLoopFailing",
                   "SlurmRecoveryBlockedByBudget", "SlurmRecoveryHeldJobsPastDecisionTimeout",
                   "SlurmRecoveryStoreErrors"}


def promtool() -> str:
    found = shutil.which("promtool") or ("/usr/bin/promtool"
                                        if Path("/usr/bin/promtool").exists() else None)
    if found is None:   # a missing checker must not pass as a skipped test
        pytest.fail("promtool is missing: apt-get install prometheus")
    return found


def scrape(tmp_path) -> list:
    """The families a running agent serves (a cycle has succeeded)."""
    cfg = from_mapping({"api": {"auth": "none"},
                        "environments": {"prod": {"mode": "action"}}})
    store = Store(tmp_path / "r.db")
    store.health["ok_at"] = time.time()
    client = TestClient(create_app(cfg, Ingest(store, "c1")))
    client.post("/v1/hooks/prolog", content=b"{}")   # an ingest outcome to count
    return list(text_string_to_metric_families(client.get("/metrics").text))


def served(tmp_path) -> set[str]:
    """Every series name the agent serves, also of families with no sample yet."""
    names = set()
    for family in scrape(tmp_path):
        names |= {s.name for s in family.samples}
        names |= {family.name + suffix for suffix in {
            "counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")
        }.get(family.type, ("",))}
    return names


def documented_name(family) -> str:
    return family.name + "_total" if family.type == "counter" else family.name


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def dashboard_exprs() -> list[str]:
    def walk(panels):
        for panel in panels:
            yield from (t["expr"] for t in panel.get("targets", []))
            yield from walk(panel.get("panels", []))
    return list(walk(json.loads(DASHBOARD.read_text())["panels"]))


# -- the alerts --------------------------------------------------------------------

def test_promtool_check_rules_passes():
    result = subprocess.run([promtool(), "check", "rules", str(ALERTS)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout


def test_promtool_unit_tests_of_the_rules_pass():
    result = subprocess.run([promtool(), "test", "rules", ALERTS_TEST.name],
                            cwd=ALERTS_TEST.parent, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    tested = set(re.findall(r"alertname: (\w+)", ALERTS_TEST.read_text()))
    assert tested == {r["alert"] for r in alert_rules()}, "every alert has a rules test"


def test_promtool_catches_a_broken_rule(tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text(ALERTS.read_text().replace("> 0", "> > 0", 1))
    result = subprocess.run([promtool(), "check", "rules", str(broken)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode != 0


def test_the_alerts_the_issue_asks_for_each_say_what_to_do():
    rules = alert_rules()
    assert {r["alert"] for r in rules} == REQUIRED_ALERTS
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        notes = rule["annotations"]
        assert notes["summary"] and len(notes["description"]) > 120, rule["alert"]
        assert "`" in notes["description"], f"{rule['alert']}: name a command to run"
        assert _seconds(rule.get("for", "0s")) <= 300, f"{rule['alert']}: for too long"


def _seconds(text: str) -> int:
    return sum(int(n) * {"s": 1, "m": 60, "h": 3600}[u] for n, u in re.findall(r"(\d+)([smh])",
                                                                              text))


def test_every_series_an_alert_uses_is_served(tmp_path):
    names = served(tmp_path)
    used = {n for r in alert_rules() for n in SERIES.findall(r["expr"])}
    assert used and not used - names, f"alerts on series the agent does not serve: {used - names}"


# -- the dashboard -------------------------------------------------------------------

def test_dashboard_uses_the_datasource_variable_everywhere():
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"

    def panels(items):
        for p in items:
            yield p
            yield from panels(p.get("panels", []))
    for panel in panels(dash["panels"]):
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"] and all(t["datasource"]["uid"] == "${datasource}"
                                        for t in panel["targets"]), panel["title"]
    ids = [p["id"] for p in panels(dash["panels"])]
    assert len(ids) == len(set(ids))


def test_dashboard_covers_what_the_issue_names(tmp_path):
    exprs = " ".join(dashboard_exprs())
    for series in ("slurm_recovery_detections_total", "slurm_recovery_recommendations",
                   "slurm_recovery_recommendations_blocked_by_budget_total",
                   "slurm_recovery_watch_errors_total", "slurm_recovery_held_jobs",
                   "slurm_recovery_drained_nodes", "process_cpu_seconds_total",
                   "process_resident_memory_bytes"):
        assert series in exprs, series
    assert "by (category)" in exprs and "by (action, status)" in exprs
    used = set(SERIES.findall(exprs))
    assert not used - served(tmp_path), f"panels on unknown series: {used - served(tmp_path)}"


# -- the page ------------------------------------------------------------------------

def test_monitoring_page_lists_exactly_the_registrys_metrics(tmp_path):
    families = [f for f in scrape(tmp_path) if f.name.startswith("slurm_recovery_")]
    text = DOC.read_text()
    table = set(re.findall(r"^\| `(slurm_recovery_[a-z0-9_]+)`", text, re.M))
    names = {documented_name(f) for f in families}
    assert table == names, (f"undocumented: {sorted(names - table)}; "
                            f"documented but not served: {sorted(table - names)}")
    assert "contrib/grafana/slurm-recovery.json" in text
    assert "contrib/prometheus/alerts.yml" in text
    for rule in alert_rules():
        assert rule["alert"] in text, rule["alert"]


def test_monitoring_page_is_linked_from_the_readme():
    assert "docs/monitoring.md" in (REPO / "README.md").read_text()
