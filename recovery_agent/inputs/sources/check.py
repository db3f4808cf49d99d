"""The ingestion check: is each configured source usable before we rely on it?

For every source: can we reach it, does it hold recent data for the given
nodes and running jobs, are the labels the configuration names really there,
and how far behind real time is its newest sample or line. One
:class:`CheckResult` per source with pass/fail and a reason an admin can act
on; :func:`summary_lines` prints them one per line. This is what to run before
switching an environment to action mode.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from .base import SourceError
from .feed import Probe
from .http import redact_url

RECENT = 900.0      # "recent data" means within the last 15 minutes
MAX_LAG = 300.0     # a newest sample older than 5 minutes fails the check


@dataclass(frozen=True)
class CheckResult:
    """How one source fared. ``ok`` is the verdict; ``reason`` says why."""

    source: str
    kind: str
    url: str
    ok: bool
    reason: str
    reachable: bool = False
    lag: float | None = None
    nodes_seen: tuple[str, ...] = ()
    nodes_missing: tuple[str, ...] = ()
    jobs_seen: tuple[str, ...] = ()
    jobs_missing: tuple[str, ...] = ()
    labels_missing: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=(), compare=False)

    def line(self) -> str:
        """``PASS prometheus (http://prom:9090): 3/3 nodes, ...``"""
        return f"{'PASS' if self.ok else 'FAIL'} {self.source} ({self.url}): {self.reason}"


def check_sources(sources: Iterable[Any], nodes: Sequence[str] = (),
                  jobs: Mapping[str, Sequence[str]] | None = None, *,
                  now: float | None = None, recent: float = RECENT,
                  max_lag: float = MAX_LAG) -> list[CheckResult]:
    """One result per source, in order. ``jobs`` maps running job ids to their nodes."""
    return [check_source(s, nodes, jobs or {}, now=now, recent=recent, max_lag=max_lag)
            for s in sources]


def check_source(source: Any, nodes: Sequence[str] = (),
                 jobs: Mapping[str, Sequence[str]] | None = None, *,
                 now: float | None = None, recent: float = RECENT,
                 max_lag: float = MAX_LAG) -> CheckResult:
    """Probe one source and judge the answer; never raises."""
    now = time.time() if now is None else now
    jobs = jobs or {}
    base = {"source": source.name, "kind": source.kind, "url": redact_url(source.endpoint.url)}
    try:
        probe = source.probe(list(nodes), jobs, now, recent)
    except SourceError as exc:
        reachable = exc.kind in ("malformed", "labels", "rate_limited", "auth")
        what = {"malformed": "malformed answer", "auth": "refused our credentials",
                "timeout": "unreachable (timeout)", "unavailable": "unreachable",
                "rate_limited": "rate limited", "labels": "wrong label schema"}
        return CheckResult(ok=False, reachable=reachable,
                           reason=f"{what.get(exc.kind, 'error')}: {exc}", **base)
    except Exception as exc:   # a check must report, not crash
        return CheckResult(ok=False, reason=f"internal error: {exc!r}", **base)
    return judge(probe, nodes, jobs, now, recent, max_lag, base)


def judge(probe: Probe, nodes: Sequence[str], jobs: Mapping[str, Sequence[str]], now: float,
          recent: float, max_lag: float, base: dict) -> CheckResult:
    """Pass/fail from a probe. Fails: no recent data, an expected label absent,
    none of the given nodes (or jobs) with data, lag over ``max_lag``. Some
    nodes or jobs without data only show in the reason (a drained node is quiet)."""
    lag = None if probe.newest is None else max(0.0, now - probe.newest)
    nodes_seen = tuple(sorted(probe.nodes_seen & set(nodes)))
    nodes_missing = tuple(sorted(set(nodes) - set(nodes_seen)))
    if probe.jobs_seen is None:     # judged by their nodes
        jobs_seen = tuple(sorted(j for j, ns in jobs.items()
                                 if ns and set(ns) <= probe.nodes_seen))
    else:
        jobs_seen = tuple(sorted(probe.jobs_seen & set(jobs)))
    jobs_missing = tuple(sorted(set(jobs) - set(jobs_seen)))
    failures = _failures(probe, nodes, jobs, nodes_seen, jobs_seen, lag, recent, max_lag)
    facts = _facts(nodes, jobs, nodes_seen, nodes_missing, jobs_seen, jobs_missing, lag)
    reason = "; ".join(failures + facts) if failures else "; ".join(facts) or "reachable"
    return CheckResult(ok=not failures, reachable=True, reason=reason, lag=lag,
                       nodes_seen=nodes_seen, nodes_missing=nodes_missing,
                       jobs_seen=jobs_seen, jobs_missing=jobs_missing,
                       labels_missing=tuple(probe.labels_missing),
                       notes=tuple(probe.notes), **base)


def _failures(probe: Probe, nodes, jobs, nodes_seen, jobs_seen, lag, recent,
              max_lag) -> list[str]:
    out = []
    if probe.labels_missing:
        present = ", ".join(probe.labels_present[:12]) or "none"
        out.append(f"wrong label schema: {', '.join(repr(n) for n in probe.labels_missing)} "
                   f"not found (labels present: {present}); fix the label map")
    if not probe.count and not probe.labels_missing:
        out.append(f"no data in the last {_span(recent)}")
    if nodes and probe.count and not probe.labels_missing and not nodes_seen:
        out.append(f"no recent data for any of the {len(nodes)} node(s)")
    if jobs and probe.count and not probe.labels_missing and not jobs_seen:
        out.append(f"no recent data for any of the {len(jobs)} running job(s)")
    if lag is not None and lag > max_lag:
        out.append(f"lag {_span(lag)} behind real time (limit {_span(max_lag)})")
    return out


def _facts(nodes, jobs, nodes_seen, nodes_missing, jobs_seen, jobs_missing, lag) -> list[str]:
    out = []
    if nodes:
        out.append(f"{len(nodes_seen)}/{len(nodes)} nodes" + _missing(nodes_missing))
    if jobs:
        out.append(f"{len(jobs_seen)}/{len(jobs)} jobs" + _missing(jobs_missing))
    if lag is not None:
        out.append(f"lag {_span(lag)}")
    return out


def _missing(names: Sequence[str]) -> str:
    if not names:
        return ""
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return f" (missing: {shown})"


def _span(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def summary_lines(results: Sequence[CheckResult]) -> list[str]:
    """One line per source, then a total: what ``check --sources`` prints."""
    lines = [r.line() for r in results]
    failed = sum(not r.ok for r in results)
    if not results:
        lines.append("no sources configured")
    else:
        lines.append(f"{len(results) - failed}/{len(results)} sources pass"
                     + (f", {failed} fail" if failed else ""))
    return lines
