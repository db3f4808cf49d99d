"""The scheduler's view of jobs, for ingest, without making hooks wait on it.

Hook reports must be answered within the hooks' 0.5 s timeout, whatever
slurmctld is doing. So ingest only *peeks* at the last batched job listing;
a miss asks for a refresh in the background (at most one running, at most one
per ``min_interval``), and whoever registered ``on_refresh`` completes what it
stored without the scheduler's data (the submit time that finishes a job's key).

A cache that only refreshes on a miss goes stale while every peek hits: after
a slurmctld reset the last listing may still show the old job under an id
handed out again. The watch loop therefore offers each listing it takes
(:meth:`offer`), so what ingest peeks at is never older than one poll; the
newer of two listings wins, whichever thread took it.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from ..errors import RecoveryError
from ..scheduler.base import Job, Scheduler

log = logging.getLogger(__name__)


class JobCache:
    def __init__(self, scheduler: Scheduler, min_interval: float = 0.5) -> None:
        self.scheduler = scheduler
        self.min_interval = min_interval
        self.on_refresh: list[Callable[[dict[str, Job]], None]] = []
        self.queries = 0
        self._jobs: dict[str, Job] = {}
        self._loaded = 0.0     # when the listing held was asked for (monotonic)
        self._refreshed = 0.0  # when this cache last listed itself (the throttle)
        self._lock = threading.Lock()
        self._running: threading.Thread | None = None
        self._wanted = False  # a refresh asked for and not started yet

    def peek(self, job_id: str) -> Job | None:
        """The job as last listed, without any I/O."""
        return self._jobs.get(job_id)

    def refresh(self) -> None:
        """List every job now (one batched query) and tell the listeners."""
        asked = self._refreshed = time.monotonic()
        try:
            jobs = self.scheduler.list_jobs()
        except RecoveryError as exc:
            log.warning("job listing failed: %s", exc)
            return
        with self._lock:
            self.queries += 1
        index = self._keep(jobs, asked)
        if index is None:   # a newer listing came in meanwhile: the listeners get that
            with self._lock:
                index = self._jobs
        for listener in self.on_refresh:
            try:
                listener(index)
            except Exception:  # noqa: BLE001 - a listener's bug must not stop refreshes
                log.exception("job cache listener failed")

    def offer(self, jobs, asked: float) -> None:
        """Take a listing made elsewhere (the watch loop's, asked for at
        monotonic time ``asked``) unless the one held is newer."""
        self._keep(jobs, asked)

    def _keep(self, jobs, asked: float) -> dict[str, Job] | None:
        index: dict[str, Job] = {}
        for job in jobs:
            index[job.job_id] = job
            index.setdefault(str(job.numeric_id), job)
        with self._lock:
            if asked < self._loaded:
                return None
            self._jobs, self._loaded = index, asked
        return index

    def refresh_soon(self) -> None:
        """Ask for a background refresh. At most one runs at a time and at
        most one starts per ``min_interval``; a miss that comes while one
        runs, or inside the interval, is not dropped: one more refresh follows
        when the interval is over (the running listing may predate the job
        that missed, and nothing else would tell the listeners)."""
        with self._lock:
            self._wanted = True
            if self._running is not None and self._running.is_alive():
                return
            self._running = threading.Thread(target=self._serve, name="job-cache",
                                             daemon=True)
            self._running.start()

    @property
    def pending(self) -> bool:
        """A refresh was asked for and has not started yet."""
        with self._lock:
            return self._wanted

    def _serve(self) -> None:
        while True:
            with self._lock:
                if not self._wanted:
                    self._running = None
                    return
                # the throttle counts this cache's own refreshes only: an
                # offered listing does not run the listeners, a miss must
                # still bring them
                delay = self.min_interval - (time.monotonic() - self._refreshed)
                if delay <= 0:
                    self._wanted = False
            if delay > 0:
                time.sleep(delay)
                continue
            self.refresh()

    def wait(self, timeout: float = 10.0) -> None:
        """For tests: until the background refreshes (if any) are done, or
        ``timeout`` seconds."""
        thread = self._running
        if thread is not None:
            thread.join(timeout)
