"""The watch loop and job sync: one cycle, the registration of jobs that opted
in through ``--comment``, the scheduler's listing matched to the stored jobs
(state changes, a job gone, a job id reused), the nodes' state history
(:mod:`.nodestates`), and the loop that runs cycles.
"""
from __future__ import annotations

import logging
import threading
import time

from slurm_hooks import spec as specs

from ..config import Config
from ..decide.decider import environment_mode
from ..decide.moves import Mover
from ..decide.policy import effective_mode
from ..detect.scanner import Scanner
from ..errors import RecoveryError, StoreError
from ..inputs.tail import Tailer
from ..scheduler.base import FINISHED_STATES, Job, Scheduler
from ..store import STORE_ERRORS, Store, same_job
from .attempt import AttemptLines, AttemptWatch
from .feed import SourceFeed
from .nodestates import NodeStates
from .running import RunningChecks
from .verdicts import Verdicts, shows_run

log = logging.getLogger("recovery_agent.watch")   # one logger for the loop, as before its split
# a cycle for a hang window comes this long after the window fills (a check a
# hair early would find the silence just short of it)
HANG_SLACK = 0.05
# how long after a nudge on a job, while that job is seen COMPLETING, the loop
# looks again every agent.report_wakeup_gap (a job stuck completing must not
# keep the loop listing at that rate)
SETTLE_AFTER_NUDGE = 5.0
SEEN_FLUSH_EVERY = 60.0  # unchanged jobs' last_seen is written this often
GONE_AFTER = 600.0  # a stored job slurmctld no longer lists is let go after this
MOVES_CURSOR = "moves_cursor"   # agent state: the last degradation record planned for
# a job the agent let go (GONE) is as over as one Slurm finished: not re-read each cycle
ENDED_STATES = FINISHED_STATES | {"GONE"}


