"""The actuator against an in-memory Slurm: once-only requeues, crashes between
steps, stale state, failing scontrol, slurmctld down, the watchdog, node drains.

No cluster, no sleeps: the actuator's clock is a list the tests move by hand.
"""
from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from collections import Counter

import pytest

from recovery_agent.act.actuator import RESUME_CHECK_INTERVAL, Actuator
from recovery_agent.act.drains import drain_reason, ours
from recovery_agent.act.jobs import RELAUNCH_GAP_S, relaunch_after
from recovery_agent.config import from_mapping
from recovery_agent.errors import JobNotFound, NodeNotFound, SchedulerError
from recovery_agent.act.notify import Sent
from recovery_agent.scheduler.base import Job, Node
from recovery_agent.store import FINAL_STATUSES, OPEN_STATUSES, Store
from tests.step_faults import StepFaults

JOB_ID = "4242"
SUBMIT = 1_700_000_000
JOB_STEPS = ("allow_requeue", "requeue_hold", "exclude", "start_now", "release")
# the step each fake call belongs to (the actuator names the exclusion step "exclude")
CALL_OF_STEP = {"allow_requeue": "allow_requeue", "requeue_hold": "requeue_hold",
                "exclude": "set_excluded_nodes", "start_now": "start_now",
                "release": "release"}


class Killed(BaseException):
    """Stands in for SIGKILL: not an Exception, so nothing in the actuator catches it."""


# -- a small Slurm 22.05 ---------------------------------------------------------
class FakeSlurm:
    """One job and a few nodes, with Slurm's requeue semantics: ``requeue_hold``
    bumps the restart count, gives the job a new submit time and leaves it
    PENDING and held (listed COMPLETING for the first ``completing`` listings)."""

    name = "fake"

    def __init__(self, state: str = "FAILED", restart_count: int = 0,
                 submit_time: int = SUBMIT, requeue_allowed: bool = True,
                 held: bool = False, excluded: tuple[str, ...] = (),
                 nodes: tuple[str, ...] = ("gpu1", "gpu2", "gpu3"),
                 completing: int = 0, end_time: int | None = None) -> None:
        self.job: dict | None = {
            "state": state, "restart_count": restart_count, "submit_time": submit_time,
            "requeue_allowed": requeue_allowed, "held": held, "excluded": tuple(excluded),
            "nodes": ("gpu1", "gpu2"), "start_now": False, "start_time": None,
            "end_time": end_time}
        self.nodes = {n: {"state": "IDLE", "flags": set(), "reason": ""} for n in nodes}
        self.completing = int(completing)   # listings in COMPLETING after a requeue
        self.completing_left = 0
        self.calls: Counter = Counter()   # every mutating call that reached slurmctld
        self.log: list[tuple] = []        # the same, in order, with arguments
        self.list_calls = 0
        self.down = False                 # list_jobs raises (slurmctld unreachable)
        # failure injection for mutating calls: "refuse" raises before any effect,
        # "late" applies the change and then raises (a timeout the server honoured)
        self.fail_next = 0
        self.fail_mode = "refuse"
        self.fail_only: set[str] | None = None
        self.crash_before: str | None = None   # raise Killed before the call happens
        self.crash_after: str | None = None    # raise Killed after it took effect
        self.get_job_fails = 0                 # get_job raises SchedulerError this often
        self.lookups = 0                       # targeted lookups (scontrol show job -o)
        self.lookup_fails = 0                  # ... that raise SchedulerError this often
        self.report_requeue_flag = True        # False: listings always say no-requeue

    # -- reads
    def as_job(self) -> Job:
        j = self.job
        assert j is not None
        state = j["state"]
        if self.completing_left:
            state = "COMPLETING"
        return Job(job_id=JOB_ID, numeric_id=int(JOB_ID), name="train", user="alice",
                   state=state, restart_count=j["restart_count"],
                   submit_time=j["submit_time"], nodes=j["nodes"], batch_host=j["nodes"][0],
                   excluded_nodes=j["excluded"],
                   requeue_allowed=j["requeue_allowed"] and self.report_requeue_flag,
                   held=j["held"], start_time=j["start_time"], end_time=j["end_time"])

    def list_jobs(self, job_ids=None) -> list[Job]:
        self.list_calls += 1
        if self.down:
            raise SchedulerError("squeue: timed out", ["squeue", "--json"], None,
                                 "slurm_load_jobs error: Unable to contact slurm controller")
        if self.job is None or (job_ids is not None and JOB_ID not in job_ids):
            return []
        job = self.as_job()
        if self.completing_left:
            self.completing_left -= 1
        return [job]

    def get_job(self, job_id: str) -> Job:
        if self.get_job_fails:
            self.get_job_fails -= 1
            raise SchedulerError("scontrol show job timed out", ["scontrol", "show", "job"])
        if self.job is None or job_id != JOB_ID:
            raise JobNotFound(f"job {job_id} not found")
        return self.as_job()

    def lookup_job(self, job_id: str) -> Job:
        """``scontrol show job -o``: the targeted query, counted on its own."""
        self.lookups += 1
        if self.lookup_fails:
            self.lookup_fails -= 1
            raise SchedulerError("scontrol show job timed out", ["scontrol", "show", "job"])
        if self.job is None or job_id != JOB_ID:
            raise JobNotFound(f"job {job_id} not found")
        return self.as_job()

    def _node(self, name: str) -> Node:
        n = self.nodes[name]
        return Node(name=name, state=n["state"], flags=frozenset(n["flags"]),
                    reason=n["reason"], reason_user=n.get("user", ""),
                    reason_time=n.get("time"))

    def list_nodes(self, names=None) -> list[Node]:
        return [self._node(n) for n in self.nodes if names is None or n in names]

    def get_node(self, name: str) -> Node:
        if name not in self.nodes:
            raise NodeNotFound(f"node {name} not found", ["scontrol", "show", "node", name],
                               1, f"Node {name} not found")
        return self._node(name)

    # -- writes
    def _call(self, name: str, args: tuple, apply) -> None:
        if self.crash_before == name:
            raise Killed(f"before {name}")
        self.calls[name] += 1
        self.log.append((name, *args))
        failing = self.fail_next > 0 and (self.fail_only is None or name in self.fail_only)
        if failing:
            self.fail_next -= 1
            if self.fail_mode == "refuse":
                raise self._timeout(name)
        apply()
        if self.crash_after == name:
            raise Killed(f"after {name}")
        if failing:
            raise self._timeout(name)

    @staticmethod
    def _timeout(name: str) -> SchedulerError:
        return SchedulerError(f"scontrol {name} timed out", ["scontrol", name], None,
                              "Socket timed out on send/recv operation")

    def _the_job(self, job_id: str) -> dict:
        if self.job is None or job_id != JOB_ID:
            raise JobNotFound(f"job {job_id} not found", ["scontrol"], 1,
                              "Invalid job id specified")
        return self.job

    def _pending(self, job_id: str) -> dict:
        j = self._the_job(job_id)
        if j["state"] != "PENDING":
            raise SchedulerError("scontrol update", ["scontrol", "update"], 1,
                                 "Job is no longer pending execution")
        return j

    def requeue_hold(self, job_id: str) -> None:
        def apply():
            j = self._the_job(job_id)
            if j["state"] == "PENDING":
                raise SchedulerError("scontrol requeuehold", ["scontrol", "requeuehold"], 1,
                                     "Job is pending execution")
            if not j["requeue_allowed"]:
                raise SchedulerError("scontrol requeuehold", ["scontrol", "requeuehold"], 1,
                                     "Requested operation is presently disabled")
            j.update(restart_count=j["restart_count"] + 1,
                     submit_time=j["submit_time"] + 1000 + j["restart_count"],
                     state="PENDING", held=True)
            self.completing_left = self.completing
        self._call("requeue_hold", (job_id,), apply)

    def requeue_by_someone_else(self, held: bool = False) -> None:
        """``scontrol requeue`` typed by an operator: not one of our calls."""
        j = self.job
        assert j is not None
        j.update(restart_count=j["restart_count"] + 1, submit_time=j["submit_time"] + 500,
                 state="PENDING", held=held)

    def set_excluded_nodes(self, job_id: str, nodes) -> None:
        self._call("set_excluded_nodes", (job_id, tuple(nodes)),
                   lambda: self._pending(job_id).update(excluded=tuple(nodes)))

    def start_now(self, job_id: str) -> None:
        self._call("start_now", (job_id,),
                   lambda: self._pending(job_id).update(start_now=True))

    def release(self, job_id: str) -> None:
        self._call("release", (job_id,), lambda: self._the_job(job_id).update(held=False))

    def cancel(self, job_id: str, signal: str | None = None) -> None:
        self._call("cancel", (job_id, signal),
                   lambda: self._the_job(job_id).update(state="CANCELLED"))

    def allow_requeue(self, job_id: str) -> None:
        self._call("allow_requeue", (job_id,),
                   lambda: self._the_job(job_id).update(requeue_allowed=True))

    def drain_node(self, name: str, reason: str) -> None:
        def apply():
            n = self.nodes.get(name)
            if n is None:
                raise NodeNotFound(f"node {name} not found")
            n["flags"].add("DRAIN")
            # Slurm stamps who set the reason and when (reason_set_by_user,
            # reason_changed_at)
            n.update(reason=reason, user="root", time=self._stamp())
        self._call("drain_node", (name, reason), apply)

    def resume_node(self, name: str) -> None:
        def apply():
            n = self.nodes.get(name)
            if n is None:
                raise NodeNotFound(f"node {name} not found")
            if "DRAIN" not in n["flags"]:
                raise SchedulerError("scontrol update", ["scontrol"], 1,
                                     "Invalid node state transition")
            n["flags"].discard("DRAIN")
            n["reason"] = ""
        self._call("resume_node", (name,), apply)

    def drain_by_someone_else(self, name: str, reason: str, user: str = "admin") -> None:
        self.nodes[name]["flags"].add("DRAIN")
        self.nodes[name].update(reason=reason, user=user, time=self._stamp())

    def resume_by_someone_else(self, name: str) -> None:
        self.nodes[name]["flags"].discard("DRAIN")
        self.nodes[name].update(reason="", user="", time=None)

    def _stamp(self) -> int:
        self.stamps = getattr(self, "stamps", SUBMIT) + 7
        return self.stamps


