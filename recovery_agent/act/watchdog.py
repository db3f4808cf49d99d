"""The holds and the watchdog: is a job held by our requeue-hold, release it
fail open, and release every job held longer than ``policy.decision_timeout``
(``released_by_watchdog``), also when the store refuses writes (the side
journal keeps the record). How long a job has been held is measured on the
monotonic clock once seen, so a wall clock that jumps neither frees a job early
nor holds it forever.
"""
from __future__ import annotations

import logging

from ..errors import SchedulerError
from ..scheduler.base import Job
from ..store import Recommendation, Status
from ..store.journal import STORE_ERRORS
from .steps import StepFailed, may_have_run

log = logging.getLogger("recovery_agent.act.actuator")   # the actuator's, as before its split


class Watchdog:
    """The actuator's part that watches the holds (a part of
    :class:`~recovery_agent.act.actuator.Actuator`, whose state it shares: the
    holds seen, ``journaled``, the store and the scheduler): whether a job is
    held by our requeue-hold, letting it go, and the watchdog's release of
    holds kept too long."""

    def _overdue(self, now: float) -> bool:
        return bool(self._held_too_long(now))

    def _held_too_long(self, now: float) -> list[Recommendation]:
        """Job recommendations whose hold is older than the decision timeout and
        not known to be lifted (open ones, and ended ones whose release failed)."""
        rows = self.store.holding_recs(since=now - 7 * 86400)
        limit = self.cfg.policy.decision_timeout
        return [r for r in rows if self._hold_age(r.id, r.held_at, now) >= limit]

    def _hold_age(self, rec_id: int, held_at: float, now: float) -> float:
        """How long a job has been held. The wall clock can jump (an NTP step,
        a hand-set date). Once this process has seen a hold, its age grows
        with the monotonic clock whatever the wall clock does; a hold stamped
        in the future (the clock went back) starts at age 0, not never."""
        mono = self.mono()
        seen = self._holds_seen.get(rec_id)
        if seen is None or seen[0] != held_at:
            seen = (held_at, mono - max(0.0, now - held_at))
            self._holds_seen[rec_id] = seen
        return mono - seen[1]

    def _holds(self, rec: Recommendation, job: Job | None) -> bool:
        """Is ``job`` held by this recommendation's requeue-hold?"""
        if job is None or not (job.is_pending and job.held
                               and job.restart_count == rec.restart_at + 1):
            return False
        return self._requeued(rec)   # held after someone else's requeue: not ours

    def _requeued(self, rec: Recommendation) -> bool:
        """Did this recommendation's requeue-hold reach Slurm (or may it have)?"""
        return "requeue_hold" in may_have_run(self.store.steps(rec.id))

    def _ending(self, rec: Recommendation, job: Job | None) -> bool:
        """Is our requeue still stopping the job (COMPLETING)? It will be held."""
        return bool(job is not None and job.state == "COMPLETING"
                    and job.restart_count == rec.restart_at + 1
                    and self._requeued(rec))

    def _let_go(self, rec: Recommendation, job: Job | None, step: str) -> bool:
        """Fail open: release a job our requeue-hold holds, best effort."""
        if not self._holds(rec, job):
            return False
        try:
            self._step(rec, step, lambda: self.scheduler.release(rec.job_id),
                       fail_open=True)
            self._step(rec, "start_now", lambda: self.scheduler.start_now(rec.job_id),
                       fail_open=True)
        except (StepFailed, SchedulerError) as exc:
            log.error("rec=%s could not release job %s: %s", rec.id, rec.job_id, exc)
            return False
        return True

    # -- the watchdog ---------------------------------------------------------------
    def watchdog(self, listing: dict[str, Job], now: float) -> list[int]:
        """Release every job our requeue-hold has held longer than the decision
        timeout: open recommendations end ``released_by_watchdog``; a job left
        held by one that already ended (a release that failed) is released too."""
        released = []
        limit = self.cfg.policy.decision_timeout
        for rec in self._held_too_long(now):
            if rec.id in self.journaled:
                continue   # released; its record waits in the side journal
            try:
                job = self._listed(rec, listing)
            except SchedulerError as exc:
                log.warning("watchdog: rec=%s job %s: cannot confirm it is gone, waiting: "
                            "%s", rec.id, rec.job_id, exc)
                continue
            let_go = self._let_go(rec, job, "watchdog_release")
            if not let_go and (self._holds(rec, job) or self._ending(rec, job)):
                continue   # still stopping, or the release failed: next pass
            if rec.status.is_open:
                age = self._hold_age(rec.id, rec.held_at, now)
                why = (f"held {age:.0f}s without a completed decision "
                       f"(policy.decision_timeout={limit:g}s); released to normal scheduling")
                self._end_held(rec, Status.RELEASED_BY_WATCHDOG, why)
                released.append(rec.id)
            else:
                if let_go:
                    log.warning("watchdog released job %s left held by rec %s (%s)",
                                rec.job_id, rec.id, rec.status)
                    released.append(rec.id)
                self._end_held(rec, rec.status, rec.error or "")
        return released

    def _end_held(self, rec: Recommendation, status: Status, why: str) -> None:
        """The watchdog's record that a hold is over: in the store, or in the side
        journal while the store refuses writes (the release came first)."""
        try:
            if status != rec.status:
                rec = self._finish(rec, status, why)
            self._save(rec.hold_lifted(), "held_at")
        except STORE_ERRORS as exc:
            log.error("rec=%s %s: the store refuses writes (%s); recorded in the side "
                      "journal", rec.id, status, exc)
            self.journal.add("finish", rec.id, status=status, error=why, lifted=True,
                             job=rec.job if status != rec.status else None,
                             attempt=rec.attempt, action=rec.action)
            self.journaled.add(rec.id)
