"""``recovery-ctl check --sources`` against a fake Prometheus and a fake Loki
(real HTTP servers on loopback, answering in each API's documented shape),
with Slurm replaced by a stand-in that lists two nodes and one running job."""
from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner

from recovery_agent.interfaces import check as check_module
from recovery_agent.interfaces.ctl import main as ctl
from recovery_agent.errors import SchedulerUnavailable
from recovery_agent.scheduler.base import Job, Node
from recovery_agent.store import Store
from tests.fixtures.sources.httpfake import FakeServer, dead_url, json_reply, recorded

NODES = ("gpu-n17", "gpu-n18")
GOOD_LABELS = {"__name__": "DCGM_FI_DEV_GPU_UTIL", "Hostname": "gpu-n17", "gpu": "0",
               "UUID": "GPU-a", "instance": "gpu-n17:9400"}


class FakeSlurm:
    def __init__(self) -> None:
        self.asked: list = []

    def list_nodes(self, names=None):
        return [Node(name=n, state="MIXED") for n in NODES]

    def list_jobs(self, job_ids=None):
        self.asked.append(list(job_ids or []))
        return [Job(job_id="4242", numeric_id=4242, state="RUNNING", nodes=("gpu-n17",))]


def prometheus(server: FakeServer, sample: dict = GOOD_LABELS, age: float = 5.0) -> None:
    def query(request):
        now = time.time()
        if request.params["query"].startswith("topk("):
            items = [(sample, 50)]
        else:
            items = [({"Hostname": h}, now - age) for h in NODES]
        return json_reply({"status": "success", "data": {"resultType": "vector", "result": [
            {"metric": m, "value": [now, str(v)]} for m, v in items]}})
    server.route("/api/v1/query", query)


def loki(server: FakeServer, age: float = 3.0) -> None:
    server.route("/loki/api/v1/labels", lambda r: (200, {}, recorded("loki_labels.json")))
    server.route("/loki/api/v1/label/host/values",
                 lambda r: (200, {}, recorded("loki_label_values_host.json")))
    server.route("/loki/api/v1/label/slurm_job_id/values",
                 lambda r: (200, {}, recorded("loki_label_values_job.json")))
    server.route("/loki/api/v1/query_range", lambda r: json_reply(
        {"status": "success", "data": {"resultType": "streams", "result": [
            {"stream": {"host": "gpu-n17"},
             "values": [[str(int((time.time() - age) * 1e9)), "a line"]]}]}}))


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A config, a store holding job 4242 RUNNING, and the Slurm stand-in."""
    config = tmp_path / "recovery.toml"
    config.write_text(f'[agent]\ncluster = "c1"\nstate_dir = "{tmp_path}"\n')
    for key in ("PROMETHEUS_URL", "LOKI_URL", "VICTORIALOGS_URL"):
        monkeypatch.delenv(f"RECOVERY_SOURCES_{key}", raising=False)
    monkeypatch.setenv("RECOVERY_CONFIG", str(config))
    with Store(tmp_path / "recovery.db") as store:
        job = Job(job_id="4242", numeric_id=4242, submit_time=1000, state="RUNNING",
                  nodes=("gpu-n17",))
        with store.lock:
            store.record_job(job, "c1", env="prod", spec="prod")
            store.record_job(Job(job_id="5000", numeric_id=5000, submit_time=1000,
                                 state="RUNNING"), "other-cluster")
    slurm = FakeSlurm()
    monkeypatch.setattr(check_module, "select_scheduler", lambda *a, **k: slurm)
    return slurm


@pytest.fixture
def servers():
    with FakeServer() as prom, FakeServer() as logs:
        yield prom, logs


def check(*args, **env):
    return CliRunner().invoke(ctl, ["check", "--sources", *args],
                              env={f"RECOVERY_SOURCES_{k.upper()}": v for k, v in env.items()})


def test_every_source_passes_with_one_line_each_and_a_summary(site, servers):
    prom, logs = servers
    prometheus(prom)
    loki(logs)
    result = check(prometheus_url=prom.url, loki_url=logs.url)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == ("checking 2 source(s) against 2 node(s) from sinfo and 1 running "
                        "opted-in job(s)")
    assert lines[1].startswith(f"PASS prometheus ({prom.url}): 2/2 nodes; 1/1 jobs; lag ")
    assert lines[2].startswith(f"PASS loki ({logs.url}): 2/2 nodes; 1/1 jobs; lag ")
    assert lines[3] == "2/2 sources pass"
    assert site.asked == [["4242"]]           # the store's RUNNING job of this cluster only


def test_a_dead_source_fails_and_exits_1(site, servers):
    prom, _ = servers
    prometheus(prom)
    dead = dead_url()
    result = check(prometheus_url=prom.url, loki_url=dead)
    assert result.exit_code == 1
    (fail,) = [line for line in result.output.splitlines() if line.startswith("FAIL")]
    assert fail.startswith(f"FAIL loki ({dead}): unreachable: ")
    assert result.output.splitlines()[-1] == "1/2 sources pass, 1 fail"


def test_wrong_labels_and_stale_data_fail_with_the_reason(site, servers):
    prom, _ = servers
    relabelled = {k: v for k, v in GOOD_LABELS.items() if k != "Hostname"}
    prometheus(prom, sample=relabelled)
    result = check(prometheus_url=prom.url)
    assert result.exit_code == 1
    assert "FAIL prometheus" in result.output
    assert "wrong label schema: 'Hostname' not found" in result.output
    prometheus(prom, age=900.0)
    stale = check(prometheus_url=prom.url)
    assert stale.exit_code == 1 and "lag 15m behind real time (limit 5m)" in stale.output


def test_json_for_scripts(site, servers):
    prom, _ = servers
    prometheus(prom)
    result = check("--json", prometheus_url=prom.url)
    assert result.exit_code == 0, result.output
    answer = json.loads(result.output)
    assert answer["ok"] is True and answer["nodes"] == list(NODES)
    assert answer["jobs"] == {"4242": ["gpu-n17"]}
    (source,) = answer["sources"]
    assert source["source"] == "prometheus" and source["ok"] is True
    assert source["nodes_seen"] == list(NODES) and source["lag"] < 60


def test_without_slurm_the_check_narrows_with_a_note(site, servers, monkeypatch):
    prom, _ = servers
    prometheus(prom)

    def unavailable(*args, **kwargs):
        raise SchedulerUnavailable("no scheduler backend can run here")
    monkeypatch.setattr(check_module, "select_scheduler", unavailable)
    result = check(prometheus_url=prom.url)
    assert result.exit_code == 0, result.output
    assert "note: Slurm unavailable (no scheduler backend can run here): nodes and jobs " \
           "not checked" in result.output
    assert "against 0 node(s)" in result.output


def test_no_source_configured_says_which_keys_to_set(site):
    result = check()
    assert result.exit_code == 1
    assert "no external source is configured: set sources.prometheus_url" in result.output


def test_an_unreadable_credentials_file_is_a_clear_error(site, tmp_path):
    result = check(prometheus_url="http://127.0.0.1:9", prometheus_auth="bearer",
                   prometheus_credentials_file=str(tmp_path / "missing-token"))
    assert result.exit_code == 1
    assert "Error: sources.prometheus_credentials_file: cannot read" in result.output
    assert "Traceback" not in result.output
