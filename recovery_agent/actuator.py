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
import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable

from slurm_hooks import spec as specs

from .config import Config
from .errors import JobNotFound, NodeNotFound, SchedulerError
from .notify import notify
from .notify import targets as notify_targets
from .scheduler.base import Job, Scheduler
from .store import OPEN_STATUSES, Store

log = logging.getLogger(__name__)
DRAIN_TAG = "recovery:"
CRASH_ENV = "RECOVERY_TEST_CRASH_AFTER_STEP"   # tests: SIGKILL the agent after this step
# tests: before this step, create the file named by PAUSE_FILE_ENV and wait
# (up to PAUSE_LIMIT) until it is removed, so a test can break something first
PAUSE_ENV, PAUSE_FILE_ENV, PAUSE_LIMIT = ("RECOVERY_TEST_PAUSE_BEFORE_STEP",
                                          "RECOVERY_TEST_PAUSE_FILE", 120.0)
RESUME_CHECK_INTERVAL = 30.0


class StepFailed(Exception):
    pass


def drain_reason(rec_id: int, category: str) -> str:
    """The reason we give slurmctld: tagged as ours, so we never resume a node
    someone else drained."""
    return f"{DRAIN_TAG} {rec_id} {category or 'fault'}"[:200]


def ours(reason: str) -> bool:
    return reason.startswith(DRAIN_TAG)


