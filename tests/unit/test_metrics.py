"""``GET /metrics`` (issue 17): the ``slurm_recovery_`` namespace, build and
mode identity, process metrics, HEAD, node-report XIDs counted as detections,
and the series the shipped alerts stand on (budget blocks, holds past the
decision timeout, a failing watch loop, store errors)."""
from __future__ import annotations

import json
import sqlite3
import time
from importlib import metadata

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from recovery_agent.config import from_mapping
from recovery_agent.detect.model import Detection
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner
from recovery_agent.errors import SchedulerError
from recovery_agent.inputs.ingest import Ingest
from recovery_agent.inputs.logline import MemoryCursorStore
from recovery_agent.inputs.tail import Tailer
from recovery_agent.interfaces.api import create_app
from recovery_agent.interfaces.metrics import NAMESPACE
from recovery_agent.store import Store
from recovery_agent.watch import Watcher
from tests.unit.scripted import Script
from tests.unit.test_ingest import XID79, report

ADMIN = 0


def make(tmp_path, **policy):
    cfg = from_mapping({"agent": {"cluster": "c1"},
                        "api": {"auth": "none", "admin_uids": "0"},
                        "policy": {"decision_timeout": "60s", **policy},
                        "environments": {"prod": {"mode": "action"},
                                         "dev": {"mode": "monitor"}}})
    store = Store(tmp_path / "r.db")
    return cfg, store, TestClient(create_app(cfg, Ingest(store, "c1")))


