"""The store on a temp file: WAL, recorded migrations, job identity."""
from __future__ import annotations

import sqlite3

import pytest

from recovery_agent.errors import StoreError
from recovery_agent.scheduler.base import Job
from recovery_agent.store import MIGRATIONS, Store


def job(**kw) -> Job:
    base = dict(job_id="1234", numeric_id=1234, name="train", state="RUNNING",
                submit_time=1_800_000_000, nodes=("node1", "node2"), batch_host="node1",
                user="alice")
    base.update(kw)
    return Job(**base)


@pytest.fixture
def store(tmp_path):
    with Store(tmp_path / "sub" / "recovery.db") as s:
        yield s


def test_wal_and_tables(store):
    assert store.journal_mode == "wal"
    tables = set(store.db.table_names())
    assert {"jobs", "attempts", "events", "detections", "recommendations", "nodes"} <= tables


def test_migrations_are_recorded_once(tmp_path):
    path = tmp_path / "r.db"
    with Store(path) as first:
        assert first.migrations_run == [name for name, _ in MIGRATIONS]
    with Store(path) as second:
        assert second.migrations_run == []
        assert second.applied_migrations() == [name for name, _ in MIGRATIONS]


def test_failed_migration_leaves_nothing_half_done(tmp_path, monkeypatch):
    from recovery_agent.store import migrations

    def broken(db):
        db["half"].create({"id": int}, pk="id")
        raise sqlite3.OperationalError("boom")

    monkeypatch.setattr(migrations, "MIGRATIONS", [*migrations.MIGRATIONS, ("002_broken", broken)])
    with pytest.raises(StoreError, match="boom"):
        Store(tmp_path / "r.db")
    conn = sqlite3.connect(tmp_path / "r.db")
    names = {r[0] for r in conn.execute("select name from sqlite_master where type='table'")}
    assert "half" not in names and "jobs" in names
    assert [r[0] for r in conn.execute("select name from _migrations")] == \
        [name for name, _ in MIGRATIONS]  # the good ones stay applied


def test_record_job_is_idempotent_and_refreshes(store):
    pk = store.record_job(job(), cluster="c1", env="prod", mode="action")
    assert store.record_job(job(state="COMPLETING", restart_count=1), cluster="c1") == pk
    row = store.job(pk)
    assert row["state"] == "COMPLETING" and row["restart_count"] == 1
    assert len(store.jobs()) == 1


def test_job_id_reuse_starts_a_new_history(store):
    old = store.record_job(job(), cluster="c1")
    store.add_event(old, "registered", "first life")
    new = store.record_job(job(submit_time=1_900_000_000), cluster="c1")
    assert new != old
    assert store.find_job("c1", "1234")["id"] == new
    assert list(store.timeline(new)) == []
    assert [e["message"] for e in store.timeline(old)] == ["first life"]


def test_same_id_on_two_clusters(store):
    assert store.record_job(job(), cluster="a") != store.record_job(job(), cluster="b")


def test_attempts_and_timeline(store):
    pk = store.record_job(job(), cluster="c1")
    store.record_attempt(pk, job())
    store.record_attempt(pk, job(state="FAILED", exit_code=1))
    store.record_attempt(pk, job(restart_count=1, nodes=("node3", "node4")))
    attempts = store.attempts(pk)
    assert [(a["attempt"], a["state"]) for a in attempts] == [(0, "FAILED"), (1, "RUNNING")]
    assert attempts[1]["nodes"] == ["node3", "node4"]
    store.add_event(pk, "detected", "xid 79 on node1", attempt=0, data={"xid": 79}, ts=2.0)
    store.add_event(pk, "registered", "prolog", attempt=0, ts=1.0)
    events = list(store.timeline(pk))
    assert [e["kind"] for e in events] == ["registered", "detected"]
    assert events[1]["data"] == {"xid": 79}


def test_unopenable_store(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StoreError, match="cannot open store"):
        Store(blocker / "recovery.db")


def test_detections_round_trip(store):
    from recovery_agent.detect.model import Detection, Evidence
    pk = store.record_job(job(), cluster="c1")
    det = Detection(rule="nccl.watchdog_timeout", category="nccl_timeout_hang",
                    severity="error", action_hint="kill_requeue", host="node2", rank=5,
                    evidence=(Evidence("[rank5] Watchdog caught collective operation timeout",
                                       source="/logs/train-1234.out", line=812),))
    store.record_detection(pk, 0, det, ts=5.0)
    (row,) = store.detections(pk)
    assert (row["pattern_id"], row["node"], row["rank"], row["attempt"]) == \
        ("nccl.watchdog_timeout", "node2", 5, 0)
    assert row["evidence"]["lines"][0]["line"] == 812
    assert row["evidence"]["action_hint"] == "kill_requeue"


def test_watch_rows_leave_out_long_finished_jobs(store):
    from recovery_agent.scheduler.base import FINISHED_STATES
    running = store.record_job(job(job_id="1", submit_time=100), "c")
    old = store.record_job(job(job_id="2", submit_time=101, state="COMPLETED"), "c")
    recent = store.record_job(job(job_id="3", submit_time=102, state="FAILED"), "c")
    other = store.record_job(job(job_id="4", submit_time=103), "elsewhere")
    store.db.execute("update jobs set last_seen = 10 where id in (?, ?)", [running, old])
    store.db.execute("update jobs set last_seen = 1000 where id = ?", [recent])
    rows = store.watch_rows("c", FINISHED_STATES, since=500)
    assert [r["id"] for r in rows] == [running, recent]
    assert other not in [r["id"] for r in rows]
    assert {"id", "job_id", "state", "last_seen", "restart_count", "env", "mode",
            "spec", "cluster"} <= set(rows[0].keys())


def test_migration_links_the_detected_events_of_an_older_store(tmp_path, monkeypatch):
    """A store written before events named their detection: the migration pairs
    the k-th event of a rule in an attempt with the k-th detection of it."""
    from recovery_agent.store import migrations
    before = [m for m in migrations.MIGRATIONS if m[0] < "009"]
    monkeypatch.setattr(migrations, "MIGRATIONS", before)
    path = tmp_path / "old.db"
    with Store(path) as old:
        pk = old.record_job(job(), cluster="c1")
        dets, events = old.db["detections"], old.db["events"]
        ids = []
        for attempt, rule, text in [(0, "slurm.task_exit", "task 0"), (0, "nccl.timeout", "t"),
                                    (0, "slurm.task_exit", "task 3"),
                                    (1, "slurm.task_exit", "task 5")]:
            ids.append(dets.insert({"job": pk, "attempt": attempt, "ts": 1.0,
                                    "category": "application", "pattern_id": rule,
                                    "evidence": "{}"}).last_pk)
            events.insert({"job": pk, "attempt": attempt, "ts": 1.0, "kind": "detected",
                           "message": f"{rule} (application)"})
        events.insert({"job": pk, "attempt": 0, "ts": 2.0, "kind": "verdict", "message": "v"})
        events.insert({"job": pk, "attempt": 0, "ts": 2.0, "kind": "detected",
                       "message": "gone.rule (x)"})   # its detection was never stored
    monkeypatch.undo()
    with Store(path) as new:
        assert new.migrations_run[:2] == ["009_event_detections", "010_attempt_output_paths"]
        links = [(e["kind"], e["detection"]) for e in new.timeline(pk)]
    assert links == [("detected", ids[0]), ("detected", ids[1]), ("detected", ids[2]),
                     ("detected", ids[3]), ("verdict", None), ("detected", None)]
