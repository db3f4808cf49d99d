"""The store's named queries (store/jobs.py, recs.py, nodes.py, counts.py) and
its transaction context, each on a temp store file: every SQL statement the
agent runs is one of these or another Store method (issue 16)."""
from __future__ import annotations

import sqlite3
import threading

import pytest
from sqlite_utils.db import NotFoundError

from recovery_agent.errors import StoreError
from recovery_agent.scheduler.base import FINISHED_STATES, Job
from recovery_agent.store import STORE_ERRORS, DatabaseError, Error, Recommendation, Store


def job(job_id="100", **kw) -> Job:
    base = dict(job_id=job_id, numeric_id=int(job_id.split("_")[0]), name="train",
                state="RUNNING", submit_time=1_800_000_000, nodes=("n1",), user="alice")
    base.update(kw)
    return Job(**base)


@pytest.fixture
def store(tmp_path):
    with Store(tmp_path / "recovery.db") as s:
        yield s


def rec(store: Store, **kw) -> int:
    values = {"action": "requeue", "status": "proposed", "mode": "action", "scope": "job"}
    return store.add_recommendation({**values, **kw})


# -- the transaction and the error types ------------------------------------------
def test_the_store_exports_sqlites_errors():
    assert Error is sqlite3.Error and DatabaseError is sqlite3.DatabaseError
    assert STORE_ERRORS == (StoreError, sqlite3.Error)


def test_a_transaction_keeps_all_or_nothing(store):
    pk = store.record_job(job(), "c1")
    with pytest.raises(RuntimeError):
        with store.transaction():
            store.add_event(pk, "one", "first")
            store.set_job_state(pk, "FAILED")
            raise RuntimeError("half way")
    assert [e["kind"] for e in store.timeline(pk)] == []
    assert store.job(pk)["state"] == "RUNNING"
    with store.transaction() as same:
        assert same is store
        store.add_event(pk, "one", "first")
        with store.transaction():   # nested: a savepoint inside the same transaction
            store.set_job_state(pk, "FAILED")
    assert [e["kind"] for e in store.timeline(pk)] == ["one"]
    assert store.job(pk)["state"] == "FAILED"


def test_a_transaction_holds_the_store_lock(store):
    taken = []
    with store.transaction():
        other = threading.Thread(target=lambda: taken.append(store.lock.acquire(timeout=0.05)))
        other.start()
        other.join()
    assert taken == [False]


# -- jobs ---------------------------------------------------------------------------
def test_touch_seen_sets_last_seen_of_many_jobs(store):
    a, b, c = (store.record_job(job(str(n)), "c1") for n in (1, 2, 3))
    store.touch_seen({a: 10.0, b: 20.0})
    assert [store.job(pk)["last_seen"] for pk in (a, b)] == [10.0, 20.0]
    assert store.job(c)["last_seen"] > 1e9   # untouched: when it was recorded
    store.touch_seen({})


def test_set_job_state(store):
    pk = store.record_job(job(), "c1")
    store.set_job_state(pk, "GONE")
    assert store.job(pk)["state"] == "GONE"


def test_jobs_without_submit_time_and_set_submit_time(store):
    early = store.record_job(job("7", submit_time=None), "c1")
    store.record_job(job("8", submit_time=None), "c2")
    store.record_job(job("9"), "c1")
    assert [r["id"] for r in store.jobs_without_submit_time("c1")] == [early]
    store.set_submit_time(early, 1_800_000_500)
    assert store.jobs_without_submit_time("c1") == []
    assert store.find_job_exact("c1", "7", 1_800_000_500)["id"] == early


def test_find_jobs_filters_newest_first(store):
    pks = [store.record_job(job(str(n), user=user, state=state), "c1", env=env)
           for n, user, state, env in [(1, "alice", "RUNNING", "prod"),
                                       (2, "bob", "RUNNING", "dev"),
                                       (3, "alice", "FAILED", "dev"),
                                       (4, "alice", "RUNNING", "dev")]]
    store.record_job(job("5"), "c2")
    assert [r["id"] for r in store.find_jobs("c1")] == pks[::-1]
    assert [r["id"] for r in store.find_jobs("c1", user="alice")] == [pks[3], pks[2], pks[0]]
    assert [r["id"] for r in store.find_jobs("c1", state="RUNNING", env="dev")] == \
        [pks[3], pks[1]]
    assert [r["id"] for r in store.find_jobs("c1", user="alice", limit=1)] == [pks[3]]
    assert store.find_jobs("c1", user="carol") == []


