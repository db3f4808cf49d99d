"""The job recovery steps: a job recommendation's next step worked out from
the live job (see :mod:`recovery_agent.act.actuator`): stop it (cancel a hung
attempt, notify), or requeue-hold it and then, on the held job, our
exclusions, ``StartTime=now`` and the release; a job slurmctld requeued itself
is adopted; a job that moved on ends the recommendation ``expired``.
"""
from __future__ import annotations

import logging

from slurm_hooks import spec as specs

from ..errors import JobNotFound
from ..scheduler.base import Job
from ..store import Recommendation, Status
from .notify import allowed, notify
from .notify import targets as notify_targets
from .steps import may_have_run

log = logging.getLogger("recovery_agent.act.actuator")   # the actuator's, as before its split

# Whole seconds between the second of our requeue and the restart. Each slurmd
# keeps the time it was told to kill an attempt and refuses to launch the job
# again under a credential that is not newer ("Job 1 already killed, do not
# launch batch job"; slurmctld: "Killing non-startable batch JobId=1: Job
# credential revoked"). Seen live on 24.11: StartTime=now 0.5 s after the
# requeue, the start in the next second was refused and cost an attempt.
# Slurm's own guard is its two-minute requeue delay; ours is to let the job
# start no sooner than this many whole seconds after the second of the kill.
# The kill is our requeue for a running job; for one that had ended already it
# was its end: slurmctld told the nodes to end it then (job_complete ->
# deallocate_nodes), and a requeue of a finished job tells them nothing more
# (_job_requeue_op deallocates only running jobs), so the gap counts from the
# end Slurm stamped, which comes before our requeue.
RELAUNCH_GAP_S = 2


