"""Named schema migrations, applied in order and recorded in ``_migrations``.

A migration is never edited once it has shipped: change the schema by adding a
new one at the end of :data:`MIGRATIONS`.
"""
from __future__ import annotations

import json
import time
from typing import Callable

from sqlite_utils import Database

MIGRATIONS_TABLE = "_migrations"


def m001_initial(db: Database) -> None:
    """The tables of DESIGN.md: jobs, attempts, events, detections,
    recommendations and nodes."""
    db["jobs"].create({
        "id": int, "cluster": str, "job_id": str, "submit_time": int,
        "numeric_id": int, "array_job_id": int, "array_task_id": int, "name": str,
        "user": str, "env": str, "mode": str, "spec": str, "state": str,
        "restart_count": int, "first_seen": float, "last_seen": float,
    }, pk="id", not_null={"cluster", "job_id", "submit_time"},
        defaults={"restart_count": 0, "state": "UNKNOWN"})
    db["jobs"].create_index(["cluster", "job_id", "submit_time"], unique=True)
    db["jobs"].create_index(["state"])

    db["attempts"].create({
        "id": int, "job": int, "attempt": int, "nodes": str, "batch_host": str,
        "start_time": int, "end_time": int, "state": str, "exit_code": int,
        "exit_signal": int, "first_seen": float, "last_seen": float,
    }, pk="id", foreign_keys=[("job", "jobs", "id")], not_null={"job", "attempt"})
    db["attempts"].create_index(["job", "attempt"], unique=True)

    db["events"].create({
        "id": int, "job": int, "attempt": int, "ts": float, "kind": str, "source": str,
        "message": str, "data": str,
    }, pk="id", foreign_keys=[("job", "jobs", "id")], not_null={"ts", "kind"})
    db["events"].create_index(["job", "ts"])

    db["detections"].create({
        "id": int, "job": int, "attempt": int, "ts": float, "category": str,
        "pattern_id": str, "severity": str, "node": str, "gpu": str, "rank": int,
        "source": str, "evidence": str,
    }, pk="id", foreign_keys=[("job", "jobs", "id")], not_null={"ts", "category"})
    db["detections"].create_index(["job", "attempt"])

    db["recommendations"].create({
        "id": int, "job": int, "attempt": int, "action": str, "target_nodes": str,
        "reason_category": str, "evidence": str, "mode": str, "status": str,
        "created": float, "updated": float, "error": str, "actor": str,
    }, pk="id", foreign_keys=[("job", "jobs", "id")],
        not_null={"action", "status", "mode", "created"})
    db["recommendations"].create_index(["status"])
    db["recommendations"].create_index(["job", "attempt"])

    db["nodes"].create({
        "name": str, "cluster": str, "suspect_score": float, "strikes": int,
        "drained_by_us": int, "drain_reason": str, "drained_at": float,
        "excluded_by_operator": int, "last_health": str, "updated": float,
    }, pk="name", defaults={"suspect_score": 0.0, "strikes": 0, "drained_by_us": 0,
                            "excluded_by_operator": 0})


def m002_node_reports(db: Database) -> None:
    """What the node hooks send: one row per report (idempotent by report id),
    and the XIDs they found, tied to node, GPU and job."""
    db["node_reports"].create({
        "id": int, "report_id": str, "hook": str, "cluster": str, "node": str,
        "job": int, "attempt": int, "created": float, "received": float,
        "gpu_ok": int, "gpu_count": int, "gpus": str, "preflight": str,
        "exit_code": int, "exit_signal": int, "sender_uid": int, "body": str,
    }, pk="id", foreign_keys=[("job", "jobs", "id")],
        not_null={"report_id", "hook", "node", "received"})
    db["node_reports"].create_index(["report_id"], unique=True)
    db["node_reports"].create_index(["node", "received"])
    db["node_reports"].create_index(["job"])
    db["xids"].create({
        "id": int, "report": int, "job": int, "attempt": int, "node": str, "kind": str,
        "xid": int, "pci": str, "gpu_index": int, "gpu_uuid": str, "time": float,
        "message": str, "raw": str, "fingerprint": str,
    }, pk="id", foreign_keys=[("report", "node_reports", "id"), ("job", "jobs", "id")],
        not_null={"node", "xid", "fingerprint"})
    db["xids"].create_index(["fingerprint", "job"], unique=True)
    db["xids"].create_index(["node", "time"])


