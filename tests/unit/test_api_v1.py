"""The read, Advisor and operator API on a temp store (auth "none": the caller's
uid comes from X-Recovery-Uid; munge itself is tested live in test_munge_auth)."""
from __future__ import annotations

import json
import pwd
import time

import pytest
from fastapi.testclient import TestClient

from recovery_agent.interfaces.api import create_app
from recovery_agent.config import from_mapping
from recovery_agent.decide.decider import Decider
from recovery_agent.inputs.ingest import Ingest
from recovery_agent.scheduler.base import Job, Node
from recovery_agent.store import Store
from slurm_hooks import spec as specs

ADMIN, OWNER, OTHER = 0, 65534, 1           # root, nobody, daemon
OWNER_NAME = pwd.getpwuid(OWNER).pw_name


def make(tmp_path, **api):
    cfg = from_mapping({"agent": {"cluster": "c1"},
                        "api": {"auth": "none", "admin_uids": "0", **api},
                        "environments": {"ext": {"mode": "external"},
                                         "act": {"mode": "action"}}})
    store = Store(tmp_path / "r.db")
    client = TestClient(create_app(cfg, Ingest(store, "c1")))
    return cfg, store, client


def add_job(store, job_id="42", user=OWNER_NAME, restarts=0, env="ext") -> int:
    job = Job(job_id=job_id, numeric_id=int(job_id.split("_")[0]), submit_time=1000,
              restart_count=restarts, user=user, name="train", state="FAILED")
    with store.lock:
        pk = store.record_job(job, "c1", env=env, mode="", spec=env)
        store.record_attempt(pk, job)
    return pk


def add_rec(store, job_pk, job_id="42", mode="external", status="proposed", user=OWNER_NAME,
            attempt=0) -> int:
    with store.lock:
        return store.add_recommendation({
            "job": job_pk, "attempt": attempt, "job_id": job_id, "scope": "job",
            "action": "requeue_exclude", "rule": "hardware", "reason": "xid 79 on node2",
            "target_nodes": ["node2"], "exclude": ["node2"], "mode": mode, "status": status,
            "restart_at": attempt, "submit_time": 1000, "env": "ext", "user": user})


def post(client, path, uid, body=None):
    return client.post(path, content=json.dumps(body or {}),
                       headers={"X-Recovery-Uid": str(uid)})


def test_jobs_job_and_timeline(tmp_path):
    _, store, client = make(tmp_path)
    pk = add_job(store)
    rec = add_rec(store, pk)
    store.add_step(rec, "claimed", "ok", "x")
    jobs = client.get("/v1/jobs").json()["jobs"]
    assert [j["job_id"] for j in jobs] == ["42"]
    assert client.get("/v1/jobs", params={"user": "someone"}).json()["jobs"] == []
    one = client.get("/v1/jobs/42").json()
    assert one["job"]["user"] == OWNER_NAME and one["recommendations"][0]["id"] == rec
    events = client.get("/v1/jobs/42/timeline").json()["events"]
    assert any(e["kind"] == "step" and "claimed" in e["message"] for e in events)
    assert client.get("/v1/jobs/999").status_code == 404
    assert client.get("/v1/jobs/999/timeline").status_code == 404


def test_advisor_lifecycle_ack_then_complete(tmp_path):
    _, store, client = make(tmp_path)
    rec = add_rec(store, add_job(store))
    listed = client.get("/v1/recommendations",
                        params={"status": "proposed", "mode": "external"}).json()
    assert [r["id"] for r in listed["recommendations"]] == [rec]
    # the site controller runs as an admin
    acked = post(client, f"/v1/recommendations/{rec}/ack", ADMIN)
    assert acked.status_code == 200 and acked.json()["status"] == "executing"
    again = post(client, f"/v1/recommendations/{rec}/ack", ADMIN)
    assert again.status_code == 409 and "claimed by" in again.json()["detail"]
    bad = post(client, f"/v1/recommendations/{rec}/complete", ADMIN, {"outcome": "maybe"})
    assert bad.status_code == 400
    done = post(client, f"/v1/recommendations/{rec}/complete", ADMIN,
                {"outcome": "done", "detail": "requeued by the site controller"})
    assert done.status_code == 200 and store.rec(rec).status == "done"
    assert [s["step"] for s in store.steps(rec)] == ["claimed", "completed"]
    audit = [e for e in store.timeline(1) if e["kind"].startswith("api_")]
    assert [e["kind"] for e in audit] == ["api_ack", "api_complete"]
    assert all(e["data"]["uid"] == ADMIN for e in audit)


