"""Operators' changes are audit records (issue 22, items 1 and 2): each of
mode, mode --clear, exclude, include, ack, complete and cancel, through the API
and straight on the store, is one record with who (the caller's uid and user),
when, the state before and after, and why; they show in ``recovery-ctl
audit`` (text, csv, json), ``GET /v1/audit`` and the Console, and ``--since``
filters them. A refused call records nothing. ``mode ENV --clear`` gives the
file's mode back, and ``show config`` says where each mode comes from."""
from __future__ import annotations

import csv
import io
import json
import logging
import os
import pwd
import sqlite3

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient
from sqlite_utils import Database

from recovery_agent.config import from_mapping
from recovery_agent.inputs.ingest import Ingest
from recovery_agent.interfaces.api import create_app
from recovery_agent.interfaces.api_schema import AuditList
from recovery_agent.interfaces.ctl import main as ctl
from recovery_agent.scheduler.base import Job, Node
from recovery_agent.store import MIGRATIONS, Store

ADMIN, OWNER, OTHER = 0, 65534, 1           # root, nobody, daemon
OWNER_NAME = pwd.getpwuid(OWNER).pw_name
ME = pwd.getpwuid(os.getuid()).pw_name
VERBS = ["mode", "mode_clear", "exclude", "include", "ack", "complete", "cancel"]


class SlurmNodes:
    """A scheduler whose node listing is these names (exclude asks it)."""

    def __init__(self, *names):
        self.names = names

    def list_nodes(self, names=None):
        return [Node(name=n, state="IDLE") for n in self.names]


@pytest.fixture(autouse=True)
def slurm_has_nodes(monkeypatch):
    monkeypatch.setattr("recovery_agent.interfaces.service.scheduler_for",
                        lambda cfg: SlurmNodes("node1", "node2", "node3"))


def add_job(store, job_id, user, env="ext") -> int:
    job = Job(job_id=job_id, numeric_id=int(job_id), submit_time=1000, restart_count=0,
              user=user, name="train", state="FAILED")
    with store.lock:
        pk = store.record_job(job, "c1", env=env, mode="", spec=env)
        store.record_attempt(pk, job)
    return pk


def add_rec(store, pk, job_id, user) -> int:
    with store.lock:
        return store.add_recommendation({
            "job": pk, "attempt": 0, "job_id": job_id, "scope": "job", "action": "requeue",
            "rule": "unknown", "reason": "no evidence", "target_nodes": [], "exclude": [],
            "mode": "external", "status": "proposed", "restart_at": 0, "submit_time": 1000,
            "env": "ext", "user": user})


def operator_rows(store) -> list[dict]:
    return list(store.db["operator_actions"].rows_where(order_by="id"))


# -- straight on the store: recovery-ctl --db, the caller is this process's uid -------

@pytest.fixture
def on_store(tmp_path, monkeypatch):
    config = tmp_path / "recovery.toml"
    config.write_text(f'[agent]\ncluster = "c1"\nstate_dir = "{tmp_path}"\n'
                      f'[api]\nauth = "none"\nadmin_uids = "{os.getuid()}"\n'
                      '[environments.default]\nmode = "monitor"\n'
                      '[environments.prod]\nmax_restarts = 5\n'
                      '[environments.ext]\nmode = "external"\n')
    monkeypatch.setenv("RECOVERY_CONFIG", str(config))
    store = Store(tmp_path / "recovery.db")
    recs = [add_rec(store, add_job(store, str(4410 + i), "ana"), str(4410 + i), "ana")
            for i in range(2)]
    return str(tmp_path / "recovery.db"), store, recs


def run(*args):
    return CliRunner().invoke(ctl, list(args), catch_exceptions=False)


def session(db, recs) -> None:
    """One of each operator change, each one asked for with a reason."""
    for args in (["mode", "prod", "action", "--reason", "two quiet weeks"],
                 ["mode", "prod", "--clear", "--reason", "back to the file"],
                 ["exclude", "node3", "--reason", "IB flaps"],
                 ["include", "node3", "--reason", "cable swapped"],
                 ["ack", str(recs[0]), "--reason", "controller takes it"],
                 ["complete", str(recs[0]), "--outcome", "done", "--detail", "requeued"],
                 ["cancel", str(recs[1]), "--reason", "maintenance"]):
        result = run(*args, "--db", db)
        assert result.exit_code == 0, (args, result.output)