class Watcher(AttemptLines, RunningChecks, Verdicts):
    """``sources``: a :class:`~recovery_agent.inputs.sources.SourcePoller` over the
    configured external sources, or None (off).

    The loop and job sync are here; the other parts, by role, are the bases:
    :class:`~recovery_agent.watch.attempt.AttemptLines` (an attempt's output),
    :class:`~recovery_agent.watch.running.RunningChecks` (detectors on a
    running attempt), :class:`~recovery_agent.watch.verdicts.Verdicts`. They
    share the state made here (the watches, the queue of ended attempts, the
    cycle's first store failure), one cycle's, so they are parts of one object
    rather than objects of their own."""

    def __init__(self, cfg: Config, store: Store, scheduler: Scheduler, scanner: Scanner,
                 tailer: Tailer, clock=time.time, decider=None, sources=None,
                 provider=None) -> None:
        self.cfg, self.store, self.scheduler = cfg, store, scheduler
        self.decider = decider
        self.provider = provider   # a site attribution provider (detect.provider)
        self.scanner, self.tailer, self.clock = scanner, tailer, clock
        # output lines are stamped with their file's mtime only on the wall
        # clock, the one file times are in (tests may run the loop on another)
        self.mtime_stamps = clock is time.time
        self.sources: SourceFeed | None = None
        if sources is not None:
            self.sources = SourceFeed(sources, scanner, settle=cfg.sources.ingest_delay
                                      + cfg.sources.prometheus_step)
            store.health["sources"] = self.sources.counters()
        self.watches: dict[int, AttemptWatch] = {}   # by job row id
        # called with (every listed job, monotonic time it was asked for) each cycle
        self.on_listing: list = []
        self.wake = threading.Event()   # set by nudge(): evidence came in
        self.early_cycles = 0           # cycles a nudge brought forward
        self.settling = False           # the last cycle listed a nudged job completing
        self._nudged: dict[int, float] = {}   # job row -> until when it settles (monotonic)
        self._nudge_lock = threading.Lock()
        self.closing: list[tuple[AttemptWatch, Job | None, float]] = []
        # hang/straggler decisions the store refused: (job pk, attempt) -> args
        self._pending_decisions: dict[tuple[int, int], tuple] = {}
        self._deferred: Exception | None = None
        self._report_lines: list[tuple[int, int, dict]] = []
        self._report_lock = threading.Lock()
        self.cycles = 0
        self.detections = 0
        # per-cycle work proportional to what changed, not to what is tracked:
        self._stored: dict[int, tuple] = {}       # job row -> what was last written
        self._listed_at: dict[int, float] = {}    # job row -> last time squeue listed it
        # (job row, attempt) -> the runs of it with a verdict (Slurm start times;
        # None: a verdict that names no run, which counts for every run)
        self._judged: dict[tuple[int, int], set[int | None]] = {}
        self._known: set[tuple[str, int]] = set()   # (job id, submit time) registered
        self._env_checked: set[int] = set()   # job rows whose environment was looked up
        self._seen_flushed = 0.0
        self._path_users: dict[str, int] = {}       # followed path -> watches using it
        self._node_map: tuple[float, dict[str, str]] = (float("-inf"), {})
        self.node_states = NodeStates(cfg, store, scheduler)   # the node state history
        self._moves_cursor: int | None = None   # the last degradation record planned for
        if decider is not None:   # its cluster size may come from the poll's listing
            decider.polled_nodes = lambda: self.node_states.listing

    def cycle(self) -> int:
        """Run one cycle; return how many detections it stored."""
        now = self.clock()
        self.settling = False      # a failed listing shows nothing completing
        asked = time.monotonic()
        jobs = self.scheduler.list_jobs()
        for listener in self.on_listing:   # the hooks' job cache: never older than a poll
            try:
                listener(jobs, asked)
            except Exception:  # noqa: BLE001 - a listener's bug must not stop the watch
                log.exception("job listing listener failed")
        listing = {j.job_id: j for j in jobs}
        # a watched job whose node reported lately and that is still completing
        # (its epilogs run) ends within moments: the loop looks again soon
        with self._nudge_lock:
            self._nudged = {pk: t for pk, t in self._nudged.items() if t > asked}
            nudged = set(self._nudged)
        # (the few jobs reports named lately, not every watch: a hot path)
        self.settling = any((w := self.watches.get(pk)) is not None
                            and (j := listing.get(w.job_id)) is not None
                            and j.state == "COMPLETING" for pk in nudged)
        # array tasks a hook stored under their numeric id take the scheduler's name
        for j in listing.values():
            if j.array_task_id is not None:
                self.store.adopt_printable_id(self.cfg.agent.cluster, j)
        self._register_comment_jobs(listing.values())
        self._deferred: Exception | None = None
        self._sync(listing, now)
        try:
            self.node_states.poll(now)
            self._plan_moves(now)
        except STORE_ERRORS as exc:
            self._defer(exc)
        found = self._scan(now)
        found += self._poll_sources(listing, now)
        found += self._check(listing, now)
        self._close_attempts(now)
        self.cycles += 1
        self.detections += len(found)
        if self._deferred is not None:
            raise self._deferred
        return len(found)

    def _register_comment_jobs(self, jobs) -> None:
        cluster = self.cfg.agent.cluster
        for job in jobs:
            key = (job.job_id, job.submit_time or 0)
            if key in self._known:
                continue
            raw = specs.from_comment(job.comment)
            if raw is None or job.is_finished or job.array_task_spec:
                continue
            if self.store.match_job(cluster, job):
                self._known.add(key)
                continue
            problem = None
            try:
                spec = specs.parse(raw)
            except specs.SpecError as exc:
                spec = specs.RecoverySpec(mode="monitor")
                problem = str(exc)
                log.warning("job=%s invalid --comment spec: %s", job.job_id, exc)
            with self.store.transaction():
                pk = self.store.record_job(job, cluster, env=spec.env, mode=spec.mode or "",
                                           spec=spec.canonical())
                self.store.record_attempt(pk, job)
                self.store.add_event(pk, "registered", "registered from --comment by the "
                                     "scheduler poll", attempt=job.restart_count,
                                     source="poller")
                if problem:   # on the timeline too, as the hooks do for --recovery
                    self.store.note_invalid_spec(pk, raw, problem, job.restart_count,
                                                 "poller")
            self._known.add(key)   # only once it is stored: a failed write is retried

    def _sync(self, listing: dict[str, Job], now: float) -> None:
        """Start, renew or end the watch of every tracked job."""
        cluster = self.cfg.agent.cluster
        # last_seen in the store may lag the memory by a flush interval
        since = now - GONE_AFTER - 2 * SEEN_FLUSH_EVERY
        for row in self.store.watch_rows(cluster, ENDED_STATES, since):
            job = listing.get(row["job_id"])
            if job is not None and not row["submit_time"] and job.submit_time and \
                    self.store.find_job_exact(cluster, job.job_id, job.submit_time):
                # a hook stored this job anew; the listed job is the stored row
                # that holds its key (ingest merges the two once it lists it)
                continue
            if job is not None and not same_job(row, job):
                # the id names another job now (slurmctld lost its state and
                # counts again): this job is gone (once), and nothing of it
                # passes on; checked before an ended, judged job is passed over
                self._reused(row, job)
                continue
            self._flag_unknown_env(row)
            last_seen = max(row["last_seen"] or 0, self._listed_at.get(row["id"], 0))
            # the run Slurm shows, when it shows one of the stored attempt: a run
            # of an ended, judged attempt may come again (slurmctld re-ran it)
            run = job.run_start if job is not None \
                and job.restart_count == row["restart_count"] else None
            if row["state"] in ENDED_STATES and (
                    now - last_seen > GONE_AFTER
                    or not self._needs_verdict(row["id"], row["restart_count"], run)):
                continue
            if job is None:
                if now - (last_seen or now) > GONE_AFTER:
                    self._end(row["id"], "GONE")
                continue
            self._listed_at[row["id"]] = now
            stored = (job.state, job.restart_count, job.nodes, job.batch_host, job.start_time,
                      job.end_time, job.exit_code, job.exit_signal, job.submit_time, job.name,
                      job.user)
            if self._stored.get(row["id"]) == stored and row["state"] == job.state:
                self._follow(row, job, now)
                continue
            self._record(row, job, stored)
            self._follow(row, job, now)
        self._flush_last_seen(now)

    def _flag_unknown_env(self, row: dict) -> None:
        """A job whose directive names an environment the config lacks runs as
        ``default``: say so on its timeline the first time the loop sees it (the
        SPANK plugin refuses such names at submit time only when the plugstack
        sets allowed_envs)."""
        if row["id"] in self._env_checked:
            return
        if row["env"] not in self.cfg.environments:
            mode = effective_mode(environment_mode(self.cfg, self.store, "default"),
                                  row["mode"] or None)
            try:
                with self.store.transaction():
                    if self.store.note_unknown_env(row["id"], row["env"],
                                                   self.cfg.environments, mode, "poller"):
                        log.warning("job=%s environment %r is not configured; it runs as "
                                    "default (mode %s)", row["job_id"], row["env"], mode)
            except STORE_ERRORS as exc:
                self._defer(exc)
                return   # tried again next cycle
        self._env_checked.add(row["id"])

    def _record(self, row: dict, job: Job, stored: tuple) -> None:
        """Write a listed job's changes (and its state change, for the timeline)."""
        cluster = self.cfg.agent.cluster
        try:
            with self.store.lock:
                # env, mode and spec stay as the job's own directive registered
                # them (its identity is checked in _sync): never another job's
                self.store.record_job(job, cluster, env=row["env"], mode=row["mode"],
                                      spec=row["spec"])
                self.store.record_attempt(row["id"], job)
                seen = (row["state"], row["restart_count"])
                if seen != (job.state, job.restart_count) and row["state"] != "UNKNOWN":
                    # Slurm's state changes, for the timeline
                    self.store.add_event(row["id"], "slurm_state",
                                         f"{row['state']} -> {job.state}"
                                         + (f" ({job.reason})" if job.reason and
                                            job.reason != "None" else ""),
                                         attempt=job.restart_count, source="poller")
        except STORE_ERRORS as exc:
            # written again next cycle; the watch itself goes on, so an
            # attempt that ended is still judged (its verdict waits in
            # memory until the store takes it)
            self._defer(exc)
        else:
            self._stored[row["id"]] = stored   # written: unchanged listings skip it

    def _reused(self, row, job: Job) -> None:
        """A stored job whose id Slurm now gives to another job: its watch ends
        and its row is marked gone, once, with a line on its timeline."""
        self._stored.pop(row["id"], None)
        self._listed_at.pop(row["id"], None)
        if row["state"] == "GONE":
            return
        log.warning("job=%s: slurmctld now lists another job under this id (submitted "
                    "%s, not %s); the stored job is gone", row["job_id"], job.submit_time,
                    row["submit_time"])
        try:
            with self.store.transaction():
                self.store.add_event(row["id"], "id_reused",
                                     f"job id {row['job_id']} now belongs to another job "
                                     f"(submitted {job.submit_time}); this job is gone",
                                     source="poller")
            self._end(row["id"], "GONE")
        except STORE_ERRORS as exc:
            self._defer(exc)

    def _flush_last_seen(self, now: float, every: float = SEEN_FLUSH_EVERY) -> None:
        """Jobs listed but unchanged are not rewritten each cycle; their
        last_seen is brought up to date in one statement now and then."""
        if now - self._seen_flushed < every or not self._listed_at:
            return
        self._seen_flushed = now
        self.store.touch_seen(self._listed_at)

    def _follow(self, row: dict, job: Job, now: float) -> None:
        """Start, renew or end the watch of one listed job."""
        watch = self.watches.get(row["id"])
        if watch is not None and not shows_run(job, watch):
            # requeued, or run again at the same restart count: that run is over
            self._finish(watch, now, job)
            watch = None
        if job.is_finished:
            if watch:
                self._finish(watch, now, job)
            elif self._needs_verdict(row["id"], job.restart_count, job.run_start):
                # it ran and ended between two polls: read its output this
                # cycle, judge it next cycle (with the node reports)
                self._start(row, job, now)
            return
        if job.state == "RUNNING" and watch is None:
            self._start(row, job, now)

    def _plan_moves(self, now: float) -> None:
        """A node that became degraded since the last look gets its moves
        planned (decide/moves.py): at most once per change into ``degraded``.
        The cursor is the last degradation record seen, kept across restarts."""
        if self.decider is None:
            return
        if self._moves_cursor is None:
            self._moves_cursor = int(self.store.get_state(MOVES_CURSOR, 0) or 0)
        rows = self.store.degradation_after(self._moves_cursor)
        if not rows:
            return
        nodes = sorted({r["node"] for r in rows if r["level"] == "degraded"
                        and r["previous_level"] != "degraded"})
        # the cursor moves first: an agent that dies while planning plans those
        # nodes at most once (a lost plan moves nothing; a repeated one could)
        self._moves_cursor = rows[-1]["id"]
        self.store.set_state(MOVES_CURSOR, self._moves_cursor)
        mover = Mover(self.decider)
        for node in nodes:
            moved = mover.plan(node, now)
            if moved.plan is not None:
                log.info("node=%s degraded: %d move(s), %d refusal(s)", node,
                         sum(m.moves for m in moved.plan.jobs),
                         sum(not m.moves for m in moved.plan.jobs))

    def _end(self, job_pk: int, state: str) -> None:
        watch = self.watches.get(job_pk)
        if watch:
            self._finish(watch, self.clock())
        self.store.set_job_state(job_pk, state)

    def _defer(self, exc: Exception) -> None:
        """Remember the first store failure of this cycle; the cycle goes on
        (in memory) and reports it at the end, so /healthz turns red."""
        if self._deferred is None:
            self._deferred = exc if isinstance(exc, StoreError) else StoreError(
                f"store write failed: {exc}")

    def run_once(self) -> bool:
        """One cycle that never raises; the outcome goes to ``store.health``,
        which /healthz and /metrics read (a full or read-only store shows there,
        loudly, while the agent keeps running and retries)."""
        health = self.store.health
        try:
            self.cycle()
            self.store.set_state("heartbeat", {"time": self.clock(), "cycles": self.cycles})
        except Exception as exc:  # noqa: BLE001 - the loop must outlive any one bad cycle
            if isinstance(exc, RecoveryError):
                log.warning("watch cycle failed: %s", exc)
            else:
                log.exception("watch cycle crashed; carrying on")
            health.update(error=f"{type(exc).__name__}: {exc}"[:500], error_at=self.clock(),
                          errors=health.get("errors", 0) + 1)
            if isinstance(exc, STORE_ERRORS):   # counted apart: /metrics' store errors
                health["store_errors"] = health.get("store_errors", 0) + 1
            return False
        if health.get("error"):
            log.info("watch cycle healthy again after: %s", health["error"])
        health.update(error=None, ok_at=self.clock())
        return True

    def nudge(self, job_pk: int | None = None) -> None:
        """Evidence came in (a node report, from any thread), on the job of row
        ``job_pk``: run the next cycle now rather than at the next poll, and,
        while that job is still COMPLETING, the ones after it soon too, for
        SETTLE_AFTER_NUDGE (see :meth:`run_forever`)."""
        if job_pk is not None:
            with self._nudge_lock:
                self._nudged[job_pk] = time.monotonic() + SETTLE_AFTER_NUDGE
        self.wake.set()

    def run_forever(self, stop: threading.Event) -> None:
        """A cycle every poll interval, and one sooner when :meth:`nudge` says
        evidence came in, or when a watched attempt's silence fills its hang
        window before the next poll. An epilog reports while its job is still
        COMPLETING, so a cycle that lists a nudged job completing is followed
        by the next one a gap later, not a poll later. An early cycle never
        starts less than ``agent.report_wakeup_gap`` after the last one ended
        (a burst of epilogs costs one listing, and a slow listing is not
        repeated back to back), and never later than the poll."""
        interval, gap = self.cfg.agent.poll_interval, self.cfg.agent.report_wakeup_gap
        while not stop.is_set():
            started = time.monotonic()
            self.wake.clear()      # what comes in from here on, this cycle may miss
            self.run_once()
            due, early = started + interval, False
            soonest = time.monotonic() + gap if gap > 0 else None
            if soonest is not None and self.settling and soonest < due:
                due, early = soonest, True    # its end is moments away
            hang = self._next_hang_due()
            if hang is not None:
                at = time.monotonic() + (hang - self.clock()) + HANG_SLACK
                if at < due:
                    due, early = at, True
            if self._until_next(stop, due, soonest) or early:
                self._early()
        self.tailer.close()

    def _next_hang_due(self) -> float | None:
        """The soonest moment (the loop's clock) a watched attempt's silence
        fills its hang window, if any is still to come."""
        now = self.clock()
        dues = [d for w in self.watches.values()
                if (d := w.hang.due()) is not None and d > now]
        return min(dues, default=None)

    def _early(self) -> None:
        self.early_cycles += 1
        self.store.health["early_cycles"] = self.early_cycles

    def _until_next(self, stop: threading.Event, due: float, early: float | None) -> bool:
        """Wait until ``due`` (monotonic), or less when nudged (not before
        ``early``, nor after ``due``; never when ``early`` is None); True when
        a nudge ended it."""
        while not stop.is_set():
            left = due - time.monotonic()
            if left <= 0:
                return False
            if not self.wake.wait(left):
                return False
            if early is None:      # early cycles are off: the nudge waits for the poll
                self.wake.clear()
                continue
            stop.wait(max(0.0, min(early, due) - time.monotonic()))
            return True
        return False
