"""What the service says about jobs and nodes after a recovery (issue 17, truthful
state): a job's summary names the category that decided its recovery, and a node
reads the same everywhere, with a health an operator can act on.

The store is left as an XID recovery leaves it: attempt 0 ended with the job's
own ``srun: error ... Exited`` line (an ``application`` detection) and a fatal
XID 79 from node2's epilog report; attribution and the real decider record the
verdict, the requeue-exclude and the drain of node2; the actuator drained it;
attempt 1 then completed (a verdict that names no category)."""
from __future__ import annotations

import pytest

from recovery_agent.config import from_mapping
from recovery_agent.decide.decider import Decider
from recovery_agent.detect.attribution import attribute
from recovery_agent.detect.context import AttributionContext
from recovery_agent.detect.model import Detection, Evidence
from recovery_agent.interfaces.service import Caller, Service
from recovery_agent.scheduler.base import Job
from recovery_agent.store import Store
from slurm_hooks import spec as specs

NODES = ("node1", "node2")


def _job(restarts: int, state: str) -> Job:
    return Job(job_id="77", numeric_id=77, submit_time=1000 + restarts, user="ana",
               name="train", state=state, restart_count=restarts, nodes=NODES)


def _verdict_event(verdict, attempt: int, state: str) -> dict:
    """The verdict's timeline line, as the watch loop writes it."""
    return {"kind": "verdict", "message": f"{verdict.blame}: {verdict.category}",
            "attempt": attempt, "source": "attribution",
            "data": {"blame": verdict.blame, "category": verdict.category,
                     "action": verdict.action, "nodes": list(verdict.nodes), "state": state}}


def _judge(store, decider, pk, job, found, node_events=()) -> None:
    context = AttributionContext(nodes=NODES, node_events=tuple(node_events))
    verdict = attribute(found, context)
    decider.decide_attempt(pk, job.restart_count, specs.parse("act"), verdict,
                           trigger="ended", job=job, nodes=NODES,
                           detections=[*found, *node_events],
                           verdict_event=_verdict_event(verdict, job.restart_count,
                                                        job.state))


@pytest.fixture
def recovered(tmp_path):
    """(service, store, job row id) after an XID 79 recovery of job 77."""
    cfg = from_mapping({"agent": {"cluster": "c1"},
                        "environments": {"act": {"mode": "action"}}})
    store = Store(tmp_path / "r.db")
    decider = Decider(cfg, store)
    first = _job(0, "FAILED")
    with store.lock:
        pk = store.record_job(first, "c1", env="act", spec="act")
        store.record_attempt(pk, first)
    exited = Detection(rule="slurm.task_exit", category="application", severity="warning",
                       action_hint="requeue", role="exit", host="node2", origin="job",
                       evidence=(Evidence("srun: error: node2: task 1: Exited with exit "
                                          "code 1", "train-77.out", 40),))
    xid = Detection(rule="node.xid", category="gpu_hardware", severity="critical",
                    host="node2", xid=79, gpu="0", origin="system", emitter="system",
                    evidence=(Evidence("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off "
                                       "the bus", "hook:node2"),))
    store.record_detection(pk, 0, exited)
    _judge(store, decider, pk, first, [exited], [xid])
    (drain,) = [r for r in store.recommendations(job_pk=pk) if r.scope == "node"]
    store.set_node("node2", drained_by_us=1, drain_reason=f"recovery: {drain.id} x",
                   drained_at=1.0, drain_rec=drain.id)
    second = _job(1, "COMPLETED")
    with store.lock:
        store.record_job(second, "c1", env="act", spec="act")
        store.record_attempt(pk, second)
    _judge(store, decider, pk, second, [])
    yield Service(cfg, store), store, pk
    store.close()


