"""recovery-ctl as a Slurm admin expects it (issue 17): ISO times with the date
(--utc), --json on every verb, -P/-n/-o on listings, hostlists, Slurm state
codes, show recommendation, complete, --version, exclude checked against
Slurm's nodes, and text without Python's True/False or raw floats."""
from __future__ import annotations

import csv
import io
import json
import os
import re
from datetime import datetime

import pytest
from click.testing import CliRunner

from recovery_agent.errors import SchedulerError
from recovery_agent.interfaces.ctl import main as ctl
from recovery_agent.scheduler.base import Job, Node
from recovery_agent.store import Store

CREATED = 1764620210.25          # 2025-12-01T20:16:50.25Z
ISO_LOCAL = datetime.fromtimestamp(CREATED).strftime("%Y-%m-%dT%H:%M:%S")


class FakeSlurm:
    """What the CLI asks of Slurm here: its nodes, its jobs (none)."""

    def __init__(self, *names, fail=False):
        self.names, self.fail = names, fail

    def list_nodes(self, names=None):
        if self.fail:
            raise SchedulerError("sinfo --json: exit 1: Unable to contact slurm controller",
                                 argv=["sinfo", "--json"])
        return [Node(name=n, state="IDLE") for n in self.names]

    def list_jobs(self):
        return []


@pytest.fixture
def slurm(monkeypatch):
    fake = FakeSlurm("node1", "node2", "node3", "node4")
    for where in ("recovery_agent.interfaces.service", "recovery_agent.interfaces.ctl.audit",
                  "recovery_agent.interfaces.ctl.host"):
        monkeypatch.setattr(f"{where}.scheduler_for", lambda cfg: fake, raising=False)
    return fake


@pytest.fixture
def db(tmp_path, monkeypatch, slurm):
    config = tmp_path / "recovery.toml"
    config.write_text(f'[agent]\ncluster = "c1"\nstate_dir = "{tmp_path}"\n'
                      f'[api]\nauth = "none"\nadmin_uids = "{os.getuid()}"\n'
                      '[environments.prod]\nmode = "monitor"\n'
                      '[environments.ext]\nmode = "external"\n')
    monkeypatch.setenv("RECOVERY_CONFIG", str(config))
    store = Store(tmp_path / "recovery.db")
    with store.lock:
        for job_id, state, env in (("4410", "RUNNING", "prod"), ("4411", "PENDING", "prod"),
                                   ("4412", "COMPLETING", "ext")):
            job = Job(job_id=job_id, numeric_id=int(job_id), submit_time=1000, user="ana",
                      name="llm", state=state, nodes=("node1", "node2"))
            pk = store.record_job(job, "c1", env=env, mode="", spec=env)
            store.record_attempt(pk, job)
        rec = store.add_recommendation({
            "job": pk - 2, "attempt": 0, "job_id": "4410", "scope": "job",
            "action": "requeue_exclude", "rule": "hardware", "reason": "xid 79 on node2",
            "target_nodes": ["node2"], "exclude": ["node2"], "mode": "action",
            "status": "done", "restart_at": 0, "env": "prod", "user": "ana",
            "pattern_ids": ["node.xid"], "created": CREATED, "detected_at": CREATED,
            "done_at": CREATED + 1,
            "evidence": [{"pattern": "node.xid", "lines": [{"text": "NVRM: Xid 79"}]}],
            "attribution": {"blame": "node", "confidence": 0.9, "nodes": ["node2"],
                            "suspects": ["node2"]}})
        ext = store.add_recommendation({
            "job": pk, "attempt": 0, "job_id": "4412", "scope": "job",
            "action": "requeue", "rule": "hang", "reason": "hang", "target_nodes": [],
            "exclude": [], "mode": "external", "status": "proposed", "restart_at": 0,
            "env": "ext", "user": "ana"})
        store.add_event(pk - 2, "verdict", "node: gpu_hardware -> requeue_exclude (node2)",
                        attempt=0, ts=CREATED)
        store.set_node("node2", drained_by_us=1, drain_reason="recovery: xid 79")
        store.add_strike("node3", "hang", 0.923456)
    store.add_step(rec, "requeue_hold", "ok", "restart 0 -> 1", ts=CREATED)
    return str(tmp_path / "recovery.db"), store, rec, ext