def test_users_act_only_on_their_own_jobs(tmp_path):
    _, store, client = make(tmp_path)
    rec = add_rec(store, add_job(store))
    refused = post(client, f"/v1/recommendations/{rec}/ack", OTHER)
    assert refused.status_code == 403 and "own jobs" in refused.json()["detail"]
    assert post(client, f"/v1/recommendations/{rec}/cancel", OTHER).status_code == 403
    assert post(client, f"/v1/recommendations/{rec}/ack", ADMIN).status_code == 200
    # claimed by root: the owner may not complete someone else's claim
    assert post(client, f"/v1/recommendations/{rec}/complete", OWNER,
                {"outcome": "done"}).status_code == 403


def test_stale_recommendation_ack_is_409_and_expires(tmp_path):
    _, store, client = make(tmp_path)
    pk = add_job(store)
    rec = add_rec(store, pk)
    add_job(store, restarts=1)              # the job restarted meanwhile
    answer = post(client, f"/v1/recommendations/{rec}/ack", ADMIN)
    assert answer.status_code == 409 and "stale" in answer.json()["detail"]
    assert store.rec(rec).status == "expired"


def test_only_external_recommendations_are_claimed(tmp_path):
    _, store, client = make(tmp_path)
    rec = add_rec(store, add_job(store), mode="action")
    assert post(client, f"/v1/recommendations/{rec}/ack", ADMIN).status_code == 409
    assert post(client, "/v1/recommendations/999/ack", ADMIN).status_code == 404


def test_expired_claims_are_offered_again(tmp_path):
    _, store, client = make(tmp_path, claim_ttl="1s")
    rec = add_rec(store, add_job(store))
    assert post(client, f"/v1/recommendations/{rec}/ack", ADMIN).status_code == 200
    with store.lock:
        store.update_rec(rec, claim_expires=time.time() - 1)
    listed = client.get("/v1/recommendations", params={"status": "proposed"}).json()
    assert [r["id"] for r in listed["recommendations"]] == [rec]
    assert store.steps(rec)[-1]["step"] == "claim_expired"


def test_cancel_before_anything_ran(tmp_path):
    _, store, client = make(tmp_path)
    rec = add_rec(store, add_job(store))
    answer = post(client, f"/v1/recommendations/{rec}/cancel", OWNER, {"reason": "mine"})
    assert answer.status_code == 200 and store.rec(rec).status == "cancelled"
    assert post(client, f"/v1/recommendations/{rec}/cancel", OWNER).status_code == 409


def test_mode_change_is_admin_only_persisted_audited_and_used(tmp_path):
    cfg, store, client = make(tmp_path)
    assert post(client, "/v1/environments/act/mode", OWNER, {"mode": "monitor"}
                ).status_code == 403
    assert post(client, "/v1/environments/nope/mode", ADMIN, {"mode": "monitor"}
                ).status_code == 404
    assert post(client, "/v1/environments/act/mode", ADMIN, {"mode": "loud"}
                ).status_code == 400
    answer = post(client, "/v1/environments/act/mode", ADMIN,
                  {"mode": "monitor", "reason": "quiet week"})
    assert answer.json() == {"env": "act", "mode": "monitor", "before": "action",
                             "source": "operator"}
    envs = client.get("/v1/environments").json()["environments"]
    assert {k: envs["act"][k] for k in ("configured", "mode", "source", "set_uid",
                                        "reason")} == {
        "configured": "action", "mode": "monitor", "source": "operator", "set_uid": ADMIN,
        "reason": "quiet week"}
    assert Decider(cfg, store).mode(specs.parse("act")) == "monitor"
    (event,) = [e for e in store.db["events"].rows_where("kind = 'api_mode'")]
    assert "action -> monitor" in event["message"] and '"uid": 0' in event["data"]


class SlurmNodes:
    def __init__(self, *names):
        self.names = names

    def list_nodes(self, names=None):
        return [Node(name=n, state="IDLE") for n in self.names]


@pytest.fixture(autouse=True)
def slurm_has_nodes_1_to_9(monkeypatch):
    """exclude asks Slurm which nodes exist; here, a Slurm of node1..node9."""
    monkeypatch.setattr("recovery_agent.interfaces.service.scheduler_for",
                        lambda cfg: SlurmNodes(*(f"node{i}" for i in range(1, 10))))


