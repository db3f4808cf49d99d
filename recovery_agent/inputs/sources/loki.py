"""Candidate log lines from Grafana Loki (LogQL over ``/loki/api/v1/query_range``).

Two feeds per job, each a stream selector plus the pattern prefilter as a line
filter, so Loki does the filtering and only candidate lines travel:

* the job's own streams: ``{<job label>="1234"} |~ "<prefilter>"``
* its nodes' streams (kernel and slurmd logs): ``{<host label>=~"n1|n2"} |~ ...``

Paging reads forward from the cursor with ``limit``; the next page starts at
the last timestamp seen (Loki's ``start`` is inclusive), and lines at that
boundary timestamp already delivered are dropped by digest. The cursor (the
timestamp and the digests at it) is saved per (source, job, feed).

Tested against recorded answers in the documented API shape, not a live Loki.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .base import SourceResponseError
from .feed import FeedRead, LogLine, LogSource, Probe, line_digest, page_forward
from .http import Endpoint
from .query import alternation, quote, to_ns

QUERY_RANGE = "/loki/api/v1/query_range"
LABELS = "/loki/api/v1/labels"


@dataclass(frozen=True)
class LokiLabels:
    """Which stream labels hold the Slurm job id and the node name; empty
    disables that feed. ``selector``: extra matchers for both, e.g. ``cluster="a"``."""

    job: str = "slurm_job_id"
    host: str = "host"
    selector: str = ""


@dataclass(frozen=True)
class _Entry:
    ns: int
    text: str
    labels: Mapping[str, str]
    stream: str
    digest: str


class LokiSource(LogSource):
    kind = "loki"

    def __init__(self, endpoint: Endpoint, labels: LokiLabels = LokiLabels(), *,
                 prefilter: str | None = None, **kw: Any) -> None:
        super().__init__(endpoint, **kw)
        self.labels = labels
        self.prefilter = prefilter

    # -- queries ---------------------------------------------------------------------
    def feeds(self, job_id: str, nodes: Sequence[str]) -> list[tuple[str, str]]:
        out = []
        if self.labels.job and job_id:
            out.append(("job", self.query(f"{self.labels.job}={quote(str(job_id))}")))
        if self.labels.host and nodes:
            out.append(("nodes", self.query(f"{self.labels.host}=~{quote(alternation(nodes))}")))
        return out

    def query(self, matcher: str) -> str:
        """A LogQL log query: the matcher, the extra selector, the prefilter."""
        inner = ",".join(m for m in (matcher, self.labels.selector) if m)
        text = "{" + inner + "}"
        if self.prefilter:
            text += f" |~ {quote(self.prefilter)}"
        return text

    # -- paging ----------------------------------------------------------------------
    def read_feed(self, query: str, cursor: dict, end_ns: int) -> FeedRead:
        warnings: list[str] = []

        def fetch(start: int, end: int, limit: int) -> list[_Entry]:
            entries, warns = self.page(query, start, end, limit)
            warnings.extend(warns)
            return entries
        entries, read = page_forward(fetch, cursor, end_ns, self.page_limit, self.max_pages)
        read.lines = [self._line(e) for e in entries]
        read.warnings = warnings
        return read

    def page(self, query: str, start_ns: int, end_ns: int, limit: int,
             direction: str = "forward") -> tuple[list[_Entry], list[str]]:
        """One query_range answer as entries sorted by time (start inclusive,
        end exclusive, as Loki reads them)."""
        payload = self.http.get_json(QUERY_RANGE, {"query": query, "start": str(start_ns),
                                                   "end": str(end_ns), "limit": str(limit),
                                                   "direction": direction})
        data = _data(payload, QUERY_RANGE)
        if data.get("resultType") != "streams":
            raise SourceResponseError(f"{QUERY_RANGE}: expected resultType 'streams', got "
                                      f"{data.get('resultType')!r} (a metric query?)")
        entries = [e for item in data["result"] for e in _entries(item)]
        entries.sort(key=lambda e: (e.ns, e.stream, e.text))
        return entries, [str(w) for w in payload.get("warnings") or ()]

    def _line(self, e: _Entry) -> LogLine:
        host = e.labels.get(self.labels.host) if self.labels.host else None
        return LogLine(self.source, e.text, e.ns / 1e9, host or None, e.stream, e.ns)

    # -- the ingestion check -----------------------------------------------------------
    def probe(self, nodes: Sequence[str], jobs: Mapping[str, Sequence[str]], now: float,
              recent: float) -> Probe:
        """Label names, which nodes and jobs have streams, and the newest line,
        over the last ``recent`` seconds."""
        span = {"start": str(to_ns(now - recent)), "end": str(to_ns(now))}
        probe = Probe(jobs_seen=set())
        names = self._strings(LABELS, span)
        probe.labels_present = sorted(names)
        wanted = [name for name in (self.labels.job, self.labels.host) if name]
        probe.labels_missing = [name for name in wanted if name not in names]
        if self.labels.host and self.labels.host in names:
            values = self._strings(f"/loki/api/v1/label/{self.labels.host}/values", span)
            probe.nodes_seen = set(values) & set(nodes)
        if self.labels.job and self.labels.job in names:
            values = self._strings(f"/loki/api/v1/label/{self.labels.job}/values", span)
            probe.jobs_seen = set(values) & set(jobs)
        matcher = next((f"{name}=~\".+\"" for name in wanted if name in names), None)
        if matcher is not None:
            query = "{" + ",".join(m for m in (matcher, self.labels.selector) if m) + "}"
            entries, _ = self.page(query, to_ns(now - recent), to_ns(now) + 1, 1, "backward")
            probe.count = len(entries)
            probe.newest = max((e.ns / 1e9 for e in entries), default=None)
        return probe

    def _strings(self, path: str, params: dict) -> list[str]:
        data = _data(self.http.get_json(path, params), path, want=list)
        if not all(isinstance(v, str) for v in data):
            raise SourceResponseError(f"{path}: 'data' is not a list of strings")
        return data


def _data(payload: Any, path: str, want: type = dict) -> Any:
    if not isinstance(payload, dict) or "status" not in payload:
        raise SourceResponseError(f"{path}: not a Loki API answer: no 'status'")
    if payload["status"] != "success":
        raise SourceResponseError(f"{path}: {payload.get('errorType', 'error')}: "
                                  f"{payload.get('error', payload.get('message', 'no message'))}")
    data = payload.get("data")
    if not isinstance(data, want):
        raise SourceResponseError(f"{path}: 'data' is not a {want.__name__}")
    if want is dict and not isinstance(data.get("result"), list):
        raise SourceResponseError(f"{path}: 'data.result' is not a list")
    return data


def _entries(item: Any) -> list[_Entry]:
    """One stream of a streams answer: values are [ns, line] or, with
    categorised labels, [ns, line, {metadata}]."""
    if not isinstance(item, dict) or not isinstance(item.get("stream"), dict) \
            or not isinstance(item.get("values"), list):
        raise SourceResponseError(f"{QUERY_RANGE}: a stream lacks 'stream' labels or "
                                  f"'values'")
    labels = {str(k): str(v) for k, v in item["stream"].items()}
    stream = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    out = []
    for value in item["values"]:
        if not isinstance(value, list) or len(value) < 2 or not isinstance(value[1], str):
            raise SourceResponseError(f"{QUERY_RANGE}: a value is not [\"<ns>\", \"<line>\"]: "
                                      f"{str(value)[:80]}")
        try:
            ns = int(value[0])
        except (TypeError, ValueError):
            raise SourceResponseError(f"{QUERY_RANGE}: timestamp {value[0]!r} is not "
                                      f"nanoseconds") from None
        out.append(_Entry(ns, value[1], labels, stream, line_digest(stream, str(ns), value[1])))
    return out
