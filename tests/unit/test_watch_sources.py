"""The watch loop with external sources switched on: a fake Prometheus and a
fake Loki (real HTTP servers on loopback), a scheduler replaying listings, and
the agent's clock in the test's hands. The live version, with a real
Prometheus and the dev cluster, is tests/integration/test_sources_live.py."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from recovery_agent.config import from_mapping
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner
from recovery_agent.inputs.logline import MemoryCursorStore
from recovery_agent.inputs.tail import Tailer
from recovery_agent.interfaces.metrics import render
from recovery_agent.scheduler.base import Job
from recovery_agent.inputs.sources import SourcePoller, build_sources
from recovery_agent.store import Store
from recovery_agent.watch import EPILOG_GRACE, Watcher
from tests.fixtures.sources.httpfake import FakeServer, dead_url, json_reply, recorded
from tests.unit.scripted import Script
from tests.unit.test_sources_prometheus import FakeProm, labels

T0 = 1714557600.0
XID = "DCGM_FI_DEV_XID_ERRORS"
UTIL = "DCGM_FI_DEV_GPU_UTIL"


class Decisions:
    """Stands in for the Decider: records what it was asked."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def decide_attempt(self, job_pk, attempt, spec, verdict, **kw):
        self.calls.append({"verdict": verdict, **kw})


def job(state: str, out: Path, job_id: str = "77", nodes=("node1", "node2"),
        comment: str = "recovery=prod", **kw) -> Job:
    base = dict(job_id=job_id, numeric_id=int(job_id), state=state, submit_time=int(T0) - 400,
                start_time=int(T0) - 300, nodes=nodes, comment=comment, stdout=str(out),
                stderr=str(out), user_id=0, group_id=0)  # root's files, read with root's rights
    base.update(kw)
    return Job(**base)


def make(tmp_path, clock, sources: dict, decider=None):
    cfg = from_mapping({"agent": {"cluster": "c1", "state_dir": str(tmp_path)},
                        "sources": {"ingest_delay": "10s", "prometheus_step": "15s",
                                    "query_interval": "30s", "timeout": "2s", "retries": 0,
                                    **sources}})
    store = Store(tmp_path / "r.db")
    sched = Script()
    scanner = Scanner(load_rules(), engine="re")
    poller = SourcePoller(build_sources(cfg, scanner.rules), clock=lambda: clock[0])
    watcher = Watcher(cfg, store, sched, scanner, Tailer(MemoryCursorStore()),
                      clock=lambda: clock[0], decider=decider, sources=poller)
    return watcher, store, sched


def verdicts(store):
    return [e for e in store.timeline(1) if e["kind"] == "verdict"]


@pytest.fixture
def server():
    with FakeServer() as fake:
        yield fake


def test_an_xid_scraped_after_the_job_died_reaches_its_verdict(tmp_path, server):
    prom = FakeProm(server)
    out = tmp_path / "o.out"
    out.write_text("step 1 loss 2.0\n")
    clock = [T0]
    # not due again for 2 minutes: the last look must not wait for that
    watcher, store, sched = make(tmp_path, clock, {"prometheus_url": server.url,
                                                   "query_interval": "120s"})
    sched.jobs = [job("RUNNING", out)]
    watcher.cycle()                          # first look: nothing wrong yet
    assert (tmp_path / "cursors" / "prometheus.json").exists()
    # node2's GPU 1 fails at T0+9; the exporter is scraped at T0+20, after the end
    prom.events = [(labels(XID, "node2", 1, pci_bus_id="00000000:28:00.0"),
                    [(T0 - 30, 0), (T0 + 5, 0), (T0 + 20, 79), (T0 + 35, 79)])]
    clock[0] = T0 + 12
    sched.jobs = [job("FAILED", out, exit_code=1, end_time=int(T0) + 10)]
    watcher.cycle()
    clock[0] = T0 + 12 + EPILOG_GRACE + 1     # the epilog grace is over...
    watcher.cycle()
    assert verdicts(store) == []              # ...but Prometheus may not hold the end yet
    clock[0] = T0 + 10 + 25 + 1               # end + ingest_delay + prometheus_step
    watcher.cycle()
    (verdict,) = verdicts(store)
    assert verdict["data"]["blame"] == "node" and verdict["data"]["nodes"] == ["node2"]
    assert verdict["data"]["category"] == "gpu_hardware"
    assert verdict["data"]["gpus"] == ["0000:28:00"]
    (det,) = store.detections(1)
    assert (det["pattern_id"], det["node"], det["gpu"]) == ("dcgm.xid", "node2", "1")
    assert det["source"] == f"prometheus:{server.url.removeprefix('http://')}"
    source = watcher.sources.poller.sources[0]
    assert source.cursors.keys() == []        # the job's cursor is forgotten once judged


def test_idle_gpus_of_a_running_job_are_decided_as_a_hang(tmp_path, server):
    prom = FakeProm(server)
    prom.util = [(labels(UTIL, host, gpu), [(T0 - 200 + 5 * i, 0) for i in range(60)])
                 for host in ("node1", "node2") for gpu in (0, 1)]
    out = tmp_path / "o.out"
    out.write_text("")
    clock = [T0]
    decisions = Decisions()
    watcher, store, sched = make(tmp_path, clock, {"prometheus_url": server.url},
                                 decider=decisions)
    sched.jobs = [job("RUNNING", out, comment="recovery=prod,hang=60s",
                      start_time=int(T0) - 100)]
    with open(out, "a") as fh:    # the job keeps printing: its log never goes silent
        fh.write("heartbeat: alive\n")
    watcher.cycle()
    (call,) = decisions.calls
    assert call["trigger"] == "hang" and call["verdict"].category == "nccl_timeout_hang"
    (det,) = [d for d in store.detections(1) if d["pattern_id"] == "hang"]
    assert det["source"].startswith("prometheus:")
    assert "all 4 GPUs of 2 node(s) at 0% utilisation for 60s" in det["evidence"]["detail"]
    clock[0] += 31                              # the next poll: still idle, no second hang
    with open(out, "a") as fh:
        fh.write("heartbeat: alive\n")
    watcher.cycle()
    assert len(decisions.calls) == 1