class Actuator:
    def __init__(self, cfg: Config, store: Store, scheduler: Scheduler,
                 clock: Callable[[], float] = time.time,
                 mono: Callable[[], float] = time.monotonic) -> None:
        self.cfg, self.store, self.scheduler, self.clock = cfg, store, scheduler, clock
        self.mono = mono
        self._holds_seen: dict[int, tuple[float, float]] = {}   # rec -> (held_at, mono 0)
        self.wake = threading.Event()
        self.crash_after = os.environ.get(CRASH_ENV, "")
        self.pause_before = os.environ.get(PAUSE_ENV, "")
        self.pause_file = os.environ.get(PAUSE_FILE_ENV, "")
        self.waiting_for_slurm = False
        self.last_resume_check = 0.0
        self.passes = 0

    # -- one pass --------------------------------------------------------------
    def run_once(self) -> int:
        """Advance every open action-mode recommendation once; run the watchdog
        and, now and then, the resume check. Returns how many are still open."""
        now = self.clock()
        open_recs = [r for r in self.store.recommendations(OPEN_STATUSES)
                     if r["mode"] == "action"]
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
                if rec["next_try"] and rec["next_try"] > now:
                    continue
                self.advance(rec, listing, now)
            self.watchdog(listing, now)
        if now - self.last_resume_check >= RESUME_CHECK_INTERVAL:
            self.last_resume_check = now
            self.resume_clean_nodes(now)
        self.passes += 1
        return sum(1 for r in self.store.recommendations(OPEN_STATUSES)
                   if r["mode"] == "action")

    def advance(self, rec: dict, listing: dict[str, Job], now: float) -> None:
        """One step (or a few) of one recommendation, from the live job."""
        if self.store.rec(rec["id"])["status"] not in OPEN_STATUSES:
            return   # cancelled (or ended) since the list was read
        try:
            if rec["scope"] == "job":
                self._advance_job(rec, listing.get(rec["job_id"]), now)
            else:
                self._advance_node(rec, now)
        except StepFailed as exc:
            self._retry_or_fail(rec, str(exc), listing.get(rec["job_id"]), now)
        except SchedulerError as exc:   # a read inside a step: wait, do not count
            log.warning("rec=%s waiting: %s", rec["id"], exc)

    def _overdue(self, now: float) -> bool:
        return bool(self._held_too_long(now))

    def _held_too_long(self, now: float) -> list[dict]:
        """Job recommendations whose hold is older than the decision timeout and
        not known to be lifted (open ones, and ended ones whose release failed)."""
        rows = self.store.db["recommendations"].rows_where(
            "scope = 'job' and held_at is not null and status in "
            "('proposed', 'executing', 'failed', 'expired') and created >= ?",
            [now - 7 * 86400], order_by="id")
        limit = self.cfg.policy.decision_timeout
        return [r for r in rows if self._hold_age(r["id"], r["held_at"], now) >= limit]

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
    def _step(self, rec: dict, name: str, call: Callable[[], object], detail: str = "") -> None:
        if self.pause_before == name and self.pause_file:
            self._pause(name)
        self.store.add_step(rec["id"], name, "started", detail)
        try:
            call()
        except (JobNotFound, NodeNotFound):
            self.store.add_step(rec["id"], name, "failed", "not found")
            raise
        except SchedulerError as exc:
            self.store.add_step(rec["id"], name, "failed", f"{exc} {exc.stderr}".strip())
            raise StepFailed(f"{name}: {exc}") from None
        self.store.add_step(rec["id"], name, "ok", detail)
        log.info("rec=%s job=%s step %s ok %s", rec["id"], rec["job_id"], name, detail)
        if self.crash_after == name:
            os.kill(os.getpid(), signal.SIGKILL)

    def _pause(self, name: str) -> None:
        """Test hook: hold still before a step while the test breaks something."""
        self.pause_before = ""   # once per agent
        path = Path(self.pause_file)
        path.write_text(f"{os.getpid()} before {name}\n")
        log.warning("test hook: paused before step %s until %s is removed", name, path)
        deadline = time.monotonic() + PAUSE_LIMIT
        while path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    def _set(self, rec: dict, **values) -> None:
        with self.store.lock, self.store.db.atomic():
            self.store.update_rec(rec["id"], **values)
        rec.update(values)

    def _finish(self, rec: dict, status: str, why: str = "", job: Job | None = None) -> None:
        extra = {}
        if status in ("expired", "failed") and rec["scope"] == "job" and self._requeued(rec):
            # fail open, judged on the job as it is now (a requeue that timed out
            # may still have happened); a hold we could not lift, or could not
            # see, stays marked for the watchdog
            try:
                job = self.scheduler.get_job(rec["job_id"])
            except JobNotFound:
                job = None
            except SchedulerError:
                job = False
            if job is not False and (not self._holds(rec, job) and not self._ending(rec, job)
                                     or self._let_go(rec, job, f"release_after_{status}")):
                extra["held_at"] = None
        now = self.clock()
        with self.store.lock, self.store.db.atomic():
            self.store.update_rec(rec["id"], status=status, error=why or None,
                                  done_at=now if status == "done" else None,
                                  next_try=None, **extra)
            if rec["job"] is not None:
                self.store.add_event(rec["job"], f"rec_{status}",
                                     f"#{rec['id']} {rec['action']} {status}"
                                     + (f": {why}" if why else ""),
                                     attempt=rec["attempt"], source="actuator")
        rec["status"] = status
        log.log(logging.INFO if status == "done" else logging.WARNING,
                "rec=%s %s %s%s", rec["id"], rec["action"], status, f": {why}" if why else "")

    def _begin(self, rec: dict) -> None:
        if rec["status"] == "proposed":
            self._set(rec, status="executing")

    def _retry_or_fail(self, rec: dict, why: str, job: Job | None, now: float) -> None:
        tries = (rec["tries"] or 0) + 1
        pol = self.cfg.policy
        if tries < pol.action_retries and not self._past_deadline(rec, now):
            wait = pol.retry_backoff * (2 ** (tries - 1))
            self._set(rec, tries=tries, next_try=now + wait)
            log.warning("rec=%s try %d failed (%s); retrying in %.1fs", rec["id"], tries, why,
                        wait)
            return
        self._set(rec, tries=tries)
        self._finish(rec, "failed", f"{why} (after {tries} tries)", job)

    def _past_deadline(self, rec: dict, now: float) -> bool:
        return bool(rec["held_at"]) and self._hold_age(
            rec["id"], rec["held_at"], now) >= self.cfg.policy.decision_timeout

    def _holds(self, rec: dict, job: Job | None) -> bool:
        """Is ``job`` held by this recommendation's requeue-hold?"""
        if job is None or not (job.is_pending and job.held
                               and job.restart_count == rec["restart_at"] + 1):
            return False
        return self._requeued(rec)   # held after someone else's requeue: not ours

    def _requeued(self, rec: dict) -> bool:
        """Did this recommendation's requeue-hold reach Slurm (or may it have)?"""
        return any(s["step"] == "requeue_hold" for s in self.store.steps(rec["id"]))

    def _ending(self, rec: dict, job: Job | None) -> bool:
        """Is our requeue still stopping the job (COMPLETING)? It will be held."""
        return bool(job is not None and job.state == "COMPLETING"
                    and job.restart_count == rec["restart_at"] + 1
                    and self._requeued(rec))

    def _let_go(self, rec: dict, job: Job | None, step: str) -> bool:
        """Fail open: release a job our requeue-hold holds, best effort."""
        if not self._holds(rec, job):
            return False
        try:
            self._step(rec, step, lambda: self.scheduler.release(rec["job_id"]))
            self._step(rec, "start_now", lambda: self.scheduler.start_now(rec["job_id"]))
        except (StepFailed, SchedulerError) as exc:
            log.error("rec=%s could not release job %s: %s", rec["id"], rec["job_id"], exc)
            return False
        return True

    # -- job actions -----------------------------------------------------------
    def _advance_job(self, rec: dict, job: Job | None, now: float) -> None:
        if job is None:
            self._finish(rec, "expired", "the job is gone from slurmctld")
            return
        # Slurm gives a requeued job a new submit time; at the decided attempt
        # it must not have changed, and it never goes back
        if rec["submit_time"] and job.submit_time and (
                job.submit_time < rec["submit_time"]
                or job.restart_count <= rec["restart_at"]
                and job.submit_time != rec["submit_time"]):
            self._finish(rec, "expired", "the job id now belongs to another job")
            return
        self._begin(rec)
        try:
            if rec["action"] == "stop":
                self._stop(rec, job)
            elif rec["action"] in ("requeue", "requeue_exclude", "kill_requeue"):
                self._requeue(rec, job, now)
            else:
                self._finish(rec, "failed", f"unknown job action {rec['action']!r}")
        except JobNotFound:
            self._finish(rec, "expired", "the job vanished during the recovery")

    def _stop(self, rec: dict, job: Job) -> None:
        steps = {s["step"] for s in self.store.steps(rec["id"]) if s["state"] == "ok"}
        if rec["trigger"] != "ended" and job.is_active and job.restart_count == rec["restart_at"]:
            # a hung job with nothing left to try: free its nodes
            self._step(rec, "cancel", lambda: self.scheduler.cancel(rec["job_id"]))
        spec = _spec(self.store.job(rec["job"])["spec"])
        if "notify" not in steps:
            env = self.cfg.environment(spec.env)
            for target in notify_targets(spec.notify, env.notify):
                outcome = notify(target, rec)
                self.store.add_step(rec["id"], "notify", "ok" if outcome.ok else "failed",
                                    outcome.detail)
        self._finish(rec, "done")

    def _requeue(self, rec: dict, job: Job, now: float) -> None:
        at = rec["restart_at"]
        steps = self.store.steps(rec["id"])
        begun = {s["step"] for s in steps}
        done = {s["step"] for s in steps if s["state"] == "ok"}
        if job.restart_count == at:
            if job.is_pending and not job.held and "requeue_hold" not in done:
                self._adopt(rec, job, done)
                return
            if job.is_pending or (rec["trigger"] == "ended" and not job.is_finished
                                  and job.state != "COMPLETING"):
                self._finish(rec, "expired", f"the job is {job.state} again without our "
                             "requeue", job)
                return
            if job.state == "COMPLETING":
                return   # the attempt is still ending; next pass
            if not job.requeue_allowed and "allow_requeue" not in done:
                self._step(rec, "allow_requeue",
                           lambda: self.scheduler.allow_requeue(rec["job_id"]))
            detail = f"restart {at} -> {at + 1}"
            if "requeue_hold" in done:
                # it went through, yet the job is back at the decided attempt: a
                # controller restarted from older state has forgotten it
                detail += " again: slurmctld no longer shows our first requeue"
                log.warning("rec=%s job=%s: %s", rec["id"], rec["job_id"], detail)
            self._set(rec, held_at=now)
            self._step(rec, "requeue_hold", lambda: self.scheduler.requeue_hold(rec["job_id"]),
                       detail)
            return
        if job.restart_count != at + 1:
            self._finish(rec, "expired", f"the job restarted {job.restart_count - at} times "
                         "since the decision", job)
            return
        if "requeue_hold" not in begun:
            self._finish(rec, "expired", "the job was requeued by someone else meanwhile")
            return
        if not rec["held_at"]:
            self._set(rec, held_at=now)
        if job.state == "COMPLETING":
            return   # still stopping the killed attempt; next pass
        if job.is_pending and job.held:
            self._exclude_and_start(rec, job, done)
            self._step(rec, "release", lambda: self.scheduler.release(rec["job_id"]))
            self._finish(rec, "done")
            return
        if job.is_pending and "release" in done and "start_now" not in done:
            self._step(rec, "start_now", lambda: self.scheduler.start_now(rec["job_id"]))
        note = "" if "release" in begun else f"released by someone else; now {job.state}"
        self._finish(rec, "done", note)

    def _adopt(self, rec: dict, job: Job, done: set[str]) -> None:
        """The attempt is back in the queue, unheld, at the same restart count,
        and not by our requeue: slurmctld put it there itself (a controller
        that lost its last state changes in a crash does this). Requeueing it
        again is not needed; our exclusions and an immediate start still are.
        A job that starts before the exclusion lands refuses it: retried,
        then expired as usual."""
        self._exclude_and_start(rec, job, done)
        self._finish(rec, "done", "slurmctld requeued the job itself; our exclusions applied")

    def _exclude_and_start(self, rec: dict, job: Job, done: set[str]) -> None:
        """Our exclusions on the pending job (unless Slurm has them), then
        StartTime=now (once), so it does not wait out Slurm's requeue delay."""
        want = list(rec["exclude"] or [])
        if want and sorted(job.excluded_nodes) != sorted(want):
            self._step(rec, "exclude",
                       lambda: self.scheduler.set_excluded_nodes(rec["job_id"], want),
                       ",".join(want))
        if "start_now" not in done:
            self._step(rec, "start_now", lambda: self.scheduler.start_now(rec["job_id"]))

    # -- node actions -------------------------------------------------------------
    def _advance_node(self, rec: dict, now: float) -> None:
        name = (rec["target_nodes"] or [None])[0]
        if not name:
            self._finish(rec, "failed", "no node named")
            return
        try:
            node = self.scheduler.get_node(name)
        except NodeNotFound:
            self._finish(rec, "failed", f"node {name} no longer exists")
            return
        self._begin(rec)
        if rec["action"] == "drain_node":
            if node.drained:
                if ours(node.reason):
                    self._mark_drained(name, node.reason, now)
                    self._finish(rec, "done")
                else:
                    self._finish(rec, "done", f"already drained by someone else "
                                 f"({node.reason or 'no reason'}); not ours to resume")
                return
            reason = drain_reason(rec["id"], rec["reason_category"] or "")
            try:
                self._step(rec, "drain", lambda: self.scheduler.drain_node(name, reason),
                           reason)
            except NodeNotFound:
                self._finish(rec, "failed", f"node {name} no longer exists")
                return
            self._mark_drained(name, reason, now)
            self._finish(rec, "done")
        elif rec["action"] == "resume_node":
            if not node.drained:
                self.store.set_node(name, drained_by_us=0)
                self._finish(rec, "done", "the node is no longer drained")
                return
            if not ours(node.reason):
                self.store.set_node(name, drained_by_us=0)
                self._finish(rec, "expired", f"drained by someone else now ({node.reason})")
                return
            self._step(rec, "resume", lambda: self.scheduler.resume_node(name))
            self.store.set_node(name, drained_by_us=0, drain_reason=None)
            self._finish(rec, "done")
        else:
            self._finish(rec, "failed", f"unknown node action {rec['action']!r}")

    def _mark_drained(self, name: str, reason: str, now: float) -> None:
        with self.store.lock, self.store.db.atomic():
            self.store.set_node(name, drained_by_us=1, drain_reason=reason, drained_at=now)

    # -- the watchdog ---------------------------------------------------------------
    def watchdog(self, listing: dict[str, Job], now: float) -> list[int]:
        """Release every job our requeue-hold has held longer than the decision
        timeout: open recommendations end ``released_by_watchdog``; a job left
        held by one that already ended (a release that failed) is released too."""
        released = []
        limit = self.cfg.policy.decision_timeout
        for row in self._held_too_long(now):
            rec = self.store.decode_rec(row)
            job = listing.get(rec["job_id"])
            let_go = self._let_go(rec, job, "watchdog_release")
            if not let_go and (self._holds(rec, job) or self._ending(rec, job)):
                continue   # still stopping, or the release failed: next pass
            if rec["status"] in OPEN_STATUSES:
                age = self._hold_age(rec["id"], rec["held_at"], now)
                self._finish(rec, "released_by_watchdog",
                             f"held {age:.0f}s without a completed decision "
                             f"(policy.decision_timeout={limit:g}s); released to normal "
                             "scheduling")
                released.append(rec["id"])
            else:
                if let_go:
                    log.warning("watchdog released job %s left held by rec %s (%s)",
                                rec["job_id"], rec["id"], rec["status"])
                    released.append(rec["id"])
                with self.store.lock, self.store.db.atomic():
                    self.store.update_rec(rec["id"], held_at=None)
        return released

    # -- resuming our drains ------------------------------------------------------
    def resume_clean_nodes(self, now: float) -> list[int]:
        """A resume recommendation for each node we drained whose health reports
        have been clean for ``policy.resume_after``."""
        after = self.cfg.policy.resume_after
        if not after:
            return []
        made = []
        for node in self.store.db["nodes"].rows_where("drained_by_us = 1"):
            name = node["name"]
            if any(r["action"] == "resume_node" and r["target_nodes"] == [name]
                   for r in self.store.recommendations(OPEN_STATUSES)):
                continue
            since = node["drained_at"] or now
            reports = list(self.store.db["node_reports"].rows_where(
                "node = ? and received >= ?", [name, since], order_by="received"))
            dirty = [r["received"] for r in reports if not r["gpu_ok"]
                     or self.store.db["xids"].count_where("report = ?", [r["id"]])]
            clean_from = max([since, *dirty])
            clean = [r for r in reports if r["received"] > clean_from]
            if not clean or now - clean_from < after:
                continue
            with self.store.lock, self.store.db.atomic():
                pk = self.store.add_recommendation({
                    "scope": "node", "action": "resume_node", "rule": "healthy_again",
                    "reason": f"health reports clean for {now - clean_from:.0f}s "
                              f"({len(clean)} report(s))",
                    "reason_category": "recovered", "target_nodes": [name], "mode": "action",
                    "status": "proposed", "actor": "agent", "exclude": []})
            made.append(pk)
        return made

    # -- running it ---------------------------------------------------------------
    def run_forever(self, stop: threading.Event, interval: float = 0.5) -> None:
        while not stop.is_set():
            try:
                pending = self.run_once()
            except Exception:  # noqa: BLE001 - the actuator must outlive one bad pass
                log.exception("actuator pass crashed; carrying on")
                pending = 1
            self.wake.wait(interval if pending else 2.0)
            self.wake.clear()


def _spec(text: str) -> specs.RecoverySpec:
    try:
        return specs.parse(text or "")
    except specs.SpecError:
        return specs.RecoverySpec(mode="monitor")