# -- helpers ----------------------------------------------------------------------
def config(**policy):
    return from_mapping({"agent": {"cluster": "c1"}, "policy": policy})


@pytest.fixture
def clock():
    # near the real time: the watchdog compares the fake clock with the rows'
    # "created", which the store stamps with time.time()
    return [float(int(time.time()))]


@pytest.fixture(scope="module")
def migrated(tmp_path_factory):
    """One migrated, empty store file; each test gets a copy (migrating costs ~50 ms)."""
    path = tmp_path_factory.mktemp("template") / "recovery.db"
    Store(path).close()
    return path


@pytest.fixture
def store(tmp_path, migrated):
    shutil.copy(migrated, tmp_path / "recovery.db")
    with Store(tmp_path / "recovery.db") as s:
        assert s.migrations_run == []
        yield s


def make_actuator(store, slurm, clock, on_step=None, **policy) -> Actuator:
    """Wall clock ``clock[0]``; the monotonic clock moves with it except for
    wall-clock jumps, recorded in ``clock[1]`` by :func:`jump`."""
    return Actuator(config(**policy), store, slurm, clock=lambda: clock[0],
                    mono=lambda: clock[0] - (clock[1] if len(clock) > 1 else 0.0),
                    on_step=on_step)


def jump(clock, seconds: float) -> None:
    """Step the wall clock (an NTP step, a hand-set date); time itself goes on."""
    if len(clock) == 1:
        clock.append(0.0)
    clock[0] += seconds
    clock[1] += seconds


def add_job_rec(store, slurm: FakeSlurm, action: str = "requeue_exclude",
                trigger: str = "ended", exclude=("gpu2",), spec: str = "act", **over) -> int:
    job = slurm.as_job()
    pk = store.record_job(job, "c1", env="act", mode="action", spec=spec)
    values = {"job": pk, "attempt": job.restart_count, "job_id": JOB_ID, "scope": "job",
              "action": action, "mode": "action", "status": "proposed", "trigger": trigger,
              "restart_at": job.restart_count, "submit_time": job.submit_time,
              "exclude": list(exclude), "target_nodes": ["gpu2"], "reason_category": "xid",
              "rule": "gpu_fault", "reason": "XID 79 on gpu2", "cluster": "c1",
              "actor": "agent"}
    values.update(over)
    with store.lock, store.db.atomic():
        return store.add_recommendation(values)


def add_node_rec(store, action: str, node: str = "gpu3", **over) -> int:
    values = {"scope": "node", "action": action, "target_nodes": [node], "mode": "action",
              "status": "proposed", "reason_category": "xid", "rule": "gpu_fault",
              "reason": "XID 79", "exclude": [], "actor": "agent"}
    values.update(over)
    with store.lock, store.db.atomic():
        return store.add_recommendation(values)


def drive(act: Actuator, store, rec_id: int, clock, dt: float = 1.0, limit: int = 60) -> int:
    """run_once until the recommendation is final; returns the passes it took."""
    for n in range(1, limit + 1):
        act.run_once()
        if store.rec(rec_id).status not in OPEN_STATUSES:
            return n
        clock[0] += dt
    raise AssertionError(f"rec {rec_id} still {store.rec(rec_id).status} after {limit} "
                         "passes")


def steps(store, rec_id: int) -> list[tuple[str, str]]:
    return [(s["step"], s["state"]) for s in store.steps(rec_id)]


@pytest.fixture
def killed(monkeypatch):
    """os.kill in the step faults raises Killed (and records what it was asked)."""
    sent = []

    def fake_kill(pid, sig):
        sent.append((pid, sig))
        raise Killed(f"signal {sig}")

    monkeypatch.setattr("tests.step_faults.os.kill", fake_kill)
    return sent


# -- 1. the happy path ------------------------------------------------------------
@pytest.mark.parametrize("completing", [False, True])
def test_failed_job_requeue_exclude_happy_path(store, clock, completing):
    slurm = FakeSlurm(state="FAILED", completing=completing)
    rec_id = add_job_rec(store, slurm, exclude=("gpu2",))
    act = make_actuator(store, slurm, clock)
    t0 = clock[0]

    passes = drive(act, store, rec_id, clock)

    rec = store.rec(rec_id)
    assert rec.status == "done" and rec.error is None
    assert rec.held_at == t0 and rec.done_at == clock[0]
    # the start waits RELAUNCH_GAP_S whole seconds after the requeue's second
    assert passes == 3
    assert slurm.calls == Counter(requeue_hold=1, set_excluded_nodes=1, start_now=1,
                                  release=1)
    assert [c[0] for c in slurm.log] == ["requeue_hold", "set_excluded_nodes", "start_now",
                                         "release"]
    assert slurm.log[1] == ("set_excluded_nodes", JOB_ID, ("gpu2",))
    j = slurm.job
    assert j["restart_count"] == 1 and j["excluded"] == ("gpu2",)
    assert j["held"] is False and j["start_now"] is True
    assert steps(store, rec_id) == [
        ("requeue_hold", "started"), ("requeue_hold", "ok"),
        ("exclude", "started"), ("exclude", "ok"),
        ("start_now", "started"), ("start_now", "ok"),
        ("release", "started"), ("release", "ok")]
    assert store.steps(rec_id)[2]["detail"] == "gpu2"
    kinds = [e["kind"] for e in store.timeline(rec.job)]
    assert kinds == ["rec_done"]
    # nothing is left to do: more passes change nothing
    for _ in range(3):
        clock[0] += 100
        assert act.run_once() == 0
    assert sum(slurm.calls.values()) == 4


def test_exclusion_already_in_place_is_not_set_again(store, clock):
    slurm = FakeSlurm(excluded=("gpu2",))
    rec_id = add_job_rec(store, slurm, exclude=("gpu2",))
    drive(make_actuator(store, slurm, clock), store, rec_id, clock)
    assert store.rec(rec_id).status == "done"
    assert slurm.calls == Counter(requeue_hold=1, start_now=1, release=1)


def test_an_ending_attempt_is_waited_for(store, clock):
    """Decided on an ended attempt that slurmctld still lists as COMPLETING."""
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm)
    slurm.completing_left = 2
    act = make_actuator(store, slurm, clock)
    for _ in range(2):
        act.run_once()
        clock[0] += 1
    rec = store.rec(rec_id)
    assert not slurm.calls and rec.status == "executing" and rec.held_at is None
    drive(act, store, rec_id, clock)
    assert store.rec(rec_id).status == "done" and slurm.calls["requeue_hold"] == 1


def test_plain_requeue_without_exclusions(store, clock):
    slurm = FakeSlurm()
    rec_id = add_job_rec(store, slurm, action="requeue", exclude=())
    drive(make_actuator(store, slurm, clock), store, rec_id, clock)
    assert store.rec(rec_id).status == "done"
    assert slurm.calls == Counter(requeue_hold=1, start_now=1, release=1)
    assert slurm.job["excluded"] == ()


def test_monitor_mode_recommendations_are_never_acted_on(store, clock):
    slurm = FakeSlurm()
    rec_id = add_job_rec(store, slurm, mode="monitor")
    act = make_actuator(store, slurm, clock)
    for _ in range(5):
        assert act.run_once() == 0
        clock[0] += 10
    assert store.rec(rec_id).status == "proposed"
    assert not slurm.calls and slurm.list_calls == 0