class JobRecovery:
    """The actuator's part that recovers jobs (a part of
    :class:`~recovery_agent.act.actuator.Actuator`, whose state it shares:
    the config, the store and the scheduler)."""

    def _advance_job(self, rec: Recommendation, job: Job | None, now: float) -> None:
        if job is None:
            self._finish(rec, Status.EXPIRED, "the job is gone from slurmctld")
            return
        # Slurm gives a requeued job a new submit time; at the decided attempt
        # it must not have changed, and it never goes back
        if rec.submit_time and job.submit_time and (
                job.submit_time < rec.submit_time
                or job.restart_count <= rec.restart_at
                and job.submit_time != rec.submit_time):
            self._finish(rec, Status.EXPIRED, "the job id now belongs to another job")
            return
        if rec.run_start and job.restart_count == rec.restart_at and job.run_start \
                and job.run_start != rec.run_start:
            # the decided run is over and slurmctld began another at the same
            # restart count: that run has a decision of its own
            self._finish(rec, Status.EXPIRED, "slurmctld ran the attempt again at the same "
                         f"restart count since the decision (run started {job.run_start}, "
                         f"the decided one {rec.run_start})", job)
            return
        twin = self.store.open_twin(rec)
        if twin is not None:
            self._finish(rec, Status.EXPIRED, f"recommendation #{twin} already acts on job "
                         f"{rec.job_id} at restart {rec.restart_at}")
            return
        rec = self._begin(rec)
        try:
            if rec.action == "stop":
                self._stop(rec, job)
            elif rec.action in ("requeue", "requeue_exclude", "kill_requeue"):
                self._requeue(rec, job, now)
            elif rec.action == "migrate":
                self._migrate(rec, job, now)   # .migrate: checkpoint first, then _requeue
            else:
                self._finish(rec, Status.FAILED, f"unknown job action {rec.action!r}")
        except JobNotFound:
            self._finish(rec, Status.EXPIRED, "the job vanished during the recovery")

    def _stop(self, rec: Recommendation, job: Job) -> None:
        steps = {s["step"] for s in self.store.steps(rec.id) if s["state"] == "ok"}
        if rec.trigger != "ended" and job.is_active and job.restart_count == rec.restart_at:
            # a hung job with nothing left to try: free its nodes
            self._step(rec, "cancel", lambda: self.scheduler.cancel(rec.job_id))
        spec = _spec(self.store.job(rec.job)["spec"])
        if "notify" not in steps:
            env = self.cfg.environment(spec.env)
            for target in notify_targets(spec.notify, env.notify):
                # the job's own target is a user's word; the environment's, an admin's
                refused = allowed(target, env.notify_allow) if target == spec.notify else ""
                if refused:
                    log.warning("rec=%s notify refused: %s", rec.id, refused)
                    self.store.add_step(rec.id, "notify", "refused", refused)
                    continue
                outcome = notify(target, rec)
                self.store.add_step(rec.id, "notify", "ok" if outcome.ok else "failed",
                                    outcome.detail)
        self._finish(rec, Status.DONE)

    def _requeue(self, rec: Recommendation, job: Job, now: float) -> None:
        at = rec.restart_at
        steps = self.store.steps(rec.id)
        begun = may_have_run(steps)
        done = {s["step"] for s in steps if s["state"] == "ok"}
        if job.restart_count == at:
            if job.is_pending and not job.held and "requeue_hold" not in done:
                self._adopt(rec, job, done)
                return
            if job.is_pending or (rec.trigger == "ended" and not job.is_finished
                                  and job.state != "COMPLETING"):
                self._finish(rec, Status.EXPIRED, f"the job is {job.state} again without our "
                             "requeue", job)
                return
            if job.state == "COMPLETING":
                return   # the attempt is still ending; next pass
            if not job.requeue_allowed and "allow_requeue" not in done:
                self._step(rec, "allow_requeue",
                           lambda: self.scheduler.allow_requeue(rec.job_id))
            detail = f"restart {at} -> {at + 1}"
            if "requeue_hold" in done:
                # it went through, yet the job is back at the decided attempt: a
                # controller restarted from older state has forgotten it
                detail += " again: slurmctld no longer shows our first requeue"
                log.warning("rec=%s job=%s: %s", rec.id, rec.job_id, detail)
            rec = self._save(rec.held(now), "held_at")
            if job.is_finished and job.end_time:
                # its nodes were told to end it at its end (read now: the
                # requeue stamps a new end time on it)
                self._ended_at[rec.id] = float(job.end_time)
            self._step(rec, "requeue_hold", lambda: self.scheduler.requeue_hold(rec.job_id),
                       detail)
            return
        if job.restart_count != at + 1:
            self._finish(rec, Status.EXPIRED, f"the job restarted {job.restart_count - at} times "
                         "since the decision", job)
            return
        if "requeue_hold" not in begun:
            self._finish(rec, Status.EXPIRED, "the job was requeued by someone else meanwhile")
            return
        if not rec.held_at:
            rec = self._save(rec.held(now), "held_at")
        if job.state == "COMPLETING":
            return   # still stopping the killed attempt; next pass
        if job.is_pending and job.held:
            if now < relaunch_after(rec.held_at, self._ended_at.get(rec.id)):
                self._exclude(rec, job)   # the start waits for RELAUNCH_GAP_S; next pass
                return
            self._exclude_and_start(rec, job, done, retried=_failed_since_start(steps))
            self._step(rec, "release", lambda: self.scheduler.release(rec.job_id))
            self._finish(rec, Status.DONE)
            return
        if job.is_pending and "release" in done and "start_now" not in done:
            self._step(rec, "start_now", lambda: self.scheduler.start_now(rec.job_id))
        note = "" if "release" in begun else f"released by someone else; now {job.state}"
        self._finish(rec, Status.DONE, note)

    def _adopt(self, rec: Recommendation, job: Job, done: set[str]) -> None:
        """The attempt is back in the queue, unheld, at the same restart count,
        and not by our requeue: slurmctld put it there itself (a controller
        that lost its last state changes in a crash does this). Requeueing it
        again is not needed; our exclusions and an immediate start still are.
        A job that starts before the exclusion lands refuses it: retried,
        then expired as usual."""
        self._exclude_and_start(rec, job, done)
        self._finish(rec, Status.DONE, "slurmctld requeued the job itself; our exclusions applied")

    def _exclude_and_start(self, rec: Recommendation, job: Job, done: set[str],
                           retried: bool = False) -> None:
        """Our exclusions on the pending job (unless Slurm has them), then
        StartTime=now, so it does not wait out Slurm's requeue delay: once, and
        again when a step failed after it (a controller killed then may come
        back from state saved before it; squeue does not show the begin time,
        so it cannot be checked)."""
        self._exclude(rec, job)
        if "start_now" not in done or retried:
            self._step(rec, "start_now", lambda: self.scheduler.start_now(rec.job_id),
                       "again: a step failed since; slurmctld may have lost it" if retried
                       and "start_now" in done else "")

    def _exclude(self, rec: Recommendation, job: Job) -> None:
        """Our exclusions on the pending job, unless Slurm shows them already."""
        want = list(rec.exclude or [])
        if want and sorted(job.excluded_nodes) != sorted(want):
            self._step(rec, "exclude",
                       lambda: self.scheduler.set_excluded_nodes(rec.job_id, want),
                       ",".join(want))


def relaunch_after(held_at: float | None, ended_at: float | None = None) -> float:
    """The earliest moment for StartTime=now after a requeue at ``held_at``
    (see RELAUNCH_GAP_S): counted from ``ended_at`` instead, Slurm's end time
    of an attempt that had ended before the requeue, when it is earlier (an
    agent restarted since the requeue no longer knows it, and waits from the
    requeue); no wait when the requeue's time is unknown."""
    if not held_at:
        return 0.0
    killed = min(held_at, ended_at) if ended_at else held_at
    return float(int(killed) + RELAUNCH_GAP_S)


def _failed_since_start(steps: list[dict]) -> bool:
    """Did a step fail after StartTime=now went through?"""
    started = [i for i, s in enumerate(steps) if s["step"] == "start_now" and s["state"] == "ok"]
    return bool(started) and any(s["state"] == "failed" for s in steps[started[-1] + 1:])


def _spec(text: str) -> specs.RecoverySpec:
    try:
        return specs.parse(text or "")
    except specs.SpecError:
        return specs.RecoverySpec(mode="monitor")
