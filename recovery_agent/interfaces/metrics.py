"""``GET /metrics``: the agent's state in Prometheus text format.

The figures are read from the store at scrape time (a custom collector), so
they survive agent restarts and never drift from the audit trail: detections
by category, recommendations by action and status, detection and action
latency histograms, tracked jobs, our drains, hook reports (by outcome, since
this process started) and spool replays. Live state of this process (watch
cycle errors, pending verdicts, the external sources' health) is read from
``store.health``, which the watch loop keeps up to date.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

from ..scheduler.base import FINISHED_STATES
from ..store import Store

LATENCY_BUCKETS = (0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0)


def _histogram(name: str, doc: str, values: list[float]) -> HistogramMetricFamily:
    buckets = []
    for bound in LATENCY_BUCKETS:
        buckets.append((str(bound), float(sum(1 for v in values if v <= bound))))
    buckets.append(("+Inf", float(len(values))))
    total = float(sum(values))
    family = HistogramMetricFamily(name, doc)
    family.add_metric([], buckets, total)
    return family


class StoreCollector:
    def __init__(self, store: Store, counters=None) -> None:
        self.store, self.counters = store, counters

    def collect(self):
        figures = self.store.figures(FINISHED_STATES)
        detections, recs, latencies = (figures["detections"], figures["recs"],
                                       figures["latencies"])
        tracked, drained, excluded = figures["tracked"], figures["drained"], figures["excluded"]
        reports, replays = figures["reports"], figures["replays"]
        family = CounterMetricFamily("recovery_detections", "Detections stored, by category",
                                     labels=["category"])
        for category, count in detections:
            family.add_metric([category or "unknown"], count)
        yield family
        family = GaugeMetricFamily("recovery_recommendations",
                                   "Recommendations in the store, by action and status",
                                   labels=["action", "status"])
        for action, status, count in recs:
            family.add_metric([action, status], count)
        yield family
        yield _histogram("recovery_detection_latency_seconds",
                         "From the failure's first evidence to the decision",
                         [d for d, _ in latencies if d is not None and d >= 0])
        yield _histogram("recovery_action_latency_seconds",
                         "From the decision to the last Slurm step of a done recommendation",
                         [a for _, a in latencies if a is not None and a >= 0])
        yield GaugeMetricFamily("recovery_tracked_jobs", "Opted-in jobs not finished",
                                value=tracked)
        yield GaugeMetricFamily("recovery_drained_nodes", "Nodes drained by slurm-recovery",
                                value=drained)
        yield GaugeMetricFamily("recovery_excluded_nodes",
                                "Nodes an operator excluded from retries", value=excluded)
        family = CounterMetricFamily("recovery_hook_reports", "Node hook reports stored",
                                     labels=["hook"])
        for hook, count in reports:
            family.add_metric([hook], count)
        yield family
        yield CounterMetricFamily("recovery_spool_replays",
                                  "Hook reports that arrived over 5 s after they were "
                                  "made (replayed from a node's spool)", value=replays)
        yield CounterMetricFamily("recovery_watch_errors",
                                  "Watch cycles that failed (a full or read-only store, "
                                  "Slurm errors) since the agent started",
                                  value=self.store.health.get("errors", 0))
        health = self.store.health
        yield GaugeMetricFamily("recovery_store_failing",
                                "1 while the last watch cycle failed, and once a read "
                                "found the store damaged (as /healthz says)",
                                value=1 if health.get("error") or health.get("damaged")
                                else 0)
        yield GaugeMetricFamily("recovery_pending_verdicts",
                                "Ended attempts judged but not yet stored (kept in memory "
                                "while the store cannot be written)",
                                value=self.store.health.get("pending_verdicts", 0))
        yield CounterMetricFamily("recovery_verdicts_dropped",
                                  "Pending verdicts dropped because more than "
                                  "MAX_PENDING_VERDICTS waited (the store failed for long)",
                                  value=self.store.health.get("dropped_verdicts", 0))
        yield CounterMetricFamily("recovery_log_bytes_skipped",
                                  "Bytes of job output skipped unread since the agent "
                                  "started: files that ran more than "
                                  "agent.log_max_backlog_mb ahead (floods) were read on "
                                  "from their tail (each skip is on the job's timeline)",
                                  value=self.store.health.get("log_bytes_skipped", 0))
        yield from _source_families(self.store.health.get("sources") or {})
        if self.counters is not None:
            family = CounterMetricFamily("recovery_ingest_requests",
                                         "Hook requests since the agent started, by outcome",
                                         labels=["outcome"])
            with self.counters.lock:
                for outcome, count in sorted(self.counters.values.items()):
                    family.add_metric([outcome], count)
            yield family


def _source_families(sources: dict):
    """Per external source: up, and errors by kind since the agent started
    (from the watch loop's SourcePoller.counters() snapshot)."""
    up = GaugeMetricFamily("recovery_source_up",
                           "1 while an external source (Prometheus, Loki, VictoriaLogs) "
                           "answers; 0 from its first failure until it answers again",
                           labels=["source"])
    errors = CounterMetricFamily("recovery_source_errors",
                                 "Failed queries to an external source, by kind "
                                 "(unavailable, timeout, rate_limited, auth, malformed, "
                                 "labels, error)", labels=["source", "kind"])
    for name, state in sorted(sources.items()):
        up.add_metric([name], 1 if state.get("up") else 0)
        for kind, count in sorted((state.get("errors_by_kind") or {}).items()):
            errors.add_metric([name, kind], count)
    yield up
    yield errors


def render(store: Store, counters=None) -> tuple[bytes, str]:
    registry = CollectorRegistry()
    registry.register(StoreCollector(store, counters))
    return generate_latest(registry), CONTENT_TYPE_LATEST
