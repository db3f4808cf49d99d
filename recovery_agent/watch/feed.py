"""The sources feed: the watch loop's side of the external sources
(:mod:`recovery_agent.inputs.sources`).

Each cycle the watcher hands over its running attempts and gets back
detections per attempt: the metrics source's own (XIDs, ECC, NVLink, a GPU
utilisation hang) as they are, and log-store lines run through the scanner,
one scan stream per (source, stream), so a traceback is never stitched
together from two nodes' lines.

An attempt that ended gets one last look before its verdict, once the
sources can hold its final moments: ``sources.ingest_delay`` plus one
``sources.prometheus_step`` after it ended. That is how an XID scraped after
the job died still reaches the verdict. A source that is down is not waited for.

Nothing here raises into the watch loop: the poller turns a failing source
into one log line and a counter, and a bug in this glue is logged and skipped.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from ..detect.model import Detection
from ..detect.scanner import Scanner, ScanStream
from ..inputs.sources import JobFindings, JobRef, LogLine, SourcePoller
from .attempt import AttemptWatch

log = logging.getLogger("recovery_agent.watch_sources")   # its name before the move


@dataclass
class _Attempt:
    """What the sources left with one attempt: its log scan streams (each
    with the last line fed to it) and whether it had its last look."""

    streams: dict[tuple[str, str], tuple[ScanStream, LogLine]] = field(default_factory=dict)
    looked: bool = False


class SourceFeed:
    """Polls the sources for the watcher and turns findings into detections."""

    def __init__(self, poller: SourcePoller, scanner: Scanner, settle: float) -> None:
        self.poller = poller
        self.scanner = scanner
        self.settle = settle
        self.glue_errors = 0
        self._attempts: dict[str, _Attempt] = {}    # by AttemptWatch.key

    # -- running attempts ------------------------------------------------------------
    def poll_running(self, watches: Sequence[AttemptWatch], now: float
                     ) -> dict[str, list[Detection]]:
        """New detections per attempt key (each source only when it is due)."""
        refs = [JobRef(w.job_id, tuple(w.nodes), since=w.started, hang=w.hang.hang)
                for w in watches]
        found = self._poll(refs, now, force=False)
        return {w.key: self._detections(w, found[w.job_id]) for w in watches
                if w.job_id in found}

    # -- ended attempts --------------------------------------------------------------
    def settled(self, ended: float, now: float) -> bool:
        """Can the sources hold an attempt's last moments yet? Also true once
        none of them is up (nothing would come by waiting)."""
        return now >= ended + self.settle or not any(
            s.health.up for s in self.poller.sources)

    def last_look(self, watch: AttemptWatch, ended: float, now: float
                  ) -> list[Detection] | None:
        """Detections from one final poll of an ended attempt (its scan streams
        flushed), or None while the sources may not have its end yet."""
        state = self._attempts.setdefault(watch.key, _Attempt())
        if state.looked:
            return []
        if not self.settled(ended, now):
            return None
        ref = JobRef(watch.job_id, tuple(watch.nodes), since=watch.started)
        found = self._poll([ref], now, force=True)
        out = self._detections(watch, found[watch.job_id]) if watch.job_id in found else []
        state.looked = True
        for stream, last in state.streams.values():
            try:
                out += [_placed(d, last) for d in stream.flush()]
            except Exception:  # noqa: BLE001
                self.glue_errors += 1
                log.exception("sources: job=%s flushing a log stream failed", watch.job_id)
        return out

    def done(self, watch: AttemptWatch, job_still_watched: bool) -> None:
        """The attempt is judged: drop its streams, and the job's cursors unless
        a newer attempt of the same job is being followed already."""
        self._attempts.pop(watch.key, None)
        if not job_still_watched:
            try:
                self.poller.forget(watch.job_id)
            except Exception:  # noqa: BLE001 - the watch loop must go on
                self.glue_errors += 1
                log.exception("sources: job=%s cannot forget its cursors", watch.job_id)

    # -- bookkeeping -----------------------------------------------------------------
    def save(self) -> None:
        """Write the sources' cursors (a failed write is logged by the poller)."""
        try:
            self.poller.save()
        except Exception:  # noqa: BLE001
            self.glue_errors += 1
            log.exception("sources: saving cursors failed")

    def counters(self) -> dict[str, dict[str, Any]]:
        """Per source: up, errors by kind (for /metrics)."""
        return self.poller.counters()

    # -- inside ----------------------------------------------------------------------
    def _poll(self, refs: list[JobRef], now: float, force: bool) -> dict[str, JobFindings]:
        if not refs:
            return {}
        try:
            return self.poller.poll(refs, now, force=force)
        except Exception:  # noqa: BLE001 - the poller should not raise; if it does, skip
            self.glue_errors += 1
            log.exception("sources: poll failed; this cycle goes on without them")
            return {}

    def _detections(self, watch: AttemptWatch, found: JobFindings) -> list[Detection]:
        # metrics are the nodes' own (DCGM, NVML exporters): node-level evidence
        out = [replace(d, origin="system") for d in found.detections]
        if not found.lines:
            return out
        state = self._attempts.setdefault(watch.key, _Attempt())
        try:
            for line in found.lines:
                key = (line.source, line.stream)
                entry = state.streams.get(key)
                stream = entry[0] if entry else self.scanner.stream(
                    f"{line.source} {line.stream}".strip(),
                    origin="job" if line.feed == "job" else "system")
                state.streams[key] = (stream, line)
                out += [_placed(d, line) for d in stream.feed(line.text)]
        except Exception:  # noqa: BLE001 - the rest of the cycle must go on
            self.glue_errors += 1
            log.exception("sources: job=%s scanning log-store lines failed", watch.job_id)
        return out


def _placed(det: Detection, line: LogLine) -> Detection:
    """A detection from a log-store line, with the line's host and time. Line
    numbers are dropped: they would count prefiltered lines, not the source's."""
    evidence = tuple(replace(e, line=None, time=e.time if e.time is not None else line.time)
                     for e in det.evidence)
    return replace(det, host=det.host or line.host, evidence=evidence)
