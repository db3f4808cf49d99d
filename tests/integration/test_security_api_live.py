"""The hostile-user suite for reads and changes (issue 14, findings 6, 7 and
13): the agent runs on the dev cluster with real munge, and the attacker,
mallory, is a real unprivileged Unix user, as is alice, whose job fails with a
real XID and leads to a real drain recommendation. Every request or command of
theirs runs as their uid: munge signs it as them, and the kernel owns their
sockets as them."""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from recovery_devtools.devcluster.inject import inject_xid
from tests.integration.conftest import AgentProcess, Submitter, release_node, wait_for

pytestmark = [pytest.mark.live, pytest.mark.security]
CTL = str(Path(sys.executable).parent / "recovery-ctl")
EVIDENCE = "GPU has fallen off the bus"

# One request as the user running it (the body on stdin): signed with munge as
# that uid (a GET over the empty body), or forged, replayed, signed for another
# body, or sent unsigned; extra headers as JSON. Prints [[status, body], ...].
REQUEST = r"""
import json, sys, urllib.error, urllib.request
from slurm_hooks import munge
method, url, sock, how = sys.argv[1:5]
extra = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
data = sys.stdin.buffer.read()
headers = {"Content-Type": "application/json", **extra}
if how != "unsigned":
    cred = munge.sign_body(b'{"other": 1}' if how == "otherbody" else
                           (data if method == "POST" else b""), sock)
    if how == "forged":
        cred = cred[:30] + ("A" if cred[30] != "A" else "B") + cred[31:]
    headers["Authorization"] = "Munge " + cred
out = []
for _ in range(2 if how == "replay" else 1):
    req = urllib.request.Request(url, data=data if method == "POST" else None,
                                 headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            out.append([resp.status, resp.read().decode()])
    except urllib.error.HTTPError as exc:
        out.append([exc.code, exc.read().decode()])
print(json.dumps(out))
"""


class Rig:
    """The agent under test, and requests and recovery-ctl runs as a user."""

    def __init__(self, agent: AgentProcess, sock: str) -> None:
        self.agent, self.sock = agent, sock
        self.url = f"http://127.0.0.1:{agent.port}"

    def request(self, user, method: str, path: str, body: dict | None = None,
                how: str = "signed", headers: dict | None = None) -> list[list]:
        argv = [sys.executable, "-c", REQUEST, method, self.url + path, self.sock, how,
                json.dumps(headers or {})]
        data = json.dumps(body or {}) if method == "POST" else ""
        result = user.run(argv, input=data) if user is not None else subprocess.run(
            argv, input=data, capture_output=True, text=True, check=True, timeout=60)
        return json.loads(result.stdout)

    def get(self, user, path: str, **kw) -> tuple[int, str]:
        return tuple(self.request(user, "GET", path, **kw)[0])

    def post(self, user, path: str, body: dict | None = None, **kw) -> tuple[int, str]:
        return tuple(self.request(user, "POST", path, body, **kw)[0])

    def ctl(self, user, *args, env: dict | None = None) -> subprocess.CompletedProcess:
        environ = {**self.agent.environ(), **(env or {})}
        return user.run([CTL, *args, "--url", self.url] if "--db" not in args
                        else [CTL, *args], check=False, env=environ, timeout=120)


def recs_of(agent, job_id: str) -> list[dict]:
    rows = agent.query("select r.id, r.scope, r.action, r.status, r.target_nodes, r.mode "
                       "from recommendations r join jobs j on r.job = j.id "
                       "where j.job_id = ? order by r.id", job_id)
    return [dict(zip(("id", "scope", "action", "status", "nodes", "mode"), r)) for r in rows]


@pytest.fixture(scope="module")
def people(unix_users):
    return unix_users("alice"), unix_users("mallory")


@pytest.fixture(scope="module")
def rig(devcluster, people):
    """The agent on a store made as an older version made it: world-readable
    in a world-readable directory."""
    folder = devcluster.lay.root / "sec-api"
    folder.mkdir(exist_ok=True)
    os.chmod(folder, 0o755)
    db = folder / "recovery.db"
    for leftover in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
        leftover.unlink(missing_ok=True)
    with sqlite3.connect(db) as conn:
        conn.execute("create table carried_over (x)")
    os.chmod(db, 0o644)
    log_start = devcluster.lay.logs.joinpath("agent.log")
    offset = log_start.stat().st_size if log_start.exists() else 0
    agent = AgentProcess(devcluster, db=db)
    # the dev cluster's config, with an environment whose recommendations wait
    # for a site controller (a job cannot ask for external mode itself)
    agent.config = folder / "recovery.toml"
    agent.config.write_text(devcluster.lay.agent_config.read_text()
                            + '[environments.ext]\nmode = "external"\n')
    os.chmod(agent.config, 0o644)
    agent.start()
    rig = Rig(agent, str(devcluster.lay.munge_socket))
    rig.log_offset = offset
    yield rig
    agent.stop()


