"""Recording the steps: every Slurm call is written ``started`` before it runs
and its outcome after (``ok``; ``refused``: Slurm said no, so it did not
happen; ``failed``: it may have). A release that keeps a job from staying held
runs fail open: when the store refuses the record, the call still runs and the
side journal keeps the record until the store takes it. The moves of a
recommendation's record (begun, retried, finished) are written here too.
"""
from __future__ import annotations

import logging
import re
from typing import Callable

from ..errors import JobNotFound, NodeNotFound, SchedulerError
from ..scheduler.base import Job
from ..store import Recommendation, Status
from ..store.journal import STORE_ERRORS

log = logging.getLogger("recovery_agent.act.actuator")   # the actuator's, as before its split
# slurmctld's answers that say a call was refused, so it did not happen (their
# texts in Slurm's slurm_errno.c); every other failure may have taken effect
REFUSALS = re.compile(
    r"Invalid job id specified|Job is pending execution|Job is no longer pending "
    r"execution|Requested operation is presently disabled|Job/step already completing or "
    r"completed|Access/permission denied|Invalid node state transition requested|Invalid "
    r"node name specified|Job is current suspended, requested operation disabled")


class StepFailed(Exception):
    """A Slurm step failed; ``rec`` is the recommendation as it stood then."""

    def __init__(self, message: str, rec: Recommendation) -> None:
        super().__init__(message)
        self.rec = rec


class Fenced(Exception):
    """This agent no longer holds the store: another one took it over. It must
    not touch Slurm again."""


class Steps:
    """The actuator's part that records what it does (a part of
    :class:`~recovery_agent.act.actuator.Actuator`, whose state it shares: the
    store, the scheduler, the fence, the side journal, ``on_step``): each Slurm
    step before and after, and each move of a recommendation's record."""

    def _step(self, rec: Recommendation, name: str, call: Callable[[], object], detail: str = "",
              fail_open: bool = False) -> None:
        """One Slurm call, recorded ``started`` before and its outcome after.
        ``fail_open`` (the releases that keep a job from staying held): when the
        store refuses the record, the call still runs and the side journal
        keeps the record until the store takes it."""
        if self.on_step is not None:
            self.on_step("before", name)
        why = self.fence() if self.fence is not None else ""
        if why:
            raise Fenced(why)
        aside = self._record(rec, name, "started", detail, fail_open, False)
        try:
            call()
        except (JobNotFound, NodeNotFound):
            self._record(rec, name, "refused", "not found", fail_open, aside)
            raise
        except SchedulerError as exc:
            # Slurm's own "no" means it did not happen ('refused'); anything else
            # (a timeout, "Unexpected message received" from a controller that
            # died mid-call, ssh failing) may have happened ('failed')
            refused = exc.returncode not in (None, 255) and bool(
                REFUSALS.search(exc.stderr or ""))
            self._record(rec, name, "refused" if refused else "failed",
                         f"{exc} {exc.stderr}".strip(), fail_open, aside)
            raise StepFailed(f"{name}: {exc}", rec) from None
        self._record(rec, name, "ok", detail, fail_open, aside)
        log.info("rec=%s job=%s step %s ok %s", rec.id, rec.job_id, name, detail)
        if self.on_step is not None:
            self.on_step("ok", name)

    def _record(self, rec: Recommendation, name: str, state: str, detail: str, fail_open: bool,
                aside: bool) -> bool:
        """Write one step row; True when it went to the side journal instead."""
        if not aside:
            try:
                self.store.add_step(rec.id, name, state, detail)
                return False
            except STORE_ERRORS:
                if not fail_open:
                    raise
                log.error("rec=%s step %s %s: the store refuses writes; releasing anyway, "
                          "recorded in the side journal", rec.id, name, state)
        self.journal.add("step", rec.id, step=name, state=state, detail=detail)
        return True

    def _save(self, new: Recommendation, *changed: str) -> Recommendation:
        """Write the ``changed`` columns of ``new`` (a move of the record); every
        later read in this pass uses the record returned."""
        with self.store.transaction():
            self.store.save_rec(new, *changed)
        return new

    def _finish(self, rec: Recommendation, status: Status, why: str = "",
                job: Job | None = None) -> Recommendation:
        self._ended_at.pop(rec.id, None)
        extra = {}
        if status in (Status.EXPIRED, Status.FAILED) and rec.scope == "job" and self._requeued(rec):
            # fail open, judged on the job as it is now (a requeue that timed out
            # may still have happened); a hold we could not lift, or could not
            # see, stays marked for the watchdog
            try:
                job = self.scheduler.get_job(rec.job_id)
            except JobNotFound:
                job = None
            except SchedulerError:
                job = False
            if job is not False and (not self._holds(rec, job) and not self._ending(rec, job)
                                     or self._let_go(rec, job, f"release_after_{status}")):
                extra["held_at"] = None
        now = self.clock()
        new = rec.finished(status, error=why or None,
                           done_at=now if status == Status.DONE else None, next_try=None,
                           **extra)
        with self.store.transaction():
            self.store.save_rec(new, "status", "error", "done_at", "next_try", *extra)
            if rec.job is not None:
                self.store.add_event(rec.job, f"rec_{status}",
                                     f"#{rec.id} {rec.action} {status}"
                                     + (f": {why}" if why else ""),
                                     attempt=rec.attempt, source="actuator")
        log.log(logging.INFO if status == Status.DONE else logging.WARNING,
                "rec=%s %s %s%s", rec.id, rec.action, status, f": {why}" if why else "")
        return new

    def _begin(self, rec: Recommendation) -> Recommendation:
        if rec.status == Status.PROPOSED:
            return self._save(rec.executing(), "status")
        return rec

    def _retry_or_fail(self, rec: Recommendation, why: str, job: Job | None,
                       now: float) -> None:
        tries = (rec.tries or 0) + 1
        pol = self.cfg.policy
        if tries < pol.action_retries and not self._past_deadline(rec, now):
            wait = pol.retry_backoff * (2 ** (tries - 1))
            self._save(rec.retrying(tries, now + wait), "tries", "next_try")
            log.warning("rec=%s try %d failed (%s); retrying in %.1fs", rec.id, tries, why,
                        wait)
            return
        rec = self._save(rec.retrying(tries, rec.next_try), "tries")
        self._finish(rec, Status.FAILED, f"{why} (after {tries} tries)", job)

    def _past_deadline(self, rec: Recommendation, now: float) -> bool:
        return bool(rec.held_at) and self._hold_age(
            rec.id, rec.held_at, now) >= self.cfg.policy.decision_timeout


def may_have_run(steps: list[dict]) -> set[str]:
    """The steps of which some call may have reached Slurm. Every call is
    recorded ``started`` before it runs; one that Slurm answered with a refusal
    (``refused``) did not happen; one whose outcome was never written (the
    agent died) or that got no answer (``failed``: a timeout) may have."""
    calls: dict[str, int] = {}
    ran: set[str] = set()
    for row in steps:
        name, state = row["step"], row["state"]
        if state == "started":
            calls[name] = calls.get(name, 0) + 1
        elif calls.get(name):
            calls[name] -= 1
            if state != "refused":
                ran.add(name)
    return ran | {name for name, open_calls in calls.items() if open_calls}