def run(*args):
    return CliRunner().invoke(ctl, list(args), catch_exceptions=False)


# -- times: ISO 8601 with the date; --utc -------------------------------------------

def test_times_print_with_the_date_local_or_utc(db):
    path, _, rec, _ = db
    shown = run("show", "job", "4410", "--db", path).output
    assert f"{ISO_LOCAL} [0]  verdict" in shown
    assert "2025-12-01T20:16:50Z [0]  verdict" in run("--utc", "show", "job", "4410",
                                                       "--db", path).output
    recs = run("--utc", "show", "recommendations", "--db", path, "-P").output
    assert f"{rec}|2025-12-01T20:16:50Z|4410|" in recs
    audit = run("audit", "--db", path).output
    assert f"proposed {ISO_LOCAL}" in audit and f"{ISO_LOCAL} requeue_hold" in audit
    assert not re.search(r"(?<![\dT-])\d\d:\d\d:\d\d\.\d{3}", shown + audit)


def test_report_window_has_dates(db):
    path = db[0]
    out = run("--utc", "report", "--since", "7d", "--db", path).output
    start, end = re.match(r"window (\S+) \.\. (\S+)", out).groups()
    for stamp in (start, end):
        datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")
    gap = (datetime.strptime(end, "%Y-%m-%dT%H:%M:%SZ")
           - datetime.strptime(start, "%Y-%m-%dT%H:%M:%SZ"))
    assert round(gap.total_seconds()) == 7 * 86400


def test_audit_csv_has_iso_times_and_no_json_in_cells(db):
    path = db[0]
    rows = list(csv.DictReader(io.StringIO(run("--utc", "audit", "--db", path, "--format",
                                               "csv").output)))
    first = rows[0]
    assert first["created"] == "2025-12-01T20:16:50Z"
    assert first["detected_at"] == "2025-12-01T20:16:50Z"
    assert first["done_at"] == "2025-12-01T20:16:51Z"
    assert first["blame"] == "node" and first["confidence"] == "0.90"
    assert first["attributed_nodes"] == "node2" and first["pattern_ids"] == "node.xid"
    assert first["evidence"] == "[node.xid] NVRM: Xid 79"
    for row in rows:
        for cell in row.values():
            try:
                value = json.loads(cell)
            except ValueError:
                continue
            assert not isinstance(value, (list, dict)), cell


# -- --json on every verb ------------------------------------------------------------

def test_every_change_answers_json(db):
    path, _, _, ext = db
    assert json.loads(run("mode", "prod", "action", "--db", path, "--json").output)["mode"] \
        == "action"
    assert json.loads(run("exclude", "node3", "--reason", "x", "--db", path, "--json")
                      .output) == {"node": "node3", "excluded": True}
    assert json.loads(run("include", "node3", "--db", path, "--json").output) == \
        {"node": "node3", "excluded": False}
    claimed = json.loads(run("ack", str(ext), "--db", path, "--json").output)
    assert claimed["status"] == "executing"
    done = json.loads(run("complete", str(ext), "--outcome", "done", "--db", path,
                          "--json").output)
    assert done == {"id": ext, "status": "done"}
    watchdog = json.loads(run("watchdog", "--db", path, "--json").output)
    assert watchdog["released"] == [] and watchdog["notes"][-1].endswith("0 job(s) released")


def test_cancel_answers_json(db):
    path, _, _, ext = db
    assert json.loads(run("cancel", str(ext), "--db", path, "--json").output) == \
        {"id": ext, "status": "cancelled"}


