"""Who may read and change what through the API and the Console (issue 14,
findings 6 and 7), on a temp store, with real Unix users as the callers.

Munge itself is checked live (tests/integration/test_security_api_live.py);
here ``munge.verify_body`` maps a credential "cred-<uid>" to its uid, so each
request is made as a real user's uid and ``role_of`` looks the user up as the
agent would. The tests that open real connections (who owns a local socket)
run the client as that user."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import pytest
from fastapi.testclient import TestClient

from recovery_agent.interfaces.api import create_app
from recovery_agent.config import from_mapping
from recovery_agent.inputs.ingest import Ingest
from recovery_agent.scheduler.base import Job
from recovery_agent.store import Store
from slurm_hooks import munge

EVIDENCE = "NVRM: Xid (PCI:0000:18:00): 79, GPU has fallen off the bus."


@pytest.fixture
def people(unix_users):
    return unix_users("alice"), unix_users("mallory")


def _job(store, job_id: str, user: str, array: tuple[int, int] | None = None) -> int:
    numeric = int(job_id.split("_")[0]) + (array[1] if array else 0)
    job = Job(job_id=job_id, numeric_id=numeric, submit_time=1000 + numeric, user=user,
              name=f"train-{job_id}", state="FAILED", nodes=("node1", "node2"),
              array_job_id=array[0] if array else None,
              array_task_id=array[1] if array else None)
    with store.lock:
        pk = store.record_job(job, "c1", env="ext", mode="", spec="ext")
        store.record_attempt(pk, job)
    return pk


def _rec(store, pk: int, job_id: str, user: str, scope: str = "job", parent=None,
         action: str = "requeue_exclude") -> int:
    with store.lock:
        return store.add_recommendation({
            "job": pk, "attempt": 0, "job_id": job_id, "scope": scope, "parent": parent,
            "action": action, "rule": "hardware", "reason": "xid 79 on node2",
            "target_nodes": ["node2"], "exclude": ["node2"] if scope == "job" else [],
            "mode": "external", "status": "proposed", "restart_at": 0, "submit_time": 1000,
            "env": "ext", "user": user})


@pytest.fixture
def rig(tmp_path, people, monkeypatch):
    """alice's job 42 (an XID on node2: a requeue and a drain of node2, both
    waiting for a site controller), alice's array 1200 (two tasks, and a task
    of mallory's under the same id after an id reuse), mallory's job 77."""
    alice, mallory = people
    cfg = from_mapping({"agent": {"cluster": "c1"},
                        "api": {"auth": "munge", "admin_uids": "0"},
                        "environments": {"ext": {"mode": "external"}}})
    store = Store(tmp_path / "r.db")
    pk = _job(store, "42", alice.name)
    with store.lock:
        found = store.record_detection(pk, 0, _detection(), ts=1001.0)
        store.add_event(pk, "detected", "node.xid_fatal gpu_hardware on node2", attempt=0,
                        ts=1001.0, detection=found)
        store.add_strike("node2", "gpu_hardware", 1.0, pk, alice.name, ts=time.time())
    job_rec = _rec(store, pk, "42", alice.name)
    drain = _rec(store, pk, "42", alice.name, scope="node", parent=job_rec,
                 action="drain_node")
    tasks = [_job(store, f"1200_{i}", alice.name, (1200, i)) for i in (0, 1)]
    _job(store, "1200_5", mallory.name, (1200, 5))
    theirs = _job(store, "77", mallory.name)
    own_rec = _rec(store, theirs, "77", mallory.name)
    monkeypatch.setattr(munge, "verify_body", lambda cred, body, socket="": int(cred[5:]))
    client = TestClient(create_app(cfg, Ingest(store, "c1")))
    return {"store": store, "client": client, "alice": alice, "mallory": mallory,
            "job_rec": job_rec, "drain": drain, "tasks": tasks, "mallory_rec": own_rec}


def _detection():
    from recovery_agent.detect.model import Detection, Evidence
    return Detection(rule="node.xid_fatal", category="gpu_hardware", severity="fatal",
                     host="node2", evidence=(Evidence(text=EVIDENCE, source="hooks/node2"),))


def as_(user) -> dict:
    return {"Authorization": f"Munge cred-{0 if user is None else user.uid}"}


def post(rig, path: str, user, body: dict | None = None):
    return rig["client"].post(path, content=json.dumps(body or {}), headers=as_(user))


# -- finding 6: reads ---------------------------------------------------------------

def test_console_overview_shows_a_user_only_their_own_jobs_and_recommendations(rig):
    client, mallory = rig["client"], rig["mallory"]
    jobs = client.get("/console/part/jobs", headers=as_(mallory)).text
    assert "/console/job/77" in jobs and "/console/job/42'" not in jobs
    assert rig["alice"].name not in jobs
    recs = client.get("/console/part/recommendations", headers=as_(mallory)).text
    assert f"#{rig['mallory_rec']}<" in recs and f"#{rig['job_rec']}<" not in recs
    assert f"#{rig['drain']}<" not in recs
    whole = client.get("/console", headers=as_(mallory)).text
    assert "/console/job/42'" not in whole and "/console/job/77" in whole
    admin = client.get("/console/part/jobs", headers=as_(None)).text
    assert "/console/job/42'" in admin and "/console/job/77" in admin
    # nodes are the cluster's (sinfo shows them to everyone): the same for all
    assert client.get("/console/part/nodes", headers=as_(mallory)).text == \
        client.get("/console/part/nodes", headers=as_(None)).text


def test_console_job_page_and_timeline_of_another_users_job_are_403(rig):
    client, mallory, alice = rig["client"], rig["mallory"], rig["alice"]
    page = client.get("/console/job/42", headers=as_(mallory))
    assert page.status_code == 403 and "may read only their own jobs" in page.text
    assert "fallen off the bus" not in page.text and "node2" not in page.text
    part = client.get("/console/part/job/42/timeline", headers=as_(mallory))
    assert part.status_code == 403 and "fallen off the bus" not in part.text
    assert client.get("/v1/jobs/42", headers=as_(mallory)).status_code == 403
    mine = client.get("/console/job/42", headers=as_(alice))
    assert mine.status_code == 200 and "fallen off the bus" in mine.text
    assert client.get("/console/part/job/42/timeline", headers=as_(alice)).status_code == 200
    assert client.get("/console/job/42", headers=as_(None)).status_code == 200
    assert client.get("/console/job/999", headers=as_(mallory)).status_code == 404


def test_an_arrays_parent_id_lists_only_the_callers_tasks(rig):
    client, mallory, alice = rig["client"], rig["mallory"], rig["alice"]
    def tasks(user):
        answer = client.get("/v1/jobs/1200", headers=as_(user))
        return answer.status_code, [t["job_id"] for t in answer.json().get("tasks", [])]
    assert tasks(mallory) == (200, ["1200_5"])
    assert tasks(alice) == (200, ["1200_0", "1200_1"])
    assert tasks(None) == (200, ["1200_0", "1200_1", "1200_5"])
    _job(rig["store"], "1300_0", alice.name, (1300, 0))     # an array all alice's
    refused = client.get("/v1/jobs/1300", headers=as_(mallory))
    assert refused.status_code == 403 and "1300_0" not in refused.text


def test_recommendation_reads_are_the_owners(rig):
    client, mallory, alice = rig["client"], rig["mallory"], rig["alice"]
    assert client.get(f"/v1/recommendations/{rig['job_rec']}",
                      headers=as_(mallory)).status_code == 403
    assert client.get(f"/v1/recommendations/{rig['drain']}",
                      headers=as_(mallory)).status_code == 403
    listed = client.get("/v1/recommendations", headers=as_(mallory)).json()
    assert [r["id"] for r in listed["recommendations"]] == [rig["mallory_rec"]]
    # the owner sees the drain their job's failure led to (it is on their job's page)
    mine = client.get("/v1/recommendations", headers=as_(alice)).json()["recommendations"]
    assert {r["id"] for r in mine} == {rig["job_rec"], rig["drain"]}
    jobs = client.get("/v1/jobs", params={"user": alice.name}, headers=as_(mallory)).json()
    assert [j["job_id"] for j in jobs["jobs"]] == ["77", "1200_5"]   # ?user= cannot widen
    timeline = client.get("/v1/jobs/42/timeline", headers=as_(mallory))
    assert timeline.status_code == 403


def test_node_strikes_name_only_the_readers_own_jobs(rig):
    client, mallory, alice = rig["client"], rig["mallory"], rig["alice"]
    (strike,) = client.get("/v1/nodes/node2", headers=as_(mallory)).json()["strikes"]
    assert strike["user"] is None and strike["job"] is None
    assert strike["category"] == "gpu_hardware"
    (strike,) = client.get("/v1/nodes/node2", headers=as_(alice)).json()["strikes"]
    assert strike["user"] == alice.name and strike["job"] == 1
    nodes = client.get("/v1/nodes", headers=as_(mallory)).json()["nodes"]
    assert [n["name"] for n in nodes] == ["node2"] and nodes[0]["suspect_score"] > 0


# -- finding 7: changes ----------------------------------------------------------------

def test_a_job_owner_cannot_ack_complete_or_cancel_the_drain_of_the_node_it_blamed(rig):
    alice, store, drain = rig["alice"], rig["store"], rig["drain"]
    for verb, body in (("ack", {}), ("complete", {"outcome": "done"}), ("cancel", {})):
        answer = post(rig, f"/v1/recommendations/{drain}/{verb}", alice, body)
        assert answer.status_code == 403, verb
        assert "node-level recommendations are for admins" in answer.json()["detail"]
    assert store.rec(drain).status == "proposed" and store.steps(drain) == []
    assert post(rig, f"/v1/recommendations/{drain}/cancel", None,
                {"reason": "not this one"}).status_code == 200
    assert store.rec(drain).status == "cancelled"


def test_users_never_claim_or_complete_but_may_cancel_their_own_job_recommendation(rig):
    alice, store, job_rec, drain = rig["alice"], rig["store"], rig["job_rec"], rig["drain"]
    claim = post(rig, f"/v1/recommendations/{job_rec}/ack", alice)
    assert claim.status_code == 403 and "only admins ack" in claim.json()["detail"]
    assert store.rec(job_rec).status == "proposed"
    assert post(rig, f"/v1/recommendations/{job_rec}/ack", None).status_code == 200
    done = post(rig, f"/v1/recommendations/{job_rec}/complete", alice, {"outcome": "done"})
    assert done.status_code == 403 and store.rec(job_rec).status == "executing"
    withdrawn = post(rig, f"/v1/recommendations/{job_rec}/cancel", alice, {"reason": "mine"})
    assert withdrawn.status_code == 200 and store.rec(job_rec).status == "cancelled"
    assert store.rec(drain).status == "proposed"      # the node's drain is not hers
    (event,) = [e for e in store.timeline(1) if e["kind"] == "api_cancel"]
    assert event["data"]["uid"] == alice.uid


def test_other_users_may_change_nothing_of_anothers(rig):
    mallory, store = rig["mallory"], rig["store"]
    for rec in (rig["job_rec"], rig["drain"]):
        for verb in ("ack", "complete", "cancel"):
            answer = post(rig, f"/v1/recommendations/{rec}/{verb}", mallory,
                          {"outcome": "done"})
            assert answer.status_code == 403 and "own jobs" in answer.json()["detail"]
        assert store.rec(rec).status == "proposed"
    assert post(rig, "/v1/environments/ext/mode", mallory, {"mode": "monitor"}
                ).status_code == 403
    assert post(rig, "/v1/nodes/node1/exclude", mallory, {"reason": "x"}).status_code == 403
    assert post(rig, "/v1/nodes/node2/include", mallory).status_code == 403
    assert not [e for e in store.db["events"].rows_where("kind like 'api_%'")]


# -- who reads without a credential: the kernel's record of the socket -----------------

HOLD = """
import socket, sys, time
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.sendall(b"x")
print("connected", flush=True)
if sys.argv[2] == "close":
    s.close()