# -- 2. crashes between steps -------------------------------------------------------
@pytest.mark.parametrize("completing", [False, True], ids=["direct", "completing"])
@pytest.mark.parametrize("step", JOB_STEPS)
def test_crash_after_any_step_then_restart_finishes_once(store, clock, killed,
                                                         step, completing):
    slurm = FakeSlurm(state="FAILED", requeue_allowed=False, completing=completing)
    want = ("gpu2", "gpu3")
    rec_id = add_job_rec(store, slurm, exclude=want)

    first = make_actuator(store, slurm, clock, on_step=StepFaults(crash_after=step))
    with pytest.raises(Killed):
        drive(first, store, rec_id, clock)
    assert killed == [(os.getpid(), signal.SIGKILL)]
    assert steps(store, rec_id)[-1] == (step, "ok")       # the crash came right after it
    assert store.rec(rec_id).status in OPEN_STATUSES

    # a restarted agent: a fresh Actuator on the same store, the same Slurm
    second = make_actuator(store, slurm, clock)
    clock[0] += 1
    drive(second, store, rec_id, clock)

    rec = store.rec(rec_id)
    assert rec.status == "done", rec.error
    # every Slurm call exactly once, across both agents
    assert slurm.calls == Counter(allow_requeue=1, requeue_hold=1, set_excluded_nodes=1,
                                  start_now=1, release=1)
    j = slurm.job
    assert j["restart_count"] == 1
    assert sorted(j["excluded"]) == sorted(want)
    assert j["held"] is False and j["start_now"] is True
    assert killed == [(os.getpid(), signal.SIGKILL)]   # the second agent never "crashed"


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("step", JOB_STEPS)
def test_crash_inside_a_step(store, clock, step, when):
    """The agent dies with ``started`` written and scontrol not yet run (before),
    or run but its ``ok`` not yet written (after)."""
    slurm = FakeSlurm(state="FAILED", requeue_allowed=False)
    want = ("gpu2",)
    rec_id = add_job_rec(store, slurm, exclude=want)
    setattr(slurm, f"crash_{when}", CALL_OF_STEP[step])
    with pytest.raises(Killed):
        drive(make_actuator(store, slurm, clock), store, rec_id, clock)
    assert steps(store, rec_id)[-1] == (step, "started")
    assert slurm.calls[CALL_OF_STEP[step]] == (0 if when == "before" else 1)
    if when == "before" and step in ("allow_requeue", "requeue_hold"):
        assert slurm.job["restart_count"] == 0   # the requeue really did not happen

    setattr(slurm, f"crash_{when}", None)
    clock[0] += 1
    drive(make_actuator(store, slurm, clock), store, rec_id, clock)
    assert store.rec(rec_id).status == "done"
    assert slurm.calls["requeue_hold"] == 1 and slurm.calls["allow_requeue"] == 1
    assert slurm.calls["set_excluded_nodes"] == 1
    if when == "before":
        assert slurm.calls == Counter(allow_requeue=1, requeue_hold=1, set_excluded_nodes=1,
                                      start_now=1, release=1)
    assert slurm.job["restart_count"] == 1
    assert slurm.job["excluded"] == want
    assert slurm.job["held"] is False and slurm.job["start_now"] is True


def test_restart_long_after_a_crash_still_requeues_only_once(store, clock, killed):
    """Down for longer than the decision timeout while the job sat held."""
    slurm = FakeSlurm()
    rec_id = add_job_rec(store, slurm)
    with pytest.raises(Killed):
        drive(make_actuator(store, slurm, clock, on_step=StepFaults(crash_after="requeue_hold")),
              store, rec_id, clock)
    clock[0] += 10 * 60.0
    drive(make_actuator(store, slurm, clock), store, rec_id, clock)
    assert store.rec(rec_id).status in ("done", "released_by_watchdog")
    assert slurm.calls["requeue_hold"] == 1
    assert slurm.job["held"] is False and slurm.job["restart_count"] == 1


# -- 3. stale state: the world moved on ----------------------------------------------
@pytest.mark.parametrize("held", [False, True])
def test_requeued_by_someone_else_expires_and_does_nothing(store, clock, held):
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm)
    slurm.requeue_by_someone_else(held=held)
    drive(make_actuator(store, slurm, clock), store, rec_id, clock)
    rec = store.rec(rec_id)
    assert rec.status == "expired"
    assert "someone else" in rec.error
    assert not slurm.calls                       # zero mutating calls
    assert slurm.job["held"] is held             # not ours to release
    assert steps(store, rec_id) == []
    assert rec.held_at is None


def test_restarted_twice_since_the_decision_expires(store, clock):
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm)
    slurm.requeue_by_someone_else()
    slurm.job["state"] = "FAILED"
    slurm.requeue_by_someone_else()
    drive(make_actuator(store, slurm, clock), store, rec_id, clock)
    rec = store.rec(rec_id)
    assert rec.status == "expired" and "restarted 2 times" in rec.error
    assert not slurm.calls


def test_job_id_reused_expires(store, clock):
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm)
    # slurmctld lost its state: the same id is now another job (same restart count)
    slurm.job.update(submit_time=SUBMIT + 86400, state="RUNNING")
    drive(make_actuator(store, slurm, clock), store, rec_id, clock)
    rec = store.rec(rec_id)
    assert rec.status == "expired" and "another job" in rec.error
    assert not slurm.calls


def test_job_vanished_expires(store, clock):
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm)
    slurm.job = None
    drive(make_actuator(store, slurm, clock), store, rec_id, clock)
    rec = store.rec(rec_id)
    assert rec.status == "expired" and "gone" in rec.error
    assert not slurm.calls


@pytest.mark.parametrize("state,held", [("RUNNING", False), ("PENDING", True)])
def test_job_active_again_at_the_same_attempt_expires(store, clock, state, held):
    """An ended attempt running again without any requeue, or put back and
    held by someone: not ours to touch."""
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm, trigger="ended")
    slurm.job.update(state=state, held=held)
    drive(make_actuator(store, slurm, clock), store, rec_id, clock)
    rec = store.rec(rec_id)
    assert rec.status == "expired" and state in rec.error
    assert not slurm.calls


def test_job_slurm_put_back_in_the_queue_gets_our_exclusions(store, clock):
    """A controller that crashed may requeue the attempt itself, unheld and at
    the same restart count: no second requeue, only the exclusions and a start."""
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm, trigger="ended")
    slurm.job.update(state="PENDING", held=False)
    drive(make_actuator(store, slurm, clock), store, rec_id, clock)
    rec = store.rec(rec_id)
    assert rec.status == "done" and "itself" in rec.error
    assert slurm.calls == Counter(set_excluded_nodes=1, start_now=1)
    assert slurm.job["excluded"] == ("gpu2",)


def test_job_put_back_that_starts_before_the_exclusion_expires(store, clock):
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm, trigger="ended")
    slurm.job.update(state="PENDING", held=False)
    slurm.fail_next, slurm.fail_only = 1, {"set_excluded_nodes"}
    act = make_actuator(store, slurm, clock)
    act.run_once()
    slurm.job.update(state="RUNNING")       # it started meanwhile
    drive(act, store, rec_id, clock)
    rec = store.rec(rec_id)
    assert rec.status == "expired" and "RUNNING" in rec.error
    assert "requeue_hold" not in slurm.calls


def test_job_vanishing_during_the_requeue_expires(store, clock):
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm)
    act = make_actuator(store, slurm, clock)
    orig = slurm.requeue_hold

    def gone(job_id):
        slurm.job = None
        orig(job_id)
    slurm.requeue_hold = gone
    drive(act, store, rec_id, clock)
    rec = store.rec(rec_id)
    assert rec.status == "expired" and "vanished" in rec.error
    # Slurm answered "no such job": the call did not happen
    assert steps(store, rec_id) == [("requeue_hold", "started"), ("requeue_hold", "refused")]
    assert store.steps(rec_id)[-1]["detail"] == "not found"
    assert rec.tries == 0


# -- 4. scontrol failing ------------------------------------------------------------
def test_failing_requeue_is_retried_with_backoff_then_fails(store, clock):
    slurm = FakeSlurm(state="FAILED")
    slurm.fail_next = 100
    rec_id = add_job_rec(store, slurm)
    act = make_actuator(store, slurm, clock, action_retries=3, retry_backoff=2)
    t0 = clock[0]

    act.run_once()
    rec = store.rec(rec_id)
    assert slurm.calls["requeue_hold"] == 1
    assert rec.status == "executing" and rec.tries == 1 and rec.next_try == t0 + 2

    clock[0] = t0 + 1.9                 # before next_try: left alone
    act.run_once()
    assert slurm.calls["requeue_hold"] == 1

    clock[0] = t0 + 2                   # second try; backoff doubles
    act.run_once()
    rec = store.rec(rec_id)
    assert slurm.calls["requeue_hold"] == 2
    assert rec.tries == 2 and rec.next_try == t0 + 2 + 4

    clock[0] = t0 + 5.5
    act.run_once()
    assert slurm.calls["requeue_hold"] == 2

    clock[0] = t0 + 6                   # third and last try
    assert act.run_once() == 0
    rec = store.rec(rec_id)
    assert rec.status == "failed" and rec.tries == 3
    assert "requeue_hold" in rec.error and "timed out" in rec.error
    assert "after 3 tries" in rec.error
    assert rec.next_try is None and rec.held_at is None
    assert slurm.calls == Counter(requeue_hold=3)          # never held: nothing to release
    assert steps(store, rec_id) == [("requeue_hold", "started"),
                                    ("requeue_hold", "failed")] * 3
    assert "Socket timed out" in store.steps(rec_id)[1]["detail"]
    assert [e["kind"] for e in store.timeline(rec.job)] == ["rec_failed"]


