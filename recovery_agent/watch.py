"""The agent's watch loop: follow every opted-in job and turn its output into
detections.

One cycle: one batched scheduler query; register jobs that opted in through
``--comment`` (hook-registered jobs are already in the store); follow each
tracked attempt's stdout/stderr; scan new lines; ask the external sources
(GPU metrics, log stores; see :mod:`recovery_agent.watch_sources`), when
configured; run the hang, straggler and checkpoint detectors; store what was
found. A bad cycle is logged and the next one runs (the loop never dies of one
job's oddity).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from slurm_hooks import kmsg
from slurm_hooks import spec as specs

from .config import Config
from .detect.attribution import (AttributionContext, LayoutLines, all_detections, attribute,
                                 node_addresses)
from .detect.checkpoint import CheckpointWatcher, newest_checkpoint
from .detect.model import Detection, Evidence, Verdict
from .detect.progress import HangDetector, StragglerDetector
from .detect.scanner import Scanner
from .errors import RecoveryError, SchedulerError, StoreError
from .logs.tail import LogLine, Tailer, lines_from_report
from .logs.userfs import Rights
from .policy import STRIKE_WEIGHTS, confined
from .scheduler.base import FINISHED_STATES, Job, Scheduler
from .store import STORE_ERRORS, Store, same_job
from .store import reports as report_rows
from .watch_sources import SourceFeed

log = logging.getLogger(__name__)
CKPT_SCAN_INTERVAL = 30.0
SEEN_FLUSH_EVERY = 60.0  # unchanged jobs' last_seen is written this often
# stragglers are judged over minutes of step times: a few seconds between looks
# cost nothing in latency and most of the medians' CPU at 10,000 jobs
STRAGGLER_CHECK_EVERY = 5.0
# ended attempts whose verdict cannot be stored (a full or read-only store)
# wait in memory, oldest dropped past this many: nothing is acted on unstored
MAX_PENDING_VERDICTS = 5000
GONE_AFTER = 600.0  # a stored job slurmctld no longer lists is let go after this
EPILOG_GRACE = 15.0  # how long a verdict waits for the nodes' epilog reports
XID_SLACK = 120.0    # node clocks may lag the controller's by this much
NODE_MAP_TTL = 300.0  # how long a listing of the nodes' addresses is reused
# ended so that more node evidence cannot change what is done (NODE_FAIL: Slurm
# blames the nodes; the others: policy acts on none of them)
NO_WAIT_STATES = frozenset({"NODE_FAIL", "COMPLETED", "CANCELLED", "PREEMPTED"})
# a job the agent let go (GONE) is as over as one Slurm finished: not re-read each cycle
ENDED_STATES = FINISHED_STATES | {"GONE"}


@dataclass
class AttemptWatch:
    """Everything followed for one attempt of one job."""

    job_pk: int
    job_id: str
    attempt: int
    spec: specs.RecoverySpec
    started: float
    paths: set[str]
    hang: HangDetector
    straggler: StragglerDetector
    ckpt: CheckpointWatcher = field(default_factory=CheckpointWatcher)
    streams: dict = field(default_factory=dict)
    last_ckpt_scan: float = 0.0
    straggler_checked: float = float("-inf")
    unstored: list = field(default_factory=list)  # (detection, time) the store refused
    saved_ckpt: object = None
    nodes: tuple[str, ...] = ()
    found: list = field(default_factory=list)   # this attempt's detections, for the verdict
    found_at: list = field(default_factory=list)  # when each was seen (agent clock)
    rights: Rights | None = None   # the job user's: its output and ckpt= are read with them
    layout: LayoutLines = field(default_factory=LayoutLines)   # what the log says of placement

    @property
    def key(self) -> str:
        return f"{self.job_pk}:{self.attempt}"


class Watcher:
    """``sources``: a :class:`~recovery_agent.sources.SourcePoller` over the
    configured external sources, or None (off)."""

    def __init__(self, cfg: Config, store: Store, scheduler: Scheduler, scanner: Scanner,
                 tailer: Tailer, clock=time.time, decider=None, sources=None,
                 provider=None) -> None:
        self.cfg, self.store, self.scheduler = cfg, store, scheduler
        self.decider = decider
        self.provider = provider   # a site attribution provider (detect.provider)
        self.scanner, self.tailer, self.clock = scanner, tailer, clock
        self.sources: SourceFeed | None = None
        if sources is not None:
            self.sources = SourceFeed(sources, scanner, settle=cfg.sources.ingest_delay
                                      + cfg.sources.prometheus_step)
            store.health["sources"] = self.sources.counters()
        self.watches: dict[int, AttemptWatch] = {}   # by job row id
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
        self._judged: set[tuple[int, int]] = set()  # (job row, attempt) with a verdict
        self._known: set[tuple[str, int]] = set()   # (job id, submit time) registered
        self._seen_flushed = 0.0
        self._path_users: dict[str, int] = {}       # followed path -> watches using it
        self._node_map: tuple[float, dict[str, str]] = (float("-inf"), {})

    # -- one cycle -----------------------------------------------------------
    def cycle(self) -> int:
        """Run one cycle; return how many detections it stored."""
        now = self.clock()
        listing = {j.job_id: j for j in self.scheduler.list_jobs()}
        # array tasks a hook stored under their numeric id take the scheduler's name
        for j in listing.values():
            if j.array_task_id is not None:
                self.store.adopt_printable_id(self.cfg.agent.cluster, j)
        self._register_comment_jobs(listing.values())
        self._deferred: Exception | None = None
        self._sync(listing, now)
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
            if job is not None and not same_job(row, job):
                # the id names another job now (slurmctld lost its state and
                # counts again): this job is gone (once), and nothing of it
                # passes on; checked before an ended, judged job is passed over
                self._reused(row, job)
                continue
            last_seen = max(row["last_seen"] or 0, self._listed_at.get(row["id"], 0))
            if row["state"] in ENDED_STATES and (
                    now - last_seen > GONE_AFTER
                    or not self._needs_verdict(row["id"], row["restart_count"])):
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
            try:
                with self.store.lock:
                    # env, mode and spec stay as the job's own directive registered
                    # them (its identity is checked above): never another job's
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
            self._follow(row, job, now)
        self._flush_last_seen(now)

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
        if job.is_finished:
            if watch:
                self._finish(watch, now, job)
            elif self._needs_verdict(row["id"], job.restart_count):
                # it ran and ended between two polls: read its output this
                # cycle, judge it next cycle (with the node reports)
                self._start(row, job, now)
            return
        if watch is not None and watch.attempt != job.restart_count:
            self._finish(watch, now, job)  # requeued: that attempt is over
            watch = None
        if job.state == "RUNNING" and watch is None:
            self._start(row, job, now)

    def _start(self, row: dict, job: Job, now: float) -> None:
        watch = self._new_watch(row, job, now)
        # /dev/null holds nothing to follow; any other path is read with the
        # user's rights (a refusal goes on the timeline, see _tail_notices)
        watch.paths = {p for p in (job.stdout, job.stderr) if p and p != "/dev/null"}
        for path in watch.paths:
            self.tailer.add(path, watch.key, rights=watch.rights)
            watch.streams[path] = self.scanner.stream(path, origin="job")
            self._path_users[path] = self._path_users.get(path, 0) + 1
        self.watches[row["id"]] = watch
        if job.restart_count:
            self.store.mark_running_again(row["id"], job.restart_count - 1,
                                          float(job.start_time or now))
        log.info("job=%s attempt=%s watching %s", job.job_id, job.restart_count,
                 ", ".join(sorted(watch.paths)))

    def _new_watch(self, row: dict, job: Job, now: float) -> AttemptWatch:
        """An attempt's detectors, following no file yet."""
        spec = _parse(row["spec"])
        env = self.cfg.environment(spec.env)
        started = float(job.start_time or now)
        return AttemptWatch(row["id"], job.job_id, job.restart_count, spec, started, set(),
                            HangDetector.for_attempt(spec, env, started),
                            StragglerDetector.for_environment(env, nodes=job.nodes),
                            nodes=job.nodes, rights=Rights.of_job(job))

    def _needs_verdict(self, job_pk: int, attempt: int) -> bool:
        if (job_pk, attempt) in self._judged:
            return False
        if any(w.job_pk == job_pk and w.attempt == attempt for w, _, _ in self.closing):
            return False
        done = report_rows.has_verdict(self.store, job_pk, attempt)
        if done:
            self._judged.add((job_pk, attempt))
        return not done

    def _finish(self, watch: AttemptWatch, now: float, job: Job | None = None) -> None:
        found = []
        for path in watch.paths:   # read in bounded pieces, a flood skipped to its end
            for _, _, run in _runs(self.tailer.flush_iter(path), {}, to=watch):
                found += self._feed(watch, path, run, now)
            found += watch.streams[path].flush()
        self._tail_notices({watch.key: watch})
        self._store(watch, found, now)
        self._checkpoint(watch, now)   # a checkpoint line in the attempt's last moments
        self.closing.append((watch, job, now + EPILOG_GRACE))
        self.watches.pop(watch.job_pk, None)
        for path in watch.paths:
            self._path_users[path] = self._path_users.get(path, 1) - 1
            if self._path_users[path] <= 0:
                del self._path_users[path]
                self.tailer.remove(path)

    def _close_attempts(self, now: float) -> None:
        """Give each ended attempt its verdict once its node evidence is in (see
        :meth:`_evidence_in`); then count the fatal XIDs of reports that came
        after their attempt's verdict."""
        waiting, failed = [], None
        for watch, job, deadline in self.closing:
            if self._evidence_in(watch, job, deadline, now) \
                    and self._last_look(watch, job, deadline, now):
                try:
                    self._verdict(watch, job, now)
                except STORE_ERRORS as exc:   # kept in memory, judged next cycle
                    self._defer(exc)
                    waiting.append((watch, job, deadline))
                except Exception as exc:  # noqa: BLE001 - kept, and judged next cycle
                    failed = failed or exc
                    waiting.append((watch, job, deadline))
                else:
                    self._sources_done(watch)
            else:
                waiting.append((watch, job, deadline))
        if len(waiting) > MAX_PENDING_VERDICTS:
            dropped, waiting = waiting[:-MAX_PENDING_VERDICTS], waiting[-MAX_PENDING_VERDICTS:]
            for watch, _, _ in dropped:
                self._sources_done(watch)
            health = self.store.health
            health["dropped_verdicts"] = health.get("dropped_verdicts", 0) + len(dropped)
            log.error("store unwritable for long: dropped %d pending verdict(s), oldest "
                      "first (jobs %s); nothing was done to them", len(dropped),
                      ", ".join(w.job_id for w, _, _ in dropped[:10]))
        self.closing = waiting
        self.store.health["pending_verdicts"] = len(waiting)
        try:
            self._count_late_evidence(now)
        except STORE_ERRORS as exc:   # counted next cycle
            self._defer(exc)
        if failed is not None:
            raise failed

    def _evidence_in(self, watch: AttemptWatch, job: Job | None, deadline: float,
                     now: float) -> bool:
        """Whether an ended attempt may be judged now: every node's epilog
        report is in; or the grace is over and no node worth waiting for
        (:meth:`_awaited`) is missing; or ``agent.node_report_wait`` has passed
        since the attempt ended. The timeline says what is waited for, and when
        the verdict goes ahead without it."""
        epilogs = report_rows.nodes_reporting(self.store, watch.job_pk, watch.attempt,
                                              "epilog")
        if set(watch.nodes) <= epilogs or len(epilogs) >= len(watch.nodes):
            return True
        if now < deadline:
            return False   # the grace: epilog reports normally come within it
        missing = self._awaited(watch, job, epilogs, now)
        if not missing:
            return True
        wait = self.cfg.agent.node_report_wait
        names = ", ".join(missing)
        if now >= deadline - EPILOG_GRACE + wait:
            self._note_once(watch, "node_report_missing",
                            f"deciding without the epilog report of {names}: none came "
                            f"within {wait:.0f}s of the job's end (agent.node_report_wait)",
                            missing)
            return True
        self._note_once(watch, "node_report_wait",
                        f"waiting up to {wait:.0f}s after the job's end for the epilog "
                        f"report of {names}: its prolog reported, so a report it had to "
                        "spool comes when the node replays its spool", missing)
        return False

    def _awaited(self, watch: AttemptWatch, job: Job | None, epilogs: set[str],
                 now: float) -> tuple[str, ...]:
        """The attempt's nodes whose epilog report is worth waiting for: those
        that sent this attempt's prolog report (their hooks work) and not yet
        their epilog's. None when waiting cannot change what is done: the job
        is gone, requeued already, ended NODE_FAIL (Slurm blames its nodes) or
        in a state policy never acts on; or the node reports in already blame a
        node by a fatal XID."""
        if self.cfg.agent.node_report_wait <= EPILOG_GRACE or job is None \
                or job.restart_count != watch.attempt or job.state in NO_WAIT_STATES:
            return ()
        prologs = report_rows.nodes_reporting(self.store, watch.job_pk, watch.attempt,
                                              "prolog")
        missing = tuple(n for n in watch.nodes if n in prologs and n not in epilogs)
        if missing and self._node_blamed(watch, now):
            return ()
        return missing

    def _node_blamed(self, watch: AttemptWatch, now: float) -> bool:
        """Whether the hooks' reports already blame a node of the attempt by a
        root cause (a fatal XID that excludes the node)."""
        context = AttributionContext(nodes=tuple(watch.nodes),
                                     node_events=tuple(self._node_events(watch, now)))
        return any(d.host and d.role == "root" and d.action_hint == "requeue_exclude"
                   for d in all_detections([], context))

    def _note_once(self, watch: AttemptWatch, kind: str, message: str,
                   nodes: tuple[str, ...]) -> None:
        """One timeline line (and log line) per attempt and kind."""
        try:
            with self.store.transaction():
                if report_rows.has_event(self.store, watch.job_pk, watch.attempt, kind):
                    return
                self.store.add_event(watch.job_pk, kind, message, attempt=watch.attempt,
                                     source="watch", data={"nodes": list(nodes)})
        except STORE_ERRORS as exc:   # the wait goes on; the line is tried again
            self._defer(exc)
            return
        log.info("job=%s attempt=%s %s", watch.job_id, watch.attempt, message)

    def _count_late_evidence(self, now: float) -> None:
        """Reports stored after their attempt's verdict: fatal XIDs they carry
        from inside the attempt count against their node, once (a strike in its
        lemon score, with a decider: drains and exclusions follow from strikes
        by policy), and go on the timeline. The verdict itself stands."""
        for row in report_rows.uncounted_after_verdict(self.store):
            fatal = self._late_fatal(row)
            with self.store.transaction():
                if fatal:
                    self._late_strike(row, fatal)
                report_rows.mark_counted(self.store, row["id"], now)

    def _late_fatal(self, row: dict) -> list[int]:
        """The fatal XIDs of a stored report logged during its attempt."""
        started = report_rows.attempt_start(self.store, row["job"], row["attempt"])
        found = []
        for x in report_rows.report_xids(self.store, row["id"]):
            if not kmsg.is_fatal({k: x[k] for k in ("xid", "kind", "message")}):
                continue
            if started and x["time"] and x["time"] < started - XID_SLACK:
                continue   # older than the attempt: not this job's fault
            if x["xid"] not in found:
                found.append(x["xid"])
        return found

    def _late_strike(self, row: dict, fatal: list[int]) -> None:
        node, job_pk, attempt = row["node"], row["job"], row["attempt"]
        job = self.store.job(job_pk) or {}
        xids = ", ".join(map(str, fatal))
        if node in report_rows.verdict_nodes(self.store, job_pk, attempt):
            counted = f"the verdict blamed {node} already"
        elif self.decider is not None:
            self.store.add_strike(node, "gpu_hardware", STRIKE_WEIGHTS["gpu_hardware"],
                                  job_pk, job.get("user") or "", witnessed=True)
            counted = f"counted against {node} (a gpu_hardware strike)"
        else:
            counted = "recorded"
        message = (f"fatal XID {xids} in {node}'s {row['hook']} report, which came after "
                   f"this attempt's verdict: {counted}; the verdict stands")
        self.store.add_event(job_pk, "late_evidence", message, attempt=attempt,
                             source="watch", data={"node": node, "xids": fatal,
                                                   "report": row["report_id"]})
        log.warning("job=%s attempt=%s %s", job.get("job_id"), attempt, message)

    def _last_look(self, watch: AttemptWatch, job: Job | None, deadline: float,
                   now: float) -> bool:
        """The sources' view of an ended attempt's last moments, stored before
        its verdict; False while they may not hold them yet (bounded: see
        :meth:`SourceFeed.settled`)."""
        if self.sources is None:
            return True
        ended = (float(job.end_time) if job is not None and job.is_finished and job.end_time
                 else deadline - EPILOG_GRACE)
        found = self.sources.last_look(watch, ended, now)
        if found is None:
            return False
        self._store(watch, found, now)
        self.sources.save()
        self.store.health["sources"] = self.sources.counters()
        return True

    def _sources_done(self, watch: AttemptWatch) -> None:
        if self.sources is not None:
            self.sources.done(watch, any(w.job_id == watch.job_id
                                         for w in self.watches.values()))

    def _verdict(self, watch: AttemptWatch, job: Job | None, now: float) -> None:
        """Who is to blame for how this attempt ended, recorded on the timeline,
        and (with a decider) what to do about it, in the same transaction."""
        if watch.unstored:
            self._store(watch, [], now)
            if watch.unstored:   # still refused: the verdict waits with them
                raise self._deferred or StoreError("store refused detections")
        node_fail = tuple(watch.nodes) if job is not None and job.state == "NODE_FAIL" else ()
        context = watch.layout.context(nodes=tuple(watch.nodes),
                                       node_events=tuple(self._node_events(watch, now)),
                                       node_fail=node_fail, addresses=self._addresses(now))
        verdict = attribute(watch.found, context)
        consulted = None
        if self.provider is not None:
            consulted = self.provider.consult(watch.job_id, watch.attempt, watch.nodes,
                                              job.state if job else None,
                                              all_detections(watch.found, context), verdict)
            verdict = consulted.verdict
        verdict = confined(verdict, watch.nodes)   # as the decision will see it
        data = {"blame": verdict.blame, "category": verdict.category,
                "action": verdict.action, "nodes": list(verdict.nodes),
                "gpus": list(verdict.gpus), "confidence": verdict.confidence,
                "reason": verdict.reason, "state": job.state if job else None}
        if consulted is not None:
            data["provider"] = {"name": consulted.provider, "outcome": consulted.outcome}
        event = {"kind": "verdict",
                 "message": f"{verdict.blame}: {verdict.category or 'no failure'} -> "
                            f"{verdict.action}"
                            + (f" ({', '.join(verdict.nodes)})" if verdict.nodes else ""),
                 "attempt": watch.attempt, "source": "attribution", "data": data}
        log.info("job=%s attempt=%s verdict blame=%s action=%s nodes=%s", watch.job_id,
                 watch.attempt, verdict.blame, verdict.action, ",".join(verdict.nodes))
        # decide only while Slurm still shows this attempt: one requeued by
        # someone else (or gone) is recorded, not acted on
        if self.decider is not None and job is not None and job.restart_count == watch.attempt:
            self._decide(watch, job, verdict, "ended", all_detections(watch.found, context),
                         event)
        else:
            with self.store.lock:
                self.store.add_event(watch.job_pk, **event)
        self._judged.add((watch.job_pk, watch.attempt))   # recorded: never judged again

    def _decide(self, watch: AttemptWatch, job: Job | None, verdict: Verdict, trigger: str,
                detections: list[Detection], event: dict | None = None) -> None:
        seen = list(watch.found_at) + [None] * (len(detections) - len(watch.found_at))
        try:
            self.decider.decide_attempt(watch.job_pk, watch.attempt, watch.spec, verdict,
                                        trigger=trigger, job=job, nodes=tuple(watch.nodes),
                                        detections=detections, seen_at=seen,
                                        started=watch.started, verdict_event=event)
        except STORE_ERRORS:
            if trigger == "ended":
                raise    # the ended attempt stays pending in self.closing
            # a hang or straggler decision waits in memory for the store
            self._pending_decisions[(watch.job_pk, watch.attempt)] = (verdict, trigger,
                                                                      detections)
            raise
        except RecoveryError as exc:
            log.error("job=%s attempt=%s no decision: %s", watch.job_id, watch.attempt, exc)
            if event:
                with self.store.lock:
                    self.store.add_event(watch.job_pk, **event)

    def _addresses(self, now: float) -> dict[str, str]:
        """Address -> node from Slurm's node records (``NodeAddr``,
        ``NodeHostname``), so that an NCCL peer's IP address or a node's FQDN
        in a log names the node. Listed when a verdict needs it, at most every
        ``NODE_MAP_TTL`` seconds; while the listing fails the last map stays
        (addresses seldom change, and a name outside the job's nodes counts
        for nothing whatever it maps to)."""
        listed_at, known = self._node_map
        if now - listed_at < NODE_MAP_TTL:
            return known
        try:
            nodes = self.scheduler.list_nodes()
        except SchedulerError as exc:
            log.warning("cannot list nodes for their addresses: %s", exc)
            self._node_map = (now, known)
            return known
        known = node_addresses((n.name, n.address, n.hostname) for n in nodes)
        self._node_map = (now, known)
        return known

    def _node_events(self, watch: AttemptWatch, now: float) -> list[Detection]:
        """Fatal XIDs the node hooks reported for this attempt."""
        events = []
        rows = self.store.attempt_xids(watch.job_pk, watch.attempt)
        for row in rows:
            event = {"xid": row["xid"], "kind": row["kind"], "message": row["message"]}
            if not kmsg.is_fatal(event):
                continue
            if row["time"] and row["time"] < watch.started - XID_SLACK:
                continue   # logged before this attempt began (an old fault, preflight's job)
            events.append(Detection(
                rule=f"node.{row['kind']}", category="gpu_hardware", severity="critical",
                host=row["node"], pci=row["pci"], xid=row["xid"], origin="system",
                emitter="system",
                gpu=str(row["gpu_index"]) if row["gpu_index"] is not None else None,
                evidence=(Evidence(row["raw"], f"hook:{row['node']}", None, row["time"]),)))
        return events

    def _end(self, job_pk: int, state: str) -> None:
        watch = self.watches.get(job_pk)
        if watch:
            self._finish(watch, self.clock())
        self.store.set_job_state(job_pk, state)

    # -- lines and detectors -------------------------------------------------
    def report_lines(self, job_pk: int, attempt: int, report: dict) -> None:
        """Ingest hands over a node report carrying log lines (any thread)."""
        with self._report_lock:
            self._report_lines.append((job_pk, attempt, report))

    def _lines(self) -> Iterator[LogLine]:
        """New lines from the followed files, yielded as they are read (a flood
        is never held whole, and the work on it counts against the tailer's time
        budget), then those that came in reports."""
        yield from self.tailer.poll_iter()
        with self._report_lock:
            queued, self._report_lines = self._report_lines, []
        for job_pk, attempt, report in queued:
            watch = self.watches.get(job_pk)
            if watch is not None and watch.attempt == attempt:
                yield from lines_from_report(report, key=watch.key)

    def _scan(self, now: float) -> list[Detection]:
        by_key = {w.key: w for w in self.watches.values()}
        pending: dict[str, list[Detection]] = {}
        for watch, path, run in _runs(self._lines(), by_key):
            pending.setdefault(watch.key, []).extend(self._feed(watch, path, run, now))
        self._tail_notices(by_key, others="drop")
        stored = []
        for key, found in pending.items():
            self._store(by_key[key], found, now)
            stored += found
        return stored

    def _feed(self, watch: AttemptWatch, path: str, run: list[LogLine],
              now: float) -> list[Detection]:
        """A run of consecutive lines of one file: line by line to the hang
        (when on), straggler and checkpoint detectors, as one block to the
        scanner (same detections as line by line, at a fraction of the cost)."""
        straggler, ckpt = watch.straggler, watch.ckpt
        hang = watch.hang if watch.hang.enabled else None   # off: nothing to feed it
        layout = watch.layout
        for line in run:
            if hang is not None:
                hang.feed(now, line.text, path, line.lineno)
            straggler.feed(now, line.text)
            ckpt.feed(now, line.text)
            layout.feed(line.text)
        stream = watch.streams.get(path) or watch.streams.setdefault(
            path, self.scanner.stream(path, origin="job"))
        stream.lineno = run[0].lineno - 1
        return stream.scan_block("\n".join([line.text for line in run])
                                 .encode("utf-8", "surrogatepass"))

    def _tail_notices(self, by_key: dict[str, AttemptWatch], others: str = "keep") -> None:
        """What the tailer has to say about these watches' output (a path it
        will not read, a flood it skipped) onto their timelines, once each.
        Notices of other watches are kept for their turn, or dropped (``others
        = "drop"``: their watch is over). The bytes skipped go to /metrics."""
        self.store.health["log_bytes_skipped"] = self.tailer.skipped_bytes
        notices = self.tailer.notices
        waiting = []
        for i, notice in enumerate(notices):
            watch = by_key.get(notice.key)
            if watch is None:
                if others == "keep":
                    waiting.append(notice)
                continue
            refused = notice.kind == "not_followed"
            data = {"path": notice.path}
            if notice.skipped:
                data["skipped_bytes"] = notice.skipped
            try:
                with self.store.lock:
                    self.store.add_event(
                        watch.job_pk, "output_not_followed" if refused else "output_skipped",
                        (f"output not followed: {notice.message}" if refused
                         else notice.message)[:1000],
                        attempt=watch.attempt, source="tailer", data=data)
            except STORE_ERRORS as exc:
                self._defer(exc)
                waiting += notices[i:]    # written next cycle
                break
            if refused:
                log.warning("job=%s attempt=%s output not followed: %s", watch.job_id,
                            watch.attempt, notice.message)
        notices[:] = waiting

    def _defer(self, exc: Exception) -> None:
        """Remember the first store failure of this cycle; the cycle goes on
        (in memory) and reports it at the end, so /healthz turns red."""
        if self._deferred is None:
            self._deferred = exc if isinstance(exc, StoreError) else StoreError(
                f"store write failed: {exc}")

    def _retry_decisions(self, listing: dict[str, Job]) -> None:
        """Hang and straggler decisions the store refused, tried again while
        their attempt still runs (once it ends, its own verdict decides)."""
        for key, (verdict, trigger, detections) in list(self._pending_decisions.items()):
            watch = self.watches.get(key[0])
            job = listing.get(watch.job_id) if watch is not None else None
            if watch is None or watch.attempt != key[1] or job is None \
                    or job.state != "RUNNING" or job.restart_count != key[1]:
                del self._pending_decisions[key]
                continue
            try:
                self._decide(watch, job, verdict, trigger, detections)
            except STORE_ERRORS as exc:
                self._defer(exc)
                return
            self._pending_decisions.pop(key, None)

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
            hosts = tuple(d.host for d in slow if d.host)
            verdict = Verdict(blame="node" if hosts else "unknown", category="straggler",
                              action="kill_requeue", confidence=0.6, nodes=hosts,
                              rests_on=tuple(range(len(watch.found) - len(slow),
                                                   len(watch.found))),
                              reason=slow[0].detail)
            self._decide(watch, job, verdict, "straggler", list(watch.found))

    def _checkpoint(self, watch: AttemptWatch, now: float) -> None:
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
                                         source=newest.source)
            except STORE_ERRORS as exc:
                self._defer(exc)   # written next time round
                return
            watch.saved_ckpt = newest

    def _store(self, watch: AttemptWatch, found: list[Detection], now: float) -> None:
        """Record detections (and any an unwritable store refused before). The
        attempt's memory has them either way; the store gets them in order."""
        watch.found.extend(found)
        watch.found_at.extend([now] * len(found))
        for det in found:
            log.info("job=%s attempt=%s detected=%s category=%s host=%s", watch.job_id,
                     watch.attempt, det.rule, det.category, det.host)
        todo = watch.unstored + [(det, now) for det in found]
        if not todo:
            return
        try:
            with self.store.transaction():
                for det, ts in todo:
                    self.store.record_detection(watch.job_pk, watch.attempt, det, ts=ts)
                    self.store.add_event(watch.job_pk, "detected",
                                         f"{det.rule} ({det.category})"
                                         + (f" on {det.host}" if det.host else ""),
                                         attempt=watch.attempt, source="watch")
        except STORE_ERRORS as exc:
            watch.unstored = todo
            self._defer(exc)
            return
        watch.unstored = []

    # -- running it --------------------------------------------------------
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
            return False
        if health.get("error"):
            log.info("watch cycle healthy again after: %s", health["error"])
        health.update(error=None, ok_at=self.clock())
        return True

    def run_forever(self, stop: threading.Event) -> None:
        interval = self.cfg.agent.poll_interval
        while not stop.is_set():
            started = time.monotonic()
            self.run_once()
            stop.wait(max(0.0, interval - (time.monotonic() - started)))
        self.tailer.close()


RUN_LINES = 2000   # lines handed to the scanner at once, at most


def _runs(lines: Iterable[LogLine], by_key: dict[str, AttemptWatch],
          to: AttemptWatch | None = None
          ) -> Iterator[tuple[AttemptWatch, str, list[LogLine]]]:
    """``lines`` cut into runs of consecutive lines of one file of one watch:
    the watch of their key in ``by_key`` (lines of other keys are dropped), or
    ``to`` for every line."""
    run: list[LogLine] = []
    watch = None
    for line in lines:
        if run and (line.key != run[-1].key or line.path != run[-1].path
                    or line.lineno != run[-1].lineno + 1 or len(run) >= RUN_LINES):
            yield watch, run[0].path, run
            run = []
        if not run:
            watch = to or by_key.get(line.key)
            if watch is None:
                continue
        run.append(line)
    if run:
        yield watch, run[0].path, run


def _parse(text: str) -> specs.RecoverySpec:
    try:
        return specs.parse(text)
    except specs.SpecError:
        return specs.RecoverySpec(mode="monitor")
