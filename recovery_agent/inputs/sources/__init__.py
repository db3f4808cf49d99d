"""External signal sources: GPU metrics from a Prometheus-API server (DCGM
exporter series), log lines from Loki or VictoriaLogs, and the ingestion check.

Sites that already collect logs and GPU metrics centrally let the agent ask
them, instead of tailing everything itself. :func:`build_sources` makes the
configured sources from the ``[sources]`` config section; :class:`SourcePoller`
queries them per job at the configured interval and never raises: a dead
source degrades to an error in the result, one log line, and a counter.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Iterable, Mapping, Sequence

from ...config import Config
from .base import SourceError
from .check import CheckResult, check_sources, summary_lines
from .feed import CursorStore, LogLine, LogSource, PollResult
from .http import Credentials, Endpoint
from .loki import LokiLabels, LokiSource
from .prometheus import DcgmLabels, MetricsResult, MetricsSource
from .query import prefilter_regex
from .victorialogs import VictoriaLogsFields, VictoriaLogsSource

__all__ = ["CheckResult", "JobRef", "JobFindings", "LogLine", "MetricsSource", "LokiSource",
           "PollResult", "SourceError", "SourcePoller", "VictoriaLogsSource", "build_sources",
           "check_sources", "summary_lines"]

log = logging.getLogger(__name__)


def build_sources(cfg: Config, rules: Sequence[Any] | None = None,
                  extra_patterns: Iterable[str] = ()) -> list[Any]:
    """The sources the config names, in the order prometheus, loki, victorialogs.

    ``rules`` (the loaded pattern rules) give the prefilter pushed into log
    queries; without them log sources fetch every line. Raises ConfigError
    when a credentials file cannot be read (the message names the key).
    """
    src = cfg.sources
    cursor_dir = Path(src.cursor_dir or Path(cfg.agent.state_dir) / "cursors")
    common = {"interval": src.query_interval, "delay": src.ingest_delay}
    prefilter = prefilter_regex(rules, extra_patterns) if rules else None
    out: list[Any] = []
    if src.prometheus_url:
        labels = DcgmLabels(host=src.prometheus_host_label, gpu=src.prometheus_gpu_label,
                            uuid=src.prometheus_uuid_label,
                            host_rewrite=src.prometheus_host_rewrite,
                            selector=src.prometheus_selector)
        out.append(MetricsSource(_endpoint(cfg, "prometheus"), labels, step=src.prometheus_step,
                                 cursors=CursorStore(cursor_dir, "prometheus"), **common))
    logs = {"page_limit": src.page_limit, "max_pages": src.max_pages, "prefilter": prefilter,
            **common}
    if src.loki_url:
        headers = {"X-Scope-OrgID": src.loki_tenant} if src.loki_tenant else {}
        labels_l = LokiLabels(job=src.loki_job_label, host=src.loki_host_label,
                              selector=src.loki_selector)
        out.append(LokiSource(_endpoint(cfg, "loki", headers), labels_l,
                              cursors=CursorStore(cursor_dir, "loki"), **logs))
    if src.victorialogs_url:
        headers = {}
        if src.victorialogs_tenant:
            account, project = src.victorialogs_tenant.split(":")
            headers = {"AccountID": account, "ProjectID": project}
        fields = VictoriaLogsFields(job=src.victorialogs_job_field,
                                    host=src.victorialogs_host_field,
                                    filter=src.victorialogs_filter)
        out.append(VictoriaLogsSource(_endpoint(cfg, "victorialogs", headers), fields,
                                      cursors=CursorStore(cursor_dir, "victorialogs"), **logs))
    return out


def _endpoint(cfg: Config, kind: str, headers: Mapping[str, str] | None = None) -> Endpoint:
    src = cfg.sources
    creds = Credentials.load(getattr(src, f"{kind}_auth"),
                             getattr(src, f"{kind}_credentials_file"),
                             f"sources.{kind}_credentials_file")
    return Endpoint(getattr(src, f"{kind}_url"), creds, timeout=src.timeout,
                    retries=src.retries, headers=dict(headers or {}))


@dataclass(frozen=True)
class JobRef:
    """A running job as the sources need it. ``since``: the attempt's start;
    ``hang``: the environment's hang window (0: no utilisation check);
    ``gpus``: host -> GPU indexes the job holds, when known."""

    job_id: str
    nodes: tuple[str, ...]
    since: float
    hang: float = 0.0
    gpus: Mapping[str, Collection[str]] | None = None


@dataclass
class JobFindings:
    """What the sources gave for one job in one poll."""

    detections: list = field(default_factory=list)
    lines: list[LogLine] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


class SourcePoller:
    """Asks every source about every running job once per ``query_interval``.

    Per watch cycle: ``poller.poll(jobs)`` (cheap when nothing is due); feed
    ``lines`` to the scanner (one scan stream per ``line.stream``) and add
    ``detections`` to the job's evidence; then ``poller.save()``. When a job
    ends: ``poller.forget(job_id)``. ``counters()`` is for /metrics.
    """

    def __init__(self, sources: Sequence[Any], clock=time.time) -> None:
        self.sources = list(sources)
        self.clock = clock
        self._due: dict[tuple[str, str], float] = {}

    def poll(self, jobs: Iterable[JobRef], now: float | None = None,
             force: bool = False) -> dict[str, JobFindings]:
        """Findings per job id, from the sources due for it. ``force`` asks
        every source now, due or not (a job's last look, once it has ended)."""
        now = self.clock() if now is None else now
        out: dict[str, JobFindings] = {}
        for job in jobs:
            for source in self.sources:
                key = (source.name, job.job_id)
                if not force and now < self._due.get(key, 0.0):
                    continue
                self._due[key] = now + source.interval
                found = out.setdefault(job.job_id, JobFindings())
                self._one(source, job, now, found)
        return out

    @staticmethod
    def _one(source: Any, job: JobRef, now: float, found: JobFindings) -> None:
        if isinstance(source, MetricsSource):
            result: MetricsResult | PollResult = source.poll(
                job.job_id, job.nodes, job.since, now, hang=job.hang, gpus=job.gpus)
            found.detections.extend(result.detections)
        else:
            assert isinstance(source, LogSource)
            result = source.poll(job.job_id, job.nodes, job.since, now)
            found.lines.extend(result.lines)
        if result.error:
            found.errors[source.name] = result.error
        found.warnings.extend(f"{source.name}: {w}" for w in result.warnings)

    def forget(self, job_id: str) -> None:
        for source in self.sources:
            source.forget(job_id)
            self._due.pop((source.name, job_id), None)

    def save(self) -> None:
        """Write every source's cursors (atomically); a failed write is logged."""
        for source in self.sources:
            try:
                source.save()
            except OSError as exc:
                log.error("source %s: cannot save cursors: %s", source.name, exc)

    def counters(self) -> dict[str, dict[str, Any]]:
        """Per source: up, errors_total, errors by kind, consecutive failures."""
        return {s.name: {"up": s.health.up, "errors_total": s.health.errors_total,
                         "errors_by_kind": dict(s.health.errors_by_kind),
                         "consecutive_failures": s.health.consecutive}
                for s in self.sources}
