"""A job id reused after a slurmctld state reset is another job: it inherits
nothing of the stored job (issue 14, finding 1). The watch loop runs against a
scheduler that replays listings as Slurm 22.05 prints them after a reset: the
same id, a later submit time, restart count 0."""
from __future__ import annotations

import time
from dataclasses import replace

import pytest

from recovery_agent.config import from_mapping
from recovery_agent.inputs.ingest import Ingest
from recovery_agent.inputs.jobcache import JobCache
from recovery_agent.scheduler.base import Job
from recovery_agent.store import Store, same_job
from tests.unit.scripted import Script, scripted_watcher


def listed(state, out, submit, comment="", **kw) -> Job:
    base = dict(job_id="5", numeric_id=5, state=state, submit_time=submit,
                start_time=submit + 1, nodes=("node1", "node2"), comment=comment,
                stdout=str(out), stderr=str(out), user="alice", name="train")
    base.update(kw)
    return Job(**base)


@pytest.fixture
def loop(tmp_path):
    cfg = from_mapping({"agent": {"cluster": "c1"},
                        "environments": {"act": {"mode": "action"}}})
    store = Store(tmp_path / "r.db")
    sched = Script()
    clock = [10_000.0]
    watcher = scripted_watcher(cfg, store, sched, clock)
    return watcher, store, sched, clock


def run(watcher, clock, cycles=1, step=2.0):
    for _ in range(cycles):
        watcher.cycle()
        clock[0] += step


def fail_job(watcher, sched, clock, job: Job, out) -> None:
    """The job prints an unexplained failure and ends; the verdict grace passes."""
    with open(out, "a") as fh:
        fh.write("srun: error: node1: task 0: Exited with exit code 1\n")
    run(watcher, clock)
    sched.jobs = [Job(**{**job.__dict__, "state": "FAILED", "exit_code": 1,
                         "end_time": int(clock[0])})]
    run(watcher, clock, cycles=12)


def opted_in_job(loop, tmp_path) -> tuple:
    """Job 5, opted in for action, running and watched for two cycles."""
    watcher, _store, sched, clock = loop
    out = tmp_path / "slurm-5.out"
    out.write_text("")
    old = listed("RUNNING", out, submit=9_000, comment="recovery=act:action")
    sched.jobs = [old]
    run(watcher, clock, cycles=2)
    return out, old


@pytest.mark.parametrize("comment, expect_rows", [
    ("", 1),                                 # the new job never opted in
    ("recovery=act:monitor", 2),             # it asked to be monitored only
])
def test_reused_id_inherits_nothing(loop, tmp_path, comment, expect_rows):
    watcher, store, sched, clock = loop
    out, old = opted_in_job(loop, tmp_path)
    (row,) = store.jobs()
    assert (row["env"], row["mode"]) == ("act", "action")
    # slurmctld loses its state: the old job vanishes, job id 5 is handed out again
    new = listed("RUNNING", out, submit=int(clock[0]), comment=comment, user="bob",
                 name="other")
    sched.jobs = [new]
    run(watcher, clock, cycles=3)
    fail_job(watcher, sched, clock, new, out)
    rows = store.jobs()
    assert len(rows) == expect_rows
    assert rows[0]["state"] == "GONE"
    # nothing acts on the new job in action mode: it never asked for it
    recs = store.recommendations()
    assert [r for r in recs if r.mode == "action"] == []
    if comment:
        assert rows[1]["submit_time"] == new.submit_time and rows[1]["mode"] == "monitor"
        assert all(r.job == rows[1]["id"] for r in recs)
    reused = [e for e in store.timeline(rows[0]["id"]) if e["kind"] == "id_reused"]
    assert len(reused) == 1
    # the old job's timeline does not fill with the new job's state every cycle
    states = [e for e in store.timeline(rows[0]["id"]) if e["kind"] == "slurm_state"]
    assert states == []


def test_an_ended_and_judged_job_is_gone_once_its_id_comes_back(loop, tmp_path):
    """The live campaign (RUNS=20): the old job was cancelled, and nothing was
    left to judge of it, before slurmctld's reset; the poller passed over such
    rows, so the new job under the same id never marked it gone (1 run in 20)."""
    watcher, store, sched, clock = loop
    out, old = opted_in_job(loop, tmp_path)
    sched.jobs = [Job(**{**old.__dict__, "state": "CANCELLED", "end_time": int(clock[0])})]
    run(watcher, clock, cycles=6)                    # seen cancelled: nothing to judge
    (row,) = store.jobs()
    assert row["state"] == "CANCELLED"
    assert not watcher._needs_verdict(row["id"], row["restart_count"])
    sched.jobs = [listed("PENDING", out, submit=int(clock[0]), user="bob", name="other")]
    run(watcher, clock, cycles=3)
    (row,) = store.jobs()
    assert row["state"] == "GONE"
    assert [e["kind"] for e in store.timeline(row["id"])].count("id_reused") == 1


