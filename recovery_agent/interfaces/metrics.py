"""``GET /metrics``: the agent's state in Prometheus text format.

Every name starts ``slurm_recovery_`` (:data:`NAMESPACE`), except the
process's own ``process_*`` series (prometheus_client's ProcessCollector, in
the same registry). The figures are read from the store at scrape time (a
custom collector), so they survive agent restarts and never drift from the
audit trail: detections by category (the job output's and the XIDs of node
reports), recommendations by action and status, detection and action latency
histograms, tracked jobs, holds, our drains, hook reports and spool replays.
Live state of this process (watch cycle errors, store errors, pending
verdicts, the external sources' health) is read from ``store.health``, which
the watch loop keeps up to date. ``docs/monitoring.md`` lists every series
(a unit test keeps the two equal), the shipped Grafana dashboard and alerts.
"""
from __future__ import annotations

import math
import time
from importlib import metadata

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector,
                               generate_latest)
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

from ..config import MODES, Config
from ..decide.decider import environment_mode
from ..scheduler.base import FINISHED_STATES
from ..detect.ledger import OUTCOMES
from ..detect.model import CATEGORIES
from ..store import Store
from . import ledger

NAMESPACE = "slurm_recovery"
LATENCY_BUCKETS = (0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0)
HOLD_WINDOW = 7 * 86400   # the watchdog's window: holds older than this are not looked at
XID_CATEGORY = "gpu_hardware"   # a node report's XID is a detection of this category


def _name(short: str) -> str:
    return f"{NAMESPACE}_{short}"


def version() -> str:
    """The installed package's version ("unknown" when run from a bare tree)."""
    try:
        return metadata.version("slurm-recovery")
    except metadata.PackageNotFoundError:
        return "unknown"


def _histogram(short: str, doc: str, values: list[float]) -> HistogramMetricFamily:
    buckets = []
    for bound in LATENCY_BUCKETS:
        buckets.append((str(bound), float(sum(1 for v in values if v <= bound))))
    buckets.append(("+Inf", float(len(values))))
    total = float(sum(values))
    family = HistogramMetricFamily(_name(short), doc)
    family.add_metric([], buckets, total)
    return family


