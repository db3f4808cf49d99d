"""The proactive move of a job off a degraded node (a ``migrate``
recommendation, made by :mod:`recovery_agent.decide.proactive`), step by step
from the live job, like every other job recovery:

1. ``ckpt_signal``: the checkpoint signal by the job's convention,
   ``scancel --signal=SIG`` (its steps) or ``--batch`` (the batch shell);
2. ``ckpt_wait``: started at once after it; the move waits for a checkpoint of
   this attempt dated from the signal on (``ledger.time_slack`` before it
   counts, for node clocks), for at most the recommendation's bound;
3. a checkpoint came: the job recovery steps of :mod:`.jobs` (requeue-hold,
   exclude the node, ``StartTime=now``, release);
4. none came: the job is left alone and the recommendation ends ``expired``,
   saying so. The node's drain (its own recommendation, a child of this one)
   is ``state=DRAIN``, which lets the running job finish: new work only.

A job that ended, was requeued by someone else, or is not running when the
move begins is left alone (``expired``). Every step is recorded before its
Slurm call (:mod:`.steps`), so an agent that restarts carries on from the
record: a signal that may have been sent is never sent twice.
"""
from __future__ import annotations

import logging

from ..scheduler.base import Job
from ..store import Recommendation, Status
from .steps import may_have_run

log = logging.getLogger("recovery_agent.act.actuator")   # the actuator's
WAIT_POLL = 5.0   # seconds between looks for the checkpoint while the move waits


def move_plan(rec: Recommendation) -> dict:
    """The move's parameters as the decider stored them (attribution.migrate)."""
    plan = (rec.attribution or {}).get("migrate")
    return plan if isinstance(plan, dict) else {}


class Migrations:
    """The actuator's part that moves jobs off degraded nodes (a part of
    :class:`~recovery_agent.act.actuator.Actuator`, whose state it shares; the
    requeue itself is :class:`~recovery_agent.act.jobs.JobRecovery`'s)."""

    def _migrate(self, rec: Recommendation, job: Job, now: float) -> None:
        steps = self.store.steps(rec.id)
        begun = may_have_run(steps)
        if "requeue_hold" in begun:
            self._requeue(rec, job, now)   # the move is past its checkpoint
            return
        if job.restart_count != rec.restart_at or job.is_finished or job.is_pending:
            self._finish(rec, Status.EXPIRED, f"the job is {job.state} at restart "
                         f"{job.restart_count} before the move: nothing to move", job)
            return
        if job.state != "RUNNING":
            return   # completing, suspended...: look again next pass
        plan = move_plan(rec)
        signal, target = plan.get("signal") or "", plan.get("target") or "steps"
        if not signal:
            self._finish(rec, Status.FAILED, "the move names no checkpoint signal")
            return
        if "ckpt_signal" not in begun:
            self._step(rec, "ckpt_signal", lambda: self.scheduler.signal_job(
                rec.job_id, signal, batch=target == "batch"), f"SIG{signal} to {target}")
            steps = self.store.steps(rec.id)
        sent = _wait_started(steps)
        bound = float(plan.get("checkpoint_wait") or self.cfg.proactive.checkpoint_wait)
        if sent is None:
            sent = now
            self.store.add_step(rec.id, "ckpt_wait", "started",
                                f"a new checkpoint within {bound:.0f}s", ts=now)
        found = self._checkpoint_since(rec, sent - self.cfg.ledger.time_slack,
                                       _signal_started(steps) or sent)
        if found is not None:
            self.store.add_step(rec.id, "ckpt_wait", "ok", _seen(found), ts=now)
            self.store.add_event(rec.job, "checkpoint_for_move",
                                 f"#{rec.id} {_seen(found)} after SIG{signal}; moving the "
                                 f"job off {', '.join(rec.exclude)}", attempt=rec.attempt,
                                 source="actuator")
            self._requeue(rec, job, now)
            return
        if now - sent >= bound:
            why = (f"no new checkpoint within {bound:.0f}s of SIG{signal}: the job is left "
                   f"alone on {', '.join(rec.exclude)}, which is drained for new work only")
            self.store.add_step(rec.id, "ckpt_wait", "refused", why, ts=now)
            self._finish(rec, Status.EXPIRED, why, job)
            return
        self._save(rec.retrying(rec.tries or 0, min(now + WAIT_POLL, sent + bound)),
                   "next_try")

    def _checkpoint_since(self, rec: Recommendation, since: float,
                          signalled: float) -> dict | None:
        """The decided attempt's first checkpoint that is new since the signal
        (:func:`new_checkpoint`)."""
        if rec.job is None:
            return None
        return new_checkpoint(self.store.job_checkpoints(rec.job), rec.restart_at, since,
                              signalled)


def new_checkpoint(checkpoints: list[dict], attempt: int | None, since: float,
                   signalled: float) -> dict | None:
    """The first of ``attempt``'s checkpoints (``Store.job_checkpoints``
    entries) that answers the signal sent at ``signalled``: dated ``since``
    or later (the signal, less the slack for node clocks), not yet recorded
    by the agent when the signal went out, and newer than every checkpoint
    that was (a higher step where both steps are known, else a later time).

    The slack alone would take the job's last periodic save, made a moment
    before the signal, for the answer, and requeue the job while it is still
    writing the checkpoint it was asked for. A save made within the slack
    before the signal that the agent reads only after it still counts: it
    loses at most the slack's worth of work."""
    mine = [c for c in checkpoints if c["attempt"] == attempt]
    known = [c for c in mine if c.get("seen") is not None and c["seen"] < signalled]
    for ckpt in mine:
        if ckpt["time"] < since or any(ckpt is k for k in known):
            continue
        if all(_newer(ckpt, k) for k in known):
            return ckpt
    return None


def _newer(ckpt: dict, other: dict) -> bool:
    if ckpt.get("step") is not None and other.get("step") is not None:
        return ckpt["step"] > other["step"]
    return ckpt["time"] > other["time"]


def _signal_started(steps: list[dict]) -> float | None:
    """When the checkpoint signal's call began (its first ``started`` row), or None."""
    for row in steps:
        if row["step"] == "ckpt_signal" and row["state"] == "started":
            return float(row["ts"])
    return None


def _wait_started(steps: list[dict]) -> float | None:
    """When the wait for the checkpoint began (its ``started`` row), or None."""
    for row in steps:
        if row["step"] == "ckpt_wait" and row["state"] == "started":
            return float(row["ts"])
    return None


def _seen(ckpt: dict) -> str:
    step = f" (step {ckpt['step']})" if ckpt.get("step") is not None else ""
    return f"checkpoint{step} at {ckpt['time']:.0f}"