@pytest.fixture(scope="module")
def incident(rig, devcluster, people):
    """alice's job fails with XID 79 on its node: the agent proposes a requeue
    without the node and the node's drain, both for a site controller
    (environment ``ext``), so both stay open for the tests to try."""
    alice, mallory = people
    submit = Submitter(devcluster)
    sched = devcluster.scheduler()
    node = None
    try:
        job_id = submit("-N1", "--recovery=ext", "-o", "sec-%j.out",
                        script="echo 'step 1 loss 2.0'; sleep 6; exit 1", as_user=alice)
        job = wait_for(lambda: (j := sched.get_job(job_id)) and j.state == "RUNNING" and j,
                       60, f"alice's job {job_id} RUNNING")
        node = job.nodes[0]
        inject_xid(devcluster.lay, node, 0, 79)
        recs = wait_for(lambda: (r := recs_of(rig.agent, job_id)) and
                        {x["scope"] for x in r} == {"job", "node"} and r, 90,
                        "the requeue and the drain recommendations")
        theirs = submit("-N1", "--recovery=ext", "-o", "sec-%j.out",
                        script="sleep 120", as_user=mallory)
        wait_for(lambda: rig.agent.query("select id from jobs where job_id = ?", theirs),
                 60, "mallory's job tracked")
        (job_rec,) = [r for r in recs if r["scope"] == "job"]
        (drain,) = [r for r in recs if r["scope"] == "node"]
        yield {"job": job_id, "node": node, "job_rec": job_rec, "drain": drain,
               "theirs": theirs}
    finally:
        submit.cleanup()
        if node:
            release_node(devcluster, node)


# -- the store file ----------------------------------------------------------------------

def test_the_agent_made_the_old_world_readable_store_private_and_said_so(rig):
    db = rig.agent.db
    assert oct(os.stat(db).st_mode & 0o777) == "0o600"
    for suffix in ("-wal", "-shm"):
        if os.path.exists(f"{db}{suffix}"):
            assert oct(os.stat(f"{db}{suffix}").st_mode & 0o777) == "0o600", suffix
    log = rig.agent.log.read_text(errors="replace")[rig.log_offset:]
    assert f"made it private: {db}: 0644 -> 0600" in log


def test_mallory_cannot_read_the_store_with_recovery_ctl_db(rig, people, incident):
    _, mallory = people
    for args in (["show", "jobs"], ["show", "job", incident["job"]], ["audit"]):
        result = rig.ctl(mallory, *args, "--db", str(rig.agent.db))
        assert result.returncode == 1, result.stdout
        assert "Traceback" not in result.stderr
        assert f"cannot read the store {rig.agent.db}" in result.stderr
        assert "permission denied (mode 0600" in result.stderr
        assert EVIDENCE not in result.stdout and incident["job"] not in result.stdout


# -- reads: the Console, the API, recovery-ctl --url ----------------------------------

@pytest.mark.parametrize("how", ["signed", "unsigned"])
def test_mallory_sees_nothing_of_alices_job(rig, people, incident, how):
    alice, mallory = people
    job = incident["job"]
    for path in (f"/console/job/{job}", f"/console/part/job/{job}/timeline",
                 f"/v1/jobs/{job}", f"/v1/jobs/{job}/timeline",
                 f"/v1/recommendations/{incident['job_rec']['id']}",
                 f"/v1/recommendations/{incident['drain']['id']}"):
        status, body = rig.get(mallory, path, how=how)
        assert status == 403, (path, status)
        assert EVIDENCE not in body and incident["node"] not in body, path
    for part in ("jobs", "recommendations"):
        status, body = rig.get(mallory, f"/console/part/{part}", how=how)
        assert status == 200 and f"/console/job/{job}'" not in body, part
    status, body = rig.get(mallory, "/console/part/jobs", how=how)
    assert f"/console/job/{incident['theirs']}'" in body          # her own job is there
    status, body = rig.get(mallory, "/v1/jobs", how=how)
    assert job not in [j["job_id"] for j in json.loads(body)["jobs"]]
    status, body = rig.get(mallory, "/v1/recommendations", how=how)
    assert json.loads(body)["recommendations"] == []
    # the owner sees her job, with its evidence
    status, body = rig.get(alice, f"/console/job/{job}", how=how)
    assert status == 200 and EVIDENCE in body