def _gauge(short: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(_name(short), doc, value=value)


def _counter(short: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(_name(short), doc, value=value)


class StoreCollector:
    """The ``slurm_recovery_*`` families, from the store and ``store.health``.
    ``cfg`` (when given) adds the environments' modes and the holds past
    ``policy.decision_timeout``."""

    def __init__(self, store: Store, counters=None, cfg: Config | None = None,
                 clock=time.time) -> None:
        self.store, self.counters, self.cfg, self.clock = store, counters, cfg, clock

    def collect(self):
        figures = self.store.figures(FINISHED_STATES)
        yield from self._identity()
        yield from self._detections(figures)
        yield from self._recommendations(figures)
        yield from self._holds()
        yield _gauge("tracked_jobs", "Opted-in jobs not finished", figures["tracked"])
        yield _gauge("drained_nodes", "Nodes drained by slurm-recovery", figures["drained"])
        yield _gauge("excluded_nodes", "Nodes an operator excluded from retries",
                     figures["excluded"])
        family = CounterMetricFamily(_name("hook_reports"), "Node hook reports stored",
                                     labels=["hook"])
        for hook, count in figures["reports"]:
            family.add_metric([hook], count)
        yield family
        yield _counter("spool_replays", "Hook reports that arrived over 5 s after they were "
                       "made (replayed from a node's spool)", figures["replays"])
        yield from self._loop_health()
        yield from _source_families(self.store.health.get("sources") or {})
        yield from self._ingest()
        if self.cfg is not None:
            yield from _ledger_families(ledger_figures(self.store, self.cfg, self.clock()))

    def _identity(self):
        family = GaugeMetricFamily(_name("build_info"), "Always 1; the agent's version in "
                                   "its label", labels=["version"])
        family.add_metric([version()], 1)
        yield family
        if self.cfg is None:
            return
        family = GaugeMetricFamily(_name("environment_mode"),
                                   "1 for each environment's mode now (as configured, or as "
                                   "an operator set it with recovery-ctl mode), 0 for its "
                                   "other modes", labels=["env", "mode"])
        for env in sorted(self.cfg.environments):
            now = environment_mode(self.cfg, self.store, env)
            for mode in MODES:
                family.add_metric([env, mode], 1 if mode == now else 0)
        yield family
        yield _gauge("decision_timeout_seconds", "policy.decision_timeout: a job held for "
                     "a recovery decision longer than this is released by the watchdog",
                     self.cfg.policy.decision_timeout)

    def _detections(self, figures: dict):
        by_category: dict[str, int] = {}
        for category, count in figures["detections"]:
            key = category or "unknown"
            by_category[key] = by_category.get(key, 0) + count
        xids = figures["xids"]
        if xids:
            by_category[XID_CATEGORY] = (by_category.get(XID_CATEGORY, 0)
                                         + sum(n for _, _, n in xids))
        family = CounterMetricFamily(_name("detections"), "Detections stored, by category: "
                                     "rules matched in job output, and each XID or SXid a "
                                     "node hook reported (gpu_hardware)",
                                     labels=["category"])
        for category, count in sorted(by_category.items()):
            family.add_metric([category], count)
        yield family
        family = CounterMetricFamily(_name("node_xids"), "XIDs and NVSwitch SXids the node "
                                     "hooks reported, by kind and code",
                                     labels=["kind", "xid"])
        for kind, code, count in sorted(xids):
            family.add_metric([kind, str(code)], count)
        yield family

    def _recommendations(self, figures: dict):
        family = GaugeMetricFamily(_name("recommendations"),
                                   "Recommendations in the store, by action and status",
                                   labels=["action", "status"])
        for action, status, count in figures["recs"]:
            family.add_metric([action, status], count)
        yield family
        yield _counter("recommendations_blocked_by_budget",
                       "Recommendations (drains) the blast-radius budget blocked "
                       "(policy.max_drains_per_hour, policy.max_drained_percent)",
                       figures["blocked"])
        latencies = figures["latencies"]
        yield _histogram("detection_latency_seconds",
                         "From the failure's first evidence to the decision",
                         [d for d, _ in latencies if d is not None and d >= 0])
        yield _histogram("action_latency_seconds",
                         "From the decision to the last Slurm step of a done recommendation",
                         [a for _, a in latencies if a is not None and a >= 0])

    def _holds(self):
        now = self.clock()
        held = [r.held_at for r in self.store.holding_recs(since=now - HOLD_WINDOW)]
        yield _gauge("held_jobs", "Jobs our requeue-hold holds while their recovery "
                     "runs (not yet released)", len(held))
        if self.cfg is None:
            return
        limit = self.cfg.policy.decision_timeout
        yield _gauge("held_jobs_past_decision_timeout",
                     "Held jobs whose hold is older than policy.decision_timeout (the "
                     "watchdog should have released them)",
                     sum(1 for at in held if now - at >= limit))

    def _loop_health(self):
        health = self.store.health
        yield _counter("watch_errors", "Watch cycles that failed (a full or read-only store, "
                       "Slurm errors) since the agent started", health.get("errors", 0))
        yield _gauge("watch_failing", "1 while the last watch cycle failed",
                     1 if health.get("error") else 0)
        if health.get("ok_at"):
            yield _gauge("watch_last_success_timestamp_seconds",
                         "When the last watch cycle succeeded (Unix time)", health["ok_at"])
        yield _counter("store_errors", "Watch cycles that failed on the store (full, "
                       "read-only, locked, damaged) since the agent started",
                       health.get("store_errors", 0))
        yield _gauge("store_failing", "1 while the last watch cycle failed, and once a read "
                     "found the store damaged (as /healthz says)",
                     1 if health.get("error") or health.get("damaged") else 0)
        yield _gauge("store_damaged", "1 once a read found the store file damaged (until "
                     "a restart, which refuses a damaged store)",
                     1 if health.get("damaged") else 0)
        yield _counter("watch_early_cycles", "Watch cycles a node report brought forward "
                       "(an epilog, XIDs, log lines came in: the cycle ran then, not at the "
                       "next poll; agent.report_wakeup_gap)", health.get("early_cycles", 0))
        yield _gauge("pending_verdicts", "Ended attempts judged but not yet stored (kept in "
                     "memory while the store cannot be written)",
                     health.get("pending_verdicts", 0))
        yield _counter("verdicts_dropped", "Pending verdicts dropped because more than "
                       "MAX_PENDING_VERDICTS waited (the store failed for long)",
                       health.get("dropped_verdicts", 0))
        yield _counter("log_bytes_skipped", "Bytes of job output skipped unread since the "
                       "agent started: files that ran more than agent.log_max_backlog_mb "
                       "ahead (floods) were read on from their tail (each skip is on the "
                       "job's timeline)", health.get("log_bytes_skipped", 0))

    def _ingest(self):
        if self.counters is None:
            return
        family = CounterMetricFamily(_name("ingest_requests"),
                                     "Hook requests since the agent started, by outcome",
                                     labels=["outcome"])
        with self.counters.lock:
            for outcome, count in sorted(self.counters.values.items()):
                family.add_metric([outcome], count)
        yield family


# the ledger is computed from every job in the store: at most once this often
# per store, however often Prometheus scrapes
LEDGER_EVERY = 60.0
_ledger_cache: dict[str, tuple[float, dict]] = {}


def ledger_figures(store: Store, cfg: Config, now: float) -> dict:
    """What the ledger's series show: over the whole store, GPU-seconds lost
    by category, incidents by outcome and GPU-seconds saved by mode; ETTR per
    environment over ``ledger.metrics_window``. Kept for LEDGER_EVERY."""
    key = str(store.path)
    cached = _ledger_cache.get(key)
    if cached is not None and 0 <= now - cached[0] < LEDGER_EVERY:
        return cached[1]
    whole = ledger.report(store, cfg, 0.0, now, "category", now=now, checks=False)
    # every category is served from 0, so that increase() sees the first loss
    lost = {cat: 0.0 for cat in (*CATEGORIES, "unknown")}
    lost.update({cat: g["gpu_hours_lost"] * 3600 for cat, g in whole["groups"].items()})
    outcomes = {o: sum(g[o] for g in whole["groups"].values()) for o in OUTCOMES}
    saved = {"action": sum(g["gpu_hours_saved"] for g in whole["groups"].values()) * 3600,
             "monitor": sum(g["would_have_gpu_hours_saved"]
                            for g in whole["groups"].values()) * 3600}
    recent = ledger.report(store, cfg, now - cfg.ledger.metrics_window, now, "env",
                           now=now, checks=False)
    # every environment has a sample; NaN while its ETTR is unknown (no job of it
    # in the window, or none whose every figure is known)
    ettr = {env: math.nan for env in cfg.environments}
    ettr.update({env: math.nan if g["ettr"] is None else g["ettr"]
                 for env, g in recent["groups"].items()})
    figures = {"lost": lost, "outcomes": outcomes, "saved": saved, "ettr": ettr}
    _ledger_cache[key] = (now, figures)
    return figures


def _ledger_families(figures: dict):
    lost = CounterMetricFamily(_name("gpu_seconds_lost"),
                               "GPU-seconds lost to incidents (work lost since the last "
                               "checkpoint plus downtime), by failure category; incidents "
                               "whose loss is unknown are not in it (docs/goodput.md)",
                               labels=["category"])
    for category, seconds in sorted(figures["lost"].items()):
        lost.add_metric([category], seconds)
    yield lost
    outcomes = CounterMetricFamily(_name("incidents"),
                                   "Incidents (failed attempts) by outcome: recovered, "
                                   "stopped, given_up, unknown (an unknown one moves to "
                                   "another outcome once it settles)", labels=["outcome"])
    for outcome in OUTCOMES:
        outcomes.add_metric([outcome], figures["outcomes"].get(outcome, 0))
    yield outcomes
    saved = CounterMetricFamily(_name("gpu_seconds_saved"),
                                "GPU-seconds saved against plain Slurm: mode action, what "
                                "recovery saved; mode monitor, what acting would have "
                                "saved", labels=["mode"])
    for mode in ("action", "monitor"):
        saved.add_metric([mode], figures["saved"][mode])
    yield saved
    ettr = GaugeMetricFamily(_name("ettr"), "Effective training time ratio (productive / "
                             "allocated GPU time) of each environment's jobs over "
                             "ledger.metrics_window; NaN while unknown", labels=["env"])
    for env, value in sorted(figures["ettr"].items()):
        ettr.add_metric([env], value)
    yield ettr


def _source_families(sources: dict):
    """Per external source: up, and errors by kind since the agent started
    (from the watch loop's SourcePoller.counters() snapshot)."""
    up = GaugeMetricFamily(_name("source_up"),
                           "1 while an external source (Prometheus, Loki, VictoriaLogs) "
                           "answers; 0 from its first failure until it answers again",
                           labels=["source"])
    errors = CounterMetricFamily(_name("source_errors"),
                                 "Failed queries to an external source, by kind "
                                 "(unavailable, timeout, rate_limited, auth, malformed, "
                                 "labels, error)", labels=["source", "kind"])
    for name, state in sorted(sources.items()):
        up.add_metric([name], 1 if state.get("up") else 0)
        for kind, count in sorted((state.get("errors_by_kind") or {}).items()):
            errors.add_metric([name, kind], count)
    yield up
    yield errors


def registry(store: Store, counters=None, cfg: Config | None = None) -> CollectorRegistry:
    """The registry ``/metrics`` serves: the store's families and this process's."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(StoreCollector(store, counters, cfg))
    ProcessCollector(registry=reg)
    return reg


def render(store: Store, counters=None, cfg: Config | None = None) -> tuple[bytes, str]:
    return generate_latest(registry(store, counters, cfg)), CONTENT_TYPE_LATEST
