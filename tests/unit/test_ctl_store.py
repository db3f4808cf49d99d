"""recovery-ctl's show/audit/mode/exclude verbs straight on a store (--db), and
over HTTP against the agent's app (--url, served here by a thread)."""
from __future__ import annotations

import csv
import io
import json
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from recovery_agent.interfaces.ctl import main as ctl
from recovery_agent.scheduler.base import Job, Node
from recovery_agent.store import MIGRATIONS, Store


@pytest.fixture
def env(tmp_path, monkeypatch):
    config = tmp_path / "recovery.toml"
    config.write_text(f'[agent]\ncluster = "c1"\nstate_dir = "{tmp_path}"\n'
                      f'[api]\nauth = "none"\nadmin_uids = "{os.getuid()}"\n'
                      '[environments.prod]\nmode = "monitor"\n')
    monkeypatch.setenv("RECOVERY_CONFIG", str(config))
    # the nodes Slurm knows, for exclude's check (no slurmctld here)
    monkeypatch.setattr("recovery_agent.interfaces.service.scheduler_for",
                        lambda cfg: SlurmNodes("node1", "node2", "node3", "node4"))
    store = Store(tmp_path / "recovery.db")
    job = Job(job_id="4410", numeric_id=4410, submit_time=1000, user="ana", name="llm",
              state="FAILED", nodes=("node1", "node2"))
    with store.lock:
        pk = store.record_job(job, "c1", env="prod", mode="", spec="prod")
        store.record_attempt(pk, job)
        rec = store.add_recommendation({
            "job": pk, "attempt": 0, "job_id": "4410", "scope": "job",
            "action": "requeue_exclude", "rule": "hardware", "reason": "xid 79 on node2",
            "target_nodes": ["node2"], "exclude": ["node2"], "mode": "action",
            "status": "done", "restart_at": 0, "env": "prod", "user": "ana",
            "pattern_ids": ["node.xid"], "detected_at": 1001.0, "done_at": 1001.7})
        store.add_event(pk, "verdict", "node: gpu_hardware -> requeue_exclude (node2)",
                        attempt=0)
    store.add_step(rec, "requeue_hold", "started", "restart 0 -> 1")
    store.add_step(rec, "requeue_hold", "ok", "restart 0 -> 1")
    return tmp_path, store, rec


class SlurmNodes:
    """A scheduler whose node listing is these names (all exclude asks of it)."""

    def __init__(self, *names):
        self.names = names

    def list_nodes(self, names=None):
        return [Node(name=n, state="IDLE") for n in self.names]


def run(*args):
    result = CliRunner().invoke(ctl, list(args), catch_exceptions=False)
    return result


def test_show_jobs_and_job_from_the_store(env):
    tmp, _, rec = env
    db = str(tmp / "recovery.db")
    out = run("show", "jobs", "--db", db).output
    header, line = out.splitlines()[:2]
    assert header.split()[:4] == ["JOBID", "NAME", "USER", "STATE"]
    assert line.split()[:4] == ["4410", "llm", "ana", "FAILED"]
    shown = run("show", "job", "4410", "--db", db).output
    assert "JobId=4410" in shown and f"Recommendation #{rec} [0] requeue_exclude node2" in shown
    assert "requeue_hold ok" in shown          # steps merged into the timeline
    data = json.loads(run("show", "job", "4410", "--db", db, "--json").output)
    assert data["job"]["user"] == "ana" and data["recommendations"][0]["id"] == rec
    missing = run("show", "job", "999", "--db", db)
    assert missing.exit_code == 1 and "not tracked" in missing.output


def test_audit_formats_and_window(env):
    tmp, store, rec = env
    db = str(tmp / "recovery.db")
    text = run("audit", "--db", db).output
    assert f"#{rec} job 4410" in text and "requeue_hold" in text
    rows = list(csv.DictReader(io.StringIO(run("audit", "--db", db, "--format", "csv").output)))
    assert rows[0]["action"] == "requeue_exclude" and rows[0]["user"] == "ana"
    assert rows[0]["steps"] == "requeue_hold:started; requeue_hold:ok"
    assert json.loads(run("audit", "--db", db, "--json").output.splitlines()[0])["id"] == rec
    assert run("audit", "--db", db, "--since", "2999-01-01").output == ""
    assert run("audit", "--db", db, "--since", "1h").output != ""   # made just now
    bad = run("audit", "--db", db, "--since", "yesterdayish")
    assert bad.exit_code == 2 and "ISO time" in bad.output


