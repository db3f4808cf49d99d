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

The parts, by role (one :class:`Actuator` made of them):

- this module: the pass over open recommendations, and the loop that runs passes;
- :mod:`.jobs`: the job recovery steps (stop; requeue-hold, exclude, start, release);
- :mod:`.migrate`: the move off a degraded node (checkpoint signal, the wait for
  the checkpoint, then the job recovery steps);
- :mod:`.drains`: node drains and resumes, which drains are ours, and the
  automatic resume of clean nodes;
- :mod:`.watchdog`: whether a job is held by us, letting it go, and the
  watchdog's release of holds kept too long;
- :mod:`.steps`: each Slurm step recorded before and after, the side
  journal's fail-open path, the moves of a recommendation's record.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from ..config import Config
from ..errors import JobNotFound, SchedulerError
from ..scheduler.base import Job, Scheduler
from ..store import OPEN_STATUSES, Recommendation, Store
from ..store.journal import STORE_ERRORS, SideJournal
from .drains import Drains
from .jobs import JobRecovery
from .migrate import Migrations
from .steps import Fenced, StepFailed, Steps
from .watchdog import Watchdog

log = logging.getLogger(__name__)
RESUME_CHECK_INTERVAL = 30.0


class Actuator(JobRecovery, Migrations, Drains, Watchdog, Steps):
    """The pass over open recommendations and the loop that runs passes are
    here; the other parts, by role, are the bases:
    :class:`~recovery_agent.act.jobs.JobRecovery` (the job recovery steps),
    :class:`~recovery_agent.act.drains.Drains` (node drains, their ownership,
    the resume of clean nodes), :class:`~recovery_agent.act.watchdog.Watchdog`
    (holds and their release), :class:`~recovery_agent.act.steps.Steps`
    (recording each step, the side journal's fail-open path). They share the
    state made here (the store, the scheduler, the fence, the side journal and
    what waits in it, the holds seen) and call one another's steps, so they
    are parts of one object rather than objects of their own."""

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
        self._ended_at: dict[int, float] = {}   # rec -> Slurm's end of the attempt it requeued
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
