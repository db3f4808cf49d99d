"""One attempt's watch and its lines: what is followed for an attempt (its
stdout/stderr, the log lines node reports carry), how new lines reach its
detectors and the scanner, and the store of what was found.

Detections the store refuses wait with their attempt (``AttemptWatch.unstored``)
and go in first, in order, when it takes writes again.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from slurm_hooks import spec as specs

from ..detect.checkpoint import CheckpointWatcher
from ..detect.context import LayoutLines
from ..detect.model import Detection
from ..detect.progress import HangDetector, StragglerDetector
from ..detect.steps import StepCounter
from ..inputs.logline import LogLine
from ..inputs.reportlines import lines_from_report
from ..inputs.userfs import Rights
from ..scheduler.base import Job
from ..store import STORE_ERRORS

log = logging.getLogger("recovery_agent.watch")   # one logger for the loop, as before its split


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
    steps: StepCounter = field(default_factory=StepCounter)   # the last step the log reported
    saved_step: tuple | None = None   # (step, time) last written to the store
    step_saved_at: float = 0.0
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
    # which run of the attempt: Slurm's start time (slurmctld may run an attempt
    # again at the same restart count), and the earlier runs of it already judged
    run_start: int | None = None
    earlier_runs: tuple[int, ...] = ()

    @property
    def key(self) -> str:
        return f"{self.job_pk}:{self.attempt}"


class AttemptLines:
    """The watcher's part that follows attempts' output (a part of
    :class:`~recovery_agent.watch.Watcher`, whose state it shares: ``watches``,
    the tailer and scanner, the store): start and finish an attempt's watch,
    read new lines, feed them to the detectors and the scanner, store what they
    found, and put the tailer's notices on the timelines."""

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
        if watch.earlier_runs:
            self._ran_again(watch, now)
        log.info("job=%s attempt=%s watching %s", job.job_id, job.restart_count,
                 ", ".join(sorted(watch.paths)))

    def _ran_again(self, watch: AttemptWatch, now: float) -> None:
        """The attempt runs again at the same restart count (slurmctld put it
        back in the queue itself): on the timeline, and the earlier runs'
        decisions see the job running again."""
        with self.store.lock:
            self.store.mark_running_again(watch.job_pk, watch.attempt, watch.started,
                                          before_run=watch.run_start)
            self.store.add_event(watch.job_pk, "ran_again",
                                 f"attempt {watch.attempt} runs again at the same restart "
                                 f"count (Slurm start time {watch.run_start}); this run gets "
                                 "a verdict of its own", attempt=watch.attempt,
                                 source="poller",
                                 data={"run_start": watch.run_start,
                                       "earlier_runs": list(watch.earlier_runs)})
        log.warning("job=%s attempt=%s runs again at the same restart count", watch.job_id,
                    watch.attempt)

    def _new_watch(self, row: dict, job: Job, now: float) -> AttemptWatch:
        """An attempt's detectors, following no file yet."""
        spec = _parse(row["spec"])
        env = self.cfg.environment(spec.env)
        started = float(job.start_time or now)
        run = job.run_start
        return AttemptWatch(row["id"], job.job_id, job.restart_count, spec, started, set(),
                            HangDetector.for_attempt(spec, env, started),
                            StragglerDetector.for_environment(env, nodes=job.nodes),
                            nodes=job.nodes, rights=Rights.of_job(job), run_start=run,
                            earlier_runs=self._judged_runs(row["id"], job.restart_count, run))

    def _finish(self, watch: AttemptWatch, now: float, job: Job | None = None) -> None:
        found = []
        for path in watch.paths:   # read in bounded pieces, a flood skipped to its end
            for _, _, run in _runs(self.tailer.flush_iter(path), {}, to=watch):
                found += self._feed(watch, path, run, now)
            found += watch.streams[path].flush()
        self._tail_notices({watch.key: watch})
        self._store(watch, found, now)
        # a checkpoint line in the attempt's last moments, and its last step
        self._checkpoint(watch, now, final=True)
        self._await_verdict(watch, job, now)
        self.watches.pop(watch.job_pk, None)
        for path in watch.paths:
            self._path_users[path] = self._path_users.get(path, 1) - 1
            if self._path_users[path] <= 0:
                del self._path_users[path]
                self.tailer.remove(path)

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
        straggler, ckpt, steps = watch.straggler, watch.ckpt, watch.steps
        hang = watch.hang if watch.hang.enabled else None   # off: nothing to feed it
        layout = watch.layout
        at = now
        if hang is not None and self.mtime_stamps:
            # the hang's clock: when the lines were written (the file's mtime,
            # no later than any of them), not when this poll read them, so a
            # silence is measured from the last output and found on time
            written = self.tailer.written(path)
            at = written if written is not None and written <= now else now
        for line in run:
            if hang is not None:
                hang.feed(at, line.text, path, line.lineno)
            straggler.feed(now, line.text)
            ckpt.feed(now, line.text, watch.started)
            steps.feed(now, line.text, watch.started)
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
                    pk = self.store.record_detection(watch.job_pk, watch.attempt, det, ts=ts)
                    self.store.add_event(watch.job_pk, "detected",
                                         f"{det.rule} ({det.category})"
                                         + (f" on {det.host}" if det.host else ""),
                                         attempt=watch.attempt, source="watch", detection=pk)
        except STORE_ERRORS as exc:
            watch.unstored = todo
            self._defer(exc)
            return
        watch.unstored = []


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
