"""The Console's pages render the store (the browser test is in integration/)."""
from __future__ import annotations

from fastapi.testclient import TestClient

from recovery_agent.interfaces.api import create_app
from recovery_agent.config import from_mapping
from recovery_agent.inputs.ingest import Ingest
from recovery_agent.scheduler.base import Job
from recovery_agent.store import Store


def make(tmp_path, **api):
    cfg = from_mapping({"agent": {"cluster": "c1"}, "api": {"auth": "none", **api}})
    store = Store(tmp_path / "r.db")
    job = Job(job_id="4410", numeric_id=4410, submit_time=1000, user="ana", name="llm<x>",
              state="FAILED", nodes=("node1", "node2"))
    with store.lock:
        pk = store.record_job(job, "c1", env="prod", mode="", spec="prod")
        store.record_attempt(pk, job)
        store.add_event(pk, "hook_prolog", "prolog report from node1", attempt=0, ts=1000.0)
        store.add_event(pk, "verdict", "node: gpu_hardware -> requeue_exclude (node2)",
                        attempt=0, ts=1003.0)
        rec = store.add_recommendation({
            "job": pk, "attempt": 0, "job_id": "4410", "scope": "job",
            "action": "requeue_exclude", "rule": "hardware", "reason": "xid 79 on node2",
            "target_nodes": ["node2"], "exclude": ["node2"], "mode": "action",
            "status": "proposed", "restart_at": 0, "env": "prod", "user": "ana"})
        store.add_recommendation({
            "job": pk, "attempt": 0, "job_id": "4410", "scope": "node", "parent": rec,
            "action": "drain_node", "rule": "hardware", "reason": "over budget",
            "target_nodes": ["node2"], "mode": "action", "status": "blocked_by_budget",
            "error": "drain budget spent", "user": "ana"})
    store.add_step(rec, "requeue_hold", "ok", "restart 0 -> 1")
    return store, TestClient(create_app(cfg, Ingest(store, "c1")))


def test_overview_lists_jobs_open_and_blocked_recommendations_and_nodes(tmp_path):
    _, client = make(tmp_path)
    page = client.get("/console")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    text = page.text
    assert "href='/console/job/4410'" in text and "llm&lt;x&gt;" in text   # escaped
    assert "blocked_by_budget" in text and "drain budget spent" in text
    assert "data-part='/console/part/jobs'" in text and "setInterval(refresh" in text


def test_job_page_draws_the_timeline_on_an_axis(tmp_path):
    _, client = make(tmp_path)
    text = client.get("/console/job/4410").text
    assert text.count("<circle class='ev") == 3             # hook, verdict, step
    assert "ev-step" in text and "ev-hooks" in text and "ev-decision" in text
    assert "requeue_hold ok" in text
    fragment = client.get("/console/part/job/4410/timeline").text
    assert fragment.startswith("<h2>Timeline</h2>") and "<html" not in fragment


def test_unknown_job_and_part_are_404(tmp_path):
    _, client = make(tmp_path)
    assert client.get("/console/job/999").status_code == 404
    assert client.get("/console/part/bogus").status_code == 404


def test_console_needs_the_token_when_one_is_set(tmp_path):
    token = tmp_path / "t"
    token.write_text("abc")
    _, client = make(tmp_path, read_token_file=str(token))
    assert client.get("/console").status_code == 401
    assert client.get("/console", headers={"Authorization": "Bearer abc"}).status_code == 200
