"""The move off a degraded node (act/migrate.py) against the actuator's
in-memory Slurm: signal, wait for the checkpoint, requeue without the node;
no checkpoint in time; a job that ended; a crash after the signal; and the
decider-side glue (decide/moves.py) that stores moves and refusals."""
from __future__ import annotations

from collections import Counter

import pytest

from recovery_agent.decide.decider import Decider
from recovery_agent.act.migrate import new_checkpoint
from recovery_agent.decide.moves import Mover, node_condition
from recovery_agent.scheduler.base import Job
from tests.unit.test_actuator import (JOB_ID, FakeSlurm, Killed, add_job_rec, clock,  # noqa: F401
                                      drive, make_actuator, migrated, steps, store)


class MovingSlurm(FakeSlurm):
    """The actuator's Slurm with the checkpoint signal, and a running job."""

    def __init__(self, **kw) -> None:
        kw.setdefault("state", "RUNNING")
        super().__init__(**kw)
        self.job_signal = ""
        self.gone_at_signal = False   # the job ends between the listing and the signal

    def signal_job(self, job_id: str, signal: str, batch: bool = False) -> None:
        if self.gone_at_signal:
            self.job = None
        self._call("signal_job", (job_id, signal, batch), lambda: self._the_job(job_id))

    def as_job(self) -> Job:
        from dataclasses import replace
        return replace(super().as_job(), signal=self.job_signal)


def add_move(store, slurm, wait=60.0, signal="USR1", target="steps", **over) -> int:
    return add_job_rec(store, slurm, action="migrate", trigger="degraded", exclude=("gpu1",),
                       target_nodes=["gpu1"], rule="degraded", reason_category="degraded",
                       attribution={"migrate": {"signal": signal, "target": target,
                                                "checkpoint_wait": wait}}, **over)


def checkpoint(store, rec_id, when, attempt=0, step=120):
    job = store.rec(rec_id).job
    store.add_event(job, "checkpoint", f"checkpoint step {step}", attempt=attempt,
                    source="test", data={"time": when, "step": step})


def test_signal_then_checkpoint_then_requeue_without_the_node(store, clock):
    slurm = MovingSlurm()
    rec_id = add_move(store, slurm)
    act = make_actuator(store, slurm, clock)
    act.run_once()
    assert slurm.log == [("signal_job", JOB_ID, "USR1", False)]
    assert steps(store, rec_id) == [("ckpt_signal", "started"), ("ckpt_signal", "ok"),
                                    ("ckpt_wait", "started")]
    # waiting: nothing more reaches Slurm until a checkpoint shows
    for _ in range(3):
        clock[0] += 6
        act.run_once()
    assert sum(slurm.calls.values()) == 1 and store.rec(rec_id).status == "executing"
    checkpoint(store, rec_id, clock[0])
    drive(act, store, rec_id, clock)
    rec = store.rec(rec_id)
    assert rec.status == "done"
    assert slurm.calls == Counter(signal_job=1, requeue_hold=1, set_excluded_nodes=1,
                                  start_now=1, release=1)
    assert slurm.job["excluded"] == ("gpu1",) and slurm.job["restart_count"] == 1
    assert ("ckpt_wait", "ok") in steps(store, rec_id)
    assert "checkpoint_for_move" in [e["kind"] for e in store.timeline(rec.job)]


def test_a_batch_signal_goes_to_the_batch_shell(store, clock):
    slurm = MovingSlurm()
    rec_id = add_move(store, slurm, signal="TERM", target="batch")
    make_actuator(store, slurm, clock).run_once()
    assert slurm.log == [("signal_job", JOB_ID, "TERM", True)]
    assert store.steps(rec_id)[0]["detail"] == "SIGTERM to batch"


def test_an_old_checkpoint_does_not_count(store, clock):
    slurm = MovingSlurm()
    rec_id = add_move(store, slurm, wait=30)
    act = make_actuator(store, slurm, clock)
    checkpoint(store, rec_id, clock[0] - 600)            # before the signal
    checkpoint(store, rec_id, clock[0] + 5, attempt=7)   # another attempt's
    act.run_once()
    clock[0] += 31
    act.run_once()
    assert store.rec(rec_id).status == "expired"
    assert "requeue_hold" not in slurm.calls