def test_a_forwarded_for_header_does_not_change_who_reads(rig, people, incident):
    _, mallory = people
    status, body = rig.get(mallory, "/v1/jobs", how="unsigned",
                           headers={"X-Forwarded-For": "192.0.2.10"})
    assert status == 200
    assert incident["job"] not in [j["job_id"] for j in json.loads(body)["jobs"]]


def test_recovery_ctl_url_as_mallory_is_scoped(rig, people, incident):
    alice, mallory = people
    shown = rig.ctl(mallory, "show", "job", incident["job"])
    assert shown.returncode == 1 and "HTTP 403" in shown.stderr
    assert EVIDENCE not in shown.stdout and "Traceback" not in shown.stderr
    jobs = rig.ctl(mallory, "show", "jobs", "--json")
    assert jobs.returncode == 0, jobs.stderr
    assert [j["job_id"] for j in json.loads(jobs.stdout)] == [incident["theirs"]]
    audit = rig.ctl(mallory, "audit", "--json")
    assert audit.returncode == 0 and audit.stdout == ""
    mine = rig.ctl(alice, "show", "job", incident["job"])
    assert mine.returncode == 0 and EVIDENCE in mine.stdout


def test_an_arrays_parent_id_shows_mallory_none_of_alices_tasks(rig, people, devcluster):
    alice, mallory = people
    submit = Submitter(devcluster)
    try:
        array = submit("--array=0-1", "--recovery=ext", "-o", "sec-a-%A_%a.out",
                       script="sleep 60", as_user=alice)
        wait_for(lambda: len(rig.agent.query(
            "select id from jobs where array_job_id = ?", int(array))) == 2, 60,
            "both tasks tracked")
        status, body = rig.get(mallory, f"/v1/jobs/{array}")
        assert status == 403 and f"{array}_0" not in body
        shown = rig.ctl(mallory, "show", "job", array)
        assert shown.returncode == 1 and f"{array}_0" not in shown.stdout
        assert "HTTP 403" in shown.stderr
        status, body = rig.get(alice, f"/v1/jobs/{array}")
        assert status == 200
        assert [t["job_id"] for t in json.loads(body)["tasks"]] == [f"{array}_0", f"{array}_1"]
        mine = rig.ctl(alice, "show", "job", array)
        assert mine.returncode == 0 and "2 task(s)" in mine.stdout
    finally:
        submit.cleanup()


# -- changes --------------------------------------------------------------------------------

def test_alice_cannot_touch_the_drain_her_jobs_xid_led_to(rig, people, incident):
    alice, _ = people
    drain = incident["drain"]["id"]
    assert incident["drain"]["action"] == "drain_node"
    assert json.loads(incident["drain"]["nodes"]) == [incident["node"]]
    for verb, body in (("ack", {}), ("complete", {"outcome": "done"}),
                       ("cancel", {"reason": "mine"})):
        status, text = rig.post(alice, f"/v1/recommendations/{drain}/{verb}", body)
        assert status == 403 and "node-level recommendations are for admins" in text, verb
    for verb in ("ack", "cancel"):
        result = rig.ctl(alice, verb, str(drain))
        assert result.returncode == 1 and "HTTP 403" in result.stderr, verb
    assert [r["status"] for r in recs_of(rig.agent, incident["job"])
            if r["id"] == drain] == ["proposed"]


def test_alice_may_not_claim_or_complete_her_own_but_may_cancel_it(rig, people, incident):
    alice, _ = people
    rec = incident["job_rec"]["id"]
    status, text = rig.post(alice, f"/v1/recommendations/{rec}/ack")
    assert status == 403 and "only admins ack" in text
    status, text = rig.post(alice, f"/v1/recommendations/{rec}/complete", {"outcome": "done"})
    assert status == 403
    withdrawn = rig.ctl(alice, "cancel", str(rec), "--reason", "I will resubmit")
    assert withdrawn.returncode == 0, withdrawn.stderr
    statuses = {r["scope"]: r["status"] for r in recs_of(rig.agent, incident["job"])}
    assert statuses == {"job": "cancelled", "node": "proposed"}
    (data,) = rig.agent.query("select data from events where kind = 'api_cancel'")
    assert json.loads(data[0])["uid"] == alice.uid