def test_array_tasks_by_task_id(store):
    for task in (3, 1, 2):
        store.record_job(job(f"50_{task}", array_job_id=50, array_task_id=task), "c1")
    store.record_job(job("60_1", array_job_id=60, array_task_id=1), "c1")
    store.record_job(job("50_9", array_job_id=50, array_task_id=9), "c2")
    assert [r["job_id"] for r in store.array_tasks("c1", 50)] == ["50_1", "50_2", "50_3"]
    assert store.array_tasks("c1", 70) == []


def test_last_category_prefers_the_latest_verdict(store):
    pk = store.record_job(job(), "c1")
    assert store.last_category(pk) is None

    class Det:
        rule, severity, host, gpu, rank, evidence = "r", "error", "n1", None, None, ()
        detail = action_hint = pci = xid = None

    for category in ("nccl", "oom"):
        det = Det()
        det.category = category
        store.record_detection(pk, 0, det, ts=1.0)
    assert store.last_category(pk) == "oom"   # the latest detection, no verdict yet
    store.add_event(pk, "verdict", "v1", attempt=0, data={"category": "gpu_hardware"})
    store.add_event(pk, "verdict", "v2", attempt=0, data={"category": "interconnect"})
    assert store.last_category(pk) == "interconnect"
    store.add_event(pk, "verdict", "v3", attempt=0, data={"blame": "unknown"})
    assert store.last_category(pk) == "oom"   # a verdict without one falls back


# -- recommendations ----------------------------------------------------------------
def test_holding_recs(store):
    held = [rec(store, held_at=5.0, status=s, created=100.0)
            for s in ("proposed", "executing", "failed", "expired")]
    rec(store, held_at=5.0, status="done", created=100.0)
    rec(store, held_at=None, created=100.0)
    rec(store, held_at=5.0, created=10.0)                    # older than the window
    rec(store, held_at=5.0, created=100.0, scope="node", action="drain_node")
    rows = store.holding_recs(since=50.0)
    assert [r.id for r in rows] == held
    assert isinstance(rows[0], Recommendation) and rows[0].target_nodes == ()   # decoded


def test_drains_since_counts_the_budgeted_statuses(store):
    for status in ("proposed", "executing", "done", "would_have", "failed",
                   "blocked_by_budget"):
        rec(store, action="drain_node", scope="node", status=status, created=100.0)
    rec(store, action="drain_node", scope="node", created=10.0)
    rec(store, action="requeue", created=100.0)
    assert store.drains_since(50.0) == 4
    assert store.drains_since(0.0) == 5


def test_has_rec(store):
    pk = rec(store)
    assert store.has_rec(pk) and not store.has_rec(pk + 1)


def test_expired_claims(store):
    gone = rec(store, mode="external", status="executing", claim_expires=10.0)
    rec(store, mode="external", status="executing", claim_expires=30.0)
    rec(store, mode="external", status="proposed", claim_expires=10.0)
    rec(store, mode="action", status="executing", claim_expires=10.0)
    assert [r.id for r in store.expired_claims(20.0)] == [gone]


def test_mark_running_again_once(store):
    pk = store.record_job(job(), "c1")
    first = rec(store, job=pk, attempt=0)
    other = rec(store, job=pk, attempt=1)
    node = rec(store, job=pk, attempt=0, scope="node", action="drain_node")
    store.mark_running_again(pk, 0, 50.0)
    store.mark_running_again(pk, 0, 60.0)   # noted already: stays
    assert store.rec(first).running_again_at == 50.0
    assert store.rec(other).running_again_at is None
    assert store.rec(node).running_again_at is None


# -- nodes and the hooks' reports ---------------------------------------------------
def test_node_lists(store):
    store.set_node("n3", drained_by_us=1)
    store.set_node("n1", excluded_by_operator=1)
    store.set_node("n2")
    store.set_node("n4", drained_by_us=1, excluded_by_operator=1)
    assert [r["name"] for r in store.nodes()] == ["n1", "n2", "n3", "n4"]
    assert sorted(r["name"] for r in store.drained_nodes()) == ["n3", "n4"]
    assert sorted(r["name"] for r in store.held_back_nodes()) == ["n1", "n3", "n4"]