def test_every_operator_change_is_an_audit_record_in_every_format(on_store):
    db, store, recs = on_store
    session(db, recs)
    changes = [json.loads(line) for line in run("audit", "--db", db, "--json").output
               .splitlines()]
    ops = [c for c in changes if c["kind"] == "operator"]
    assert [c["action"] for c in ops] == VERBS
    assert {(c["actor"], c["actor_uid"], c["role"], c["via"]) for c in ops} == {
        (ME, os.getuid(), "admin", "store")}
    seen = {c["action"]: (c["target"], c["before"], c["after"], c["reason"]) for c in ops}
    assert seen == {
        "mode": ("prod", "monitor", "action", "two quiet weeks"),
        "mode_clear": ("prod", "action", "monitor", "back to the file"),
        "exclude": ("node3", "included", "excluded", "IB flaps"),
        "include": ("node3", "excluded", "included", "cable swapped"),
        "ack": (f"#{recs[0]}", "proposed", "executing", "controller takes it"),
        "complete": (f"#{recs[0]}", "executing", "done", "requeued"),
        "cancel": (f"#{recs[1]}", "proposed", "cancelled", "maintenance")}
    assert [c["job_id"] for c in ops if c["rec"]] == ["4410", "4410", "4411"]
    # the recommendations are there too, everything in time order
    assert [c["kind"] for c in changes[:2]] == ["recommendation"] * 2
    assert [c["created"] for c in changes] == sorted(c["created"] for c in changes)
    text = run("audit", "--db", db).output
    for verb in VERBS:
        assert f"{verb} " in text
    assert f"operator #{ops[0]['id']} mode prod: monitor -> action by {ME}" in text
    assert "reason:   IB flaps" in text
    rows = list(csv.DictReader(io.StringIO(run("audit", "--db", db, "--format", "csv")
                                           .output)))
    operator = [r for r in rows if r["kind"] == "operator"]
    assert [r["action"] for r in operator] == VERBS
    assert operator[2]["target_nodes"] == "node3" and operator[2]["reason"] == "IB flaps"
    assert {r["actor"] for r in operator} == {ME}
    assert all(r["kind"] == "recommendation" for r in rows if r not in operator)
    # --job: that job's recommendation and the changes made to it
    mine = [json.loads(line) for line in run("audit", "--db", db, "--json", "--job", "4411")
            .output.splitlines()]
    assert [(c["kind"], c["action"]) for c in mine] == [("recommendation", "requeue"),
                                                         ("operator", "cancel")]


def test_audit_since_and_until_filter_operator_changes_by_their_time(on_store):
    db, store, recs = on_store
    session(db, recs)
    # move the first four changes a day back, as if made yesterday
    with store.lock, store.db.atomic():
        store.db.execute("update operator_actions set ts = ts - 86400 where id <= 4")
    recent = [json.loads(line) for line in run("audit", "--db", db, "--json", "--since", "1h")
              .output.splitlines()]
    assert [c["action"] for c in recent if c["kind"] == "operator"] == ["ack", "complete",
                                                                        "cancel"]
    older = [json.loads(line) for line in run("audit", "--db", db, "--json", "--until", "2h")
             .output.splitlines()]
    assert [c["action"] for c in older] == ["mode", "mode_clear", "exclude", "include"]
    assert run("audit", "--db", db, "--since", "2999-01-01").output == ""


def test_a_refused_change_records_nothing(on_store, monkeypatch, caplog):
    db, store, recs = on_store
    for args in (["mode", "nope", "action"], ["exclude", "nodeZZ", "--reason", "typo"],
                 ["include", "node9"], ["complete", str(recs[0]), "--outcome", "done"],
                 ["ack", "999"]):
        assert run(*args, "--db", db).exit_code == 1, args
    # Slurm cannot be asked (a 503 through the API): refused, nothing recorded
    monkeypatch.setattr("recovery_agent.interfaces.service.scheduler_for", lambda cfg: None)
    refused = run("exclude", "node1", "--reason", "x", "--db", db)
    assert refused.exit_code == 1 and "cannot ask Slurm" in refused.output
    assert operator_rows(store) == []
    assert not list(store.db["events"].rows_where("kind like 'api_%'"))
    assert json.loads(run("show", "config", "--db", db, "--json").output)[
        "environments"]["prod"]["mode_source"]["source"] == "file"