def test_busy_gpus_are_no_hang(tmp_path, server):
    prom = FakeProm(server)
    prom.util = [(labels(UTIL, host, gpu), [(T0 - 200 + 5 * i, 0 if host == "node1" else 40)
                                           for i in range(60)])
                 for host in ("node1", "node2") for gpu in (0, 1)]
    out = tmp_path / "o.out"
    out.write_text("heartbeat: alive\n")
    clock = [T0]
    decisions = Decisions()
    watcher, store, sched = make(tmp_path, clock, {"prometheus_url": server.url},
                                 decider=decisions)
    sched.jobs = [job("RUNNING", out, comment="recovery=prod,hang=60s",
                      start_time=int(T0) - 100)]
    watcher.cycle()
    assert decisions.calls == [] and store.detections(1) == []
    assert len(server.hits("/api/v1/query_range")) == 2     # the events and the hang query


def test_a_dead_source_degrades_with_one_log_line_and_a_metric(tmp_path, caplog):
    out = tmp_path / "o.out"
    out.write_text("")
    clock = [T0]
    watcher, store, sched = make(tmp_path, clock, {"prometheus_url": dead_url()})
    sched.jobs = [job("RUNNING", out)]
    with caplog.at_level(logging.DEBUG):
        assert watcher.run_once() is True
        clock[0] += 31
        assert watcher.run_once() is True            # asked again: fails again
        clock[0] += 40
        assert watcher.run_once() is True            # backing off (60s): not asked
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING
                and "source prometheus" in r.getMessage()]
    assert len(warnings) == 1 and "carrying on without it" in warnings[0].getMessage()
    text = render(store)[0].decode()
    assert 'slurm_recovery_source_up{source="prometheus"} 0.0' in text
    assert 'slurm_recovery_source_errors_total{kind="unavailable",source="prometheus"} 2.0' in text
    # its verdict waits for the epilog grace only: nothing would come from a dead source
    sched.jobs = [job("FAILED", out, exit_code=1, end_time=int(clock[0]))]
    watcher.cycle()
    clock[0] += EPILOG_GRACE + 1
    watcher.cycle()
    (verdict,) = verdicts(store)
    assert verdict["data"]["blame"] == "unknown"


def test_metrics_show_each_configured_source_as_up_before_any_query(tmp_path, server):
    clock = [T0]
    watcher, store, _ = make(tmp_path, clock, {"prometheus_url": server.url,
                                               "loki_url": server.url})
    text = render(store)[0].decode()
    assert 'slurm_recovery_source_up{source="prometheus"} 1.0' in text
    assert 'slurm_recovery_source_up{source="loki"} 1.0' in text
    assert "slurm_recovery_source_errors_total{" not in text


def test_log_store_lines_are_scanned_per_stream_with_their_host_and_time(tmp_path, server):
    answer = json.loads(recorded("loki_query_range.json"))

    def query_range(request):      # like Loki: only the job feed's lines, in [start, end)
        low, high = int(request.params["start"]), int(request.params["end"])
        streams = []
        if request.params["query"].startswith("{slurm_job_id="):
            for item in answer["data"]["result"]:
                values = [v for v in item["values"] if low <= int(v[0]) < high]
                if values:
                    streams.append({"stream": item["stream"], "values": values})
        return json_reply({"status": "success", "data": {"resultType": "streams",
                                                         "result": streams}})
    server.route("/loki/api/v1/query_range", query_range)
    out = tmp_path / "o.out"
    out.write_text("")
    clock = [T0 + 60]
    watcher, store, sched = make(tmp_path, clock, {"loki_url": server.url})
    sched.jobs = [job("RUNNING", out, job_id="4242", nodes=("gpu-n17", "gpu-n18"))]
    watcher.cycle()
    job_feed, node_feed = server.hits("/loki/api/v1/query_range")
    assert job_feed.params["query"].startswith('{slurm_job_id="4242"} |~ ')   # prefiltered
    assert node_feed.params["query"].startswith('{host=~"gpu-n17|gpu-n18"} |~ ')
    found = {d["pattern_id"]: d for d in store.detections(1)}
    xid = next(d for d in found.values() if d["category"] == "gpu_hardware")
    assert xid["node"] == "gpu-n18"
    assert xid["evidence"]["lines"][0]["time"] == 1714557599.0
    assert xid["evidence"]["lines"][0]["line"] is None
    assert xid["source"].startswith("loki:") and "host=gpu-n18" in xid["source"]
    nccl = next(d for d in found.values() if d["category"] == "nccl_timeout_hang")
    assert nccl["node"] == "gpu-n17"              # the stream's host label: the line names none
    assert nccl["evidence"]["lines"][0]["time"] == 1714557600.0
    clock[0] += 31
    watcher.cycle()              # the cursor moved on: the same lines are not read twice
    assert len(store.detections(1)) == len(found)
