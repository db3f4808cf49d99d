"""Reading a log store forward per job: cursors that survive restarts, the
lines a poll gives, paging by timestamp with de-duplication at the page
boundary, and :class:`LogSource`, the base class of the log sources; plus
:class:`Probe`, what any source shows the ingestion check.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from .base import SourceError
from .http import Endpoint, Health, HttpClient
from .query import to_ns

log = logging.getLogger(__name__)


# -- cursors --------------------------------------------------------------------------

CURSOR_VERSION = 1


class CursorStore:
    """Small JSON state per source, keyed by job, saved atomically.

    ``directory`` None keeps it in memory only. A corrupt or foreign file is
    logged and replaced, never fatal: the worst case is reading a window twice.
    """

    def __init__(self, directory: str | Path | None, name: str) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ValueError(f"cursor name {name!r}")
        self.path = Path(directory) / f"{name}.json" if directory else None
        self.data: dict[str, dict] = {}
        self.dirty = False
        self._load()

    def _load(self) -> None:
        if self.path is None or not self.path.exists():
            return
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
            if raw.get("version") != CURSOR_VERSION or not isinstance(raw.get("cursors"), dict):
                raise ValueError("unknown layout")
            self.data = {str(k): v for k, v in raw["cursors"].items() if isinstance(v, dict)}
        except (OSError, ValueError, AttributeError) as exc:
            log.warning("cursor file %s unreadable (%s); starting afresh", self.path, exc)
            self.data = {}

    def get(self, key: str) -> dict | None:
        return self.data.get(key)

    def put(self, key: str, value: dict) -> None:
        if self.data.get(key) != value:
            self.data[key] = value
            self.dirty = True

    def forget(self, key: str) -> None:
        if self.data.pop(key, None) is not None:
            self.dirty = True

    def keys(self) -> list[str]:
        return list(self.data)

    def save(self) -> None:
        """Write the file if anything changed: temp file, fsync, rename."""
        if self.path is None or not self.dirty:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"version": CURSOR_VERSION, "cursors": self.data},
                          sort_keys=True, separators=(",", ":"))
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.dirty = False


# -- what log sources return ----------------------------------------------------------

@dataclass(frozen=True)
class LogLine:
    """One log line from a store: what the scanner needs, and where it was seen.

    ``stream`` identifies the log stream (labels): feed each stream to its own
    scanner stream so multi-line tracebacks are not mixed across nodes.
    """

    source: str
    text: str
    time: float
    host: str | None = None
    stream: str = ""
    ns: int = 0
    feed: str = ""      # "job": the job's own output (user-written); "nodes": node logs


@dataclass
class PollResult:
    """Lines from one poll of one source for one job, and how it went.

    ``more``: the page budget ran out; the cursor sits after the last line
    delivered, so the next poll goes on from there. ``truncated``: lines were
    skipped (more than a page at a single instant). ``error`` is set, and
    ``lines`` may be partial, when the source failed; the cursor then stays
    after the last complete page.
    """

    source: str
    job_id: str
    lines: list[LogLine] = field(default_factory=list)
    error: str | None = None
    error_kind: str | None = None
    warnings: list[str] = field(default_factory=list)
    more: bool = False
    truncated: bool = False
    pages: int = 0


def line_digest(*parts: str) -> str:
    """A short stable digest of a line and its stream, for de-duplication."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()


# -- what every log source does per poll ------------------------------------------------

@dataclass
class FeedRead:
    """What reading one feed (one query) from its cursor gave."""

    lines: list[LogLine]
    cursor: dict
    pages: int = 0
    more: bool = False
    truncated: bool = False
    warnings: list[str] = field(default_factory=list)


def page_forward(fetch: Callable[[int, int, int], list], cursor: dict, end_ns: int,
                 limit: int, max_pages: int) -> tuple[list, FeedRead]:
    """Read forward from ``cursor`` to ``end_ns`` a page at a time.

    ``fetch(start, end, limit)`` returns the oldest ``limit`` entries (objects
    with ``ns`` and ``digest``) in [start, end), sorted by time. The next page
    starts at the last timestamp seen (inclusive), and the entries at that
    boundary already delivered are dropped by digest. A full page all at one
    instant, all delivered, is stepped past (``truncated``). The cursor is
    ``{"ns": start, "seen": [digests at start]}``.
    """
    start = int(cursor["ns"])
    seen = set(cursor.get("seen", ()))
    out: list = []
    read = FeedRead([], {})
    complete = False
    while read.pages < max_pages and start < end_ns:
        entries = fetch(start, end_ns, limit)
        read.pages += 1
        fresh = [e for e in entries if not (e.ns == start and e.digest in seen)]
        out.extend(fresh)
        if len(entries) < limit:
            start, seen, complete = end_ns, set(), True
            break
        last = entries[-1].ns
        at_last = {e.digest for e in entries if e.ns == last}
        if last != start:
            start, seen = last, at_last
        elif fresh:
            seen |= at_last
        else:
            read.truncated = True
            start, seen = last + 1, set()
    read.more = not complete and start < end_ns
    read.cursor = {"ns": start, "seen": sorted(seen)}
    return out, read


