"""Issue 22, item 7: slurmctld may run an attempt again at the same restart count
(a controller restarted from older state puts the job back in the queue
itself). Each run is told apart by Slurm's start time, and every failure gets
exactly one decision.

The listings are 22.05's own, recorded on the dev cluster
(tests/fixtures/slurm/22.05/rerun/README.txt): one job held, released, failed,
back held at restart count 0 after slurmctld came back from its older state,
released, failed again."""
from __future__ import annotations

import json
import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest

from recovery_agent.config import from_mapping
from recovery_agent.inputs.ingest import Ingest
from recovery_agent.scheduler.base import Job
from recovery_agent.scheduler.cli_parse import parse_squeue
from recovery_agent.store import Store
from recovery_agent.store import reports as report_rows
from recovery_agent.store.migrations import MIGRATIONS, migrate
from tests.conftest import FIXTURES
from tests.unit.scripted import Script, scripted_watcher

RECORDED = FIXTURES / "slurm" / "22.05" / "rerun"
TRACEBACK = ("Traceback (most recent call last):\n"
             "  File \"train.py\", line 3, in <module>\n"
             "ValueError: bad config\n")


def listing(name: str, out: Path) -> Job:
    """Job 61 as 22.05's squeue --json listed it at that moment, its output in
    ``out`` and opted in through its comment (the hook's part is not replayed)."""
    (job,) = parse_squeue(json.loads((RECORDED / f"{name}.json").read_text()))
    return replace(job, stdout=str(out), stderr=str(out), comment="recovery=act:monitor")


@pytest.fixture
def loop(tmp_path):
    cfg = from_mapping({"agent": {"cluster": "devcluster"},
                        "environments": {"act": {"mode": "action"}}})
    store = Store(tmp_path / "r.db")
    sched = Script()
    clock = [1_796_175_020.0]
    watcher = scripted_watcher(cfg, store, sched, clock)
    yield watcher, store, sched, clock
    store.close()


def run(watcher, clock, cycles=1, step=2.0):
    for _ in range(cycles):
        watcher.cycle()
        clock[0] += step


def replay(loop, out: Path) -> None:
    """The recorded listings in order, the job's output growing as each run
    fails; each failure waits out the verdict's grace for epilog reports."""
    watcher, _store, sched, clock = loop
    out.write_text("")
    sched.jobs = [listing("01_held", out)]
    run(watcher, clock, 2)
    sched.jobs = [listing("02_running_first", out)]
    run(watcher, clock, 2)
    with open(out, "a") as fh:
        fh.write("run 1\n" + TRACEBACK)
    sched.jobs = [listing("03_failed_first", out)]
    run(watcher, clock, 12)
    sched.jobs = [listing("04_back_held", out)]
    run(watcher, clock, 2)
    sched.jobs = [listing("05_running_again", out)]
    run(watcher, clock, 2)
    with open(out, "a") as fh:
        fh.write("run 2\n" + TRACEBACK)
    sched.jobs = [listing("06_failed_again", out)]
    run(watcher, clock, 12)


def test_the_recorded_listings_show_two_runs_at_one_restart_count():
    out = Path("/dev/null")
    first, again = listing("03_failed_first", out), listing("06_failed_again", out)
    assert first.restart_count == again.restart_count == 0
    assert first.submit_time == again.submit_time
    assert first.run_start and again.run_start and first.run_start < again.run_start
    assert listing("04_back_held", out).run_start is None   # held: no run begun


def test_a_run_slurmctld_begins_again_at_the_same_restart_count_gets_its_own_decision(
        loop, tmp_path):
    watcher, store, _sched, _clock = loop
    replay(loop, tmp_path / "rerun-61.out")
    (row,) = store.jobs()
    verdicts = [e for e in store.timeline(row["id"]) if e["kind"] == "verdict"]
    recs = [r for r in store.recommendations(job_pk=row["id"]) if r.scope == "job"]
    # two failures, two verdicts, two decisions
    assert (len(verdicts), len(recs)) == (2, 2)
    first, again = listing("03_failed_first", Path()), listing("06_failed_again", Path())
    assert [v["data"]["run_start"] for v in verdicts] == [first.start_time, again.start_time]
    assert [(r.attempt, r.run_start, r.action, r.status) for r in recs] == [
        (0, first.start_time, "stop", "would_have"),
        (0, again.start_time, "stop", "would_have")]
    (note,) = [e for e in store.timeline(row["id"]) if e["kind"] == "ran_again"]
    assert note["data"] == {"run_start": again.start_time, "earlier_runs": [first.start_time]}
    # the first run's decision sees the job running again
    assert recs[0].running_again_at == float(again.start_time)
    # and nothing is judged twice: more cycles of the last listing add nothing
    run(watcher, _clock, 5)
    assert len([r for r in store.recommendations(job_pk=row["id"]) if r.scope == "job"]) == 2