def test_the_periodic_save_just_before_the_signal_is_not_the_answer(store, clock):
    """Found live (tests/integration/test_proactive_live.py): the job's own
    periodic save, recorded a moment before the signal and dated within the
    clock slack, was taken for the new checkpoint, and the job was requeued
    while it was still writing the one it had been asked for."""
    slurm = MovingSlurm()
    rec_id = add_move(store, slurm, wait=60)
    act = make_actuator(store, slurm, clock)
    job = store.rec(rec_id).job
    store.add_event(job, "checkpoint", "checkpoint step 400", attempt=0, source="test",
                    data={"time": clock[0] - 0.7, "step": 400}, ts=clock[0] - 0.5)
    act.run_once()
    assert slurm.calls == Counter(signal_job=1)
    # the same save found again by the ckpt= scan (its file's mtime), after the signal
    store.add_event(job, "checkpoint", "checkpoint step 400", attempt=0, source="ckpt",
                    data={"time": clock[0] - 0.6, "step": 400})
    clock[0] += 6
    act.run_once()
    assert slurm.calls == Counter(signal_job=1) and store.rec(rec_id).status == "executing"
    checkpoint(store, rec_id, clock[0] - 5, step=406)   # the answer, at the next step
    drive(act, store, rec_id, clock)
    rec = store.rec(rec_id)
    assert rec.status == "done" and slurm.calls["requeue_hold"] == 1
    (ok,) = [s["detail"] for s in store.steps(rec_id)
             if (s["step"], s["state"]) == ("ckpt_wait", "ok")]
    assert ok.startswith("checkpoint (step 406) at ")


def ckpt(step, time, seen, attempt=0):
    return {"attempt": attempt, "step": step, "time": time, "seen": seen}


@pytest.mark.parametrize("checkpoints, found", [
    # recorded before the signal, dated within the slack: known, not an answer
    ([ckpt(400, 99.5, 99.8)], None),
    # recorded after it and dated after it: the answer
    ([ckpt(400, 99.5, 99.8), ckpt(406, 100.2, 101.0)], 406),
    # the known save read again (another source, another time): not newer
    ([ckpt(400, 99.5, 99.8), ckpt(400, 99.6, 105.0)], None),
    # nothing recorded before the signal: a save read after it, dated within
    # the slack, counts (at most the slack's worth of work is lost)
    ([ckpt(400, 98.0, 101.0)], 400),
    # older than the slack: never
    ([ckpt(400, 96.0, 101.0)], None),
    # another attempt's save does not count
    ([ckpt(406, 100.2, 101.0, attempt=1)], None),
    # without steps: a later time than every known one
    ([ckpt(None, 99.5, 99.8), ckpt(None, 99.5, 101.0), ckpt(None, 100.4, 101.2)], "100.4"),
    # an attempt's checkpoint with no event (seen unknown) is judged by its date
    ([ckpt(406, 100.2, None)], 406),
], ids=["known-periodic", "answer", "known-again", "unseen-in-slack", "too-old",
        "other-attempt", "no-steps", "no-event"])
def test_a_new_checkpoint_is_one_the_agent_did_not_know_at_the_signal(checkpoints, found):
    got = new_checkpoint(checkpoints, 0, since=97.0, signalled=100.0)
    if found is None:
        assert got is None
    elif isinstance(found, str):
        assert got is not None and f"{got['time']:.1f}" == found
    else:
        assert got is not None and got["step"] == found


def test_no_checkpoint_within_the_bound_leaves_the_job_alone(store, clock):
    slurm = MovingSlurm()
    rec_id = add_move(store, slurm, wait=60)
    act = make_actuator(store, slurm, clock)
    act.run_once()
    clock[0] += 59
    act.run_once()
    assert store.rec(rec_id).status == "executing"
    clock[0] += 2
    act.run_once()
    rec = store.rec(rec_id)
    assert rec.status == "expired" and "no new checkpoint within 60s" in rec.error
    assert "drained for new work only" in rec.error
    assert slurm.calls == Counter(signal_job=1)         # the job was not touched again
    assert slurm.job["state"] == "RUNNING" and slurm.job["restart_count"] == 0
    assert steps(store, rec_id)[-1] == ("ckpt_wait", "refused")


def test_a_job_that_ended_before_the_move_is_left_alone(store, clock):
    slurm = MovingSlurm(state="COMPLETED")
    rec_id = add_move(store, slurm)
    make_actuator(store, slurm, clock).run_once()
    rec = store.rec(rec_id)
    assert rec.status == "expired" and "nothing to move" in rec.error
    assert not slurm.calls


def test_a_job_that_ends_while_waiting_is_left_alone(store, clock):
    slurm = MovingSlurm()
    rec_id = add_move(store, slurm)
    act = make_actuator(store, slurm, clock)
    act.run_once()
    slurm.job["state"] = "COMPLETED"
    clock[0] += 6
    act.run_once()
    assert store.rec(rec_id).status == "expired"
    assert slurm.calls == Counter(signal_job=1)


def test_a_signal_to_a_job_that_already_ended_is_audited(store, clock):
    slurm = MovingSlurm()
    rec_id = add_move(store, slurm)
    slurm.gone_at_signal = True   # Slurm answers "Invalid job id specified"
    make_actuator(store, slurm, clock).run_once()
    rec = store.rec(rec_id)
    assert rec.status == "expired" and "vanished" in rec.error
    assert steps(store, rec_id) == [("ckpt_signal", "started"), ("ckpt_signal", "refused")]
    assert rec.held_at is None   # nothing was held, nothing is stuck