def m003_log_cursors(db: Database) -> None:
    """Where the log tailer stands in each job output file (inode, byte offset
    of the first undelivered line, lines delivered), so that an agent restart
    resumes there instead of reading every file from the start."""
    db["log_cursors"].create({
        "path": str, "inode": int, "offset": int, "lineno": int, "updated": float,
    }, pk="path", not_null={"inode", "offset", "lineno"})


def m004_attempt_checkpoints(db: Database) -> None:
    """The newest checkpoint seen during each attempt, for the policy "no new
    checkpoint over the last K attempts"."""
    db["attempts"].add_column("ckpt_path", str)
    db["attempts"].add_column("ckpt_step", int)
    db["attempts"].add_column("ckpt_time", float)


def m005_decide_and_act(db: Database) -> None:
    """The write-ahead audit: the columns a recommendation carries through its
    lifecycle, one row per execution step, node strikes for the lemon score,
    and a small key/value table for the agent's heartbeat."""
    for name, kind in [("job_id", str), ("cluster", str), ("env", str), ("scope", str),
                       ("rule", str), ("reason", str), ("trigger", str),
                       ("attribution", str), ("pattern_ids", str), ("exclude", str),
                       ("restart_at", int), ("submit_time", int), ("parent", int),
                       ("tries", int), ("next_try", float), ("held_at", float),
                       ("failure_at", float), ("detected_at", float), ("done_at", float),
                       ("running_again_at", float), ("workload", str), ("user", str),
                       ("claimed_by", str), ("claim_expires", float)]:
        db["recommendations"].add_column(name, kind)
    # one job-level decision per attempt: a restarted agent cannot decide twice
    db.execute("create unique index recommendations_one_per_attempt on "
               "recommendations (job, attempt) where scope = 'job'")
    db["rec_steps"].create({
        "id": int, "rec": int, "step": str, "state": str, "ts": float, "detail": str,
    }, pk="id", foreign_keys=[("rec", "recommendations", "id")],
        not_null={"rec", "step", "state", "ts"})
    db["rec_steps"].create_index(["rec"])
    db["strikes"].create({
        "id": int, "node": str, "ts": float, "job": int, "user": str, "category": str,
        "weight": float, "rec": int,
    }, pk="id", not_null={"node", "ts", "category", "weight"})
    db["strikes"].create_index(["node", "ts"])
    db["agent_state"].create({"key": str, "value": str, "updated": float}, pk="key")


def m006_late_reports(db: Database) -> None:
    """Reports replayed from a node's spool: ``late``, when they were spooled
    and how they came (the hooks' ``delivery`` object); whether their attempt
    had its verdict already when they arrived (``after_verdict``), and when
    their fatal XIDs were then counted against the node (``counted_at``)."""
    table = db["node_reports"]
    table.add_column("late", int, not_null_default=0)
    table.add_column("spooled_at", float)
    table.add_column("delivery", str)
    table.add_column("after_verdict", int, not_null_default=0)
    table.add_column("counted_at", float)
    db.execute("create index node_reports_uncounted on node_reports (id) "
               "where after_verdict = 1 and counted_at is null")


def m007_drain_records(db: Database) -> None:
    """What makes a drain ours: the recommendation that made it and the reason,
    user and time Slurm showed right after (``scontrol show node``'s Reason=,
    its user and timestamp). A drain is ours while Slurm still shows exactly
    that; a human who drains the node again, whatever the wording, changes the
    timestamp."""
    table = db["nodes"]
    table.add_column("drain_rec", int)
    table.add_column("drain_slurm_reason", str)
    table.add_column("drain_slurm_user", str)
    table.add_column("drain_slurm_time", int)


def m008_strike_witness(db: Database) -> None:
    """Whether a strike rests on evidence the job did not write itself (a node
    report, Slurm's own node state, a line from a system log), which decides
    how far beyond the job it may reach (``policy.voiced``). Strikes made
    before this are read as unwitnessed."""
    db["strikes"].add_column("witnessed", int, not_null_default=0)