def report(node="n1", received=100.0, **kw) -> dict:
    return {"report_id": f"r-{node}-{received}", "hook": "epilog", "node": node,
            "received": received, "created": received, "gpu_ok": 1, **kw}


def xid(report_pk, job_pk=None, attempt=None, raw="NVRM: Xid 79", **kw) -> dict:
    return {"report": report_pk, "job": job_pk, "attempt": attempt, "node": "n1",
            "kind": "xid", "xid": 79, "raw": raw, "fingerprint": raw, **kw}


def test_reports_by_id_and_row_id(store):
    assert store.report_by_id("r-n1-100.0") is None
    pk = store.add_report(report())
    assert store.report_by_id("r-n1-100.0")["id"] == pk
    assert store.node_report(pk)["node"] == "n1"
    with pytest.raises(NotFoundError):
        store.node_report(pk + 1)
    with pytest.raises(sqlite3.IntegrityError):   # the hook's id is unique
        store.add_report(report())


def test_reports_since_oldest_first(store):
    late = store.add_report(report(received=300.0))
    early = store.add_report(report(received=200.0))
    store.add_report(report(received=100.0))
    store.add_report(report(node="n2", received=300.0))
    assert [r["id"] for r in store.reports_since("n1", 200.0)] == [early, late]


def test_xids_of_a_report_a_job_and_an_attempt(store):
    pk = store.record_job(job(), "c1")
    one = store.add_report(report())
    two = store.add_report(report(received=200.0))
    store.add_xid(xid(one, pk, 0, raw="a"))
    store.add_xid(xid(one, pk, 0, raw="a"))            # the same XID again: ignored
    store.add_xid(xid(one, pk, 1, raw="b"))
    store.add_xid(xid(two, None, None, raw="c"))
    assert store.report_xid_count(one) == 2 and store.report_xid_count(two) == 1
    assert [x["raw"] for x in store.job_xids(pk)] == ["a", "b"]
    assert [x["raw"] for x in store.attempt_xids(pk, 0)] == ["a"]
    assert store.attempt_xids(pk, 2) == []


# -- the metrics' figures -----------------------------------------------------------
def test_figures(store):
    pk = store.record_job(job(), "c1")
    store.record_job(job("2", state="COMPLETED"), "c1")
    gone = store.record_job(job("3"), "c1")
    store.set_job_state(gone, "GONE")
    rec(store, job=pk, attempt=0, detected_at=10.0, failure_at=7.0, done_at=12.0,
        status="done")
    rec(store, scope="node", action="drain_node", detected_at=10.0)
    store.set_node("n1", drained_by_us=1)
    store.set_node("n2", excluded_by_operator=1)
    rec(store, scope="node", action="drain_node", status="blocked_by_budget")
    late = store.add_report(report(received=100.0, created=90.0))   # replayed: 10 s late
    store.add_report(report(received=200.0, hook="prolog"))
    store.add_xid(xid(late, pk, 0, raw="a"))
    store.add_xid(xid(late, pk, 0, raw="b"))
    store.add_xid(xid(late, None, None, raw="c", kind="sxid", xid=12028))
    got = store.figures(FINISHED_STATES)
    assert got["detections"] == []
    assert sorted(got["recs"]) == [("drain_node", "blocked_by_budget", 1),
                                   ("drain_node", "proposed", 1), ("requeue", "done", 1)]
    assert got["latencies"] == [(3.0, 2.0)]
    assert sorted(got["xids"]) == [("sxid", 12028, 1), ("xid", 79, 2)]
    assert got["blocked"] == 1
    assert (got["tracked"], got["drained"], got["excluded"], got["replays"]) == (1, 1, 1, 1)
    assert sorted(got["reports"]) == [("epilog", 1), ("prolog", 1)]


def test_find_jobs_before_pages_by_row_id(store):
    pks = [store.record_job(job(str(n)), "c1") for n in range(1, 6)]
    assert [r["id"] for r in store.find_jobs("c1", limit=2)] == [pks[4], pks[3]]
    assert [r["id"] for r in store.find_jobs("c1", limit=2, before=pks[3])] == \
        [pks[2], pks[1]]
    assert [r["id"] for r in store.find_jobs("c1", before=pks[1])] == [pks[0]]
    assert store.find_jobs("c1", before=pks[0]) == []