def test_exclude_and_include_a_node(tmp_path, monkeypatch):
    monkeypatch.setattr("recovery_agent.interfaces.service.scheduler_for",
                        lambda cfg: SlurmNodes("node3"))
    _, store, client = make(tmp_path)
    assert post(client, "/v1/nodes/node3/exclude", OWNER, {"reason": "x"}).status_code == 403
    assert post(client, "/v1/nodes/node3/exclude", ADMIN, {}).status_code == 400
    assert post(client, "/v1/nodes/node3/exclude", ADMIN,
                {"reason": "flaky IB"}).status_code == 200
    assert store.node("node3")["excluded_by_operator"] == 1
    nodes = client.get("/v1/nodes").json()["nodes"]
    assert nodes[0]["name"] == "node3" and nodes[0]["suspect_score"] == 0.0
    assert post(client, "/v1/nodes/node3/include", ADMIN).status_code == 200
    assert store.node("node3")["excluded_by_operator"] == 0
    assert post(client, "/v1/nodes/zz/include", ADMIN).status_code == 404
    assert client.get("/v1/nodes/zz").status_code == 404
    # a node Slurm does not know is refused, unless forced (and the answer says so)
    unknown = post(client, "/v1/nodes/nodeZZ/exclude", ADMIN, {"reason": "typo"})
    assert unknown.status_code == 404 and "Slurm has no node 'nodeZZ'" in unknown.json()["detail"]
    assert store.node("nodeZZ") is None
    forced = post(client, "/v1/nodes/nodeZZ/exclude", ADMIN, {"reason": "r", "force": True})
    assert forced.status_code == 200 and "Slurm has no node" in forced.json()["forced"]


def test_metrics_are_prometheus_text(tmp_path):
    _, store, client = make(tmp_path)
    pk = add_job(store)
    rec = add_rec(store, pk, status="done")
    with store.lock:
        store.update_rec(rec, failure_at=100.0, detected_at=101.5, done_at=102.0)
    text = client.get("/metrics").text
    assert 'slurm_recovery_recommendations{action="requeue_exclude",status="done"} 1.0' in text
    assert 'slurm_recovery_detection_latency_seconds_bucket{le="2.0"} 1.0' in text
    assert "slurm_recovery_action_latency_seconds_count 1.0" in text
    assert "slurm_recovery_tracked_jobs 0.0" in text


def test_healthz_is_red_without_a_watch_heartbeat(tmp_path):
    _, store, client = make(tmp_path)
    assert client.get("/healthz").status_code == 503
    store.set_state("heartbeat", {"time": time.time(), "cycles": 1})
    answer = client.get("/healthz")
    assert answer.status_code == 200 and answer.json()["watching"] is True