# -- listings: -P, -n, -o; through tabulate -----------------------------------------

def test_listings_take_parsable_noheader_and_fields(db):
    path = db[0]
    out = run("show", "jobs", "--db", path, "-P", "-o", "jobid,STATE").output.splitlines()
    assert out == ["JOBID|STATE", "4412|COMPLETING", "4411|PENDING", "4410|RUNNING"]
    out = run("show", "jobs", "--db", path, "-P", "-n", "-o", "state").output.splitlines()
    assert out == ["COMPLETING", "PENDING", "RUNNING"]
    header = run("show", "jobs", "--db", path).output.splitlines()[0].split()
    assert "CATEGORY" in header
    nodes = run("show", "nodes", "--db", path, "--noheader", "--format", "node,excluded")
    assert nodes.output.split() == ["node2", "no", "node3", "no"]
    recs = run("show", "recommendations", "--db", path, "--parsable2", "-o", "id,status")
    assert recs.output.splitlines()[0] == "ID|STATUS"


def test_an_unknown_field_is_refused_with_the_valid_ones(db):
    bad = run("show", "nodes", "--db", db[0], "-o", "node,colour")
    assert bad.exit_code == 2
    assert "unknown field 'colour'" in bad.output and "NODE,HEALTH,SUSPECT" in bad.output


# -- hostlists, states ------------------------------------------------------------------

def test_show_node_and_exclude_take_hostlists(db):
    path, store, _, _ = db
    shown = run("show", "node", "node[2-3]", "--db", path)
    assert shown.exit_code == 0
    assert [line.split()[0] for line in shown.output.splitlines()
            if line.startswith("NodeName=")] == ["NodeName=node2", "NodeName=node3"]
    assert [n["name"] for n in json.loads(run("show", "node", "node[2-3]", "--db", path,
                                              "--json").output)] == ["node2", "node3"]
    done = run("exclude", "node[1,3-4]", "--reason", "rack work", "--db", path)
    assert done.exit_code == 0 and done.output.count("excluded from retries") == 3
    assert all(store.node(n)["excluded_by_operator"] == 1 for n in ("node1", "node3", "node4"))
    back = run("include", "node[1,3-4]", "--db", path)
    assert back.exit_code == 0 and store.node("node4")["excluded_by_operator"] == 0
    bad = run("show", "node", "node[1-", "--db", path)
    assert bad.exit_code == 2 and "not a hostlist" in bad.output


@pytest.mark.parametrize("state,expected", [
    ("running", ["4410"]), ("RUNNING", ["4410"]), ("R", ["4410"]), ("pd", ["4411"]),
    ("CG", ["4412"]), ("completing", ["4412"]), ("r,PD", ["4411", "4410"])])
def test_state_takes_slurm_names_and_codes(db, state, expected):
    rows = json.loads(run("show", "jobs", "--db", db[0], "--state", state, "--json").output)
    assert [r["job_id"] for r in rows] == expected


def test_an_unknown_state_is_refused(db):
    bad = run("show", "jobs", "--db", db[0], "--state", "runing")
    assert bad.exit_code == 2 and "RUNNING (R)" in bad.output


# -- show recommendation, complete, --version ----------------------------------------

def test_show_recommendation(db):
    path, _, rec, _ = db
    out = run("--utc", "show", "recommendation", str(rec), "--db", path).output
    assert out.startswith(f"Recommendation={rec} JobId=4410 Attempt=0 Action=requeue_exclude")
    assert "Created=2025-12-01T20:16:50Z" in out and "Evidence [node.xid] NVRM: Xid 79" in out
    assert "2025-12-01T20:16:50Z requeue_hold" in out
    assert json.loads(run("show", "recommendation", str(rec), "--db", path, "--json")
                      .output)["steps"][0]["step"] == "requeue_hold"
    missing = run("show", "recommendation", "999", "--db", path)
    assert missing.exit_code == 1 and "no recommendation 999" in missing.output