def test_last_detection_category_ignores_verdicts(store):
    pk = store.record_job(job(), "c1")
    assert store.last_detection_category(pk) is None

    class Det:
        rule, severity, host, gpu, rank, evidence = "r", "error", "n1", None, None, ()
        detail = action_hint = pci = xid = None

    for category in ("gpu_hardware", "application"):
        det = Det()
        det.category = category
        store.record_detection(pk, 0, det, ts=1.0)
    store.add_event(pk, "verdict", "v", attempt=0, data={"category": "gpu_hardware"})
    assert store.last_detection_category(pk) == "application"


def test_last_exclusion_is_the_latest_for_that_node(store):
    assert store.last_exclusion("n1") is None
    store.add_event(None, "api_exclude", "m", data={"node": "n1", "reason": "old"})
    store.add_event(None, "api_exclude", "m", data={"node": "n2", "reason": "other"})
    store.add_event(None, "api_exclude", "m", data={"node": "n1", "reason": "flaky IB"})
    store.add_event(None, "api_include", "m", data={"node": "n1"})
    assert store.last_exclusion("n1")["reason"] == "flaky IB"
    assert store.last_exclusion("n2")["reason"] == "other"


# -- what the Console asks: paging, searching, a node's page (issue 17) -------------
class Det:
    """The fields record_detection reads off a Detection."""
    severity, gpu, rank, detail, action_hint, pci, xid = "error", None, None, None, None, None, None

    def __init__(self, rule="slurm.task_exit", category="application", host=None, text=""):
        from recovery_agent.detect.model import Evidence
        self.rule, self.category, self.host = rule, category, host
        self.evidence = (Evidence(text=text, source="/out/slurm.out", line=7),) if text else ()


def test_find_jobs_before_pages_by_row_id_newest_first(store):
    pks = [store.record_job(job(str(n)), "c1") for n in range(1, 8)]
    assert [r["id"] for r in store.find_jobs("c1", limit=3)] == pks[:3:-1]
    assert [r["id"] for r in store.find_jobs("c1", limit=3, before=pks[4])] == \
        [pks[3], pks[2], pks[1]]
    assert [r["id"] for r in store.find_jobs("c1", before=pks[0])] == []
    # with the other filters
    assert [r["id"] for r in store.find_jobs("c1", user="alice", before=pks[1])] == [pks[0]]


def test_search_jobs_filters_by_node_category_text_and_pages(store):
    ana = store.record_job(job("11", user="ana", name="llm-70b", state="FAILED"), "c1",
                           env="prod")
    store.record_attempt(ana, job("11", nodes=("n1", "n2")))
    store.record_attempt(ana, job("11", nodes=("n3", "n4"), restart_count=1))
    bob = store.record_job(job("12", user="bob", name="vision"), "c1", env="dev")
    store.record_attempt(bob, job("12", nodes=("n2",)))
    store.record_detection(bob, 0, Det(category="nccl"))
    cat = store.record_job(job("13", user="cat", name="LLM-tiny"), "c1", env="dev")
    store.record_detection(cat, 0, Det(category="nccl"))
    rec(store, job=cat, attempt=0, reason_category="gpu_hardware")    # decides the category
    store.record_job(job("14", user="ana"), "c2")                     # another cluster

    def ids(**kw):
        return [r["job_id"] for r in store.search_jobs("c1", **kw)]

    assert ids() == ["13", "12", "11"]
    assert ids(node="n4") == ["11"] and ids(node="n2") == ["12", "11"] and ids(node="n") == []
    assert ids(category="nccl") == ["12"] and ids(category="gpu_hardware") == ["13"]
    assert [r["category"] for r in store.search_jobs("c1")] == ["gpu_hardware", "nccl", None]
    assert ids(text="llm") == ["13", "11"] and ids(text="BOB") == ["12"]
    assert ids(text="1") == ["13", "12", "11"]               # the job id matches too
    assert ids(text="%") == [] and ids(text="_") == []       # no LIKE wildcards
    assert ids(state="FAILED", env="prod", user="ana") == ["11"]
    assert ids(user="ana", env="dev") == []
    assert ids(limit=2) == ["13", "12"] and ids(limit=2, before=bob) == ["11"]
    assert store.job_facets("c1") == {"state": ["FAILED", "RUNNING"], "env": ["dev", "prod"],
                                      "user": ["ana", "bob", "cat"],
                                      "category": ["gpu_hardware", "nccl"]}
    assert store.job_facets("c1", user="bob") == {"state": ["RUNNING"], "env": ["dev"],
                                                  "user": ["bob"], "category": ["nccl"]}
    assert store.job_facets("c1", user="zed") == {"state": [], "env": [], "user": [],
                                                  "category": []}