def test_the_store_reads_as_an_xid_recovery_leaves_it(recovered):
    _, store, pk = recovered
    (rec,) = [r for r in store.recommendations(job_pk=pk) if r.scope == "job"]
    assert rec.action == "requeue_exclude" and rec.attribution["category"] == "gpu_hardware"
    verdicts = [e["data"]["category"] for e in store.timeline(pk) if e["kind"] == "verdict"]
    assert verdicts == ["gpu_hardware", None]   # the completed attempt names none
    # what the issue saw: the last verdict names nothing, so the summary's
    # last_detection falls back to the job's own exit line
    assert Service.jobs(recovered[0])[0]["last_detection"] == "application"


def test_a_job_summary_names_the_category_that_decided_its_recovery(recovered):
    service, _, _ = recovered
    (row,) = service.jobs()
    assert row["category"] == "gpu_hardware"        # main: no such field
    assert row["last_recommendation"].startswith("requeue_exclude")
    assert service.job("77")["job"]["category"] == "gpu_hardware"


def test_without_a_recommendation_the_category_is_the_last_detections(recovered):
    service, store, _ = recovered
    job = Job(job_id="78", numeric_id=78, submit_time=5, user="ana", state="RUNNING")
    pk = store.record_job(job, "c1", env="act")
    assert service.jobs()[0]["category"] is None
    det = Detection(rule="nccl.timeout", category="interconnect")
    store.record_detection(pk, 0, det)
    assert service.jobs()[0]["category"] == "interconnect"


def test_a_node_reads_the_same_in_the_list_and_alone(recovered):
    service, _, _ = recovered
    listed = {n["name"]: n for n in service.nodes()}
    alone = service.node("node2")
    assert listed["node2"] == alone
    assert alone["cluster"] == "c1"
    assert alone["drained_by_us"] is True and alone["excluded_by_operator"] is False
    assert isinstance(alone["strikes"], list) and alone["strike_count"] == len(
        alone["strikes"]) >= 1
    assert isinstance(alone["suspect_score"], float)
    assert set(listed["node2"]) == set(service.node_view("nodeX", None, [], 0.0))


def test_a_node_we_drained_for_an_xid_says_so(recovered):
    service, _, _ = recovered
    node = service.node("node2")
    assert (node["health"], node["health_detail"]) == ("drained",
                                                       "drained by recovery (xid 79)")


def test_suspect_excluded_and_ok(recovered, monkeypatch):
    service, store, _ = recovered
    monkeypatch.setattr(service, "slurm_node_names", lambda: {"node7"})
    store.add_strike("node5", "gpu_hardware", 1.0, ts=service.clock())
    node = service.node("node5")
    assert (node["health"], node["health_detail"]) == ("suspect", "suspect (score 1)")
    store.add_strike("node6", "hang_suspect", 0.25, ts=service.clock())
    assert service.node("node6")["health_detail"] == "ok"      # under a quarter of 3.0
    admin = Caller(0, "root", True)
    service.exclude(admin, "node7", "flaky IB")
    node = service.node("node7")
    assert (node["health"], node["health_detail"]) == ("excluded",
                                                       "excluded by operator (flaky IB)")
    service.include(admin, "node7")
    assert service.node("node7")["health"] == "ok"


def test_a_user_sees_no_other_users_jobs_in_the_node_list(recovered):
    service, _, _ = recovered
    other = Caller(1234, "bob", False)
    strikes = {n["name"]: n for n in service.nodes(other)}["node2"]["strikes"]
    assert strikes and all(s["job"] is None and s["user"] is None for s in strikes)
    mine = {n["name"]: n for n in service.nodes(Caller(1, "ana", False))}["node2"]["strikes"]
    assert all(s["user"] == "ana" for s in mine)


def test_a_strike_names_the_slurm_job_blanked_for_other_users(recovered):
    service, store, _ = recovered
    pk = store.jobs()[0]["id"]
    job_id = store.job(pk)["job_id"]
    store.add_strike("node8", "gpu_hardware", 1.0, pk, "ana", ts=service.clock())
    (strike,) = service.node("node8")["strikes"]
    assert strike["job_id"] == job_id and strike["job"] == pk
    (hidden,) = service.node("node8", Caller(1234, "zed", False))["strikes"]
    assert hidden["job_id"] is None and hidden["job"] is None and hidden["user"] is None