def m009_event_detections(db: Database) -> None:
    """Each ``detected`` event names the detection it announces
    (``events.detection``), so that a page shows the detection's own evidence
    line beside it, not the line of another detection of the same rule.
    Events written before this are linked here: the watch loop wrote each
    detection and its event together, in the same order, so the k-th event of
    a rule in an attempt is the k-th detection of that rule in that attempt."""
    db["events"].add_column("detection", int)
    found: dict[tuple, list[int]] = {}
    for row in db.execute("select id, job, attempt, pattern_id from detections "
                          "order by id").fetchall():
        found.setdefault((row[1], row[2], row[3]), []).append(row[0])
    links = []
    for row in db.execute("select id, job, attempt, message from events "
                          "where kind = 'detected' order by id").fetchall():
        same = found.get((row[1], row[2], (row[3] or "").split(" ", 1)[0]))
        if same:
            links.append((same.pop(0), row[0]))
    db.conn.executemany("update events set detection = ? where id = ?", links)


def m010_attempt_output_paths(db: Database) -> None:
    """The output files each attempt wrote (Slurm's StdOut and StdErr, with
    their patterns expanded), for the pages that point an admin at them.
    Attempts recorded before this have none."""
    db["attempts"].add_column("stdout", str)
    db["attempts"].add_column("stderr", str)


# the operator verbs of the API's audit events (``api_<verb>``), the rows 011 carries over
_OPERATOR_VERBS = ("mode", "exclude", "include", "ack", "complete", "cancel")


def m011_operator_actions(db: Database) -> None:
    """The operator's changes as audit records of their own, one row each:
    who (the uid munge or the kernel named, its user and role, and whether it
    came through the API or straight on the store), when, what (the verb and
    its target: an environment, a node, a recommendation and its job), the
    state before and after, and the reason given. Before this they were only
    ``api_<verb>`` timeline events; those are carried over (their role and
    path unknown), so the audit trail starts where the events did."""
    db["operator_actions"].create({
        "id": int, "ts": float, "action": str, "actor": str, "actor_uid": int, "role": str,
        "via": str, "target": str, "env": str, "node": str, "rec": int, "job": int,
        "job_id": str, "job_user": str, "before": str, "after": str, "reason": str,
        "data": str,
    }, pk="id", foreign_keys=[("job", "jobs", "id")],
        not_null={"ts", "action", "actor_uid"})
    db["operator_actions"].create_index(["ts"])
    db["operator_actions"].create_index(["action", "target"])
    db["operator_actions"].create_index(["job"])
    marks = ",".join("?" * len(_OPERATOR_VERBS))
    rows = db.execute(
        "select e.id, e.ts, e.kind, e.job, e.data, j.job_id, j.user from events e "
        "left join jobs j on j.id = e.job where e.kind in (" + marks + ") "
        "and json_valid(e.data) order by e.id",
        [f"api_{verb}" for verb in _OPERATOR_VERBS]).fetchall()
    for event_id, ts, kind, job, raw, job_id, user in rows:
        data = json.loads(raw) if raw else {}
        if not isinstance(data, dict) or not isinstance(data.get("uid"), int):
            continue
        verb = kind[len("api_"):]
        rec = data.get("rec") if isinstance(data.get("rec"), int) else None
        node = data.get("node") if isinstance(data.get("node"), str) else None
        env = data.get("env") if isinstance(data.get("env"), str) else None
        before, after = data.get("before"), data.get("after")
        if verb == "exclude":
            after = "excluded"
        elif verb == "include":
            after = "included"
        elif verb == "ack":
            after = "executing"
        elif verb == "complete":
            after = data.get("outcome")
        elif verb == "cancel":
            after = "cancelled"
        db["operator_actions"].insert({
            "ts": ts, "action": verb, "actor": data.get("user") or str(data["uid"]),
            "actor_uid": data["uid"], "role": None, "via": None,
            "target": env or node or (f"#{rec}" if rec else None), "env": env, "node": node,
            "rec": rec, "job": job, "job_id": job_id, "job_user": user,
            "before": before if isinstance(before, str) else None,
            "after": after if isinstance(after, str) else None,
            "reason": data.get("reason") if isinstance(data.get("reason"), str) else None,
            "data": json.dumps({"event": event_id, **({"forced": data["forced"]}
                                                       if data.get("forced") else {})}),
        })


def m012_node_states(db: Database) -> None:
    """Node states as the watch loop saw them: a row each time a node's state,
    flags or drain reason (with its user and time) changed between two
    listings, and whether the drain then shown was ours (the store's record of
    our drain matched it). ``recovery-ctl report`` scores monitor mode against
    this history, so a human drain lifted before the report still counts."""
    db["node_states"].create({
        "id": int, "ts": float, "cluster": str, "node": str, "state": str, "drained": int,
        "reason": str, "reason_user": str, "reason_time": int, "ours": int,
    }, pk="id", not_null={"ts", "node", "state"}, defaults={"drained": 0, "ours": 0})
    db["node_states"].create_index(["node", "id"])
    db["node_states"].create_index(["ts"])