def prolog(n: int, spec: str, started: float) -> dict:
    job = {"job_id": "5", "attempt": 0, "spec": spec, "user": "alice", "started": started}
    return {"version": 1, "hook": "prolog", "report_id": f"{n:032x}", "created": started,
            "cluster": "c1", "node": "node1", "job": job,
            "gpus": {"ok": True, "count": 0, "gpus": []}, "xids": []}


def test_the_hooks_never_file_a_reused_id_under_the_old_job(loop, tmp_path):
    """CI, 22.05 live: the old job was cancelled within the second it started
    (start = end in Slurm's whole seconds). The hooks' job cache had listed it
    once, running, and every later peek hit, so it never refreshed: the new
    job's prolog, under the reused id, read that listing as the old job run
    again and rewrote the old row (monitor mode, running), which the poll then
    marked gone again each cycle. Now the loop hands each listing to the
    cache, and a start equal to the stored end is not a run again."""
    watcher, store, sched, clock = loop
    cache = JobCache(sched, min_interval=0)
    ingest = Ingest(store, "c1", cache)
    watcher.on_listing.append(cache.offer)
    out = tmp_path / "slurm-5.out"
    out.write_text("")
    old = listed("RUNNING", out, submit=9_000, comment="recovery=act:action",
                 start_time=9_001)
    sched.jobs = [old]
    cache.refresh()                       # the old job's prolog missed: one refresh
    ingest.store_report("prolog", prolog(1, "act:action", 9_001.2))
    run(watcher, clock, cycles=1)
    sched.jobs = [replace(old, state="CANCELLED", end_time=9_001)]
    run(watcher, clock, cycles=3)
    (row,) = store.jobs()
    assert row["state"] == "CANCELLED"
    # slurmctld loses its state; job 5 is handed out again, asking for monitor
    new = listed("PENDING", out, submit=int(clock[0]), comment="recovery=act:monitor",
                 start_time=int(clock[0]) + 1)
    sched.jobs = [new]
    run(watcher, clock, cycles=1)
    assert cache.peek("5").submit_time == new.submit_time
    stored = ingest.store_report("prolog", prolog(2, "act:monitor", clock[0]))
    old_row, new_row = store.jobs()
    assert stored.job_row == new_row["id"]
    assert (old_row["state"], old_row["mode"]) == ("GONE", "action")
    sched.jobs = [replace(new, state="RUNNING")]
    run(watcher, clock, cycles=3)
    reused = [e for e in store.timeline(old_row["id"]) if e["kind"] == "id_reused"]
    assert len(reused) == 1
    cache.wait()


def test_a_stale_listing_of_a_run_that_ended_in_its_first_second_is_no_run_again(tmp_path):
    """Without the loop's listings (a cache that only refreshes on misses), a
    listing older than the reset still shows the old job running; its start
    equals the stored end, so it is that ended run, not the job run again."""
    with Store(tmp_path / "r.db") as store:
        cache = JobCache(Script(), min_interval=0)
        ingest = Ingest(store, "c1", cache)
        running = Job(job_id="5", numeric_id=5, state="RUNNING", submit_time=9_000,
                      start_time=9_001, user="alice")
        cache.offer([running], 0.0)
        pk = store.record_job(running, "c1", env="act", mode="action", spec="act:action")
        store.record_attempt(pk, replace(running, state="CANCELLED", end_time=9_001))
        store.set_job_state(pk, "GONE")
        stored = ingest.store_report("prolog", prolog(3, "act:monitor", 9_500.0))
        cache.wait()    # the miss's background refresh, before the store closes
        assert stored.job_row != pk
        assert (store.job(pk)["state"], store.job(pk)["mode"]) == ("GONE", "action")


def test_the_newer_of_two_listings_is_the_one_the_cache_keeps():
    sched = Script([Job(job_id="5", numeric_id=5, state="RUNNING", submit_time=1)])
    cache = JobCache(sched, min_interval=0)
    cache.offer([Job(job_id="5", numeric_id=5, state="PENDING", submit_time=2)], 1e12)
    cache.refresh()        # asked for before the loop's listing came: not kept
    assert cache.peek("5").submit_time == 2
    cache.offer([], 0.0)   # an older listing offered late: not kept either
    assert cache.peek("5") is not None
    cache.offer([], 2e12)
    assert cache.peek("5") is None