def test_a_crash_after_the_signal_never_signals_twice(store, clock):
    slurm = MovingSlurm()
    slurm.crash_after = "signal_job"
    rec_id = add_move(store, slurm)
    with pytest.raises(Killed):
        make_actuator(store, slurm, clock).run_once()
    slurm.crash_after = None
    again = make_actuator(store, slurm, clock)   # a restarted agent
    clock[0] += 1
    again.run_once()
    checkpoint(store, rec_id, clock[0])
    drive(again, store, rec_id, clock)
    assert store.rec(rec_id).status == "done" and slurm.calls["signal_job"] == 1


def test_monitor_mode_moves_are_never_acted_on(store, clock):
    slurm = MovingSlurm()
    rec_id = add_move(store, slurm, mode="monitor", status="would_have")
    act = make_actuator(store, slurm, clock)
    act.run_once()
    assert not slurm.calls and store.rec(rec_id).status == "would_have"


# -- the glue: from a degraded node's records to stored moves and refusals ------

def degrade(store, node="gpu1"):
    store.add_degradation("c1", {"node": node, "gpu": "0", "time": 1.0, "score": 1.0,
                                 "level": "degraded", "rules": [
                                     {"rule": "row_remap_pending", "weight": 1.0,
                                      "detail": "a remap waits for a reset"}]})


def mover(store, slurm, clock, envs=None):
    from recovery_agent.config import from_mapping
    cfg = from_mapping({"agent": {"cluster": "c1"}, "environments": envs or {
        "default": {"mode": "action", "proactive": "action"}}})
    return Mover(Decider(cfg, store, slurm, clock=lambda: clock[0], mono=lambda: clock[0]))


def test_node_condition_takes_each_gpus_newest_record():
    rows = [{"gpu": "1", "score": 0.25, "level": "watch", "rules": [{"rule": "a"}]},
            {"gpu": "0", "score": 1.0, "level": "degraded", "rules": [{"rule": "b"}]},
            {"gpu": "1", "score": 1.0, "level": "degraded", "rules": [{"rule": "c"}]}]
    found = node_condition(rows, "n1")
    assert (found.level, found.score, found.rules) == ("degraded", 1.0, ("b", "a"))
    assert node_condition([], "n1") is None


def test_a_degraded_node_gets_a_move_and_a_drain(store, clock):
    slurm = MovingSlurm()
    slurm.job_signal = "USR1"
    store.record_job(slurm.as_job(), "c1", env="default", spec="default")
    degrade(store)
    moved = mover(store, slurm, clock).plan("gpu1")
    move_pk, drain_pk = moved.recs
    move, drain = store.rec(move_pk), store.rec(drain_pk)
    assert (move.action, move.status, move.exclude) == ("migrate", "proposed", ("gpu1",))
    assert move.attribution["migrate"]["signal"] == "USR1"
    assert (drain.action, drain.parent, drain.status) == ("drain_node", move_pk, "proposed")
    assert drain.reason == "degraded, not failed: row_remap_pending on 0"
    # the actuator carries both out: the drain at once, the move after its checkpoint
    act = make_actuator(store, slurm, clock)
    act.run_once()
    assert "DRAIN" in slurm.nodes["gpu1"]["flags"]
    assert slurm.nodes["gpu1"]["reason"] == f"rcv:degraded #{drain_pk}"
    checkpoint(store, move_pk, clock[0])
    drive(act, store, move_pk, clock)
    assert store.rec(move_pk).status == "done" and slurm.job["excluded"] == ("gpu1",)


def test_a_refusal_goes_on_the_jobs_timeline_and_nothing_is_stored(store, clock):
    slurm = MovingSlurm()   # no --signal and no ckpt-signal=: no convention
    pk = store.record_job(slurm.as_job(), "c1", env="default", spec="default")
    degrade(store)
    moved = mover(store, slurm, clock).plan("gpu1")
    assert moved.recs == () and moved.plan.jobs[0].rule == "no_convention"
    (event,) = [e for e in store.timeline(pk) if e["kind"] == "move_refused"]
    assert "no checkpoint convention" in event["message"]


def test_the_default_environment_records_would_have_only(store, clock):
    slurm = MovingSlurm()
    store.record_job(slurm.as_job(), "c1", env="default", spec="default,ckpt-signal=USR2")
    degrade(store)
    moved = mover(store, slurm, clock, envs={"default": {"mode": "action"}}).plan("gpu1")
    assert [store.rec(pk).status for pk in moved.recs] == ["would_have", "would_have"]


def test_an_untracked_job_or_a_healthy_node_gets_nothing(store, clock):
    slurm = MovingSlurm()
    slurm.job_signal = "USR1"
    degrade(store)
    assert mover(store, slurm, clock).plan("gpu1").plan is None   # not opted in
    store.record_job(slurm.as_job(), "c1", env="default", spec="default")
    assert mover(store, slurm, clock).plan("gpu2").plan is None   # no degradation