def samples(client) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of one scrape."""
    answer = client.get("/metrics")
    assert answer.status_code == 200
    out = {}
    for family in text_string_to_metric_families(answer.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def families(client) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(client.get("/metrics").text)}


def value(found: dict, name: str, **labels) -> float | None:
    return found.get((name, tuple(sorted(labels.items()))))


def add_rec(store, **kw) -> int:
    row = {"job": None, "attempt": 0, "job_id": "42", "scope": "job", "action": "requeue",
           "rule": "hardware", "reason": "r", "target_nodes": [], "exclude": [],
           "mode": "action", "status": "proposed", "restart_at": 0, "submit_time": 1000,
           "env": "prod", "user": "alice"}
    row.update(kw)
    with store.lock:
        return store.add_recommendation(row)


def test_every_series_is_in_the_namespace_or_the_process_collectors(tmp_path):
    _, store, client = make(tmp_path)
    names = families(client)
    foreign = [n for n in names if not n.startswith((f"{NAMESPACE}_", "process_"))]
    assert not foreign, f"series outside slurm_recovery_/process_: {foreign}"
    assert not [n for n in names if n.startswith("recovery_")]
    assert names[f"{NAMESPACE}_detections"] == "counter"


def test_build_info_names_the_package_version(tmp_path):
    _, _, client = make(tmp_path)
    found = samples(client)
    assert value(found, "slurm_recovery_build_info",
                 version=metadata.version("slurm-recovery")) == 1.0


def test_environment_mode_follows_the_config_and_the_operators_change(tmp_path):
    _, store, client = make(tmp_path)
    found = samples(client)
    assert value(found, "slurm_recovery_environment_mode", env="prod", mode="action") == 1.0
    assert value(found, "slurm_recovery_environment_mode", env="prod", mode="monitor") == 0.0
    assert value(found, "slurm_recovery_environment_mode", env="dev", mode="monitor") == 1.0
    answer = client.post("/v1/environments/prod/mode", content=json.dumps({"mode": "monitor"}),
                         headers={"X-Recovery-Uid": str(ADMIN)})
    assert answer.status_code == 200, answer.text
    found = samples(client)
    assert value(found, "slurm_recovery_environment_mode", env="prod", mode="action") == 0.0
    assert value(found, "slurm_recovery_environment_mode", env="prod", mode="monitor") == 1.0


def test_process_metrics_are_served_in_the_same_registry(tmp_path):
    _, _, client = make(tmp_path)
    found = samples(client)
    assert value(found, "process_resident_memory_bytes") > 0
    assert value(found, "process_cpu_seconds_total") > 0
    assert value(found, "process_start_time_seconds") > 1e9


@pytest.mark.parametrize("path", ["/metrics", "/healthz"])
def test_head_answers_without_a_body(tmp_path, path):
    _, store, client = make(tmp_path)
    store.set_state("heartbeat", {"time": time.time(), "cycles": 1})
    answer = client.head(path)
    assert answer.status_code == 200 and answer.content == b""


def test_head_healthz_is_red_as_get_is(tmp_path):
    _, _, client = make(tmp_path)   # no watch heartbeat yet
    answer = client.head("/healthz")
    assert answer.status_code == 503 == client.get("/healthz").status_code
    assert answer.content == b""


def test_head_metrics_needs_the_read_token_as_get_does(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    cfg = from_mapping({"api": {"auth": "none", "read_token_file": str(token)}})
    client = TestClient(create_app(cfg, Ingest(Store(tmp_path / "r.db"), "c1")),
                        client=("192.0.2.7", 5000))
    assert client.head("/metrics").status_code == client.get("/metrics").status_code == 401
    assert client.head("/metrics", headers={"Authorization": "Bearer s3cret"}
                       ).status_code == 200


def test_node_report_xids_count_as_gpu_hardware_detections(tmp_path):
    """Issue 17: an XID a node hook reported was never in the detections counter."""
    _, store, client = make(tmp_path)
    xid13 = dict(XID79, xid=13, raw=XID79["raw"].replace(": 79,", ": 13,"),
                 message="Graphics SM Warp Exception")
    answer = client.post("/v1/hooks/health",
                         content=json.dumps(report("health", job=None,
                                                   xids=[XID79, xid13])).encode())
    assert answer.status_code == 201, answer.text
    found = samples(client)
    assert value(found, "slurm_recovery_detections_total", category="gpu_hardware") == 2.0
    assert value(found, "slurm_recovery_node_xids_total", kind="xid", xid="79") == 1.0
    assert value(found, "slurm_recovery_node_xids_total", kind="xid", xid="13") == 1.0
    # the same report again (a spool replay) is stored once, and counted once
    client.post("/v1/hooks/health", content=json.dumps(
        report("health", job=None, xids=[XID79, xid13])).encode())
    assert value(samples(client), "slurm_recovery_detections_total",
                 category="gpu_hardware") == 2.0


def test_log_detections_and_xids_add_up_in_one_category(tmp_path):
    _, store, client = make(tmp_path)
    with store.lock:
        store.record_detection(None, None, Detection(rule="kernel.xid", category="gpu_hardware",
                                                     severity="error"))
        store.record_detection(None, None, Detection(rule="py.exc", category="application",
                                                     severity="error"))
    client.post("/v1/hooks/health",
                content=json.dumps(report("health", job=None, xids=[XID79])).encode())
    found = samples(client)
    assert value(found, "slurm_recovery_detections_total", category="gpu_hardware") == 2.0
    assert value(found, "slurm_recovery_detections_total", category="application") == 1.0


def test_recommendations_blocked_by_budget_counter(tmp_path):
    _, store, client = make(tmp_path)
    assert value(samples(client), "slurm_recovery_recommendations_blocked_by_budget_total") \
        == 0.0   # present from the start, so that Prometheus' increase() sees the first
    add_rec(store, scope="node", action="drain_node", status="blocked_by_budget")
    add_rec(store, scope="node", action="drain_node", status="done")
    found = samples(client)
    assert value(found, "slurm_recovery_recommendations_blocked_by_budget_total") == 1.0
    assert value(found, "slurm_recovery_recommendations", action="drain_node",
                 status="blocked_by_budget") == 1.0


def test_held_jobs_and_those_past_the_decision_timeout(tmp_path):
    cfg, store, client = make(tmp_path)
    now = time.time()
    add_rec(store, status="executing", held_at=now - 5)
    add_rec(store, status="executing", held_at=now - 120)        # past the 60 s timeout
    add_rec(store, status="done", held_at=None)                  # released: not held
    found = samples(client)
    assert value(found, "slurm_recovery_held_jobs") == 2.0
    assert value(found, "slurm_recovery_held_jobs_past_decision_timeout") == 1.0
    assert value(found, "slurm_recovery_decision_timeout_seconds") == 60.0


class FailingListing(Script):
    def __init__(self) -> None:
        super().__init__()
        self.fail = False

    def list_jobs(self, job_ids=None):
        if self.fail:
            raise SchedulerError(["squeue"], 1, "slurmctld not responding")
        return super().list_jobs(job_ids)


def test_watch_loop_health_and_store_errors(tmp_path, monkeypatch):
    cfg, store, client = make(tmp_path)
    listing = FailingListing()
    watcher = Watcher(cfg, store, listing, Scanner(load_rules(), engine="re"),
                      Tailer(MemoryCursorStore()))
    found = samples(client)
    assert value(found, "slurm_recovery_watch_failing") == 0.0
    assert value(found, "slurm_recovery_store_errors_total") == 0.0
    assert ("slurm_recovery_watch_last_success_timestamp_seconds", ()) not in found

    before = time.time()
    assert watcher.run_once() is True
    found = samples(client)
    assert value(found, "slurm_recovery_watch_last_success_timestamp_seconds") >= before

    listing.fail = True                      # Slurm fails: the loop, not the store
    assert watcher.run_once() is False
    found = samples(client)
    assert value(found, "slurm_recovery_watch_failing") == 1.0
    assert value(found, "slurm_recovery_watch_errors_total") == 1.0
    assert value(found, "slurm_recovery_store_errors_total") == 0.0

    listing.fail = False                     # the store fails
    def refuse(*args, **kw):
        raise sqlite3.OperationalError("attempt to write a readonly database")
    monkeypatch.setattr(store, "set_state", refuse)
    assert watcher.run_once() is False
    found = samples(client)
    assert value(found, "slurm_recovery_watch_errors_total") == 2.0
    assert value(found, "slurm_recovery_store_errors_total") == 1.0
    assert value(found, "slurm_recovery_store_failing") == 1.0

    monkeypatch.undo()
    assert watcher.run_once() is True
    assert value(samples(client), "slurm_recovery_watch_failing") == 0.0


def test_head_metrics_answers_as_get_when_the_store_fails(tmp_path, monkeypatch):
    _, store, client = make(tmp_path)
    answer = client.head("/metrics")
    assert answer.headers["content-type"].startswith("text/plain")

    def damaged(*args):
        raise sqlite3.DatabaseError("database disk image is malformed")
    monkeypatch.setattr(store, "figures", damaged)
    assert client.get("/metrics").status_code == 503
    answer = client.head("/metrics")
    assert answer.status_code == 503 and answer.content == b""


def test_the_goodput_ledgers_series(tmp_path, monkeypatch):
    """The XID recovery of tests/unit/test_ledger.py, half an hour ago: its lost
    GPU-seconds by category, its incident by outcome, what it saved by mode and
    ETTR per environment; an environment without jobs reads NaN, and every
    category is served from 0."""
    import math

    from tests.unit import test_ledger
    monkeypatch.setattr(test_ledger, "T", float(int(time.time())) - 1800)
    cfg, store, client = make(tmp_path)
    test_ledger._xid_recovery(store)       # env prod, 8 GPUs
    got = samples(client)
    assert got[(f"{NAMESPACE}_gpu_seconds_lost_total", (("category", "gpu_hardware"),))] \
        == 8 * 90
    assert got[(f"{NAMESPACE}_gpu_seconds_lost_total", (("category", "interconnect"),))] == 0
    assert got[(f"{NAMESPACE}_incidents_total", (("outcome", "recovered"),))] == 1
    assert got[(f"{NAMESPACE}_incidents_total", (("outcome", "unknown"),))] == 0
    assert got[(f"{NAMESPACE}_gpu_seconds_saved_total", (("mode", "action"),))] == 8 * 452
    assert got[(f"{NAMESPACE}_gpu_seconds_saved_total", (("mode", "monitor"),))] == 0
    allocated = 8 * (252 + 310 + 40)
    assert got[(f"{NAMESPACE}_ettr", (("env", "prod"),))] == pytest.approx(
        (allocated - 720) / allocated)
    assert math.isnan(got[(f"{NAMESPACE}_ettr", (("env", "dev"),))])