def test_requeued_job_is_still_the_same_job(loop, tmp_path):
    """Slurm 22.05 renews the submit time at each requeue: that is no new job."""
    watcher, store, sched, clock = loop
    out = tmp_path / "slurm-5.out"
    out.write_text("")
    first = listed("RUNNING", out, submit=9_000, comment="recovery=act:action")
    sched.jobs = [first]
    run(watcher, clock, cycles=2)
    sched.jobs = [listed("RUNNING", out, submit=9_500, comment="recovery=act:action",
                         restart_count=1)]
    run(watcher, clock, cycles=2)
    (row,) = store.jobs()
    assert row["restart_count"] == 1 and row["state"] == "RUNNING"
    assert row["mode"] == "action"


def test_same_job_rules():
    row = {"submit_time": 100, "restart_count": 1, "user": "alice", "name": "train"}
    job = Job(job_id="5", numeric_id=5, submit_time=100, user="alice", name="train")
    assert same_job(row, job)
    later = dict(submit_time=200, user="alice", name="train")
    assert same_job(row, Job(job_id="5", numeric_id=5, restart_count=2, **later))
    assert not same_job(row, Job(job_id="5", numeric_id=5, restart_count=0, **later))
    # the restart count never goes down within one job
    assert not same_job({**row, "restart_count": 3},
                        Job(job_id="5", numeric_id=5, restart_count=2, **later))
    assert not same_job(row, Job(job_id="5", numeric_id=5, restart_count=2,
                                 submit_time=200, user="mallory", name="train"))
    # a row stored before its submit time was known: the user decides
    unknown = {**row, "submit_time": 0}
    assert same_job(unknown, job)
    assert not same_job(unknown, Job(job_id="5", numeric_id=5, submit_time=100,
                                     user="mallory"))


def test_a_miss_right_after_the_loops_listing_still_refreshes_and_tells_the_listeners():
    """The live rerun test: the loop had just offered a listing when a prolog
    missed; a throttle that counted offers skipped the refresh, so the row
    the prolog stored apart never got the listing that merges it."""
    sched = Script([Job(job_id="5", numeric_id=5, state="RUNNING", submit_time=1)])
    cache = JobCache(sched, min_interval=60)
    told = []
    cache.on_refresh.append(told.append)
    cache.offer([], time.monotonic())
    cache.refresh_soon()
    cache.wait()
    assert [sorted(t) for t in told] == [["5"]]
    cache.refresh_soon()    # its own refreshes are still throttled: this miss waits
    cache.wait(0.2)
    assert len(told) == 1 and cache.pending


def test_a_miss_while_a_refresh_runs_gets_one_more_refresh():
    """The running listing may have been taken before the job that missed was
    submitted: dropping that miss left the row it stored unmerged until some
    other miss came."""
    import threading

    class Slow(Script):
        def __init__(self, jobs) -> None:
            super().__init__(jobs)
            self.started, self.release = threading.Event(), threading.Event()

        def list_jobs(self, job_ids=None):
            listing = list(self.jobs)   # taken before the release: the old view
            self.started.set()
            self.release.wait(5)
            return listing

    sched = Slow([Job(job_id="5", numeric_id=5, state="RUNNING", submit_time=1)])
    cache = JobCache(sched, min_interval=0)
    told = []
    cache.on_refresh.append(told.append)
    cache.refresh_soon()
    assert sched.started.wait(5)
    sched.jobs.append(Job(job_id="6", numeric_id=6, state="RUNNING", submit_time=2))
    cache.refresh_soon()    # job 6 missed while the first listing was under way
    sched.release.set()
    cache.wait()
    assert [sorted(t) for t in told] == [["5"], ["5", "6"]]
    assert not cache.pending


def test_a_throttled_miss_is_served_when_the_interval_is_over():
    sched = Script([Job(job_id="5", numeric_id=5, state="RUNNING", submit_time=1)])
    cache = JobCache(sched, min_interval=0.3)
    told = []
    cache.on_refresh.append(told.append)
    cache.refresh_soon()
    cache.wait()
    sched.jobs.append(Job(job_id="6", numeric_id=6, state="RUNNING", submit_time=2))
    cache.refresh_soon()
    cache.refresh_soon()    # two misses inside the interval: one refresh serves both
    cache.wait()
    assert [sorted(t) for t in told] == [["5"], ["5", "6"]]
