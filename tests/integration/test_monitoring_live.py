"""Issue 17 live: the shipped alert rules and dashboard against a real Prometheus
scraping a live agent on the dev cluster.

Debian's ``prometheus`` loads ``contrib/prometheus/alerts.yml`` as shipped (no
``for:`` shortened) and scrapes the agent every second, evaluating the rules
every second. The agent runs with ``policy.max_drains_per_hour = 0``, so the
first drain it decides is blocked by the budget.

1. A one-node monitor-mode job gets a real-format XID 79 on its node and exits
   1: the node's epilog reports the XID, the verdict blames the GPU, and the
   drain is stored ``blocked_by_budget``. ``SlurmRecoveryBlockedByBudget`` must
   fire (Prometheus' ``/api/v1/alerts``), and the XID must show in
   ``slurm_recovery_detections_total{category="gpu_hardware"}``.
2. Every query of ``contrib/grafana/slurm-recovery.json`` (its variables set
   to all agents and a one-minute rate interval) returns data.
3. The agent stops: ``SlurmRecoveryAgentDown`` is pending, then fires one
   minute later.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import requests

from recovery_devtools.devcluster.inject import inject_xid
from tests.integration.conftest import TEST_PORT, AgentProcess, job_row, wait_for
from tests.integration.test_recovery_live import job_now
from tests.integration.test_sources_servers import free_port

pytestmark = [pytest.mark.live, pytest.mark.timeout(300)]
REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "contrib" / "prometheus" / "alerts.yml"
DASHBOARD = REPO / "contrib" / "grafana" / "slurm-recovery.json"
# Prometheus's port: inside the dev cluster's own range (RECOVERY_TEST_PORT..+100), so a
# second cluster (a resilience share, a helper's) never meets it
PORTS = range(TEST_PORT + 33, TEST_PORT + 83)


def prometheus_config(path: Path, agent_port: int) -> None:
    path.write_text("\n".join([
        "global:", "  scrape_interval: 1s", "  scrape_timeout: 1s", "  evaluation_interval: 1s",
        "rule_files:", f"  - {ALERTS}",
        "scrape_configs:", "  - job_name: slurm-recovery", "    static_configs:",
        f"      - targets: ['127.0.0.1:{agent_port}']", ""]))


def query(url: str, expr: str) -> list:
    answer = requests.get(url + "/api/v1/query", params={"query": expr}, timeout=5).json()
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


def alerts(url: str, name: str) -> list[dict]:
    answer = requests.get(url + "/api/v1/alerts", timeout=5).json()
    return [a for a in answer["data"]["alerts"] if a["labels"]["alertname"] == name]


def in_state(url: str, name: str, state: str) -> list[dict]:
    return [a for a in alerts(url, name) if a["state"] == state]


@pytest.fixture(scope="module")
def budget_agent(devcluster, tmp_path_factory):
    agent = AgentProcess(devcluster, db=tmp_path_factory.mktemp("monitoring") / "recovery.db",
                         env={"RECOVERY_POLICY_MAX_DRAINS_PER_HOUR": "0"})
    agent.start()
    yield agent
    agent.stop()


@pytest.fixture(scope="module")
def prometheus(budget_agent, tmp_path_factory):
    if shutil.which("prometheus") is None:   # a missing server must not pass as a skip
        pytest.fail("prometheus is not installed (apt-get install prometheus)")
    tmp = tmp_path_factory.mktemp("prometheus")
    prometheus_config(tmp / "prometheus.yml", budget_agent.port)
    port = free_port({budget_agent.port}, PORTS)
    url = f"http://127.0.0.1:{port}"
    log = tmp / "prometheus.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
             "--log.level=warn"], stdout=out, stderr=subprocess.STDOUT)

    def scraping() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"prometheus exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            return bool(query(url, 'slurm_recovery_recommendations_blocked_by_budget_total == 0'
                              ' and on(instance) up{job="slurm-recovery"} == 1'))
        except (requests.RequestException, ValueError):
            return False
    try:
        wait_for(scraping, 30, "prometheus scraping the agent (no drain blocked yet)")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def grafana_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    out = []

    def walk(panels):
        for panel in panels:
            out.extend((panel["title"], t["expr"]) for t in panel.get("targets", []))
            walk(panel.get("panels", []))
    walk(dash["panels"])
    return out


def blocked_drain(agent, submit, devcluster, cleanup) -> str:
    """A monitor-mode job whose node reports XID 79; its drain is blocked (budget 0)."""
    job_id = submit("-N1", "--recovery", script="sleep 6; exit 1")
    sched = devcluster.scheduler()
    job = wait_for(lambda: (j := job_now(sched, job_id)) and j.state == "RUNNING" and j,
                   60, f"job {job_id} RUNNING")
    node = job.nodes[0]
    cleanup.append((node, agent))
    inject_xid(devcluster.lay, node, 0, 79)
    pk = wait_for(lambda: job_row(agent, job_id), 30, f"job {job_id} registered")[0]
    drains = wait_for(lambda: agent.query(
        "select status, error from recommendations where job = ? and action = 'drain_node'",
        pk), 60, "the drain recommendation")
    assert drains[0][0] == "blocked_by_budget" and "max_drains_per_hour=0" in drains[0][1]
    assert not sched.get_node(node).drained
    return node


def test_blocked_drain_and_agent_down_fire_and_every_panel_has_data(
        budget_agent, prometheus, submit, devcluster, cleanup):
    assert not alerts(prometheus, "SlurmRecoveryBlockedByBudget")
    # evaluated before the first scrape, absent(up) made it pending: gone once scraped
    wait_for(lambda: not alerts(prometheus, "SlurmRecoveryAgentDown"), 10,
             "no SlurmRecoveryAgentDown while the agent is scraped")

    blocked_drain(budget_agent, submit, devcluster, cleanup)
    firing = wait_for(lambda: in_state(prometheus, "SlurmRecoveryBlockedByBudget", "firing"),
                      30, "SlurmRecoveryBlockedByBudget firing")
    assert firing[0]["labels"]["severity"] == "warning"
    assert "recovery-ctl show recommendations --status blocked_by_budget" in \
        firing[0]["annotations"]["description"]
    xids = wait_for(lambda: query(
        prometheus, 'slurm_recovery_detections_total{category="gpu_hardware"} >= 1'), 15,
        "the node's XID counted as a gpu_hardware detection")
    assert xids[0]["metric"]["job"] == "slurm-recovery"

    # the dashboard, as Grafana would ask with "All" agents and a 1m rate interval
    time.sleep(3)   # a few more scrapes, so that every rate() has two samples
    empty = []
    for title, expr in grafana_exprs():
        concrete = expr.replace("$instance", ".+").replace("$__rate_interval", "1m")
        if not query(prometheus, concrete):
            empty.append(f"{title}: {concrete}")
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
    values = requests.get(prometheus + "/api/v1/label/instance/values",
                          params={"match[]": "slurm_recovery_build_info"}, timeout=5).json()
    assert values["data"] == [f"127.0.0.1:{budget_agent.port}"]   # the $instance variable

    budget_agent.stop()
    stopped = time.monotonic()
    wait_for(lambda: in_state(prometheus, "SlurmRecoveryAgentDown", "pending"), 15,
             "SlurmRecoveryAgentDown pending")
    assert not in_state(prometheus, "SlurmRecoveryAgentDown", "firing")
    down = wait_for(lambda: in_state(prometheus, "SlurmRecoveryAgentDown", "firing"), 90,
                    "SlurmRecoveryAgentDown firing", interval=1)
    assert time.monotonic() - stopped >= 55    # the shipped for: 1m, not sooner
    assert down[0]["labels"]["severity"] == "critical"
    assert down[0]["labels"]["instance"] == f"127.0.0.1:{budget_agent.port}"
    submit.retire()
