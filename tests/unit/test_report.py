"""Monitor-mode scoring against what humans did."""
from __future__ import annotations

import time

from recovery_agent.interfaces.report import build
from recovery_agent.scheduler.base import Job, Node
from recovery_agent.store import Store


def job(store, job_id: str, state: str, attempts: int) -> int:
    pk = None
    for n in range(attempts):
        j = Job(job_id=job_id, numeric_id=int(job_id), submit_time=1000 + n, restart_count=n,
                user="ana", name="t", state=state)
        with store.lock:
            pk = store.record_job(j, "c1", env="prod", mode="", spec="prod")
            store.record_attempt(pk, j)
    return pk


def would(store, pk, job_id, action, exclude=(), scope="job", created=None):
    with store.lock:
        rid = store.add_recommendation({
            "job": pk, "attempt": 0, "job_id": job_id, "scope": scope, "action": action,
            "rule": "x", "reason": "r", "target_nodes": list(exclude),
            "exclude": list(exclude) if scope == "job" else [], "mode": "monitor",
            "status": "would_have"})
        if created:
            store.update_rec(rid, created=created)
    return rid


def test_agreement_and_node_precision_recall(tmp_path):
    store = Store(tmp_path / "r.db")
    now = time.time()
    a = job(store, "1", "RUNNING", 2)     # a human requeued attempt 0
    b = job(store, "2", "FAILED", 1)      # left ended
    c = job(store, "3", "FAILED", 1)
    d = job(store, "4", "FAILED", 1)
    would(store, a, "1", "requeue_exclude", ["node2"])     # agree (both requeue)
    would(store, a, "1", "drain_node", ["node2"], scope="node")
    would(store, b, "2", "stop")                           # agree (nobody requeued)
    would(store, c, "3", "requeue_exclude", ["node5"])     # differ: humans left it
    would(store, d, "4", "requeue", created=now - 10 * 86400)   # outside the window
    nodes = [Node("node2", "IDLE", frozenset({"DRAIN"}), reason="bad gpu 3",
                  reason_user="ops", reason_time=int(now - 60)),
             Node("node7", "IDLE", frozenset({"DRAIN"}), reason="ib flaps",
                  reason_user="ops", reason_time=int(now - 60)),
             Node("node9", "IDLE", frozenset({"DRAIN"}), reason="recovery: 4 gpu_hardware",
                  reason_time=int(now - 60)),
             Node("node8", "IDLE", frozenset({"DRAIN"}), reason="old",
                  reason_time=int(now - 30 * 86400))]
    # node9's drain is ours: the store recorded it as Slurm showed it after our call
    store.set_node("node9", drained_by_us=1, drain_reason="recovery: 4 gpu_hardware",
                   drain_slurm_reason="recovery: 4 gpu_hardware",
                   drain_slurm_time=int(now - 60))
    report = build(store, nodes, now - 86400, now + 1)
    assert (report.compared, report.agreed) == (3, 2)
    assert [d["job"] for d in report.differ] == ["3"]
    assert report.differ[0]["humans"] == "left FAILED"
    assert report.our_nodes == {"node2", "node5"}
    assert set(report.human_nodes) == {"node2", "node7"}   # not ours, not outside the window
    # the same wording with no drain of ours on record is a human's
    store.set_node("node9", drained_by_us=0)
    assert "node9" in build(store, nodes, now - 86400, now + 1).human_nodes
    assert report.precision == 0.5 and report.recall == 0.5
    assert report.as_dict()["agreement"] == 2 / 3