def m015_ledger_progress(db: Database) -> None:
    """What the goodput ledger reads beyond the rest: the last training step
    each attempt's log reported and when (``last_step``, ``last_step_time``),
    for steps lost; and the job's batch script as Slurm lists it
    (``jobs.command``), to tell a stopped job resubmitted unchanged. Rows from
    before have neither (their figures read unknown)."""
    db["attempts"].add_column("last_step", int)
    db["attempts"].add_column("last_step_time", float)
    db["jobs"].add_column("command", str)
    db["jobs"].create_index(["cluster", "user", "name"], if_not_exists=True)


def m013_recommendation_runs(db: Database) -> None:
    """A run of a job is told apart by more than its restart count: slurmctld
    may run an attempt again at the same count (a controller restarted from
    older state puts it back in the queue itself). Each recommendation keeps
    the Slurm start time of the run it decides (``run_start``), and the one job
    decision allowed per attempt becomes one per run. Recommendations made
    before this take their attempt's start time, as the attempt row has it."""
    db["recommendations"].add_column("run_start", int)
    db.execute("update recommendations set run_start = (select a.start_time from attempts a "
               "where a.job = recommendations.job and a.attempt = recommendations.attempt)")
    db.execute("drop index if exists recommendations_one_per_attempt")
    db.execute("create unique index recommendations_one_per_run on recommendations "
               "(job, attempt, coalesce(run_start, 0)) where scope = 'job'")


def m014_report_runs(db: Database) -> None:
    """Which run of its attempt a node report belongs to (``run_start``): Slurm's
    start time where the hook's environment carries it (24.11 and later), else
    the time the node's prolog noted for that run. Reports stored before this
    have none and belong to any run of their attempt, as they did."""
    db["node_reports"].add_column("run_start", float)


def m016_node_degradation(db: Database) -> None:
    """The degradation score's changes per node and GPU (docs/proactive.md): a
    row each time a GPU's score, level or fired rules changed, with the
    evidence record (the rules with their values and thresholds) and the node
    report whose reading made the change."""
    db["node_degradation"].create({
        "id": int, "ts": float, "recorded": float, "cluster": str, "node": str, "gpu": str,
        "score": float, "level": str, "previous_score": float, "previous_level": str,
        "rules": str, "evidence": str, "report": int,
    }, pk="id", foreign_keys=[("report", "node_reports", "id")],
        not_null={"node", "gpu", "score", "level", "evidence"})
    db["node_degradation"].create_index(["node", "gpu", "id"])


MIGRATIONS: list[tuple[str, Callable[[Database], None]]] = [
    ("001_initial", m001_initial),
    ("002_node_reports", m002_node_reports),
    ("003_log_cursors", m003_log_cursors),
    ("004_attempt_checkpoints", m004_attempt_checkpoints),
    ("005_decide_and_act", m005_decide_and_act),
    ("006_late_reports", m006_late_reports),
    ("007_drain_records", m007_drain_records),
    ("008_strike_witness", m008_strike_witness),
    ("009_event_detections", m009_event_detections),
    ("010_attempt_output_paths", m010_attempt_output_paths),
    ("011_operator_actions", m011_operator_actions),
    ("012_node_states", m012_node_states),
    ("013_recommendation_runs", m013_recommendation_runs),
    ("014_report_runs", m014_report_runs),
    ("015_ledger_progress", m015_ledger_progress),
    ("016_node_degradation", m016_node_degradation),
]


def applied(db: Database) -> list[str]:
    if MIGRATIONS_TABLE not in db.table_names():
        return []
    return [row["name"] for row in db[MIGRATIONS_TABLE].rows_where(order_by="applied_at, name")]


def migrate(db: Database) -> list[str]:
    """Apply every migration not yet recorded; return the names applied now."""
    if MIGRATIONS_TABLE not in db.table_names():
        db[MIGRATIONS_TABLE].create({"name": str, "applied_at": float}, pk="name")
    done = set(applied(db))
    ran = []
    for name, step in MIGRATIONS:
        if name in done:
            continue
        with db.atomic():  # one transaction per migration: all of it or none
            step(db)
            db[MIGRATIONS_TABLE].insert({"name": name, "applied_at": time.time()})
        ran.append(name)
    return ran