def test_mode_and_exclude_straight_on_the_store_are_audited(env):
    tmp, store, _ = env
    db = str(tmp / "recovery.db")
    changed = run("mode", "prod", "action", "--db", db)
    assert changed.exit_code == 0 and "monitor -> action" in changed.output
    cfg = json.loads(run("show", "config", "--db", db, "--json").output)
    assert cfg["environments"]["prod"]["mode"] == "action"
    assert run("exclude", "node3", "--reason", "flaps", "--db", db).exit_code == 0
    nodes = run("show", "nodes", "--db", db).output
    assert "node3" in nodes and "yes" in nodes
    assert run("include", "node3", "--db", db).exit_code == 0
    kinds = [e["kind"] for e in store.db["events"].rows_where("job is null")]
    assert kinds == ["api_mode", "api_exclude", "api_include"]
    refused = run("mode", "nope", "action", "--db", db)
    assert refused.exit_code == 1 and "no environment" in refused.output


def test_verbs_over_http_against_the_agent(env):
    import uvicorn

    from recovery_agent.interfaces.api import create_app
    from recovery_agent.config import load
    from recovery_agent.inputs.ingest import Ingest
    tmp, store, rec = env
    app = create_app(load(), Ingest(store, "c1"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        pass
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    try:
        jobs = json.loads(run("show", "jobs", "--url", url, "--json").output)
        assert [j["job_id"] for j in jobs] == ["4410"]
        recs = run("show", "recommendations", "--url", url).output
        assert "requeue_exclude" in recs and "done" in recs
        assert run("mode", "prod", "external", "--url", url).exit_code == 0
        conflict = run("cancel", str(rec), "--url", url)
        assert conflict.exit_code == 1 and "HTTP 409" in conflict.output
        audit = run("audit", "--url", url, "--job", "4410", "--json").output
        assert json.loads(audit.splitlines()[0])["steps"][0]["step"] == "requeue_hold"
    finally:
        server.should_exit = True
        thread.join(10)
    down = run("show", "jobs", "--url", url)
    assert down.exit_code == 1 and "not reachable" in down.output


# -- the store as another user sees it (issue 14, findings 6 and 13) -------------------

CTL = str(Path(sys.executable).parent / "recovery-ctl")


@pytest.fixture
def shared(tmp_path):
    """A config and a store where other users may look (tmp_path is root's own)."""
    top = Path(tempfile.mkdtemp(prefix="rsec-ctl-"))
    os.chmod(top, 0o755)
    config = top / "recovery.toml"
    config.write_text(f'[agent]\ncluster = "c1"\nstate_dir = "{top}/state"\n'
                      '[api]\nauth = "none"\nadmin_uids = "0"\nport = 1\n'
                      '[environments.prod]\nmode = "monitor"\n')
    os.chmod(config, 0o644)
    with Store(top / "state" / "recovery.db") as store:
        job = Job(job_id="4410", numeric_id=4410, submit_time=1000, user="ana", name="llm",
                  state="FAILED")
        with store.lock:
            store.record_job(job, "c1", env="prod", mode="", spec="prod")
    yield top, config, top / "state" / "recovery.db"
    shutil.rmtree(top, ignore_errors=True)


def ctl_as(user, config, *args):
    return user.run([CTL, *args], check=False, env={**os.environ, "RECOVERY_CONFIG": str(config)})


@pytest.mark.security
def test_another_user_cannot_read_the_store_and_gets_no_traceback(shared, unix_users):
    mallory = unix_users("mallory")
    top, config, db = shared
    assert oct(os.stat(db).st_mode & 0o777) == "0o600"
    assert oct(os.stat(db.parent).st_mode & 0o777) == "0o700"
    for args in (["show", "jobs", "--db", str(db)], ["audit", "--db", str(db)],
                 ["mode", "prod", "action", "--db", str(db)]):
        result = ctl_as(mallory, config, *args)
        assert result.returncode == 1, args
        assert "Traceback" not in result.stderr + result.stdout
        assert f"cannot read the store {db}" in result.stderr
        assert "permission denied" in result.stderr and "0700" in result.stderr
        assert "ana" not in result.stdout


@pytest.mark.security
def test_a_readable_store_is_read_read_only_and_changes_say_why_not(shared, unix_users):
    """A store the user may read but not write (an admin group's copy, a
    read-only mount): reads work without writing a byte, changes fail clearly."""
    mallory = unix_users("mallory")
    top, config, db = shared
    os.chmod(db.parent, 0o755)
    os.chmod(db, 0o644)
    before = db.read_bytes()
    shown = ctl_as(mallory, config, "show", "jobs", "--db", str(db))
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[1].split()[:3] == ["4410", "llm", "ana"]
    changed = ctl_as(mallory, config, "mode", "prod", "action", "--db", str(db))
    assert changed.returncode == 1 and "Traceback" not in changed.stderr
    assert f"cannot change the store {db} as uid {mallory.uid}" in changed.stderr
    assert db.read_bytes() == before


def test_a_read_only_open_never_migrates_and_says_so(shared):
    top, config, db = shared
    import sqlite3
    with sqlite3.connect(db) as conn:
        conn.execute("delete from _migrations where name = (select max(name) from "
                     "_migrations)")
    result = CliRunner().invoke(ctl, ["show", "jobs", "--db", str(db)],
                                env={"RECOVERY_CONFIG": str(config)})
    assert result.exit_code == 1 and "pending" in result.output
    assert "Traceback" not in result.output
    with sqlite3.connect(db) as conn:
        count = conn.execute("select count(*) from _migrations").fetchone()[0]
    assert count == len(MIGRATIONS) - 1                  # still pending: nothing applied
    missing = CliRunner().invoke(ctl, ["show", "jobs", "--db", str(top / "nope.db")],
                                 env={"RECOVERY_CONFIG": str(config)})
    assert missing.exit_code == 1 and "no store at" in missing.output
    assert not (top / "nope.db").exists()


def test_reads_fall_back_to_munge_when_the_token_cannot_be_read(env, monkeypatch):
    """A user cannot read api.read_token_file: the read is munge-signed instead
    (the agent then answers as that user), not refused."""
    from slurm_hooks import munge
    tmp, store, _ = env
    seen = []

    class Answer:
        status_code = 200

        @staticmethod
        def json():
            return {"jobs": []}

    def request(method, url, headers=None, **kw):
        seen.append(headers.get("Authorization", ""))
        return Answer()
    import requests
    monkeypatch.setattr(requests, "request", request)
    monkeypatch.setattr(munge, "sign_body", lambda body, socket="", ttl=0: "CRED")
    config = tmp / "recovery.toml"
    config.write_text(config.read_text().replace('auth = "none"', 'auth = "munge"\n'
                      f'read_token_file = "{tmp}/not-yours"'))
    result = run("show", "jobs", "--url", "http://127.0.0.1:1")
    assert result.exit_code == 0 and seen == ["Munge CRED"]
    (tmp / "not-yours").write_text("tok\n")
    assert run("show", "jobs", "--url", "http://127.0.0.1:1").exit_code == 0
    assert seen[-1] == "Bearer tok"


def test_show_nodes_and_node_carry_the_degradation_score(env):
    """The newest record of each GPU decides (docs/proactive.md): a pending
    remap on node3 shows as degraded with its rule; a GPU whose newest record
    is back at ok shows nothing, though it once scored."""
    from recovery_agent.config.schema import ProactiveConfig
    from recovery_agent.detect import degradation as dg
    from tests.unit.test_degradation import T0, gpu_snapshot

    tmp, store, _ = env
    db = str(tmp / "recovery.db")
    cfg = ProactiveConfig()

    def scored(node, *snapshots):
        rows, previous = [], None
        for i, snap in enumerate(snapshots):
            rows += dg.readings_from_snapshot(node, T0 + i * 1200, snap)
            (score,) = dg.score_node(rows, cfg).values()
            change = dg.score_change(previous, score)
            if change is not None:
                store.add_degradation("c1", change)
                previous = change
    scored("node3", gpu_snapshot(), gpu_snapshot(remapped_rows_pending=True))
    scored("node4", gpu_snapshot(remapped_rows_pending=True), gpu_snapshot())
    listing = run("show", "nodes", "--db", db).output.splitlines()
    assert "DEGRADATION" in listing[0].split()
    node3 = next(line for line in listing if line.startswith("node3"))
    node4 = next(line for line in listing if line.startswith("node4"))
    assert "degraded 1.00 (row_remap_pending)" in node3
    assert "degraded" not in node4
    data = json.loads(run("show", "node", "node3", "--db", db, "--json").output)
    assert data["degradation"]["level"] == "degraded"
    assert data["degradation"]["gpus"][0]["rules"] == ["row_remap_pending"]
    shown = run("show", "node", "node3", "--db", db).output
    assert "Degradation=degraded 1.00 (row_remap_pending) since" in shown
    assert json.loads(run("show", "node", "node4", "--db", db, "--json").output)[
        "degradation"]["level"] == "ok"
