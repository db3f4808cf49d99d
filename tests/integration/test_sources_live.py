"""Issue 8 live: the agent asks a real Prometheus about real dev-cluster jobs.

Debian's ``prometheus`` scrapes, every second, one prometheus-client exporter
per dev-cluster node. Each serves DCGM-exporter series for the node's two GPUs,
labelled with the same UUIDs and PCI addresses as the fake NVML the node hooks
read. The agent runs with ``RECOVERY_SOURCES_PROMETHEUS_URL`` pointing at it.

1. A 2-node job exits 1 and prints nothing alarming. Its nodes' kernel logs
   stay empty. The only trace of the fault is ``DCGM_FI_DEV_XID_ERRORS = 79``
   on GPU 1 of its second node, in Prometheus. The verdict must blame that
   node and that GPU, and the monitor-mode recommendation must name the node
   to exclude.
2. A running job keeps printing a heartbeat, so its log never goes quiet.
   All of its GPUs then sit at 0% for its hang window (``hang=8s``). This must
   be detected as a hang from the metrics alone, and not while they were busy.
3. ``recovery-ctl check --sources`` passes against this Prometheus and fails
   for a dead URL. ``/metrics`` shows the source up.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import requests
from prometheus_client import CollectorRegistry, start_http_server

from recovery_devtools.devcluster.config import DEFAULT_GPUS, fake_gpus
from tests.fixtures.sources.httpfake import dead_url
from tests.integration.conftest import AgentProcess, job_row, wait_for
from tests.integration.test_recovery_live import final_rec, job_now, second_node
from tests.integration.test_sources_servers import DcgmNode, argv, free_port, scrape_config

pytestmark = [pytest.mark.live, pytest.mark.timeout(180)]
PORTS = range(39200, 39300)
CTL = str(Path(sys.executable).parent / "recovery-ctl")
XID = "DCGM_FI_DEV_XID_ERRORS"
UTIL = "DCGM_FI_DEV_GPU_UTIL"
BUSY = 60.0
HANG = 8


class DevClusterNode(DcgmNode):
    """A dev-cluster node's DCGM series, labelled like its fake NVML GPUs."""

    def __init__(self, host: str) -> None:
        super().__init__(host, gpus=DEFAULT_GPUS)
        self.gpus = fake_gpus(host, DEFAULT_GPUS)["gpus"]
        for values in self.state.values():
            values[UTIL] = BUSY
            values["DCGM_FI_DEV_GPU_TEMP"] = 55.0

    def identity(self, gpu: int) -> tuple[str, str]:
        return self.gpus[gpu]["uuid"], self.gpus[gpu]["pci_bus_id"]

    def set_all(self, name: str, value: float) -> None:
        for values in self.state.values():
            values[name] = value


@pytest.fixture(scope="module")
def dcgm(devcluster):
    """One exporter per dev-cluster node: {host: (node, port)}."""
    taken: set[int] = set()
    exporters, servers = {}, []
    for node in devcluster.scheduler().list_nodes():
        dev = DevClusterNode(node.name)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(dev)
        port = free_port(taken, PORTS)
        httpd, _ = start_http_server(port, addr="127.0.0.1", registry=registry)
        servers.append(httpd)
        exporters[node.name] = (dev, port)
    yield exporters
    for httpd in servers:
        httpd.shutdown()


def prom_query(url: str, expr: str) -> list:
    answer = requests.get(url + "/api/v1/query", params={"query": expr}, timeout=2).json()
    return answer.get("data", {}).get("result") or []


