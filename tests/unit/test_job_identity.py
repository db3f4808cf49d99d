"""A job id reused after a slurmctld state reset is another job: it inherits
nothing of the stored job (issue 14, finding 1). The watch loop runs against a
scheduler that replays listings as Slurm 22.05 prints them after a reset: the
same id, a later submit time, restart count 0."""
from __future__ import annotations

import pytest

from recovery_agent.config import from_mapping
from recovery_agent.decide.decider import Decider
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner
from recovery_agent.inputs.logline import MemoryCursorStore
from recovery_agent.inputs.tail import Tailer
from recovery_agent.scheduler.base import Job
from recovery_agent.store import Store, same_job
from recovery_agent.watch import Watcher
from tests.unit.scripted import Script


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
    watcher = Watcher(cfg, store, sched, Scanner(load_rules(), engine="re"),
                      Tailer(MemoryCursorStore()), clock=lambda: clock[0],
                      decider=Decider(cfg, store, None, clock=lambda: clock[0]))
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