time.sleep(5)
"""


@pytest.mark.security
@pytest.mark.parametrize("ending", ["hold", "close"])
def test_local_peer_uid_is_the_sockets_owner_and_fails_closed(people, ending):
    from recovery_agent.interfaces.api_v1 import local_peer_uid
    _, mallory = people
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    proc = subprocess.Popen(mallory.argv([sys.executable, "-c", HOLD, str(port), ending]),
                            stdout=subprocess.PIPE, text=True)
    try:
        conn, peer = server.accept()
        assert proc.stdout.readline().strip() == "connected"
        time.sleep(0.3)
        if ending == "hold":
            assert local_peer_uid(peer, conn.getsockname()) == mallory.uid
        else:   # closed early: the kernel shows uid 0 for an orphan; never taken as root
            with pytest.raises(LookupError):
                local_peer_uid(peer, conn.getsockname())
        conn.close()
    finally:
        proc.kill()
        proc.wait()
        server.close()
    assert local_peer_uid(("testclient", 50000), ("testserver", 80)) is None
    assert local_peer_uid(("192.0.2.7", 4000), ("127.0.0.1", 8787)) is None  # another host


READ = """
import json, sys, urllib.error, urllib.request
out = {}
for path in sys.argv[2:]:
    try:
        with urllib.request.urlopen(sys.argv[1] + path, timeout=10) as resp:
            out[path] = [resp.status, resp.read().decode()]
    except urllib.error.HTTPError as exc:
        out[path] = [exc.code, exc.read().decode()]