class LogSource:
    """Polling a log store per job: one or two feeds (the job's own streams,
    its nodes' streams), each with a cursor, behind a health tracker.

    Subclasses say what the feeds are (:meth:`feeds`) and how one feed is paged
    (:meth:`read_feed`). :meth:`poll` never raises.
    """

    kind = "logs"

    def __init__(self, endpoint: Endpoint, *, page_limit: int = 1000, max_pages: int = 20,
                 interval: float = 30.0, delay: float = 30.0,
                 cursors: CursorStore | None = None, name: str | None = None,
                 http: HttpClient | None = None) -> None:
        self.name = name or self.kind
        self.endpoint = endpoint
        self.page_limit = max(1, page_limit)
        self.max_pages = max(1, max_pages)
        self.interval = interval
        self.delay = delay
        self.http = http or HttpClient(endpoint)
        self.cursors = cursors or CursorStore(None, self.name)
        self.health = Health(self.name, base_delay=interval)
        self.source = f"{self.kind}:{endpoint.label}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.endpoint.label!r})"

    def feeds(self, job_id: str, nodes: Sequence[str]) -> list[tuple[str, Any]]:
        raise NotImplementedError

    def read_feed(self, query: Any, cursor: dict, end_ns: int) -> FeedRead:
        raise NotImplementedError

    def poll(self, job_id: str, nodes: Sequence[str], since: float,
             now: float | None = None) -> PollResult:
        """New candidate lines of a job (its streams and its nodes') since the
        last poll, oldest first. The first poll starts at ``since``. Lines
        younger than ``delay`` wait for the next poll (stores ingest late).
        Call :meth:`save` once the lines are consumed."""
        now = time.time() if now is None else now
        result = PollResult(self.name, job_id)
        if not self.health.allow(now):
            result.error, result.error_kind = self.health.skipped_reason(), "skipped"
            return result
        end_ns = to_ns(now - self.delay)
        failed = False
        for feed, query in self.feeds(job_id, nodes):
            key = f"{job_id}/{feed}"
            cursor = self.cursors.get(key) or {"ns": to_ns(since)}
            if cursor.get("ns", 0) >= end_ns:
                continue
            try:
                read = self.read_feed(query, cursor, end_ns)
            except SourceError as exc:
                self._failed(result, exc, now)
                failed = True
                break
            except Exception as exc:    # a bug must not end the watch loop
                log.exception("source %s: job=%s poll failed", self.name, job_id)
                self._failed(result, exc, now)
                failed = True
                break
            self.cursors.put(key, read.cursor)
            result.lines.extend(replace(line, feed=feed) for line in read.lines)
            result.pages += read.pages
            result.more |= read.more
            result.truncated |= read.truncated
            result.warnings.extend(read.warnings)
        if not failed:
            self.health.ok(now)
        result.lines.sort(key=lambda line: (line.ns, line.stream))
        if result.truncated:
            log.warning("source %s: job=%s more than %d lines at one instant; some skipped",
                        self.name, job_id, self.page_limit)
        return result

    def _failed(self, result: PollResult, exc: Exception, now: float) -> None:
        self.health.failed(exc, now)
        result.error = str(exc) if isinstance(exc, SourceError) else f"internal error: {exc!r}"
        result.error_kind = getattr(exc, "kind", "internal")

    def forget(self, job_id: str) -> None:
        """The job ended: drop its cursors."""
        for key in self.cursors.keys():
            if key.startswith(f"{job_id}/"):
                self.cursors.forget(key)

    def save(self) -> None:
        self.cursors.save()


@dataclass
class Probe:
    """What a source showed when asked about recent data (for the check).

    ``jobs_seen`` None: the source cannot tell jobs apart (metrics); the check
    then judges jobs by their nodes.
    """

    newest: float | None = None
    count: int = 0
    nodes_seen: set[str] = field(default_factory=set)
    jobs_seen: set[str] | None = None
    labels_missing: list[str] = field(default_factory=list)
    labels_present: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