def test_a_restarted_agent_judges_neither_run_again(loop, tmp_path):
    watcher, store, sched, clock = loop
    replay(loop, tmp_path / "rerun-61.out")
    cfg = watcher.cfg
    fresh = scripted_watcher(cfg, store, sched, clock)
    run(fresh, clock, 12)
    assert len([r for r in store.recommendations() if r.scope == "job"]) == 2
    assert len([e for e in store.timeline(1) if e["kind"] == "verdict"]) == 2


def test_a_run_never_seen_ending_is_recorded_and_the_new_run_followed(loop, tmp_path):
    """Between two polls the run ends and slurmctld begins the attempt again:
    the first run's end was never listed, so its verdict is recorded without a
    decision (Slurm already runs the job again), and the new run is watched."""
    watcher, store, sched, clock = loop
    out = tmp_path / "rerun-61.out"
    out.write_text("")
    first = listing("02_running_first", out)
    sched.jobs = [first]
    run(watcher, clock, 2)
    with open(out, "a") as fh:
        fh.write(TRACEBACK)
    again = listing("05_running_again", out)
    sched.jobs = [again]
    run(watcher, clock, 12)
    (verdict,) = [e for e in store.timeline(1) if e["kind"] == "verdict"]
    assert verdict["data"]["run_start"] == first.run_start
    assert store.recommendations() == []
    assert watcher.watches[1].run_start == again.run_start


def test_a_run_again_while_the_last_run_awaits_its_verdict(loop, tmp_path):
    """slurmctld begins the attempt again while the ended run still waits for
    its epilog reports: the new run knows the earlier one, and both failures
    are decided once each."""
    watcher, store, sched, clock = loop
    out = tmp_path / "rerun-61.out"
    out.write_text("")
    sched.jobs = [listing("02_running_first", out)]
    run(watcher, clock, 2)
    with open(out, "a") as fh:
        fh.write(TRACEBACK)
    sched.jobs = [listing("03_failed_first", out)]
    run(watcher, clock)
    assert watcher.closing                               # the first run's verdict waits
    again = listing("05_running_again", out)
    sched.jobs = [again]
    run(watcher, clock)
    first = listing("03_failed_first", out)
    assert watcher.watches[1].earlier_runs == (first.start_time,)
    assert [e["kind"] for e in store.timeline(1)].count("ran_again") == 1
    run(watcher, clock, 10)
    with open(out, "a") as fh:
        fh.write(TRACEBACK)
    sched.jobs = [listing("06_failed_again", out)]
    run(watcher, clock, 12)
    recs = [r for r in store.recommendations() if r.scope == "job"]
    assert [r.run_start for r in recs] == [first.start_time, again.start_time]


def test_one_decision_per_run_is_all_the_store_takes(tmp_path):
    with Store(tmp_path / "r.db") as store:
        pk = store.record_job(Job(job_id="60", numeric_id=60, state="FAILED", submit_time=5),
                              "c1")
        base = {"job": pk, "attempt": 0, "scope": "job", "action": "stop", "mode": "monitor",
                "status": "would_have", "exclude": [], "target_nodes": []}
        with store.lock, store.db.atomic():
            store.add_recommendation({**base, "run_start": 100})
            store.add_recommendation({**base, "run_start": 200})
        with pytest.raises(sqlite3.IntegrityError), store.lock, store.db.atomic():
            store.add_recommendation({**base, "run_start": 200})
        assert store.job_rec(pk, 0, 200).run_start == 200
        assert store.job_rec(pk, 0, 300) is None
        assert store.job_rec(pk, 0).run_start == 100


def test_the_migration_gives_older_decisions_their_attempts_start(tmp_path):
    """A store made before runs were told apart: its recommendations take
    their attempt's start time, and stay one per run."""
    path = tmp_path / "old.db"
    from sqlite_utils import Database
    db = Database(path)
    before = [name for name, _ in MIGRATIONS if name < "013"]
    db["_migrations"].create({"name": str, "applied_at": float}, pk="name")
    for name, step in MIGRATIONS:
        if name in before:
            step(db)
            db["_migrations"].insert({"name": name, "applied_at": 0.0})
    db["jobs"].insert({"id": 1, "cluster": "c1", "job_id": "60", "submit_time": 5})
    db["attempts"].insert({"job": 1, "attempt": 0, "start_time": 100})
    db["recommendations"].insert({"job": 1, "attempt": 0, "scope": "job", "action": "stop",
                                  "mode": "monitor", "status": "would_have", "created": 1.0})
    assert migrate(db)[:2] == ["013_recommendation_runs", "014_report_runs"]
    assert db.execute("select run_start from recommendations").fetchall() == [(100,)]
    with pytest.raises(sqlite3.IntegrityError):
        db["recommendations"].insert({"job": 1, "attempt": 0, "scope": "job",
                                      "action": "stop", "mode": "monitor",
                                      "status": "would_have", "created": 2.0,
                                      "run_start": 100})
    db.close()


def report(hook: str, attempt: int = 0, started: float | None = None, late: bool = False,
           created: float = 1_000.0, n: int = 0) -> dict:
    job = {"job_id": "60", "attempt": attempt, "spec": "act:monitor", "user": "root",
           "started": started}
    body = {"version": 1, "hook": hook, "report_id": f"{n:032x}", "created": created,
            "cluster": "c1", "node": "node1", "job": job,
            "gpus": {"ok": True, "count": 0, "gpus": []}, "xids": []}
    if hook == "epilog":
        body["exit"] = {"code": 3, "signal": None}
    if late:
        body["delivery"] = {"spooled_at": created, "tries": 2, "by": "hook"}
    return body