def test_complete_takes_the_services_outcomes(db):
    path, store, _, ext = db
    assert run("ack", str(ext), "--db", path).exit_code == 0
    bad = run("complete", str(ext), "--outcome", "maybe", "--db", path)
    assert bad.exit_code == 2 and "'done'" in bad.output and "'failed'" in bad.output
    out = run("complete", str(ext), "--outcome", "failed", "--detail", "scontrol refused",
              "--db", path)
    assert out.exit_code == 0 and out.output.strip() == f"#{ext}: failed"
    assert store.rec(ext).error == "scontrol refused"


def test_version_is_the_packages():
    from importlib.metadata import version
    out = run("--version").output
    assert out.strip() == f"recovery-ctl {version('slurm-recovery')}"


# -- exclude: a node Slurm does not know is refused -------------------------------------

def test_exclude_of_a_node_slurm_does_not_know_is_refused_unless_forced(db):
    path, store, _, _ = db
    refused = run("exclude", "nodeZZ", "--reason", "typo", "--db", path)
    assert refused.exit_code == 1 and "Slurm has no node 'nodeZZ'" in refused.output
    assert "--force" in refused.output and store.node("nodeZZ") is None
    forced = run("exclude", "nodeZZ", "--reason", "retired", "--force", "--db", path)
    assert forced.exit_code == 0
    assert "nodeZZ: excluded from retries (forced: Slurm has no node 'nodeZZ')" in forced.output
    (event,) = store.db["events"].rows_where("kind = 'api_exclude'")
    assert "forced" in event["message"]


def test_exclude_when_slurm_cannot_be_asked_is_refused_not_taken_as_unknown(db, slurm):
    path, store, _, _ = db
    slurm.fail = True
    refused = run("exclude", "node3", "--reason", "x", "--db", path)
    assert refused.exit_code == 1
    assert "cannot ask Slurm which nodes it has" in refused.output
    assert "Unable to contact slurm controller" in refused.output
    assert "has no node" not in refused.output and store.node("node3") is None
    forced = run("exclude", "node3", "--reason", "x", "--force", "--db", path)
    assert forced.exit_code == 0 and "forced: cannot ask Slurm" in forced.output


def test_exclude_with_no_scheduler_backend_is_refused(db, monkeypatch):
    monkeypatch.setattr("recovery_agent.interfaces.service.scheduler_for", lambda cfg: None)
    refused = run("exclude", "node3", "--reason", "x", "--db", db[0])
    assert refused.exit_code == 1 and "no usable scheduler backend" in refused.output


# -- text never shows Python's True/False or raw floats ------------------------------

def test_node_text_says_health_in_words(db):
    path = db[0]
    nodes = run("show", "nodes", "--db", path).output
    one = run("show", "node", "node[2-3]", "--db", path).output
    for text in (nodes, one):
        assert "True" not in text and "False" not in text
        assert not re.search(r"\d\.\d{3,}", text), text
    by_node = {line.split()[0]: line for line in nodes.splitlines()[1:]}
    assert "drained by recovery (xid 79)" in by_node["node2"]
    assert re.search(r"suspect \(score 0\.\d+\)", by_node["node3"])
    assert "Health=drained by recovery (xid 79)" in one and "DrainedByUs=yes" in one


def test_every_verb_has_json_and_every_listing_the_slurm_flags():
    import click

    def commands(group, path=()):
        for name, cmd in group.commands.items():
            if isinstance(cmd, click.Group):
                yield from commands(cmd, path + (name,))
            else:
                yield " ".join(path + (name,)), {o for p in cmd.params for o in p.opts}
    found = dict(commands(ctl))
    assert {"show recommendation", "complete"} <= set(found)
    assert [name for name, opts in found.items() if "--json" not in opts] == []
    for listing in ("show jobs", "show nodes", "show recommendations"):
        assert {"-P", "--parsable2", "-n", "--noheader", "-o", "--format"} <= found[listing]