def test_transient_failure_then_success(store, clock):
    slurm = FakeSlurm(state="FAILED")
    slurm.fail_next = 1
    rec_id = add_job_rec(store, slurm)
    drive(make_actuator(store, slurm, clock, retry_backoff=1), store, rec_id, clock)
    rec = store.rec(rec_id)
    assert rec.status == "done" and rec.tries == 1
    assert slurm.calls == Counter(requeue_hold=2, set_excluded_nodes=1, start_now=1,
                                  release=1)
    assert slurm.job["restart_count"] == 1


def test_a_controller_restart_before_the_release_gets_start_now_again(store, clock):
    """The live campaign: slurmctld was SIGKILLed just before our release, and
    came back from state saved before our exclusion and StartTime=now. The
    exclusion is seen missing and set again; the begin time cannot be seen
    (squeue has no field for it), so StartTime=now goes again before the
    release, or the job waits out Slurm's 2-minute requeue delay."""
    slurm = FakeSlurm(state="FAILED")
    slurm.fail_only, slurm.fail_next = {"release"}, 1
    rec_id = add_job_rec(store, slurm, exclude=("gpu2",))
    act = make_actuator(store, slurm, clock, retry_backoff=1)
    act.run_once()                                   # requeue_hold
    clock[0] += RELAUNCH_GAP_S
    act.run_once()                                   # exclude, start_now, release refused
    assert ("release", "failed") in steps(store, rec_id)
    slurm.job.update(excluded=(), start_now=False)   # the restarted controller forgot them
    drive(act, store, rec_id, clock)
    assert store.rec(rec_id).status == "done"
    assert slurm.job["excluded"] == ("gpu2",) and slurm.job["start_now"] is True
    assert slurm.calls["start_now"] == 2 and slurm.calls["release"] == 2
    again = [s["detail"] for s in store.steps(rec_id) if s["step"] == "start_now"]
    assert "again" in again[-1]


def test_the_restart_waits_for_the_relaunch_gap(store, clock):
    """StartTime=now and the release come no sooner than RELAUNCH_GAP_S whole
    seconds after the requeue's second (a slurmd refuses to launch the job
    again under a credential that is not newer than its kill); the exclusion
    goes on at once."""
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm, exclude=("gpu2",))
    act = make_actuator(store, slurm, clock)
    clock[0] = float(int(clock[0])) + 0.9         # late in a second
    act.run_once()                                # requeue_hold
    held = store.rec(rec_id).held_at
    for dt in (0.3, 0.5):                         # still inside the gap
        clock[0] += dt
        act.run_once()
    assert [c[0] for c in slurm.log] == ["requeue_hold", "set_excluded_nodes"]
    assert clock[0] < relaunch_after(held) == int(held) + RELAUNCH_GAP_S
    clock[0] = relaunch_after(held)
    act.run_once()
    assert [c[0] for c in slurm.log][-2:] == ["start_now", "release"]
    assert store.rec(rec_id).status == "done"
    assert relaunch_after(None) == 0.0


@pytest.mark.parametrize("ended_before", [1.4, 0.2])
def test_the_gap_counts_from_the_end_of_an_attempt_that_had_ended(store, clock, ended_before):
    """A failed attempt's nodes were told to end it when it ended (a requeue
    of a finished job kills nothing more): the restart waits RELAUNCH_GAP_S
    whole seconds after the second Slurm stamped as its end, which may come a
    second sooner than after the requeue's. The requeue stamps a new end time
    on the job; the one read before it counts."""
    clock[0] = float(int(clock[0])) + 0.9         # requeued late in a second
    ended = int(clock[0] - ended_before)          # Slurm's end time, whole seconds
    slurm = FakeSlurm(state="FAILED", end_time=ended)
    rec_id = add_job_rec(store, slurm, exclude=("gpu2",))
    act = make_actuator(store, slurm, clock)
    act.run_once()                                # requeue_hold
    held = store.rec(rec_id).held_at
    slurm.job["end_time"] = int(held)             # as _job_requeue_op stamps it
    start = ended + RELAUNCH_GAP_S
    assert start <= relaunch_after(held)
    clock[0] = start - 0.05
    act.run_once()
    assert [c[0] for c in slurm.log] == ["requeue_hold", "set_excluded_nodes"]
    clock[0] = float(start)
    act.run_once()
    assert [c[0] for c in slurm.log][-2:] == ["start_now", "release"]
    assert store.rec(rec_id).status == "done"
    assert relaunch_after(held, ended) == start
    assert relaunch_after(held, held + 5) == relaunch_after(held)   # never later


def test_a_restarted_actuator_waits_from_the_requeue(store, clock):
    """The end time is kept in memory only: an actuator that starts between the
    requeue and the restart waits from the requeue's second, as before."""
    clock[0] = float(int(clock[0])) + 0.9
    slurm = FakeSlurm(state="FAILED", end_time=int(clock[0]) - 1)
    rec_id = add_job_rec(store, slurm, exclude=("gpu2",))
    make_actuator(store, slurm, clock).run_once()  # requeue_hold
    held = store.rec(rec_id).held_at
    act = make_actuator(store, slurm, clock)
    clock[0] = relaunch_after(held) - 0.05
    act.run_once()
    assert "start_now" not in [c[0] for c in slurm.log]
    clock[0] = relaunch_after(held)
    act.run_once()
    assert [c[0] for c in slurm.log][-2:] == ["start_now", "release"]


def test_a_clean_release_sets_start_now_once(store, clock):
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm, exclude=("gpu2",))
    drive(make_actuator(store, slurm, clock), store, rec_id, clock)
    assert slurm.calls["start_now"] == 1


def test_timed_out_requeue_that_took_effect_is_not_repeated(store, clock):
    """scontrol timed out but slurmctld did requeue: the next try sees it was ours."""
    slurm = FakeSlurm(state="FAILED")
    slurm.fail_next, slurm.fail_mode = 1, "late"
    rec_id = add_job_rec(store, slurm)
    drive(make_actuator(store, slurm, clock, retry_backoff=1), store, rec_id, clock)
    rec = store.rec(rec_id)
    assert rec.status == "done"
    assert slurm.calls["requeue_hold"] == 1 and slurm.job["restart_count"] == 1
    assert slurm.job["held"] is False and slurm.job["excluded"] == ("gpu2",)


def test_a_retry_due_past_the_decision_timeout_fails_open(store, clock):
    """The agent stalled: the next try comes after the deadline, so no more retries."""
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm)
    act = make_actuator(store, slurm, clock, decision_timeout=60, action_retries=20,
                        retry_backoff=1)
    t0 = clock[0]
    act.run_once()                                   # held
    slurm.fail_next, slurm.fail_only = 1000, {"set_excluded_nodes"}
    clock[0] = t0 + 1
    act.run_once()                                   # try 1 fails, retry at t0 + 2
    assert store.rec(rec_id).tries == 1
    clock[0] = t0 + 100
    act.run_once()
    rec = store.rec(rec_id)
    assert rec.status == "failed" and "after 2 tries" in rec.error
    assert slurm.calls["set_excluded_nodes"] == 2
    assert slurm.job["held"] is False and rec.held_at is None


def test_a_failed_step_is_judged_on_the_record_as_the_pass_left_it(store, clock):
    """A requeue-hold made again (a controller that lost the first) holds the job
    anew: when that call fails, the retry is judged on the new hold, not on the
    record as the pass read it (whose old hold is past the decision timeout)."""
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm)
    act = make_actuator(store, slurm, clock, decision_timeout=60, action_retries=3)
    t0 = clock[0]
    act.run_once()                                   # held at t0
    assert store.rec(rec_id).held_at == t0
    slurm.job.update(restart_count=0, submit_time=SUBMIT, state="FAILED", held=False)
    slurm.fail_next, slurm.fail_only = 1, {"requeue_hold"}
    clock[0] = t0 + 100
    act.run_once()                                   # held again, and that call fails
    rec = store.rec(rec_id)
    assert rec.status == "executing" and rec.tries == 1 and rec.held_at == t0 + 100
    assert rec.next_try is not None


def test_allow_requeue_is_done_once_even_if_listings_lag(store, clock):
    """Listings that keep saying no-requeue: one allow_requeue, then retries only requeue."""
    slurm = FakeSlurm(state="FAILED", requeue_allowed=False)
    slurm.report_requeue_flag = False
    rec_id = add_job_rec(store, slurm)
    slurm.fail_next, slurm.fail_only = 1, {"requeue_hold"}
    drive(make_actuator(store, slurm, clock, retry_backoff=1), store, rec_id, clock)
    assert store.rec(rec_id).status == "done"
    assert slurm.calls["allow_requeue"] == 1 and slurm.calls["requeue_hold"] == 2