def judge_run(store, pk: int, run_start: int) -> None:
    with store.lock:
        store.add_event(pk, "verdict", "application: application -> stop", attempt=0,
                        source="attribution", data={"run_start": run_start})


class Listed:
    """The job cache ingest peeks at: what the last listing showed."""

    def __init__(self) -> None:
        self.jobs: dict[str, Job] = {}
        self.on_refresh: list = []

    def peek(self, job_id: str) -> Job | None:
        return self.jobs.get(job_id)

    def refresh_soon(self) -> None:
        pass


def test_reports_of_a_run_again_are_not_taken_for_late_ones_of_the_judged_run(tmp_path):
    with Store(tmp_path / "r.db") as store:
        cache = Listed()
        ingest = Ingest(store, "c1", cache)
        running = Job(job_id="60", numeric_id=60, state="RUNNING", submit_time=5,
                      start_time=1_000, user="root")
        cache.jobs["60"] = running
        pk = store.record_job(running, "c1", env="act", spec="act:monitor")
        store.record_attempt(pk, running)
        ingest.store_report("prolog", report("prolog", started=1_000.5, n=1))
        ended = replace(running, state="FAILED", end_time=1_060)
        cache.jobs["60"] = ended
        store.record_job(ended, "c1", env="act", spec="act:monitor")
        store.record_attempt(pk, ended)
        judge_run(store, pk, 1_000)
        # the judged run's epilog, replayed late from the node's spool: after the verdict
        late = ingest.store_report("epilog", report("epilog", started=1_000.5, late=True,
                                                    created=1_061, n=2))
        # slurmctld runs the attempt again: its fresh prolog is never after that verdict
        cache.jobs["60"] = replace(running, start_time=2_000)
        again = ingest.store_report("prolog", report("prolog", started=2_000.2,
                                                     created=2_000.2, n=3))
        # ... and nor is its epilog, once the attempt shows the newer run
        store.record_attempt(pk, replace(ended, start_time=2_000, end_time=2_050))
        epilog = ingest.store_report("epilog", report("epilog", started=2_000.2,
                                                      created=2_051, n=4))
        assert {late.job_row, again.job_row, epilog.job_row} == {pk}
        flags = {r["id"]: r["after_verdict"] for r in store.db["node_reports"].rows}
        assert (flags[late.row_id], flags[again.row_id], flags[epilog.row_id]) == (1, 0, 0)
        # the second run's verdict waits for its own epilog only
        assert report_rows.nodes_reporting(store, pk, 0, "epilog", 2_000, (1_000,)) == {"node1"}
        assert report_rows.run_reports(store, pk, 0, 2_000, (1_000,)) == {again.row_id,
                                                                            epilog.row_id}
        assert report_rows.nodes_reporting(store, pk, 0, "epilog", 1_000, (2_000,)) == {"node1"}
        assert late.row_id in report_rows.run_reports(store, pk, 0, 1_000, (2_000,))


def test_a_prolog_stored_anew_for_a_job_run_again_is_merged_into_it(tmp_path):
    """The first prolog of the run again (attempt 0) came after the stored job
    had ended, with no listing to tell it from a reused id: stored as a new
    job; the next listing gives it the stored job's submit time, so it is that
    job."""
    with Store(tmp_path / "r.db") as store:
        ingest = Ingest(store, "c1")
        job = Job(job_id="60", numeric_id=60, state="FAILED", submit_time=5,
                  start_time=1_000, end_time=1_060, user="root")
        pk = store.record_job(job, "c1", env="act", spec="act:monitor")
        store.record_attempt(pk, job)
        stored = ingest.store_report("prolog", report("prolog", started=2_000.0, n=7))
        assert stored.job_row != pk   # taken for a reused id at first
        ingest.complete_submit_times({"60": replace(job, state="RUNNING", start_time=2_000,
                                                    end_time=None)})
        (row,) = store.jobs()
        assert row["id"] == pk
        assert [r["job"] for r in store.db["node_reports"].rows] == [pk]


def test_a_reused_id_still_gets_a_row_of_its_own(tmp_path):
    with Store(tmp_path / "r.db") as store:
        ingest = Ingest(store, "c1")
        old = Job(job_id="60", numeric_id=60, state="FAILED", submit_time=5, start_time=1_000,
                  end_time=1_060, user="root")
        pk = store.record_job(old, "c1", env="act", spec="act:monitor")
        new = ingest.store_report("prolog", report("prolog", started=2_000.0, n=8))
        ingest.complete_submit_times({"60": replace(old, submit_time=1_900, state="RUNNING",
                                                    start_time=2_000, end_time=None)})
        assert sorted((r["id"], r["submit_time"]) for r in store.jobs()) == [
            (pk, 5), (new.job_row, 1_900)]