print(json.dumps(out))
"""


@pytest.fixture
def served(rig):
    import uvicorn
    app = rig["client"].app
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error",
                                           proxy_headers=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    server.should_exit = True
    thread.join(10)


@pytest.mark.security
def test_an_unsigned_local_read_is_made_as_the_user_who_connects(rig, served):
    """No token and no munge: a user on the agent's host is still only a user."""
    paths = ["/v1/jobs", "/v1/jobs/42", "/console/job/42", "/console/part/jobs",
             "/v1/recommendations", "/v1/goodput?since=3650d", "/v1/goodput?job=42",
             "/console/goodput?since=365d"]
    mallory = rig["mallory"]
    seen = json.loads(mallory.run([sys.executable, "-c", READ, served, *paths]).stdout)
    assert [j["job_id"] for j in json.loads(seen["/v1/jobs"][1])["jobs"]] == ["77", "1200_5"]
    assert seen["/v1/jobs/42"][0] == 403 and seen["/console/job/42"][0] == 403
    assert "fallen off the bus" not in seen["/console/job/42"][1]
    assert "/console/job/42'" not in seen["/console/part/jobs"][1]
    recs = json.loads(seen["/v1/recommendations"][1])["recommendations"]
    assert [r["id"] for r in recs] == [rig["mallory_rec"]]
    # the goodput ledger, too, is of the reader's own jobs
    ledger = json.loads(seen["/v1/goodput?since=3650d"][1])
    assert sorted(i["job_id"] for i in ledger["incidents"]) == ["1200_5", "77"]
    assert seen["/v1/goodput?job=42"][0] == 403
    assert seen["/console/goodput?since=365d"][0] == 200
    assert "/console/job/42'" not in seen["/console/goodput?since=365d"][1]
    root = json.loads(subprocess.run([sys.executable, "-c", READ, served, "/v1/jobs"],
                                     capture_output=True, text=True, check=True).stdout)
    assert len(json.loads(root["/v1/jobs"][1])["jobs"]) == 5      # root is an admin


# -- oversize bodies ---------------------------------------------------------------------

def test_oversize_bodies_are_refused_before_they_are_read(rig):
    client, rec = rig["client"], rig["job_rec"]
    declared = client.post(f"/v1/recommendations/{rec}/cancel", content=b"{}",
                           headers={**as_(None), "Content-Length": str(10 << 30)})
    assert declared.status_code == 413

    def endless(megabytes: int):      # chunked: no length to go by
        for _ in range(megabytes * 64):
            yield b" " * (16 << 10)
    streamed = client.post(f"/v1/recommendations/{rec}/cancel", content=endless(1),
                           headers=as_(None))
    assert streamed.status_code == 413 and rig["store"].rec(rec).status == "proposed"
    hook = client.post("/v1/hooks/health", content=endless(5), headers=as_(None))
    assert hook.status_code == 413