def test_failing_exclusion_fails_open_and_releases_our_hold(store, clock):
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm)
    act = make_actuator(store, slurm, clock, action_retries=3, retry_backoff=1)
    act.run_once()                                   # requeue_hold ok
    assert slurm.job["held"] is True
    slurm.fail_next, slurm.fail_only = 100, {"set_excluded_nodes"}
    clock[0] += 1
    drive(act, store, rec_id, clock)

    rec = store.rec(rec_id)
    assert rec.status == "failed"
    assert "exclude" in rec.error and "after 3 tries" in rec.error
    assert slurm.calls["set_excluded_nodes"] == 3
    assert slurm.job["held"] is False                # fail open
    assert slurm.job["excluded"] == () and slurm.job["start_now"] is True
    assert slurm.calls["release"] == 1 and slurm.calls["requeue_hold"] == 1
    assert ("release_after_failed", "ok") in steps(store, rec_id)
    assert rec.held_at is None


def test_a_hold_that_could_not_be_lifted_is_left_for_the_watchdog(store, clock):
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm)
    act = make_actuator(store, slurm, clock, action_retries=2, retry_backoff=1,
                        decision_timeout=60)
    t0 = clock[0]
    act.run_once()                                   # held
    slurm.fail_next = 1000                           # every write fails now
    clock[0] += 1
    drive(act, store, rec_id, clock)
    rec = store.rec(rec_id)
    assert rec.status == "failed"
    assert slurm.job["held"] is True and rec.held_at == t0   # still marked

    slurm.fail_next = 0                              # scontrol works again
    clock[0] = t0 + 59
    act.run_once()
    assert slurm.job["held"] is True                 # not before the timeout
    clock[0] = t0 + 60
    act.run_once()
    rec = store.rec(rec_id)
    assert slurm.job["held"] is False
    assert rec.status == "failed" and rec.held_at is None
    assert ("watchdog_release", "ok") in steps(store, rec_id)


def test_last_try_requeue_that_took_effect_does_not_strand_the_job(store, clock):
    """Regression: the fail-open release used to be judged on the listing taken
    before the call, so a held job was neither released nor left marked for the
    watchdog (held_at cleared): held forever."""
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm)
    act = make_actuator(store, slurm, clock, action_retries=1, decision_timeout=60)
    slurm.fail_next, slurm.fail_mode = 1, "late"     # timed out, but slurmctld requeued it
    act.run_once()
    rec = store.rec(rec_id)
    assert rec.status == "failed" and "after 1 tries" in rec.error
    assert slurm.job["restart_count"] == 1 and slurm.calls["requeue_hold"] == 1
    for _ in range(5):                               # well past the decision timeout
        clock[0] += 60
        act.run_once()
    assert slurm.job["held"] is False


def test_fail_open_when_the_job_cannot_be_read_leaves_it_to_the_watchdog(store, clock):
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm)
    act = make_actuator(store, slurm, clock, decision_timeout=60, action_retries=1)
    t0 = clock[0]
    act.run_once()                                   # held
    slurm.fail_next, slurm.fail_only = 1, {"set_excluded_nodes"}
    slurm.get_job_fails = 1                          # the fail-open re-read times out
    clock[0] = t0 + 1
    act.run_once()
    rec = store.rec(rec_id)
    assert rec.status == "failed" and rec.held_at == t0   # still marked
    assert slurm.job["held"] is True and slurm.calls["release"] == 0
    clock[0] = t0 + 60
    act.run_once()                                   # the watchdog lets it go
    rec = store.rec(rec_id)
    assert slurm.job["held"] is False and rec.held_at is None
    assert rec.status == "failed"


def test_last_try_requeue_still_completing_is_released_once_held(store, clock):
    slurm = FakeSlurm(state="RUNNING", completing=3)
    rec_id = add_job_rec(store, slurm, action="kill_requeue", trigger="hang")
    act = make_actuator(store, slurm, clock, decision_timeout=60, action_retries=1)
    t0 = clock[0]
    slurm.fail_next, slurm.fail_mode = 1, "late"
    act.run_once()
    rec = store.rec(rec_id)
    assert rec.status == "failed" and rec.held_at == t0
    for _ in range(70):
        clock[0] += 1
        act.run_once()
    assert slurm.as_job().state == "PENDING" and slurm.job["held"] is False
    assert store.rec(rec_id).held_at is None
    assert slurm.calls["requeue_hold"] == 1



# -- 5. slurmctld down ------------------------------------------------------------------
def test_slurmctld_down_waits_then_completes(store, clock):
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm)
    act = make_actuator(store, slurm, clock)
    slurm.down = True
    for _ in range(5):
        assert act.run_once() == 1
        clock[0] += 1
    assert not slurm.calls
    assert store.rec(rec_id).status == "proposed" and act.waiting_for_slurm
    assert steps(store, rec_id) == []

    slurm.down = False
    drive(act, store, rec_id, clock)
    assert store.rec(rec_id).status == "done" and not act.waiting_for_slurm
    assert slurm.calls["requeue_hold"] == 1


def test_slurmctld_down_while_held_waits_then_completes(store, clock):
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm)
    act = make_actuator(store, slurm, clock, decision_timeout=60)
    act.run_once()
    assert slurm.job["held"] is True
    slurm.down = True
    for _ in range(10):
        clock[0] += 1
        assert act.run_once() == 1
    assert slurm.calls == Counter(requeue_hold=1)
    assert store.rec(rec_id).status == "executing"
    slurm.down = False
    drive(act, store, rec_id, clock)
    assert store.rec(rec_id).status == "done"
    assert slurm.calls == Counter(requeue_hold=1, set_excluded_nodes=1, start_now=1,
                                  release=1)


def test_slurmctld_outage_is_logged_once(store, clock, caplog):
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm)
    act = make_actuator(store, slurm, clock)
    slurm.down = True
    with caplog.at_level("INFO", logger="recovery_agent.act.actuator"):
        for _ in range(4):
            act.run_once()
            clock[0] += 1
        slurm.down = False
        drive(act, store, rec_id, clock)
    texts = [r.getMessage() for r in caplog.records]
    assert sum("unreachable" in t for t in texts) == 1
    assert sum("reachable again" in t for t in texts) == 1


def test_read_failure_inside_a_node_step_only_waits(store, clock):
    slurm = FakeSlurm()
    rec_id = add_node_rec(store, "drain_node")
    act = make_actuator(store, slurm, clock)
    real = slurm.get_node
    slurm.get_node = lambda name: (_ for _ in ()).throw(SchedulerError("sinfo timed out"))
    for _ in range(3):
        act.run_once()
        clock[0] += 1
    rec = store.rec(rec_id)
    assert rec.status == "proposed" and rec.tries == 0
    slurm.get_node = real
    drive(act, store, rec_id, clock)
    assert store.rec(rec_id).status == "done"


# -- 6. the watchdog ------------------------------------------------------------------
def test_watchdog_releases_a_job_held_past_the_decision_timeout(store, clock):
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm)
    act = make_actuator(store, slurm, clock, decision_timeout=60, action_retries=20,
                        retry_backoff=10)
    t0 = clock[0]
    act.run_once()                                   # requeue_hold ok, held
    slurm.fail_next, slurm.fail_only = 1000, {"set_excluded_nodes"}
    while clock[0] < t0 + 59:
        clock[0] += 1
        act.run_once()
    rec = store.rec(rec_id)
    assert rec.status == "executing" and slurm.job["held"] is True
    assert slurm.calls["set_excluded_nodes"] >= 2

    clock[0] = t0 + 60
    act.run_once()
    rec = store.rec(rec_id)
    assert rec.status == "released_by_watchdog"
    assert "policy.decision_timeout=60s" in rec.error
    assert slurm.job["held"] is False and slurm.job["start_now"] is True
    assert slurm.calls["release"] == 1 and slurm.calls["requeue_hold"] == 1
    assert ("watchdog_release", "ok") in steps(store, rec_id)
    assert "rec_released_by_watchdog" in [e["kind"] for e in store.timeline(rec.job)]


def test_watchdog_does_not_strand_a_job_stuck_completing(store, clock):
    """Regression: the watchdog used to end the rec released_by_watchdog while our
    requeued job was still COMPLETING (_holds needs PENDING), releasing nothing;
    once the kill completed the job sat PENDING and held for good."""
    # kill_requeue of a hung job whose processes take 90 s to die (UnkillableStepTimeout)
    slurm = FakeSlurm(state="RUNNING", completing=90)
    rec_id = add_job_rec(store, slurm, action="kill_requeue", trigger="hang")
    act = make_actuator(store, slurm, clock, decision_timeout=60)
    for _ in range(120):
        act.run_once()
        clock[0] += 1
    while slurm.completing_left:        # slurmd finally reaps the attempt
        slurm.list_jobs()
    assert slurm.as_job().state == "PENDING"
    for _ in range(120):
        act.run_once()
        clock[0] += 1
    assert slurm.calls["requeue_hold"] == 1
    rec = store.rec(rec_id)
    assert rec.status in FINAL_STATUSES
    assert slurm.job["held"] is False, f"rec {rec.status}: job left held"