def test_read_token_guards_reads_when_configured(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    _, store, client = make(tmp_path, read_token_file=str(token))
    assert client.get("/v1/jobs").status_code == 401
    assert client.get("/v1/jobs", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.get("/v1/jobs", headers={"Authorization": "Bearer s3cret"}
                      ).status_code == 200


def test_oversized_and_malformed_bodies(tmp_path):
    _, store, client = make(tmp_path)
    rec = add_rec(store, add_job(store))
    big = client.post(f"/v1/recommendations/{rec}/cancel", content=b"x" * (65 * 1024),
                      headers={"X-Recovery-Uid": "0"})
    assert big.status_code == 413
    bad = client.post(f"/v1/recommendations/{rec}/cancel", content=b"[1, 2",
                      headers={"X-Recovery-Uid": "0"})
    assert bad.status_code == 400
    assert post(client, "/v1/recommendations/abc/ack", ADMIN).status_code == 422


@pytest.mark.parametrize("status", ["bogus"])
def test_unknown_status_filter_is_400(tmp_path, status):
    _, _, client = make(tmp_path)
    assert client.get("/v1/recommendations", params={"status": status}).status_code == 400


def test_signed_reads_show_users_only_their_own_jobs(tmp_path, monkeypatch):
    from slurm_hooks import munge
    cfg, store, client = make(tmp_path)
    cfg2 = from_mapping({"agent": {"cluster": "c1"}, "api": {"auth": "munge"},
                         "environments": {"ext": {"mode": "external"}}})
    client = TestClient(create_app(cfg2, Ingest(store, "c1")))
    mine, theirs = add_job(store, "42"), add_job(store, "43", user="somebody")
    add_rec(store, mine, "42")
    add_rec(store, theirs, "43", user="somebody")
    uid = {"cred-owner": OWNER, "cred-root": ADMIN}
    monkeypatch.setattr(munge, "verify_body", lambda cred, body, socket="": uid[cred])
    owner = {"Authorization": "Munge cred-owner"}
    assert [j["job_id"] for j in client.get("/v1/jobs", headers=owner).json()["jobs"]] == ["42"]
    assert client.get("/v1/jobs/43", headers=owner).status_code == 403
    assert client.get("/v1/jobs/43/timeline", headers=owner).status_code == 403
    recs = client.get("/v1/recommendations", headers=owner).json()["recommendations"]
    assert [r["job_id"] for r in recs] == ["42"]
    root = {"Authorization": "Munge cred-root"}
    assert len(client.get("/v1/jobs", headers=root).json()["jobs"]) == 2
    assert client.get("/v1/jobs/43", headers=root).status_code == 200


def test_lists_page_by_cursor(tmp_path):
    _, store, client = make(tmp_path)
    pks = [add_job(store, str(n)) for n in range(1, 6)]
    first = client.get("/v1/jobs", params={"limit": 2}).json()
    assert [j["id"] for j in first["jobs"]] == [pks[4], pks[3]]
    assert first["next_cursor"] == pks[3]
    second = client.get("/v1/jobs", params={"limit": 2, "cursor": first["next_cursor"]}).json()
    assert [j["id"] for j in second["jobs"]] == [pks[2], pks[1]]
    last = client.get("/v1/jobs", params={"limit": 2, "cursor": second["next_cursor"]}).json()
    assert [j["id"] for j in last["jobs"]] == [pks[0]] and last["next_cursor"] is None
    assert client.get("/v1/jobs", params={"limit": 5}).json()["next_cursor"] is None

    recs = [add_rec(store, pk, job_id=str(n)) for n, pk in enumerate(pks, 1)]
    page = client.get("/v1/recommendations", params={"limit": 3}).json()
    assert [r["id"] for r in page["recommendations"]] == recs[:1:-1]
    assert page["next_cursor"] == recs[2]
    rest = client.get("/v1/recommendations", params={"cursor": page["next_cursor"]}).json()
    assert [r["id"] for r in rest["recommendations"]] == [recs[1], recs[0]]
    assert rest["next_cursor"] is None


def test_a_recommendation_id_past_sqlites_range_is_422_not_500(tmp_path):
    _, _, client = make(tmp_path)
    assert client.get("/v1/recommendations/9223372036854775808").status_code == 422
    assert post(client, "/v1/recommendations/9223372036854775808/ack", ADMIN
                ).status_code == 422
    assert client.get("/v1/recommendations/9223372036854775807").status_code == 404


def test_body_fields_of_the_wrong_type_are_400(tmp_path):
    _, _, client = make(tmp_path)
    answer = post(client, "/v1/nodes/node3/exclude", ADMIN, {"reason": ["flaky"]})
    assert answer.status_code == 400 and answer.json() == {"detail": "reason must be a string"}
    assert post(client, "/v1/nodes/node3/exclude", ADMIN, {"reason": "\ufeff "}
                ).status_code == 400
    assert post(client, "/v1/environments/act/mode", ADMIN, {"mode": 1}).status_code == 400


def test_nodes_in_the_api_have_one_shape(tmp_path):
    _, store, client = make(tmp_path)
    store.add_strike("node4", "gpu_hardware", 1.0, None, OWNER_NAME, ts=time.time())
    post(client, "/v1/nodes/node3/exclude", ADMIN, {"reason": "flaky IB"})
    listed = {n["name"]: n for n in client.get("/v1/nodes").json()["nodes"]}
    for name in ("node3", "node4"):
        assert client.get(f"/v1/nodes/{name}").json() == listed[name]
    assert listed["node3"]["health_detail"] == "excluded by operator (flaky IB)"
    assert listed["node4"]["health_detail"] == "suspect (score 1)"
    assert listed["node4"]["cluster"] == listed["node3"]["cluster"] == "c1"
    assert listed["node4"]["strikes"][0]["category"] == "gpu_hardware"