def test_mode_clear_gives_the_file_mode_back_and_show_config_says_whose(on_store):
    db, store, _ = on_store
    shown = json.loads(run("show", "config", "--db", db, "--json").output)
    assert shown["environments"]["prod"]["mode_source"] == {
        "source": "file", "file_mode": "monitor", "set_by": None, "set_uid": None,
        "set_at": None, "reason": None}
    assert run("mode", "prod", "action", "--reason", "go", "--db", db).exit_code == 0
    shown = json.loads(run("show", "config", "--db", db, "--json").output)["environments"]
    prod = shown["prod"]
    assert prod["mode"] == "action" and prod["max_restarts"] == 5
    assert {k: prod["mode_source"][k] for k in ("source", "file_mode", "set_by", "set_uid",
                                                "reason")} == {
        "source": "operator", "file_mode": "monitor", "set_by": ME, "set_uid": os.getuid(),
        "reason": "go"}
    assert shown["ext"]["mode_source"]["source"] == "file"
    text = run("show", "config", "--db", db).output
    prod_text = text[text.index("[environments.prod]"):]
    assert f'mode = "action"  # set by {ME} (uid {os.getuid()}) at ' in prod_text
    assert 'the config file says "monitor"' in prod_text
    cleared = run("mode", "prod", "--clear", "--db", db)
    assert cleared.exit_code == 0 and "action -> monitor (the config file's)" in cleared.output
    shown = json.loads(run("show", "config", "--db", db, "--json").output)["environments"]
    assert (shown["prod"]["mode"], shown["prod"]["mode_source"]["source"]) == ("monitor",
                                                                                "file")
    assert 'mode = "monitor"  # from the config file' in run("show", "config", "--db",
                                                              db).output
    # nothing to clear: said, and not recorded again
    again = run("mode", "prod", "--clear", "--db", db)
    assert again.exit_code == 0 and "nothing to clear" in again.output
    assert [r["action"] for r in operator_rows(store)] == ["mode", "mode_clear"]
    assert run("mode", "prod", "--db", db).exit_code == 2        # neither MODE nor --clear
    assert run("mode", "prod", "action", "--clear", "--db", db).exit_code == 2


# -- through the API ------------------------------------------------------------------

def api(tmp_path):
    cfg = from_mapping({"agent": {"cluster": "c1"},
                        "api": {"auth": "none", "admin_uids": "0"},
                        "environments": {"ext": {"mode": "external"},
                                         "act": {"mode": "action"}}})
    store = Store(tmp_path / "r.db")
    return store, TestClient(create_app(cfg, Ingest(store, "c1")))


def post(client, path, uid, body=None):
    return client.post(path, content=json.dumps(body or {}),
                       headers={"X-Recovery-Uid": str(uid)})


def test_the_api_records_each_change_and_lists_them_by_reader(tmp_path, caplog):
    store, client = api(tmp_path)
    mine = add_rec(store, add_job(store, "42", OWNER_NAME), "42", OWNER_NAME)
    theirs = add_rec(store, add_job(store, "43", "other"), "43", "other")
    caplog.set_level(logging.WARNING, "recovery_agent.interfaces.service")
    # refused: a user changing a mode, acking, touching another user's job
    assert post(client, "/v1/environments/act/mode", OWNER, {"mode": "monitor"}
                ).status_code == 403
    assert post(client, "/v1/environments/act/mode/clear", OWNER).status_code == 403
    assert post(client, f"/v1/recommendations/{mine}/ack", OWNER).status_code == 403
    assert post(client, f"/v1/recommendations/{theirs}/cancel", OWNER).status_code == 403
    assert post(client, "/v1/nodes/node1/exclude", ADMIN, {"reason": " "}).status_code == 400
    assert operator_rows(store) == []
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 4 and all(f"uid {OWNER}" in line for line in refusals)
    # done: admin changes, and the owner's cancel of their own job's recommendation
    for path, uid, body in (("/v1/environments/act/mode", ADMIN,
                             {"mode": "monitor", "reason": "incident 7"}),
                            ("/v1/environments/act/mode/clear", ADMIN, {"reason": "over"}),
                            ("/v1/nodes/node2/exclude", ADMIN, {"reason": "fan"}),
                            ("/v1/nodes/node2/include", ADMIN, {"reason": "fan fixed"}),
                            (f"/v1/recommendations/{theirs}/ack", ADMIN, {"reason": "mine"}),
                            (f"/v1/recommendations/{theirs}/complete", ADMIN,
                             {"outcome": "failed", "detail": "scontrol said no"}),
                            (f"/v1/recommendations/{mine}/cancel", OWNER, {"reason": "oops"})):
        answer = post(client, path, uid, body)
        assert answer.status_code == 200, (path, answer.text)
    rows = operator_rows(store)
    assert [r["action"] for r in rows] == VERBS
    assert [(r["actor_uid"], r["role"], r["via"]) for r in rows] == \
        [(ADMIN, "admin", "api")] * 6 + [(OWNER, "user", "api")]
    assert rows[-1]["actor"] == OWNER_NAME and rows[-1]["job_user"] == OWNER_NAME
    assert (rows[5]["before"], rows[5]["after"], rows[5]["reason"]) == (
        "executing", "failed", "scontrol said no")
    # the listing: an admin (and a trusted reader) sees every change ...
    listed = client.get("/v1/audit").json()
    AuditList.model_validate(listed)
    kinds = [(r["kind"], r["action"]) for r in listed["records"]]
    assert [a for k, a in kinds if k == "operator"] == VERBS
    assert [a for k, a in kinds if k == "recommendation"] == ["requeue", "requeue"]
    assert listed["truncated"] is False
    one = client.get("/v1/audit", params={"limit": 2}).json()
    assert one["truncated"] is True and [r["action"] for r in one["records"]] == [
        "complete", "cancel"]
    later = client.get("/v1/audit", params={"since": rows[4]["ts"]}).json()["records"]
    assert [r["action"] for r in later] == ["ack", "complete", "cancel"]
    # ... a user, signed as themselves, only their own job's record and its change
    from recovery_agent.interfaces import api_v1
    # (with auth "none", a read goes by who owns the socket: here that is the user)
    original = api_v1.local_peer_uid
    api_v1.local_peer_uid = lambda client_addr, server: OWNER
    try:
        theirs_view = client.get("/v1/audit").json()["records"]
    finally:
        api_v1.local_peer_uid = original
    assert [(r["kind"], r["action"]) for r in theirs_view] == [
        ("recommendation", "requeue"), ("operator", "cancel")]
    assert {r.get("job_id") for r in theirs_view} == {"42"}
    assert client.get("/v1/audit", params={"job": "999"}).status_code == 404


