"""The actuator: carries out recommendations on Slurm, once, and never strands a job.

Every step is written to ``rec_steps`` as ``started`` before its Slurm call and
``ok`` (or ``failed``) after it. What to do next is worked out from the live job
each time, never from memory, so a restarted agent simply carries on:

* restart count unchanged: the requeue has not happened (whatever a ``started``
  row says), so requeue-hold it now;
* restart count one higher and our ``requeue_hold`` on record: ours; finish the
  steps the held job still needs (exclusions, ``StartTime=now``, release);
* one higher without our requeue, or higher still, or another job behind the
  id: the world moved on; the recommendation ends ``expired``, nothing is done.

A read failure (slurmctld down) only waits: nothing is done on stale state. A
failing write is retried with backoff, then the recommendation ends ``failed``
and a job we held is released. The watchdog releases any job we have held
longer than ``policy.decision_timeout`` (``released_by_watchdog``); it runs here
and in ``recovery-ctl watchdog`` for when the agent itself is down.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from typing import Callable

from slurm_hooks import spec as specs

from ..config import Config
from ..errors import JobNotFound, NodeNotFound, SchedulerError
from .notify import allowed, notify
from ..decide.policy import our_drain
from .notify import targets as notify_targets
from ..scheduler.base import Job, Scheduler
from ..store import OPEN_STATUSES, Recommendation, Status, Store
from ..store.journal import STORE_ERRORS, SideJournal

log = logging.getLogger(__name__)
DRAIN_TAG = "recovery:"
RESUME_CHECK_INTERVAL = 30.0
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


def drain_reason(rec_id: int, category: str) -> str:
    """The reason we give slurmctld: tagged as ours, so we never resume a node
    someone else drained."""
    return f"{DRAIN_TAG} {rec_id} {category or 'fault'}"[:200]


def ours(reason: str) -> bool:
    """Does the reason read like one of ours? Wording only: what makes a drain
    ours is the record :func:`our_drain` checks."""
    return reason.startswith(DRAIN_TAG)


class Actuator:
    def __init__(self, cfg: Config, store: Store, scheduler: Scheduler,
                 clock: Callable[[], float] = time.time,
                 mono: Callable[[], float] = time.monotonic,
                 fence: Callable[[], str] | None = None,
                 journal: SideJournal | None = None,
                 on_step: Callable[[str, str], None] | None = None) -> None:
        """``fence``: says why this process may no longer act ("" while it may);
        ``journal``: where the fail-open release writes when the store cannot
        (default ``<store>.journal``); ``on_step(when, step)``: called with
        ``"before"`` ahead of each Slurm step and ``"ok"`` once it took effect
        (the seam the crash and pause tests use; nothing in production)."""
        self.cfg, self.store, self.scheduler, self.clock = cfg, store, scheduler, clock
        self.mono = mono
        self.fence = fence
        self.journal = journal if journal is not None else SideJournal(
            f"{store.path}.journal")
        self.journaled: set[int] = set()   # ended in the journal, not the store yet
        self._holds_seen: dict[int, tuple[float, float]] = {}   # rec -> (held_at, mono 0)
        self.wake = threading.Event()
        self.on_step = on_step
        self.waiting_for_slurm = False
        self.fenced = ""            # why this agent may no longer act, once it may not
        self.last_resume_check = 0.0
        self.passes = 0

    # -- one pass --------------------------------------------------------------
    def run_once(self) -> int:
        """Advance every open action-mode recommendation once; run the watchdog
        and, now and then, the resume check. Returns how many are still open."""
        now = self.clock()
        fenced = self.fence() if self.fence is not None else ""
        if fenced:
            if fenced != self.fenced:   # said once
                log.error("not acting on Slurm: %s", fenced)
            self.fenced = fenced
            return 0
        if len(self.journal) and self.journal.replay(self.store):
            self.journaled.clear()
        open_recs = [r for r in self.store.recommendations(OPEN_STATUSES)
                     if r.mode == "action"]
        overdue = self._overdue(now)
        if open_recs or overdue:
            try:
                listing = {j.job_id: j for j in self.scheduler.list_jobs()}
            except SchedulerError as exc:
                if not self.waiting_for_slurm:
                    log.warning("slurmctld unreachable, %d recommendation(s) wait: %s",
                                len(open_recs), exc)
                self.waiting_for_slurm = True
                return len(open_recs)
            if self.waiting_for_slurm:
                log.info("slurmctld reachable again; carrying on")
            self.waiting_for_slurm = False
            for rec in open_recs:
                if rec.next_try and rec.next_try > now:
                    continue
                try:
                    self.advance(rec, listing, now)
                except STORE_ERRORS as exc:
                    # nothing acts unrecorded; the watchdog below still runs, and
                    # releases what is held too long even with the store down
                    log.error("rec=%s waits: the store refuses writes: %s", rec.id, exc)
            self.watchdog(listing, now)
        if now - self.last_resume_check >= RESUME_CHECK_INTERVAL:
            self.last_resume_check = now
            self.resume_clean_nodes(now)
        self.passes += 1
        return sum(1 for r in self.store.recommendations(OPEN_STATUSES)
                   if r.mode == "action")

    def advance(self, rec: Recommendation, listing: dict[str, Job], now: float) -> None:
        """One step (or a few) of one recommendation, from the live job."""
        if not self.store.rec(rec.id).status.is_open:
            return   # cancelled (or ended) since the list was read
        try:
            if rec.scope == "job":
                self._advance_job(rec, self._listed(rec, listing), now)
            else:
                self._advance_node(rec, now)
        except StepFailed as exc:
            self._retry_or_fail(exc.rec, str(exc), listing.get(rec.job_id), now)
        except SchedulerError as exc:   # a read inside a step: wait, do not count
            log.warning("rec=%s waiting: %s", rec.id, exc)

    def _listed(self, rec: Recommendation, listing: dict[str, Job]) -> Job | None:
        """The recommendation's job as Slurm shows it, or None when it is gone.
        A job the listing lacks is looked up directly before it counts as gone:
        a listing is not evidence that a job is gone (a SchedulerError here
        makes the recommendation wait)."""
        job = listing.get(rec.job_id)
        if job is not None:
            return job
        try:
            return self.scheduler.lookup_job(rec.job_id)
        except JobNotFound:
            return None

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

    # -- steps ---------------------------------------------------------------------
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

    # -- job actions -----------------------------------------------------------
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
        want = list(rec.exclude or [])
        if want and sorted(job.excluded_nodes) != sorted(want):
            self._step(rec, "exclude",
                       lambda: self.scheduler.set_excluded_nodes(rec.job_id, want),
                       ",".join(want))
        if "start_now" not in done or retried:
            self._step(rec, "start_now", lambda: self.scheduler.start_now(rec.job_id),
                       "again: a step failed since; slurmctld may have lost it" if retried
                       and "start_now" in done else "")

    # -- node actions -------------------------------------------------------------
    def _advance_node(self, rec: Recommendation, now: float) -> None:
        name = (rec.target_nodes or (None,))[0]
        if not name:
            self._finish(rec, Status.FAILED, "no node named")
            return
        try:
            node = self.scheduler.get_node(name)
        except NodeNotFound:
            self._finish(rec, Status.FAILED, f"node {name} no longer exists")
            return
        rec = self._begin(rec)
        if rec.action == "drain_node":
            reason = drain_reason(rec.id, rec.reason_category or "")
            if node.drained:
                # ours only if this recommendation's own drain got there (the
                # agent died after the call): that exact reason, and our call
                if node.reason == reason and "drain" in may_have_run(
                        self.store.steps(rec.id)):
                    self._mark_drained(rec, name, reason, now, node)
                    self._finish(rec, Status.DONE)
                else:
                    self._finish(rec, Status.DONE, f"already drained by someone else "
                                 f"({node.reason or 'no reason'}); not ours to resume")
                return
            try:
                self._step(rec, "drain", lambda: self.scheduler.drain_node(name, reason),
                           reason)
            except NodeNotFound:
                self._finish(rec, Status.FAILED, f"node {name} no longer exists")
                return
            self._mark_drained(rec, name, reason, now)
            self._finish(rec, Status.DONE)
        elif rec.action == "resume_node":
            if not node.drained:
                self._disown(name)
                self._finish(rec, Status.DONE, "the node is no longer drained")
                return
            if not our_drain(self.store.node(name), node):
                self._disown(name)
                self._finish(rec, Status.EXPIRED, f"drained by someone else now ({node.reason}, "
                             f"set by {node.reason_user or '?'})")
                return
            self._step(rec, "resume", lambda: self.scheduler.resume_node(name))
            self._disown(name)
            self._finish(rec, Status.DONE)
        else:
            self._finish(rec, Status.FAILED, f"unknown node action {rec.action!r}")

    def _mark_drained(self, rec: Recommendation, name: str, reason: str, now: float,
                      node=None) -> None:
        """Record the drain as ours: what Slurm shows right after it (reason,
        user, timestamp) is what later tells our drain from anyone else's."""
        if node is None:
            try:
                node = self.scheduler.get_node(name)
            except SchedulerError as exc:
                log.warning("rec=%s drained %s but cannot read it back (%s); its drain "
                            "is recorded by reason only", rec.id, name, exc)
        shown = node if node is not None and node.drained and node.reason == reason else None
        with self.store.transaction():
            self.store.set_node(name, drained_by_us=1, drain_reason=reason, drained_at=now,
                                drain_rec=rec.id,
                                drain_slurm_reason=shown.reason if shown else reason,
                                drain_slurm_user=shown.reason_user if shown else None,
                                drain_slurm_time=shown.reason_time if shown else None)

    def _disown(self, name: str) -> None:
        with self.store.transaction():
            self.store.set_node(name, drained_by_us=0, drain_reason=None, drain_rec=None,
                                drain_slurm_reason=None, drain_slurm_user=None,
                                drain_slurm_time=None)

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

    # -- resuming our drains ------------------------------------------------------
    def reconcile_drains(self) -> list[str]:
        """Forget the drains that are no longer ours: the node was resumed, or
        drained again by someone else (Slurm's reason time changed). They stop
        counting against the drain budget and are never resumed by us. Returns
        the nodes let go; a listing that fails changes nothing."""
        rows = self.store.drained_nodes()
        if not rows:
            return []
        try:
            listed = {n.name: n for n in self.scheduler.list_nodes()}
        except SchedulerError as exc:
            log.warning("cannot check our drains against Slurm: %s", exc)
            return []
        gone = []
        for row in rows:
            node = listed.get(row["name"])
            if node is None or our_drain(row, node):
                continue
            why = ("resumed" if not node.drained else
                   f"drained again by {node.reason_user or 'someone else'} "
                   f"({node.reason or 'no reason'})")
            log.info("node %s is no longer drained by us: %s", row["name"], why)
            self._disown(row["name"])
            gone.append(row["name"])
        return gone

    def resume_clean_nodes(self, now: float) -> list[int]:
        """A resume recommendation for each node we drained whose health reports
        have been clean for ``policy.resume_after``."""
        self.reconcile_drains()
        after = self.cfg.policy.resume_after
        if not after:
            return []
        made = []
        for node in self.store.drained_nodes():
            name = node["name"]
            if any(r.action == "resume_node" and r.target_nodes == (name,)
                   for r in self.store.recommendations(OPEN_STATUSES)):
                continue
            since = node["drained_at"] or now
            reports = self.store.reports_since(name, since)
            dirty = [r["received"] for r in reports if not r["gpu_ok"]
                     or self.store.report_xid_count(r["id"])]
            clean_from = max([since, *dirty])
            clean = [r for r in reports if r["received"] > clean_from]
            if not clean or now - clean_from < after:
                continue
            with self.store.transaction():
                pk = self.store.add_recommendation({
                    "scope": "node", "action": "resume_node", "rule": "healthy_again",
                    "reason": f"health reports clean for {now - clean_from:.0f}s "
                              f"({len(clean)} report(s))",
                    "reason_category": "recovered", "target_nodes": [name], "mode": "action",
                    "status": Status.PROPOSED, "actor": "agent", "exclude": []})
            made.append(pk)
        return made

    # -- running it ---------------------------------------------------------------
    def run_forever(self, stop: threading.Event, interval: float = 0.5) -> None:
        while not stop.is_set():
            try:
                pending = self.run_once()
            except Fenced as exc:
                log.error("stopped acting on Slurm mid-pass: %s", exc)
                pending = 0
            except Exception:  # noqa: BLE001 - the actuator must outlive one bad pass
                log.exception("actuator pass crashed; carrying on")
                pending = 1
            self.wake.wait(interval if pending else 2.0)
            self.wake.clear()


def _failed_since_start(steps: list[dict]) -> bool:
    """Did a step fail after StartTime=now went through?"""
    started = [i for i, s in enumerate(steps) if s["step"] == "start_now" and s["state"] == "ok"]
    return bool(started) and any(s["state"] == "failed" for s in steps[started[-1] + 1:])


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


def _spec(text: str) -> specs.RecoverySpec:
    try:
        return specs.parse(text or "")
    except specs.SpecError:
        return specs.RecoverySpec(mode="monitor")
