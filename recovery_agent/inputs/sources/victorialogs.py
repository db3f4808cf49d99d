"""Candidate log lines from VictoriaLogs (LogsQL over ``/select/logsql/query``).

Two feeds per job, as for Loki: the job's own entries
(``"<job field>":in("1234")``) and its nodes' (``"<host field>":in("n1","n2")``),
each narrowed by the pattern prefilter as a regexp filter (``~"..."``) so the
store does the filtering.

The answer is JSON lines (``_msg``, ``_time``, ``_stream``, ...). Paging
walks the half-open time window ``_time:[cursor, end)`` forward: each page asks
for the oldest N entries (``| sort by (_time) limit N``, which keeps only N in
the server's memory; the ``limit`` argument would give the newest); the next page starts
at the last timestamp seen, and entries at that boundary already delivered are
dropped by digest, as for Loki. The cursor is that timestamp and those digests.

Tested against recorded answers in the documented API shape, not a live server.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .base import SourceResponseError
from .feed import FeedRead, LogLine, LogSource, Probe, line_digest, page_forward
from .http import Endpoint
from .query import format_rfc3339_ns, parse_rfc3339_ns, quote, to_ns

QUERY = "/select/logsql/query"


@dataclass(frozen=True)
class VictoriaLogsFields:
    """Which fields hold the Slurm job id and the node name (empty disables
    that feed); ``filter``: extra LogsQL filters for every query."""

    job: str = "slurm_job_id"
    host: str = "host"
    filter: str = ""


@dataclass(frozen=True)
class _Entry:
    ns: int
    text: str
    fields: Mapping[str, Any]
    stream: str
    digest: str


class VictoriaLogsSource(LogSource):
    kind = "victorialogs"

    def __init__(self, endpoint: Endpoint, fields: VictoriaLogsFields = VictoriaLogsFields(),
                 *, prefilter: str | None = None, **kw: Any) -> None:
        super().__init__(endpoint, **kw)
        self.fields = fields
        self.prefilter = prefilter

    # -- queries ---------------------------------------------------------------------
    def feeds(self, job_id: str, nodes: Sequence[str]) -> list[tuple[str, str]]:
        out = []
        if self.fields.job and job_id:
            out.append(("job", _in(self.fields.job, [str(job_id)])))
        if self.fields.host and nodes:
            out.append(("nodes", _in(self.fields.host, nodes)))
        return out

    def query(self, selector: str, start_ns: int, end_ns: int, limit: int | None = None) -> str:
        """A LogsQL query: the time window [start, end), the feed's selector, the
        extra filter, the prefilter; then only the fields we read, oldest first."""
        parts = [f"_time:[{format_rfc3339_ns(start_ns)}, {format_rfc3339_ns(end_ns)})",
                 selector]
        if self.fields.filter:
            parts.append(f"({self.fields.filter})")
        if self.prefilter:
            parts.append(f"~{quote(self.prefilter)}")
        keep = ["_time", "_msg", "_stream"] + [quote(f) for f in (self.fields.host,
                                                                  self.fields.job) if f]
        text = " ".join(p for p in parts if p) + " | fields " + ", ".join(keep)
        return text + (f" | sort by (_time) limit {limit}" if limit else "")

    # -- paging ----------------------------------------------------------------------
    def read_feed(self, selector: str, cursor: dict, end_ns: int) -> FeedRead:
        def fetch(start: int, end: int, limit: int) -> list[_Entry]:
            return self.page(self.query(selector, start, end, limit))
        entries, read = page_forward(fetch, cursor, end_ns, self.page_limit, self.max_pages)
        read.lines = [self._line(e) for e in entries]
        return read

    def page(self, query: str) -> list[_Entry]:
        """One answer of /select/logsql/query as entries sorted by time."""
        body = self.http.fetch(QUERY, {"query": query})
        entries = parse_lines(body)
        entries.sort(key=lambda e: (e.ns, e.stream, e.text))
        return entries

    def _line(self, e: _Entry) -> LogLine:
        host = e.fields.get(self.fields.host) if self.fields.host else None
        if not host and self.fields.host:
            host = _stream_label(e.stream, self.fields.host)
        return LogLine(self.source, e.text, e.ns / 1e9, str(host) if host else None,
                       e.stream, e.ns)

    # -- the ingestion check -----------------------------------------------------------
    def probe(self, nodes: Sequence[str], jobs: Mapping[str, Sequence[str]], now: float,
              recent: float) -> Probe:
        """The newest entry, whether the job and host fields exist, and which
        nodes and jobs have entries, over the last ``recent`` seconds."""
        start, end = to_ns(now - recent), to_ns(now) + 1
        window = f"_time:[{format_rfc3339_ns(start)}, {format_rfc3339_ns(end)})"
        extra = f" ({self.fields.filter})" if self.fields.filter else ""
        probe = Probe(jobs_seen=set())
        newest = self._raw(window + extra, 1)
        probe.count = len(newest)
        probe.newest = max((parse_rfc3339_ns(e["_time"]) / 1e9 for e in newest), default=None)
        probe.labels_present = sorted({k for e in newest for k in e})
        for name in (f for f in (self.fields.job, self.fields.host) if f):
            if probe.count and not self._raw(f"{window}{extra} {quote(name)}:*", 1):
                probe.labels_missing.append(name)
        if self.fields.host and nodes and self.fields.host not in probe.labels_missing:
            probe.nodes_seen = self._values(window + extra, self.fields.host, nodes)
        if self.fields.job and jobs and self.fields.job not in probe.labels_missing:
            probe.jobs_seen = self._values(window + extra, self.fields.job, list(jobs))
        return probe

    def _values(self, base: str, name: str, wanted: Sequence[str]) -> set[str]:
        query = f"{base} {_in(name, wanted)} | stats by ({quote(name)}) count() hits"
        return {str(row.get(name)) for row in self._raw(query, None)} & set(wanted)

    def _raw(self, query: str, limit: int | None) -> list[dict]:
        params = {"query": query} | ({"limit": str(limit)} if limit else {})
        return _json_lines(self.http.fetch(QUERY, params))


def _in(name: str, values: Sequence[str]) -> str:
    return f"{quote(name)}:in({','.join(quote(v) for v in sorted(set(values)))})"


def _json_lines(body: bytes) -> list[dict]:
    rows = []
    for number, raw in enumerate(body.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except ValueError:
            raise SourceResponseError(f"{QUERY}: line {number} of the answer is not JSON "
                                      f"(cut off?): {raw[:80]!r}") from None
        if not isinstance(row, dict):
            raise SourceResponseError(f"{QUERY}: line {number} is not a JSON object")
        rows.append(row)
    return rows


def parse_lines(body: bytes) -> list[_Entry]:
    """Entries from a JSON-lines answer; SourceResponseError on a line that is
    not a JSON object with an RFC 3339 ``_time``."""
    out = []
    for row in _json_lines(body):
        try:
            ns = parse_rfc3339_ns(str(row["_time"]))
        except (KeyError, ValueError):
            raise SourceResponseError(f"{QUERY}: an entry lacks a valid '_time': "
                                      f"{str(row)[:80]}") from None
        text, stream = str(row.get("_msg", "")), str(row.get("_stream", ""))
        out.append(_Entry(ns, text, row, stream, line_digest(stream, str(ns), text)))
    return out


def _stream_label(stream: str, name: str) -> str | None:
    """A label's value from a ``_stream`` such as ``{host="n1",job="x"}``."""
    marker = f"{name}="
    for part in stream.strip("{}").split(","):
        if part.startswith(marker):
            return part[len(marker):].strip('"') or None
    return None