def test_mallory_changes_nothing_of_anyone_elses(rig, people, incident):
    _, mallory = people
    for rec in (incident["job_rec"]["id"], incident["drain"]["id"]):
        for verb in ("ack", "complete", "cancel"):
            status, text = rig.post(mallory, f"/v1/recommendations/{rec}/{verb}",
                                    {"outcome": "done"})
            assert status == 403 and "own jobs" in text, (rec, verb)
    for args in (["mode", "act", "monitor"], ["exclude", "node1", "--reason", "x"],
                 ["include", "node1"], ["ack", str(incident["drain"]["id"])]):
        result = rig.ctl(mallory, *args)
        assert result.returncode == 1 and "HTTP 403" in result.stderr, args
    assert rig.agent.query("select count(*) from events where kind like 'api_%' and "
                           "data like ?", f'%"uid": {mallory.uid}%') == [(0,)]


def test_forged_replayed_and_misbound_credentials_are_refused(rig, people, incident):
    _, mallory = people
    own = incident["theirs"]
    first, again = rig.request(mallory, "GET", f"/v1/jobs/{own}", how="replay")
    assert first[0] == 200 and again[0] == 401 and "Replayed" in again[1]
    status, text = rig.get(mallory, "/v1/jobs", how="forged")
    assert status == 401 and "munge" in text
    status, text = rig.post(mallory, "/v1/environments/act/mode", {"mode": "monitor"},
                            how="otherbody")
    assert status == 401 and "does not match" in text
    status, text = rig.post(mallory, "/v1/environments/act/mode", {"mode": "monitor"},
                            how="unsigned")
    assert status == 401


def test_oversize_bodies_are_413(rig, people):
    """Refused as soon as the size is known, before the body is read: curl, as a
    client that reads the answer while it still sends, sees the 413."""
    _, mallory = people
    for path, size, chunked in (("/v1/environments/act/mode", 70 << 10, False),
                                ("/v1/hooks/health", 5 << 20, False),
                                ("/v1/recommendations/1/cancel", 1 << 20, True)):
        argv = ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST",
                "--data-binary", "@-", rig.url + path]
        if chunked:
            argv[1:1] = ["-H", "Transfer-Encoding: chunked"]
        result = mallory.run(argv, input="x" * size, check=False)
        assert result.stdout == "413", (path, result.stdout, result.stderr)


# -- a read token the user cannot read ---------------------------------------------------

def test_a_user_without_the_read_token_reads_signed_and_scoped(rig, people, incident,
                                                               devcluster, tmp_path):
    """An exposed agent needs the read token, which only admins can read:
    recovery-ctl as a user signs the read with munge instead."""
    _, mallory = people
    token = tmp_path / "read-token"
    token.write_text("s3cret\n")
    os.chmod(token, 0o600)
    env = {"RECOVERY_API_READ_TOKEN_FILE": str(token)}
    jobs = rig.ctl(mallory, "show", "jobs", "--json", env=env)
    assert jobs.returncode == 0, jobs.stderr
    assert [j["job_id"] for j in json.loads(jobs.stdout)] == [incident["theirs"]]
    root = subprocess.run([CTL, "show", "jobs", "--json", "--url", rig.url],
                          env={**rig.agent.environ(), **env}, capture_output=True,
                          text=True, timeout=60)
    assert root.returncode == 0 and incident["job"] in root.stdout


# -- a damaged store -------------------------------------------------------------------------

def test_the_agent_refuses_a_store_with_a_garbage_page(devcluster, tmp_path):
    db = tmp_path / "recovery.db"
    probe = AgentProcess(devcluster, db=db)
    with sqlite3.connect(db) as conn:
        conn.execute("create table big (x)")
        conn.executemany("insert into big values (?)", [("y" * 500,)] * 400)
    with sqlite3.connect(db) as conn:
        root = conn.execute("select rootpage from sqlite_master where name = 'big'"
                            ).fetchone()[0]
    with open(db, "r+b") as fh:
        fh.seek((root - 1) * 4096)
        fh.write(os.urandom(4096))
    result = subprocess.run([sys.executable, "-m", "recovery_agent"], env=probe.environ(),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "is damaged" in result.stderr and f"sqlite3 {db} .recover" in result.stderr
    assert "Traceback" not in result.stderr