def test_watchdog_retries_a_release_that_failed(store, clock):
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm)
    act = make_actuator(store, slurm, clock, decision_timeout=60, action_retries=20,
                        retry_backoff=1000)
    t0 = clock[0]
    act.run_once()                                   # held
    slurm.fail_next, slurm.fail_only = 1, {"set_excluded_nodes"}
    clock[0] = t0 + 1
    act.run_once()                                   # exclusion fails: a long backoff
    assert store.rec(rec_id).next_try == t0 + 1 + 1000
    slurm.fail_next, slurm.fail_only = 1, {"release"}
    clock[0] = t0 + 60
    act.run_once()                                   # the watchdog's release fails
    rec = store.rec(rec_id)
    assert slurm.calls["release"] == 1 and slurm.job["held"] is True
    assert rec.status in OPEN_STATUSES            # kept for the next pass
    clock[0] += 1
    act.run_once()
    assert store.rec(rec_id).status == "released_by_watchdog"
    assert slurm.calls["release"] == 2 and slurm.job["held"] is False


def test_watchdog_never_releases_a_hold_that_is_not_ours(store, clock):
    """A rec marked held (the agent died between marking it and the requeue) whose job
    someone else requeue-held: the watchdog clears the mark and leaves the job."""
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm, status="expired", held_at=clock[0] - 100)
    slurm.requeue_by_someone_else(held=True)
    act = make_actuator(store, slurm, clock, decision_timeout=60)
    act.run_once()
    assert not slurm.calls and slurm.job["held"] is True
    rec = store.rec(rec_id)
    assert rec.status == "expired" and rec.held_at is None


def test_watchdog_runs_on_its_own(store, clock):
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm)
    act = make_actuator(store, slurm, clock, decision_timeout=60)
    t0 = clock[0]
    act.run_once()
    listing = {j.job_id: j for j in slurm.list_jobs()}
    clock[0] = t0 + 59
    assert act.watchdog(listing, clock[0]) == []
    clock[0] = t0 + 61
    assert act.watchdog(listing, clock[0]) == [rec_id]
    assert store.rec(rec_id).status == "released_by_watchdog"
    assert slurm.job["held"] is False


# -- 7. node actions ------------------------------------------------------------------
def test_drain_node(store, clock):
    slurm = FakeSlurm()
    rec_id = add_node_rec(store, "drain_node", node="gpu3")
    drive(make_actuator(store, slurm, clock), store, rec_id, clock)
    rec = store.rec(rec_id)
    assert rec.status == "done"
    assert slurm.calls == Counter(drain_node=1)
    node = slurm.get_node("gpu3")
    assert node.drained and node.reason == f"rcv:xid #{rec_id}" and len(node.reason) <= 20
    assert node.reason == drain_reason(rec_id, "xid") and ours(node.reason)
    row = store.node("gpu3")
    # Slurm shows the short reason; the store keeps it (to know the drain) and the full one
    assert row["drained_by_us"] == 1 and row["drain_slurm_reason"] == node.reason
    assert row["drain_reason"] == f"recovery #{rec_id} xid: XID 79"
    assert row["drained_at"] == clock[0]
    assert steps(store, rec_id) == [("drain", "started"), ("drain", "ok")]


def test_drain_of_a_node_someone_else_drained_is_left_alone(store, clock):
    slurm = FakeSlurm()
    slurm.drain_by_someone_else("gpu3", "admin: bad fan")
    rec_id = add_node_rec(store, "drain_node", node="gpu3")
    drive(make_actuator(store, slurm, clock), store, rec_id, clock)
    rec = store.rec(rec_id)
    assert rec.status == "done" and "someone else" in rec.error
    assert not slurm.calls
    assert not (store.node("gpu3") or {}).get("drained_by_us")
    assert slurm.get_node("gpu3").reason == "admin: bad fan"


def test_drain_already_ours_is_recorded_without_a_call(store, clock):
    """Crashed after the drain call, before marking it: our call is on record
    ('started') and Slurm shows its exact reason, so it is ours."""
    slurm = FakeSlurm()
    rec_id = add_node_rec(store, "drain_node", node="gpu3")
    store.add_step(rec_id, "drain", "started", drain_reason(rec_id, "xid"))
    slurm.drain_by_someone_else("gpu3", drain_reason(rec_id, "xid"))
    drive(make_actuator(store, slurm, clock), store, rec_id, clock)
    assert store.rec(rec_id).status == "done"
    assert not slurm.calls
    assert store.node("gpu3")["drained_by_us"] == 1


def test_drain_of_an_unknown_node_fails(store, clock):
    slurm = FakeSlurm()
    rec_id = add_node_rec(store, "drain_node", node="nosuch")
    drive(make_actuator(store, slurm, clock), store, rec_id, clock)
    rec = store.rec(rec_id)
    assert rec.status == "failed" and "no longer exists" in rec.error
    assert not slurm.calls


def test_node_rec_without_a_node_fails(store, clock):
    slurm = FakeSlurm()
    rec_id = add_node_rec(store, "drain_node", target_nodes=[])
    drive(make_actuator(store, slurm, clock), store, rec_id, clock)
    rec = store.rec(rec_id)
    assert rec.status == "failed" and rec.error == "no node named"
    assert not slurm.calls


def test_node_vanishing_during_the_drain_fails(store, clock):
    slurm = FakeSlurm()
    rec_id = add_node_rec(store, "drain_node", node="gpu3")
    real = slurm.drain_node

    def vanish(name, reason):
        del slurm.nodes[name]
        real(name, reason)
    slurm.drain_node = vanish
    drive(make_actuator(store, slurm, clock), store, rec_id, clock)
    rec = store.rec(rec_id)
    assert rec.status == "failed" and "no longer exists" in rec.error
    assert steps(store, rec_id) == [("drain", "started"), ("drain", "refused")]
    assert not (store.node("gpu3") or {}).get("drained_by_us")


def test_drain_failing_is_retried_then_fails(store, clock):
    slurm = FakeSlurm()
    slurm.fail_next = 100
    rec_id = add_node_rec(store, "drain_node")
    drive(make_actuator(store, slurm, clock, action_retries=2, retry_backoff=1), store,
          rec_id, clock)
    rec = store.rec(rec_id)
    assert rec.status == "failed" and "drain" in rec.error
    assert slurm.calls == Counter(drain_node=2)
    assert not (store.node("gpu3") or {}).get("drained_by_us")


def test_resume_of_a_node_someone_else_drained_expires(store, clock):
    slurm = FakeSlurm()
    slurm.drain_by_someone_else("gpu3", "admin: maintenance")
    store.set_node("gpu3", drained_by_us=1, drain_reason="recovery: 1 xid")
    rec_id = add_node_rec(store, "resume_node", node="gpu3")
    drive(make_actuator(store, slurm, clock), store, rec_id, clock)
    rec = store.rec(rec_id)
    assert rec.status == "expired" and "someone else" in rec.error
    assert not slurm.calls
    assert slurm.get_node("gpu3").drained
    assert store.node("gpu3")["drained_by_us"] == 0


def test_resume_of_our_drain(store, clock):
    slurm = FakeSlurm()
    drain_id = add_node_rec(store, "drain_node", node="gpu3")
    act = make_actuator(store, slurm, clock)
    drive(act, store, drain_id, clock)
    rec_id = add_node_rec(store, "resume_node", node="gpu3")
    drive(act, store, rec_id, clock)
    assert store.rec(rec_id).status == "done"
    assert slurm.calls == Counter(drain_node=1, resume_node=1)
    assert not slurm.get_node("gpu3").drained
    row = store.node("gpu3")
    assert row["drained_by_us"] == 0 and row["drain_reason"] is None


def test_resume_of_a_node_no_longer_drained(store, clock):
    slurm = FakeSlurm()
    rec_id = add_node_rec(store, "resume_node", node="gpu3")
    drive(make_actuator(store, slurm, clock), store, rec_id, clock)
    rec = store.rec(rec_id)
    assert rec.status == "done" and "no longer drained" in rec.error
    assert not slurm.calls


def test_clean_reports_lead_to_a_resume(store, clock):
    slurm = FakeSlurm()
    act = make_actuator(store, slurm, clock, resume_after=100)
    drain_id = add_node_rec(store, "drain_node", node="gpu3")
    drive(act, store, drain_id, clock)
    drained_at = store.node("gpu3")["drained_at"]
    store.db["node_reports"].insert({"report_id": "r1", "hook": "health", "node": "gpu3",
                                     "received": drained_at + 5, "gpu_ok": 1})
    clock[0] = drained_at + 50
    act.last_resume_check = 0
    act.run_once()
    assert [r for r in store.recommendations() if r.action == "resume_node"] == []
    clock[0] = drained_at + 200
    act.last_resume_check = 0
    act.run_once()
    resumes = [r for r in store.recommendations() if r.action == "resume_node"]
    assert len(resumes) == 1 and resumes[0].target_nodes == ("gpu3",)
    drive(act, store, resumes[0].id, clock)
    assert store.rec(resumes[0].id).status == "done"
    assert not slurm.get_node("gpu3").drained
    assert slurm.calls == Counter(drain_node=1, resume_node=1)


def test_no_automatic_resume_when_resume_after_is_zero(store, clock):
    slurm = FakeSlurm()
    act = make_actuator(store, slurm, clock, resume_after=0)
    drive(act, store, add_node_rec(store, "drain_node"), clock)
    store.db["node_reports"].insert({"report_id": "r1", "hook": "health", "node": "gpu3",
                                     "received": clock[0] + 1, "gpu_ok": 1})
    clock[0] += 10_000
    assert act.resume_clean_nodes(clock[0]) == []