def test_a_detected_event_names_its_own_detection(store):
    pk = store.record_job(job(), "c1")
    first = store.record_detection(pk, 0, Det(text="task 0 exited with 1"))
    second = store.record_detection(pk, 0, Det(text="task 3 exited with 9"))
    store.add_event(pk, "detected", "slurm.task_exit (application)", attempt=0,
                    detection=second)
    store.add_event(pk, "registered", "seen", attempt=0)
    events = list(store.timeline(pk))
    assert [e["detection"] for e in events] == [second, None]
    assert {d["id"]: d["evidence"]["lines"][0]["text"] for d in store.detections(pk)} == \
        {first: "task 0 exited with 1", second: "task 3 exited with 9"}


def test_record_attempt_keeps_the_output_paths_a_hook_does_not_know(store):
    pk = store.record_job(job(), "c1")
    store.record_attempt(pk, job(stdout="/home/a/slurm-100.out", stderr="/home/a/err"))
    store.record_attempt(pk, job(state="FAILED"))          # a hook's report: no paths
    (attempt,) = store.attempts(pk)
    assert (attempt["stdout"], attempt["stderr"], attempt["state"]) == \
        ("/home/a/slurm-100.out", "/home/a/err", "FAILED")


def test_a_nodes_xids_drains_operator_actions_and_jobs(store):
    ana = store.record_job(job("21", user="ana"), "c1")
    store.record_attempt(ana, job("21", nodes=("n1", "n2")))
    store.record_attempt(ana, job("21", nodes=("n3",), restart_count=1))
    bob = store.record_job(job("22", user="bob"), "c1")
    store.record_attempt(bob, job("22", nodes=("n1",)))
    one = store.add_report(report(received=100.0))
    store.add_xid(xid(one, ana, 0, raw="a"))
    store.add_xid(xid(one, None, None, raw="b", node="n2"))
    two = store.add_report(report(received=200.0))
    store.add_xid(xid(two, bob, 0, raw="c"))
    got = store.node_xids("n1")
    assert [(x["raw"], x["job_id"], x["user"], x["hook"], x["received"]) for x in got] == \
        [("c", "22", "bob", "epilog", 200.0), ("a", "21", "ana", "epilog", 100.0)]
    drain = rec(store, scope="node", action="drain_node", target_nodes=["n1"], job=ana)
    rec(store, scope="node", action="drain_node", target_nodes=["n2"])
    rec(store, scope="job", action="requeue_exclude", target_nodes=["n1"])
    resume = rec(store, scope="node", action="resume_node", target_nodes=["n1"])
    assert [r.id for r in store.node_drains("n1")] == [resume, drain]
    store.add_event(None, "api_exclude", "node n1 excluded", source="api",
                    data={"node": "n1", "user": "root", "uid": 0, "reason": "flaky IB"})
    store.add_event(None, "api_exclude", "node n10 excluded", source="api",
                    data={"node": "n10", "user": "root", "uid": 0, "reason": "x"})
    store.add_event(None, "api_include", "node n1 included", source="api",
                    data={"node": "n1", "user": "root", "uid": 0})
    assert [(e["kind"], e["data"].get("reason")) for e in store.node_operator_events("n1")] \
        == [("api_include", None), ("api_exclude", "flaky IB")]
    assert [(r["job_id"], r["attempt"], r["user"]) for r in store.node_jobs("c1", "n1")] == \
        [("22", 0, "bob"), ("21", 0, "ana")]
    assert [r["job_id"] for r in store.node_jobs("c1", "n3")] == ["21"]
    assert store.node_jobs("c2", "n1") == [] and store.node_xids("n9") == []
