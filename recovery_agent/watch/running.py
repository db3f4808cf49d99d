"""The detectors on a running attempt: a silent log (hang), a rank whose steps
lag (straggler), a new checkpoint, and what the external sources say of the
attempt while it runs. A hang or straggler is decided while the attempt still
runs, on attribution's verdict: ``attribute`` for a hang
(:mod:`recovery_agent.detect.attribution`), ``straggler_verdict`` for a
straggler (:mod:`recovery_agent.detect.straggler`).
"""
from __future__ import annotations

from ..detect.attribution import attribute
from ..detect.evidence import all_detections
from ..detect.model import Detection
from ..detect.straggler import straggler_verdict
from ..inputs.checkpoints import newest_checkpoint
from ..scheduler.base import Job
from ..store import STORE_ERRORS
from .attempt import AttemptWatch

CKPT_SCAN_INTERVAL = 30.0
# stragglers are judged over minutes of step times: a few seconds between looks
# cost nothing in latency and most of the medians' CPU at 10,000 jobs
STRAGGLER_CHECK_EVERY = 5.0
# the last training step an attempt's log reported is written with each new
# checkpoint, at the attempt's end, and otherwise at most this often (one row
# update per attempt; an agent that dies loses at most this much of it)
STEP_SAVE_EVERY = 300.0


class RunningChecks:
    """The watcher's part that checks running attempts (a part of
    :class:`~recovery_agent.watch.Watcher`, whose state it shares): each cycle
    the hang, straggler and checkpoint detectors of every watch, and the
    external sources; a hang or straggler goes to the decider at once."""

    def _poll_sources(self, listing: dict[str, Job], now: float) -> list[Detection]:
        """Ask the external sources about every running attempt (each source
        paces itself per ``sources.query_interval``). Their detections feed the
        verdict like log lines do; a GPU utilisation hang is decided like a
        silent log. A failing source only shows in its counters and one log line."""
        if self.sources is None:
            return []
        running = [(w, job) for w in self.watches.values()
                   if (job := listing.get(w.job_id)) is not None and job.state == "RUNNING"
                   and job.restart_count == w.attempt]
        by_key = self.sources.poll_running([w for w, _ in running], now)
        found_all: list[Detection] = []
        for watch, job in running:
            found = by_key.get(watch.key)
            if not found:
                continue
            self._store(watch, found, now)
            found_all += found
            hang = next((d for d in found if d.rule == "hang"), None)
            if hang is not None and self.decider is not None \
                    and (watch.job_pk, watch.attempt) not in self._pending_decisions:
                try:
                    self._decide_running(watch, job, hang, [], now)
                except STORE_ERRORS as exc:
                    self._defer(exc)
        self.sources.save()
        self.store.health["sources"] = self.sources.counters()
        return found_all

    def _check(self, listing: dict[str, Job], now: float) -> list[Detection]:
        found_all = []
        self._retry_decisions(listing)
        for watch in list(self.watches.values()):
            job = listing.get(watch.job_id)
            found = []
            hang = watch.hang.check(now, running=bool(job and job.state == "RUNNING"))
            if hang:
                found.append(hang)
            slow = []
            if now - watch.straggler_checked >= STRAGGLER_CHECK_EVERY:
                watch.straggler_checked = now
                slow = watch.straggler.check(now)
            found += slow
            self._checkpoint(watch, now)
            self._store(watch, found, now)
            found_all += found
            if self.decider is not None and job is not None and job.state == "RUNNING" \
                    and job.restart_count == watch.attempt \
                    and (watch.job_pk, watch.attempt) not in self._pending_decisions:
                try:
                    self._decide_running(watch, job, hang, slow, now)
                except STORE_ERRORS as exc:
                    self._defer(exc)
        return found_all

    def _decide_running(self, watch: AttemptWatch, job: Job, hang: Detection | None,
                        slow: list[Detection], now: float) -> None:
        """Decide on a running attempt that hangs or straggles."""
        if hang:
            context = watch.layout.context(nodes=tuple(watch.nodes),
                                           node_events=tuple(self._node_events(watch, now)),
                                           addresses=self._addresses(now))
            self._decide(watch, job, attribute(watch.found, context), "hang",
                         all_detections(watch.found, context))
        elif slow:
            self._decide(watch, job, straggler_verdict(watch.found, slow), "straggler",
                         list(watch.found))

    def _checkpoint(self, watch: AttemptWatch, now: float, final: bool = False) -> None:
        """Note a new checkpoint of the attempt (and, with it, the last step
        the log reported); the last step alone every STEP_SAVE_EVERY, and at
        the attempt's end (``final``)."""
        if watch.spec.ckpt and now - watch.last_ckpt_scan >= CKPT_SCAN_INTERVAL:
            watch.last_ckpt_scan = now
            # with the user's rights: only their own files, where they may look
            watch.ckpt.observe(newest_checkpoint(watch.spec.ckpt, rights=watch.rights),
                               watch.started)
        newest = watch.ckpt.newest
        if newest is not None and newest != watch.saved_ckpt:
            try:
                with self.store.transaction():
                    self.store.set_attempt_checkpoint(watch.job_pk, watch.attempt, newest.path,
                                                      newest.step, newest.time)
                    self.store.add_event(watch.job_pk, "checkpoint",
                                         f"checkpoint {newest.path}"
                                         + (f" step {newest.step}" if newest.step is not None
                                            else ""), attempt=watch.attempt,
                                         source=newest.source,
                                         data={"path": newest.path, "step": newest.step,
                                               "time": newest.time, "clock": newest.clock})
                    self._save_step(watch, now)
            except STORE_ERRORS as exc:
                self._defer(exc)   # written next time round
                return
            watch.saved_ckpt = newest
        elif _step_changed(watch) and (final or now - watch.step_saved_at >= STEP_SAVE_EVERY):
            try:
                with self.store.transaction():
                    self._save_step(watch, now)
            except STORE_ERRORS as exc:
                self._defer(exc)

    def _save_step(self, watch: AttemptWatch, now: float) -> None:
        """The attempt's last reported step into the store, when it changed
        (inside the caller's transaction)."""
        step = watch.steps
        if not _step_changed(watch):
            return
        self.store.set_attempt_step(watch.job_pk, watch.attempt, step.last, step.time or now)
        watch.saved_step, watch.step_saved_at = (step.last, step.time), now


def _step_changed(watch: AttemptWatch) -> bool:
    step = watch.steps
    return step.last is not None and (step.last, step.time) != watch.saved_step