def test_one_open_resume_per_node(store, clock):
    slurm = FakeSlurm()
    act = make_actuator(store, slurm, clock, resume_after=10)
    drive(act, store, add_node_rec(store, "drain_node"), clock)
    store.db["node_reports"].insert({"report_id": "r1", "hook": "health", "node": "gpu3",
                                     "received": clock[0] + 1, "gpu_ok": 1})
    clock[0] += 100
    assert len(act.resume_clean_nodes(clock[0])) == 1
    assert act.resume_clean_nodes(clock[0]) == []    # the first is still open


# -- 8. kill_requeue of a hung job, stop, odd actions --------------------------------------
def test_kill_requeue_of_a_hung_running_job(store, clock):
    slurm = FakeSlurm(state="RUNNING", completing=True)
    rec_id = add_job_rec(store, slurm, action="kill_requeue", trigger="hang",
                         exclude=("gpu1",))
    act = make_actuator(store, slurm, clock)
    act.run_once()
    assert slurm.calls == Counter(requeue_hold=1)
    clock[0] += 1
    act.run_once()                                   # the killed attempt is COMPLETING
    assert slurm.calls == Counter(requeue_hold=1)
    assert store.rec(rec_id).status == "executing"
    clock[0] += 1
    drive(act, store, rec_id, clock)
    assert store.rec(rec_id).status == "done"
    assert [c[0] for c in slurm.log] == ["requeue_hold", "set_excluded_nodes", "start_now",
                                         "release"]
    assert slurm.job["excluded"] == ("gpu1",) and slurm.job["held"] is False
    assert "cancel" not in slurm.calls


def test_hung_job_stop_cancels_it(store, clock):
    slurm = FakeSlurm(state="RUNNING")
    rec_id = add_job_rec(store, slurm, action="stop", trigger="hang", exclude=())
    drive(make_actuator(store, slurm, clock), store, rec_id, clock)
    assert store.rec(rec_id).status == "done"
    assert slurm.calls == Counter(cancel=1) and slurm.job["state"] == "CANCELLED"


@pytest.mark.parametrize("completing", [False, True])
def test_stop_of_an_ended_job_makes_no_call(store, clock, completing):
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm, action="stop", trigger="ended", exclude=())
    slurm.completing_left = 100 if completing else 0   # still listed COMPLETING
    drive(make_actuator(store, slurm, clock), store, rec_id, clock)
    assert store.rec(rec_id).status == "done"
    assert not slurm.calls


def test_stop_of_a_hung_job_someone_already_restarted_cancels_nothing(store, clock):
    slurm = FakeSlurm(state="RUNNING")
    rec_id = add_job_rec(store, slurm, action="stop", trigger="hang", exclude=())
    slurm.requeue_by_someone_else()
    slurm.job["state"] = "RUNNING"
    drive(make_actuator(store, slurm, clock), store, rec_id, clock)
    assert store.rec(rec_id).status == "done"
    assert not slurm.calls and slurm.job["state"] == "RUNNING"


@pytest.mark.parametrize("scope,action", [("job", "reboot"), ("node", "reboot_node")])
def test_unknown_action_fails(store, clock, scope, action):
    slurm = FakeSlurm()
    if scope == "job":
        rec_id = add_job_rec(store, slurm, action=action)
    else:
        rec_id = add_node_rec(store, action)
    drive(make_actuator(store, slurm, clock), store, rec_id, clock)
    rec = store.rec(rec_id)
    assert rec.status == "failed" and "unknown" in rec.error
    assert not slurm.calls


def test_stop_notifies_once(store, clock, monkeypatch):
    sent = []
    monkeypatch.setattr("recovery_agent.act.jobs.notify",
                        lambda target, rec: sent.append((target, rec.id)) or Sent(True, "ok"))
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm, action="stop", exclude=(),
                         spec="act:action,notify=https://example.invalid/hook")
    cfg = from_mapping({"agent": {"cluster": "c1"},
                        "environments": {"act": {"notify_allow": "example.invalid"}}})
    act = Actuator(cfg, store, slurm, clock=lambda: clock[0], mono=lambda: clock[0])
    drive(act, store, rec_id, clock)
    assert sent == [("https://example.invalid/hook", rec_id)]
    assert ("notify", "ok") in steps(store, rec_id)
    assert store.rec(rec_id).status == "done" and not slurm.calls


@pytest.mark.parametrize("url", ["http://127.0.0.1:8787/v1/environments/prod/mode",
                                 "https://example.invalid@127.0.0.1/",
                                 "https://example.invalid:8443/hook"])
def test_user_notify_url_outside_notify_allow_is_refused(store, clock, monkeypatch, url):
    monkeypatch.setattr("recovery_agent.act.jobs.notify",
                        lambda *a: pytest.fail("a refused URL was posted to"))
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm, action="stop", exclude=(),
                         spec=f"act:action,notify={url}")
    cfg = from_mapping({"agent": {"cluster": "c1"},
                        "environments": {"act": {"notify_allow": "example.invalid"}}})
    drive(Actuator(cfg, store, slurm, clock=lambda: clock[0], mono=lambda: clock[0]),
          store, rec_id, clock)
    assert ("notify", "refused") in steps(store, rec_id)
    assert store.rec(rec_id).status == "done"


def test_stop_with_an_unparsable_spec_does_not_notify(store, clock, monkeypatch):
    monkeypatch.setattr("recovery_agent.act.jobs.notify",
                        lambda *a: pytest.fail("no notify for an invalid spec"))
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm, action="stop", exclude=(), spec="act,bogus=1")
    drive(make_actuator(store, slurm, clock), store, rec_id, clock)
    assert store.rec(rec_id).status == "done" and steps(store, rec_id) == []


# -- the loop ---------------------------------------------------------------------------
def test_run_forever_outlives_a_bad_pass(store, clock):
    act = make_actuator(store, FakeSlurm(), clock)
    stop = threading.Event()
    passes = []

    def run_once():
        passes.append(1)
        if len(passes) == 1:
            raise RuntimeError("boom")
        stop.set()
        return 0
    act.run_once = run_once
    orig_wait = act.wake.wait
    act.wake.wait = lambda timeout=None: orig_wait(0)   # no real waiting
    act.run_forever(stop, interval=0.0)
    assert len(passes) == 2


def test_a_requeue_the_controller_forgot_is_done_again_and_said_so(store, clock):
    """requeue_hold went through, then slurmctld restarted from older state and
    shows the attempt ended and not requeued: requeue again, audited as such."""
    slurm = FakeSlurm(state="FAILED", completing=1)
    rec_id = add_job_rec(store, slurm, trigger="ended")
    act = make_actuator(store, slurm, clock)
    act.run_once()
    assert slurm.calls["requeue_hold"] == 1
    slurm.job.update(state="FAILED", restart_count=0, held=False, submit_time=SUBMIT)
    slurm.completing_left = 0
    drive(act, store, rec_id, clock)
    assert store.rec(rec_id).status == "done"
    assert slurm.calls["requeue_hold"] == 2 and slurm.job["restart_count"] == 1
    details = [s["detail"] for s in store.steps(rec_id)
               if s["step"] == "requeue_hold" and s["state"] == "ok"]
    assert "again" not in details[0] and "again" in details[1]



# -- clock jumps --------------------------------------------------------------

@pytest.mark.resilience("clock jumps on the agent host during a decision",
                        "a jump back does not keep a held job held past the timeout; a "
                        "jump forward does not release it early; the drain budget still "
                        "counts this hour's drains")
@pytest.mark.parametrize("step", [-3 * 3600, +3 * 3600])
def test_watchdog_times_holds_through_clock_jumps(store, clock, step):
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm)
    slurm.fail_next, slurm.fail_only = 99, {"set_excluded_nodes"}   # stuck while held
    act = make_actuator(store, slurm, clock, decision_timeout="120s", action_retries=20,
                        retry_backoff="1s")
    act.run_once()
    assert slurm.job["held"] and store.rec(rec_id).held_at
    jump(clock, step)
    for _ in range(10):          # 100 s of real time: not yet the 120 s timeout
        clock[0] += 10
        act.run_once()
    assert store.rec(rec_id).status == "executing" and slurm.job["held"]
    for _ in range(4):           # past 120 s: released, whichever way the clock went
        clock[0] += 10
        act.run_once()
    rec = store.rec(rec_id)
    assert rec.status == "released_by_watchdog" and not slurm.job["held"]
    assert "held 1" in rec.error        # its real age, not hours


def test_drain_budget_survives_a_forward_jump(store, clock):
    from recovery_agent.decide.decider import Decider
    from recovery_agent.config import from_mapping
    cfg = from_mapping({"policy": {"max_drains_per_hour": 1}})
    mono = [0.0]
    decider = Decider(cfg, store, None, clock=lambda: clock[0], mono=lambda: mono[0])
    assert decider._over_budget("gpu1", clock[0]) == ""
    decider._drained_at.append(mono[0])          # one drain made by this process...
    clock[0] += 2 * 3600                           # ...then the wall clock leaps two hours
    # (the store's wall-clock query no longer sees that drain in "the last hour")
    mono[0] += 60                                  # one real minute later
    assert "max_drains_per_hour" in decider._over_budget("gpu1", clock[0])
    mono[0] += 3600                                # a real hour later: spent
    assert decider._over_budget("gpu1", clock[0]) == ""