def test_the_console_lists_operator_changes(tmp_path):
    store, client = api(tmp_path)
    post(client, "/v1/environments/act/mode", ADMIN, {"mode": "monitor", "reason": "calm"})
    post(client, "/v1/nodes/node2/exclude", ADMIN, {"reason": "fan <noisy>"})
    page = client.get("/console").text
    part = client.get("/console/part/changes").text
    for text in (page, part):
        assert "<h2>Operator changes</h2>" in text
        assert "action → monitor" in text and "included → excluded" in text
        assert "fan &lt;noisy&gt;" in text and "href='/console/node/node2'" in text
    assert part.index("exclude") < part.index("<td>mode</td>")    # newest first


def test_migration_011_carries_over_the_operator_events_already_stored(tmp_path):
    path = tmp_path / "old.db"
    db = Database(sqlite3.connect(path))
    db["_migrations"].create({"name": str, "applied_at": float}, pk="name")
    for name, step in MIGRATIONS[:10]:
        step(db)
        db["_migrations"].insert({"name": name, "applied_at": 1.0})
    db["jobs"].insert({"id": 1, "cluster": "c1", "job_id": "7", "submit_time": 1,
                       "user": "ana"})
    events = [(None, "api_mode", {"uid": 0, "user": "root", "env": "prod",
                                  "before": "monitor", "after": "action"}),
              (None, "api_exclude", {"uid": 0, "user": "root", "node": "node3",
                                     "reason": "flaps", "forced": "Slurm has no node"}),
              (1, "api_cancel", {"uid": 1001, "user": "ana", "rec": 5}),
              (1, "verdict", {"uid": 3}),
              (None, "api_include", "not json")]
    for job, kind, data in events:
        db["events"].insert({"job": job, "ts": 100.0, "kind": kind, "message": "m",
                             "data": json.dumps(data) if isinstance(data, dict) else data})
    db.conn.commit()
    db.conn.close()
    store = Store(path)
    rows = operator_rows(store)
    assert [(r["action"], r["actor"], r["actor_uid"], r["target"], r["before"], r["after"],
             r["reason"]) for r in rows] == [
        ("mode", "root", 0, "prod", "monitor", "action", None),
        ("exclude", "root", 0, "node3", None, "excluded", "flaps"),
        ("cancel", "ana", 1001, "#5", None, "cancelled", None)]
    assert rows[2]["job_id"] == "7" and rows[2]["job_user"] == "ana"
    assert json.loads(rows[1]["data"])["forced"] == "Slurm has no node"
    # the carried-over mode change names who set the mode that is in force
    store.set_state("mode_overrides", {"prod": "action"})
    from recovery_agent.interfaces.service import Service
    cfg = from_mapping({"environments": {"prod": {}}})
    assert Service(cfg, store).environments()["prod"]["set_by"] == "root"