@pytest.fixture(scope="module")
def prometheus(dcgm, tmp_path_factory):
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    tmp = tmp_path_factory.mktemp("prometheus")
    scrape_config(tmp / "scrape.yml", dcgm)
    port = free_port({port for _, port in dcgm.values()}, PORTS)
    url = f"http://127.0.0.1:{port}"
    log = tmp / "prometheus.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv("prometheus", port, tmp, tmp / "scrape.yml"), stdout=out,
                                stderr=subprocess.STDOUT)
    series = len(dcgm) * DEFAULT_GPUS

    def scraped() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"prometheus exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            found = prom_query(url, f"count({UTIL})")
        except (requests.RequestException, ValueError):
            return False
        return bool(found) and float(found[0]["value"][1]) == series
    try:
        wait_for(scraped, 30, f"prometheus scraping {series} GPU series")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def sources_agent(devcluster, prometheus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sources-agent")
    agent = AgentProcess(devcluster, db=tmp / "recovery.db", env={
        "RECOVERY_SOURCES_PROMETHEUS_URL": prometheus,
        "RECOVERY_SOURCES_QUERY_INTERVAL": "1s", "RECOVERY_SOURCES_INGEST_DELAY": "1s",
        "RECOVERY_SOURCES_PROMETHEUS_STEP": "1s",
        "RECOVERY_SOURCES_CURSOR_DIR": str(tmp / "cursors")})
    agent.start()
    yield agent
    agent.stop()


def registered(agent, job_id: str) -> int:
    return wait_for(lambda: job_row(agent, job_id), 30, f"job {job_id} registered")[0]


def verdict_of(agent, pk: int) -> dict | None:
    rows = agent.query("select data from events where job = ? and kind = 'verdict'", pk)
    return json.loads(rows[0][0]) if rows else None


def detections(agent, pk: int) -> list[tuple]:
    return agent.query("select pattern_id, node, gpu, source from detections where job = ? "
                       "order by id", pk)


def failed_with_xid(agent, dcgm, prometheus, submit, devcluster, tmp_path, gpu: int,
                    code: int) -> tuple[str, int, str, dict]:
    """A 2-node job that prints nothing alarming and exits 1 once Prometheus
    holds XID ``code`` for GPU ``gpu`` of its second node: its id, its row,
    that node and the verdict."""
    sched = devcluster.scheduler()
    flag = devcluster.lay.jobs / f"die-{tmp_path.name}"
    script = f'echo "step 1 loss 2.0"; while [ ! -e {flag} ]; do sleep 0.2; done; exit 1'
    job_id = submit("-N2", "--recovery=act:monitor", "-o", f"dcgm-xid{code}-%j.out",
                    script=script)
    _, bad = second_node(sched, job_id)
    pk = registered(agent, job_id)
    node = dcgm[bad][0]
    node.state[gpu][XID] = code
    try:
        wait_for(lambda: prom_query(prometheus,
                                    f'{XID}{{Hostname="{bad}",gpu="{gpu}"}} == {code}'),
                 15, "Prometheus holding the XID")
        flag.touch()                       # the job dies: exit 1, nothing in its log
        verdict = wait_for(lambda: verdict_of(agent, pk), 60, "the verdict")
    finally:
        node.state[gpu][XID] = 0
    return job_id, pk, bad, verdict


def test_a_job_whose_only_evidence_is_a_dcgm_xid_is_blamed_on_that_node_and_gpu(
        sources_agent, dcgm, prometheus, submit, devcluster, tmp_path):
    job_id, pk, bad, verdict = failed_with_xid(sources_agent, dcgm, prometheus, submit,
                                               devcluster, tmp_path, gpu=1, code=79)
    assert (verdict["blame"], verdict["category"]) == ("node", "gpu_hardware")
    assert verdict["nodes"] == [bad]
    assert verdict["gpus"] == ["0000:28:00"]          # GPU 1's PCI address (fake NVML's)
    port = prometheus.rsplit(":", 1)[1]
    assert detections(sources_agent, pk) == [("dcgm.xid", bad, "1",
                                              f"prometheus:127.0.0.1:{port}")]
    # nothing else knew: no XID from the node hooks, a plain FAILED in Slurm
    assert sources_agent.query("select count(*) from xids where job = ?", pk) == [(0,)]
    assert job_now(devcluster.scheduler(), job_id).state == "FAILED"
    rec = final_rec(sources_agent, pk)
    assert (rec["action"], rec["status"], rec["exclude"]) == ("requeue_exclude",
                                                              "would_have", [bad])


def test_a_harmless_dcgm_xid_on_a_failed_jobs_node_excludes_and_drains_nothing(
        sources_agent, dcgm, prometheus, submit, devcluster, tmp_path):
    """The same failure, but the XID Prometheus holds is 45 (a channel torn
    down after something else went wrong: the catalog's "none"). The verdict
    names the node it was seen on and asks for nothing, so the job is requeued
    once as a failure without evidence: nothing excluded, nothing drained."""
    _, pk, bad, verdict = failed_with_xid(sources_agent, dcgm, prometheus, submit,
                                          devcluster, tmp_path, gpu=0, code=45)
    assert (verdict["nodes"], verdict["action"]) == ([bad], "none")
    assert [d[0] for d in detections(sources_agent, pk)] == ["dcgm.xid"]
    rec = final_rec(sources_agent, pk)
    assert (rec["action"], rec["status"], rec["exclude"]) == ("requeue", "would_have", [])
    assert sources_agent.query("select count(*) from recommendations where job = ? and "
                               "scope = 'node'", pk) == [(0,)]
    assert not devcluster.scheduler().get_node(bad).drained


def test_all_gpus_idle_for_the_hang_window_is_a_hang_though_the_log_goes_on(
        sources_agent, dcgm, submit, devcluster):
    sched = devcluster.scheduler()
    script = 'while true; do echo "heartbeat: alive"; sleep 1; done'
    job_id = submit("-N2", f"--recovery=act:monitor,hang={HANG}s", "-o", "dcgm-hang-%j.out",
                    script=script)
    job = wait_for(lambda: (j := job_now(sched, job_id)) and j.state == "RUNNING" and j, 60,
                   f"job {job_id} RUNNING")
    pk = registered(sources_agent, job_id)
    # busy GPUs for longer than the window: checked, and no hang
    time.sleep(max(0.0, job.start_time + HANG + 4 - time.time()))
    assert [d for d in detections(sources_agent, pk) if d[0] == "hang"] == []
    try:
        for host in job.nodes:
            dcgm[host][0].set_all(UTIL, 0.0)
        idle_from = time.time()
        rec = final_rec(sources_agent, pk, timeout=40)
    finally:
        for host in job.nodes:
            dcgm[host][0].set_all(UTIL, BUSY)
    assert (rec["action"], rec["status"], rec["rule"]) == ("kill_requeue", "would_have", "hang")
    trigger, when = sources_agent.query("select trigger, detected_at from recommendations "
                                        "where id = ?", rec["id"])[0]
    assert trigger == "hang" and when >= idle_from + HANG
    (hang,) = [d for d in detections(sources_agent, pk) if d[0] == "hang"]
    assert hang[3].startswith("prometheus:")          # from the metrics, not the log
    assert job_now(sched, job_id).state == "RUNNING"  # monitor mode: left alone


def test_check_sources_passes_live_and_fails_for_a_dead_url(sources_agent, prometheus, submit):
    job_id = submit("-N1", "--recovery=act:monitor", "-o", "dcgm-check-%j.out",
                    script="sleep 60")
    wait_for(lambda: sources_agent.query("select state from jobs where job_id = ?", job_id)
             == [("RUNNING",)], 30, f"job {job_id} RUNNING in the store")
    env = sources_agent.environ()
    good = subprocess.run([CTL, "check", "--sources"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert good.returncode == 0, good.stdout + good.stderr
    lines = good.stdout.splitlines()
    assert lines[0] == ("checking 1 source(s) against 4 node(s) from sinfo and 1 running "
                        "opted-in job(s)")
    assert lines[1].startswith(f"PASS prometheus ({prometheus}): 4/4 nodes; 1/1 jobs; lag ")
    assert lines[-1] == "1/1 sources pass"
    dead = dead_url()
    bad = subprocess.run([CTL, "check", "--sources"], capture_output=True, text=True,
                         env={**env, "RECOVERY_SOURCES_PROMETHEUS_URL": dead}, timeout=60)
    assert bad.returncode == 1
    assert f"FAIL prometheus ({dead}): unreachable: " in bad.stdout
    assert bad.stdout.splitlines()[-1] == "0/1 sources pass, 1 fail"
    with urllib.request.urlopen(f"http://127.0.0.1:{sources_agent.port}/metrics",
                                timeout=5) as resp:
        text = resp.read().decode()
    assert 'slurm_recovery_source_up{source="prometheus"} 1.0' in text