# -- one failure, one actor (issue 14, finding 1) ---------------------------------
def test_refused_requeue_is_not_taken_for_ours(store, clock):
    """A requeue-hold Slurm refused did not happen: when the job is then requeued
    by someone else, the recommendation does not claim that requeue as done."""
    slurm = FakeSlurm(state="FAILED")
    slurm.job.update(requeue_allowed=False)
    rec_id = add_job_rec(store, slurm)
    act = make_actuator(store, slurm, clock)
    real_allow = slurm.allow_requeue
    slurm.allow_requeue = lambda job_id: None    # Slurm accepts, yet keeps refusing
    act.run_once()
    assert steps(store, rec_id)[-1] == ("requeue_hold", "refused")
    slurm.allow_requeue = real_allow
    slurm.requeue_by_someone_else()
    clock[0] += 5
    drive(act, store, rec_id, clock)
    rec = store.rec(rec_id)
    assert rec.status == "expired" and "someone else" in rec.error


def test_second_recommendation_for_one_failure_never_acts(store, clock):
    slurm = FakeSlurm(state="FAILED")
    first = add_job_rec(store, slurm)
    # a second stored row for the same Slurm job (the stale row of finding 1)
    stale = store.db["jobs"].insert({"cluster": "c1", "job_id": JOB_ID, "submit_time": 1,
                                     "env": "act", "mode": "action", "spec": "act"}).last_pk
    second = add_job_rec(store, slurm, job=stale)
    act = make_actuator(store, slurm, clock)
    drive(act, store, first, clock)
    assert store.rec(first).status == "done"
    rec = store.rec(second)
    assert rec.status == "expired" and f"#{first}" in rec.error
    assert slurm.calls["requeue_hold"] == 1
    assert [s for s in store.steps(second) if s["state"] == "started"] == []


# -- a listing is not evidence that a job is gone (issue 14, finding 5) ---------------
def test_job_missing_from_the_listing_is_looked_up_before_it_expires(store, clock):
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm)
    act = make_actuator(store, slurm, clock)
    real_list = slurm.list_jobs
    slurm.list_jobs = lambda job_ids=None: []     # a listing that lost the job
    act.run_once()
    assert slurm.lookups == 1
    assert store.rec(rec_id).status in OPEN_STATUSES
    assert slurm.calls["requeue_hold"] == 1       # it is there: the recovery goes on
    slurm.lookup_fails = 5                        # and cannot be confirmed: it waits
    for _ in range(5):
        clock[0] += 1
        act.run_once()
    assert store.rec(rec_id).status in OPEN_STATUSES
    slurm.list_jobs = real_list
    drive(act, store, rec_id, clock)
    assert store.rec(rec_id).status == "done"


def test_watchdog_never_lets_go_of_a_hold_it_cannot_see(store, clock):
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm)
    act = make_actuator(store, slurm, clock, decision_timeout=10.0)
    act.run_once()                                   # requeue-hold done, job held
    assert slurm.job["held"]
    slurm.list_jobs = lambda job_ids=None: []
    slurm.lookup_fails = 100
    clock[0] += 60
    act.watchdog({}, clock[0])
    rec = store.rec(rec_id)
    assert rec.status not in ("released_by_watchdog", "expired") and rec.held_at



# -- whose drain is it (issue 14, finding 8) -------------------------------------------
def drained_by_us(store, slurm, clock, node="gpu3") -> int:
    rec_id = add_node_rec(store, "drain_node", node=node)
    drive(make_actuator(store, slurm, clock), store, rec_id, clock)
    assert store.node(node)["drained_by_us"] == 1
    return rec_id


def test_a_human_redrain_with_our_wording_is_not_resumed(store, clock):
    slurm = FakeSlurm()
    rec_id = drained_by_us(store, slurm, clock)
    # a human drains it again and copies our reason, word for word, as root
    slurm.drain_by_someone_else("gpu3", drain_reason(rec_id, "xid"), user="root")
    resume = add_node_rec(store, "resume_node", node="gpu3")
    drive(make_actuator(store, slurm, clock), store, resume, clock)
    rec = store.rec(resume)
    assert rec.status == "expired" and "someone else" in rec.error
    assert "resume_node" not in slurm.calls
    assert slurm.get_node("gpu3").drained
    assert not store.node("gpu3")["drained_by_us"]


def test_our_own_drain_is_resumed(store, clock):
    slurm = FakeSlurm()
    drained_by_us(store, slurm, clock)
    resume = add_node_rec(store, "resume_node", node="gpu3")
    drive(make_actuator(store, slurm, clock), store, resume, clock)
    assert store.rec(resume).status == "done" and slurm.calls["resume_node"] == 1


def test_drain_with_our_wording_is_not_taken_for_ours(store, clock):
    """Slurm shows "recovery: <this rec> ..." but this recommendation never
    called: a human typed it. Not ours, never resumed by us."""
    slurm = FakeSlurm()
    rec_id = add_node_rec(store, "drain_node", node="gpu3")
    slurm.drain_by_someone_else("gpu3", drain_reason(rec_id, "xid"))
    drive(make_actuator(store, slurm, clock), store, rec_id, clock)
    assert "someone else" in store.rec(rec_id).error
    assert not (store.node("gpu3") or {}).get("drained_by_us")


@pytest.mark.parametrize("human", ["resume", "redrain"])
def test_nodes_a_human_took_back_leave_the_drain_budget(store, clock, human):
    """With resume_after = 0 nothing of ours looks at the node again: the
    periodic check against Slurm still lets go of drains no longer ours."""
    slurm = FakeSlurm()
    drained_by_us(store, slurm, clock)
    if human == "resume":
        slurm.resume_by_someone_else("gpu3")
    else:
        slurm.drain_by_someone_else("gpu3", "admin: fan")
    act = make_actuator(store, slurm, clock, resume_after=0)
    clock[0] += RESUME_CHECK_INTERVAL + 1
    act.run_once()
    assert not store.node("gpu3")["drained_by_us"]
    assert "resume_node" not in slurm.calls


def test_a_call_cut_off_mid_answer_may_have_happened(store, clock):
    """slurmctld died during the requeue-hold: scontrol says "Unexpected message
    received" (exit 1) though the requeue took effect. That is no refusal: the
    requeue counts as ours and the recovery finishes with its exclusions."""
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm)
    real = slurm.requeue_hold

    def cut_off(job_id):
        real(job_id)
        raise SchedulerError("scontrol requeuehold", ["scontrol", "requeuehold"], 1,
                             "scontrol: error: Unexpected message received for job 4242")
    slurm.requeue_hold = cut_off
    act = make_actuator(store, slurm, clock)
    act.run_once()
    assert steps(store, rec_id)[-1] == ("requeue_hold", "failed")
    slurm.requeue_hold = real
    drive(act, store, rec_id, clock)
    rec = store.rec(rec_id)
    assert rec.status == "done" and slurm.job["excluded"] == ("gpu2",)
    assert not slurm.job["held"]


def test_a_pause_point_holds_before_its_step_until_the_file_goes(store, clock, tmp_path):
    """The pause seam: before ``release`` the actuator stops, writes the file
    and waits; once the test removes it the step runs. Once per process."""
    slurm = FakeSlurm()
    rec_id = add_job_rec(store, slurm)
    pause = tmp_path / "paused"
    act = make_actuator(store, slurm, clock,
                        on_step=StepFaults(pause_before="release", pause_file=str(pause)))
    done = threading.Event()
    threading.Thread(target=lambda: (drive(act, store, rec_id, clock), done.set()),
                     daemon=True).start()
    for _ in range(200):
        if pause.exists():
            break
        time.sleep(0.02)
    assert pause.exists() and "before release" in pause.read_text()
    assert not done.wait(0.3) and slurm.calls["release"] == 0
    pause.unlink()
    assert done.wait(10) and slurm.calls["release"] == 1
    assert act.on_step.pause_before == ""


# -- issue 22: a run slurmctld began again at the same restart count ----------------

def test_a_decision_on_a_run_slurmctld_replaced_expires_and_the_new_runs_acts(store, clock):
    slurm = FakeSlurm(state="FAILED")
    slurm.job["start_time"] = 1_000
    first = add_job_rec(store, slurm, run_start=1_000)
    # before the actuator got to it, slurmctld (back from older state) ran the
    # attempt again at restart count 0, and that run failed too
    slurm.job["start_time"] = 2_000
    second = add_job_rec(store, slurm, run_start=2_000)
    act = make_actuator(store, slurm, clock)
    act.run_once()
    rec = store.rec(first)
    assert rec.status == "expired" and "ran the attempt again" in rec.error
    drive(act, store, second, clock)
    assert store.rec(second).status == "done"
    assert slurm.calls["requeue_hold"] == 1 and slurm.job["restart_count"] == 1
