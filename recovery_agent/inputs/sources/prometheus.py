"""GPU signals from DCGM-exporter series, through the Prometheus HTTP API.

Works with Prometheus and VictoriaMetrics (same ``/api/v1/query`` and
``/api/v1/query_range``). For a job's nodes and a time window it reads, in one
range query, the series that say a GPU or its links failed, and turns them into
:class:`~recovery_agent.detect.model.Detection` objects with host, GPU and XID
filled in, so attribution treats them like kernel-log lines:

* ``DCGM_FI_DEV_XID_ERRORS`` (a gauge holding the *last* XID): a change to a
  nonzero value inside the window is an XID event, so an XID left over from
  an earlier job is not blamed on this one. NVLink XIDs are ``interconnect``,
  the rest ``gpu_hardware``; the action comes from the XID catalog, as for
  kernel lines. (A gauge cannot show the same XID twice in a row; the kernel
  log, read by the node hooks, can.)
* ECC double-bit counters (volatile, aggregate): an increase is a fatal memory
  error. Row-remap failure or pending flags: the GPU needs a reset or RMA.
* NVLink CRC/replay/recovery counters: an increase blames the node's links.
* Thermal violation time, thermal throttle reasons, temperature: information
  only (they explain a slow job, they do not end one).

Counters are read as increases over the window (resets allowed), never as
absolute values: a GPU that had one DBE last month is not failing today.

Utilisation is a hang signal: every GPU of every node of a job at 0% for the
whole hang window gives a ``hang`` detection (:meth:`MetricsSource.hang`).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Collection, Mapping, Sequence

from slurm_hooks import kmsg

from ...detect.model import Detection, Evidence
from ...detect.patterns import xid_action
from .base import SourceError, SourceResponseError
from .feed import CursorStore, Probe
from .http import Endpoint, Health, HttpClient
from .query import alternation, quote

log = logging.getLogger(__name__)

XID = "DCGM_FI_DEV_XID_ERRORS"
UTIL = "DCGM_FI_DEV_GPU_UTIL"
TEMP = "DCGM_FI_DEV_GPU_TEMP"
THROTTLE = "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"
# name: (rule, category, severity, action, role, what an increase means)
COUNTERS: dict[str, tuple[str, str, str, str, str, str]] = {
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": ("dcgm.ecc_dbe", "gpu_hardware", "critical",
                                      "requeue_exclude", "root",
                                      "double-bit ECC errors (volatile)"),
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": ("dcgm.ecc_dbe", "gpu_hardware", "critical",
                                      "requeue_exclude", "root",
                                      "double-bit ECC errors (aggregate)"),
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": ("dcgm.row_remap", "gpu_hardware", "warning",
                                                "none", "cause",
                                                "rows remapped after uncorrectable errors"),
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": ("dcgm.nvlink", "interconnect", "error",
                                                      "requeue_exclude", "cause",
                                                      "NVLink flow-control CRC errors"),
    "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL": ("dcgm.nvlink", "interconnect", "error",
                                                      "requeue_exclude", "cause",
                                                      "NVLink data CRC errors"),
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": ("dcgm.nvlink", "interconnect", "error",
                                                    "requeue_exclude", "cause",
                                                    "NVLink replays"),
    "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL": ("dcgm.nvlink", "interconnect", "error",
                                                      "requeue_exclude", "cause",
                                                      "NVLink recovery errors"),
    "DCGM_FI_DEV_THERMAL_VIOLATION": ("dcgm.thermal", "gpu_hardware", "info", "none", "cause",
                                      "microseconds of thermal throttling"),
}
# Gauges that mean trouble whenever nonzero.
FLAGS: dict[str, tuple[str, str, str, str]] = {
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": ("dcgm.row_remap_failure", "critical", "requeue_exclude",
                                      "row remapping failed: no spare rows left"),
    "DCGM_FI_DEV_ROW_REMAP_PENDING": ("dcgm.row_remap_pending", "error", "requeue_exclude",
                                      "a row remap is pending: the GPU needs a reset"),
}
EVENT_METRICS = (XID, TEMP, THROTTLE, *COUNTERS, *FLAGS)
NVLINK_XIDS = frozenset({74, 136, 144, 145, 146, 147, 148, 149, 150, 155})
# Clock throttle reason bits about heat: HW slowdown, SW thermal, HW thermal, HW power brake.
THERMAL_BITS = {0x8: "HW slowdown", 0x20: "SW thermal", 0x40: "HW thermal",
                0x80: "HW power brake"}
SEVERITY_BY_ACTION = {"requeue_exclude": "critical", "requeue": "error", "stop": "error",
                      "none": "warning"}
HOST_REWRITES = ("none", "port", "domain")
MAX_POINTS = 1000        # per series per range query; the step grows to stay under it

Series = tuple[dict[str, str], list[tuple[float, float]]]


@dataclass(frozen=True)
class DcgmLabels:
    """Which labels carry the host, GPU index, UUID and PCI address.

    ``host_rewrite``: ``port`` strips ``:9400`` from values such as
    ``instance``; ``domain`` also strips a domain (``node1.example.org``).
    ``selector``: extra PromQL matchers for every query, e.g. ``job="dcgm"``.
    """

    host: str = "Hostname"
    gpu: str = "gpu"
    uuid: str = "UUID"
    pci: str = "pci_bus_id"
    host_rewrite: str = "port"
    selector: str = ""

    def host_matcher(self, hosts: Collection[str]) -> str:
        suffix = {"none": "", "port": r"(?::[0-9]+)?",
                  "domain": r"(?:\.[^:]*)?(?::[0-9]+)?"}[self.host_rewrite]
        return f"{self.host}=~{quote(f'(?:{alternation(hosts)}){suffix}')}"

    def selector_for(self, hosts: Collection[str], name: str | None = None) -> str:
        parts = [self.host_matcher(hosts)]
        if name is None:
            parts.append(f"__name__=~{quote('|'.join(EVENT_METRICS))}")
        if self.selector:
            parts.append(self.selector)
        return (name or "") + "{" + ",".join(parts) + "}"

    def host_of(self, labels: Mapping[str, str]) -> str | None:
        value = labels.get(self.host)
        if not value:
            return None
        if self.host_rewrite in ("port", "domain") and value.rsplit(":", 1)[-1].isdigit():
            value = value.rsplit(":", 1)[0]
        if self.host_rewrite == "domain":
            value = value.split(".", 1)[0]
        return value

    def pci_of(self, labels: Mapping[str, str]) -> str | None:
        """``0000:3b:00`` from ``00000000:3B:00.0``, as the kernel-log parser writes it."""
        parts = labels.get(self.pci, "").split(".")[0].split(":")
        if len(parts) != 3:
            return None
        try:
            return kmsg.normalize_pci(parts[0][-8:], parts[1], parts[2])
        except ValueError:
            return None


@dataclass
class MetricsResult:
    """Detections from one poll of one metrics source for one job."""

    source: str
    job_id: str
    detections: list[Detection] = field(default_factory=list)
    error: str | None = None
    error_kind: str | None = None
    warnings: list[str] = field(default_factory=list)
    window: tuple[float, float] | None = None


class PromClient:
    """The few Prometheus HTTP API calls we need, with the answers checked."""

    def __init__(self, http: HttpClient) -> None:
        self.http = http
        self.warnings: list[str] = []

    def query(self, expr: str, at: float) -> tuple[str, list[dict]]:
        data = self._data("/api/v1/query", {"query": expr, "time": _ts(at)})
        return data["resultType"], data["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[Series]:
        data = self._data("/api/v1/query_range", {"query": expr, "start": _ts(start),
                                                  "end": _ts(end), "step": _ts(step)})
        if data["resultType"] != "matrix":
            raise SourceResponseError(f"query_range: expected a matrix, got "
                                      f"{data['resultType']!r}")
        return [_series(item, "values") for item in data["result"]]

    def vector(self, expr: str, at: float) -> list[tuple[dict[str, str], float, float]]:
        kind, result = self.query(expr, at)
        if kind != "vector":
            raise SourceResponseError(f"query: expected a vector, got {kind!r}")
        out = []
        for item in result:
            labels, points = _series(item, "value")
            out.extend((labels, t, v) for t, v in points)
        return out

    def _data(self, path: str, params: dict) -> dict:
        payload = self.http.get_json(path, params)
        if not isinstance(payload, dict) or "status" not in payload:
            raise SourceResponseError(f"{path}: not a Prometheus API answer: no 'status'")
        if payload["status"] != "success":
            raise SourceResponseError(f"{path}: {payload.get('errorType', 'error')}: "
                                      f"{payload.get('error', 'no message')}")
        for warning in payload.get("warnings") or ():
            self.warnings.append(str(warning))
        data = payload.get("data")
        if not isinstance(data, dict) or not isinstance(data.get("result"), list) \
                or not isinstance(data.get("resultType"), str):
            raise SourceResponseError(f"{path}: 'data' lacks resultType/result")
        return data


def _series(item: Any, key: str) -> Series:
    if not isinstance(item, dict) or not isinstance(item.get("metric"), dict):
        raise SourceResponseError("a result item lacks its 'metric' labels")
    raw = item.get(key)
    points = [raw] if key == "value" else raw
    if not isinstance(points, list):
        raise SourceResponseError(f"a result item lacks '{key}'")
    out = []
    for point in points:
        try:
            t, v = point
            out.append((float(t), float(v)))
        except (TypeError, ValueError):
            raise SourceResponseError(f"a sample is not [time, \"value\"]: {point!r}") from None
    return {str(k): str(v) for k, v in item["metric"].items()}, out


def _ts(value: float) -> str:
    return f"{value:.3f}"


class MetricsSource:
    """DCGM series of a Prometheus-API server, as detections per job."""

    kind = "prometheus"

    def __init__(self, endpoint: Endpoint, labels: DcgmLabels = DcgmLabels(), *,
                 step: float = 15.0, interval: float = 30.0, delay: float = 30.0,
                 temp_limit: float = 90.0, cursors: CursorStore | None = None,
                 name: str = "prometheus", http: HttpClient | None = None) -> None:
        self.name = name
        self.endpoint = endpoint
        self.labels = labels
        self.step = max(step, 1.0)
        self.interval = interval
        self.delay = delay
        self.temp_limit = temp_limit
        self.client = PromClient(http or HttpClient(endpoint))
        self.cursors = cursors or CursorStore(None, name)
        self.health = Health(name, base_delay=interval)
        self.source = f"{self.kind}:{endpoint.label}"

    def __repr__(self) -> str:
        return f"MetricsSource({self.name!r}, {self.endpoint.label!r})"

    # -- per cycle ----------------------------------------------------------------
    def poll(self, job_id: str, nodes: Sequence[str], since: float, now: float | None = None,
             hang: float = 0.0, gpus: Mapping[str, Collection[str]] | None = None
             ) -> MetricsResult:
        """New detections for a running job since its last poll; never raises.

        The first poll of a job reads from ``since`` (the attempt's start).
        ``hang`` > 0 also checks utilisation over the last ``hang`` seconds
        (once the job has run that long); a hang fires once until the GPUs
        show work again. Errors come back in the result and in ``health``.
        """
        now = time.time() if now is None else now
        result = MetricsResult(self.name, job_id)
        if not nodes:
            return result
        if not self.health.allow(now):
            result.error, result.error_kind = self.health.skipped_reason(), "skipped"
            return result
        state = dict(self.cursors.get(job_id) or {})
        start, end = max(float(state.get("end", since)), since), now - self.delay
        if end <= start:
            return result
        self.client.warnings = []
        try:               # all or nothing: a failed poll is repeated whole
            detections = self.events(nodes, start, end)
            if hang > 0 and end - since >= hang:
                found = self.hang(nodes, hang, end, gpus)
                if found is not None and not state.get("hung"):
                    detections.append(found)
                state["hung"] = found is not None
        except SourceError as exc:
            self.health.failed(exc, now)
            result.error, result.error_kind = str(exc), exc.kind
            return result
        except Exception as exc:   # a bug must not end the watch loop
            log.exception("source %s: job=%s poll failed", self.name, job_id)
            self.health.failed(exc, now)
            result.error, result.error_kind = f"internal error: {exc!r}", "internal"
            return result
        self.health.ok(now)
        state["end"] = end
        self.cursors.put(job_id, state)
        result.detections = detections
        result.warnings, result.window = list(self.client.warnings), (start, end)
        return result

    def forget(self, job_id: str) -> None:
        """The job ended: drop its cursor."""
        self.cursors.forget(job_id)

    def save(self) -> None:
        self.cursors.save()

    # -- the queries --------------------------------------------------------------
    def events(self, nodes: Collection[str], start: float, end: float) -> list[Detection]:
        """Every failure the DCGM series show on ``nodes`` within [start, end]."""
        step = self._step(start, end)
        pad = 2 * step + self.delay
        series = self.client.query_range(self.labels.selector_for(nodes), start - pad, end, step)
        found: dict[tuple, Detection] = {}
        for labels, points in series:
            host = self.labels.host_of(labels)
            if host is None or host not in nodes:
                continue
            for det in self._judge(labels, points, host, start):
                key = (det.rule, det.host, det.gpu, det.xid)
                old = found.get(key)
                found[key] = det if old is None else _merge(old, det)
        return sorted(found.values(), key=lambda d: (d.evidence[0].time or 0, d.rule))

    def hang(self, nodes: Collection[str], window: float, end: float,
             gpus: Mapping[str, Collection[str]] | None = None) -> Detection | None:
        """A ``hang`` detection when every GPU of every node (or the ``gpus``
        named per host) stayed at 0% utilisation over [end - window, end].
        Missing data is no evidence: a node without series means no verdict."""
        start = end - window
        step = min(self._step(start, end), max(window / 10, 1.0))
        series = self.client.query_range(self.labels.selector_for(nodes, UTIL), start, end, step)
        seen: dict[str, list[str]] = {node: [] for node in nodes}
        for labels, points in series:
            host = self.labels.host_of(labels)
            if host not in seen:
                continue
            gpu = labels.get(self.labels.gpu, "?")
            if gpus is not None and gpu not in {str(g) for g in gpus.get(host, ())}:
                continue
            if not points or points[0][0] > start + step or points[-1][0] < end - 2 * step:
                return None        # the data does not cover the window
            if any(v != 0 for _, v in points):
                return None
            seen[host].append(gpu)
        if not all(seen.values()):
            return None
        count = sum(len(g) for g in seen.values())
        detail = (f"all {count} GPUs of {len(seen)} node(s) at 0% utilisation for "
                  f"{window:.0f}s (DCGM, {self.source})")
        evidence = tuple(Evidence(f"{UTIL}{{{self.labels.host}={quote(host)}}} = 0 on GPUs "
                                  f"{','.join(sorted(g))} from {_when(start)} to {_when(end)}",
                                  self.source, None, end)
                         for host, g in sorted(seen.items())[:8])
        return Detection(rule="hang", category="nccl_timeout_hang", severity="error",
                         action_hint="kill_requeue", evidence=evidence, detail=detail)

    # -- the ingestion check -----------------------------------------------------------
    def probe(self, nodes: Sequence[str], jobs: Mapping[str, Sequence[str]], now: float,
              recent: float) -> Probe:
        """A sample of utilisation series (labels), and per node the newest
        sample time, over the last ``recent`` seconds. Jobs are judged by their
        nodes: DCGM series carry no job id."""
        probe = Probe()
        extra = f"{{{self.labels.selector}}}" if self.labels.selector else ""
        window = f"[{max(int(recent), 1)}s]"
        sample = self.client.vector(f"topk(5, last_over_time({UTIL}{extra}{window}))", now)
        probe.count = len(sample)
        present = sorted({k for labels, _, _ in sample for k in labels})
        probe.labels_present = present
        wanted = [self.labels.host, self.labels.gpu, self.labels.uuid]
        probe.labels_missing = [name for name in wanted
                                if sample and any(name not in labels for labels, _, _ in sample)]
        hosts = set(nodes) | {n for job_nodes in jobs.values() for n in job_nodes}
        if not sample or self.labels.host in probe.labels_missing:
            return probe
        selector = self.labels.selector_for(hosts, UTIL) if hosts else f"{UTIL}{extra}"
        newest = self.client.vector(f"max by ({self.labels.host}) (timestamp({selector}))"
                                    if hosts else f"max(timestamp({selector}))", now)
        for labels, _, value in newest:
            host = self.labels.host_of(labels)
            if host:
                probe.nodes_seen.add(host)
            probe.newest = max(probe.newest or 0.0, value)
        if not hosts:   # no node named: the newest sample of any series
            probe.newest = max((v for _, _, v in newest), default=None)
        return probe

    def _step(self, start: float, end: float) -> float:
        return float(max(self.step, math.ceil((end - start) / MAX_POINTS)))

    # -- reading one series ---------------------------------------------------------
    def _judge(self, labels: dict[str, str], points: list[tuple[float, float]], host: str,
               start: float) -> list[Detection]:
        name = labels.get("__name__", "")
        before = [v for t, v in points if t < start and not math.isnan(v)]
        inside = [(t, v) for t, v in points if t >= start and not math.isnan(v)]
        if not inside:
            return []
        if name == XID:
            return self._xids(labels, host, before[-1] if before else None, inside)
        if name in COUNTERS:
            base = before[-1] if before else None
            increase, when = counter_increase(base, inside)
            return [self._counter(name, labels, host, increase, when)] if increase > 0 else []
        if name in FLAGS:
            hit = next(((t, v) for t, v in inside if v != 0), None)
            return [self._flag(name, labels, host, *hit)] if hit else []
        if name == TEMP:
            hot = max(inside, key=lambda p: p[1])
            return ([self._info(labels, host, hot[0], f"{name} = {hot[1]:g} C (limit "
                                f"{self.temp_limit:g} C)")] if hot[1] >= self.temp_limit else [])
        if name == THROTTLE:
            hit = next(((t, int(v)) for t, v in inside if int(v) & sum(THERMAL_BITS)), None)
            if hit is None:
                return []
            why = ", ".join(w for bit, w in THERMAL_BITS.items() if hit[1] & bit)
            return [self._info(labels, host, hit[0], f"{name} = {hit[1]:#x} ({why})")]
        return []

    def _xids(self, labels, host, base, inside) -> list[Detection]:
        out, last = [], base
        for t, v in inside:
            code = int(v)
            if code != 0 and code != (None if last is None else int(last)):
                out.append(self._xid(labels, host, code, t))
            last = v
        return out

    def _xid(self, labels, host, code: int, t: float) -> Detection:
        action = xid_action(code)
        category = "interconnect" if code in NVLINK_XIDS else "gpu_hardware"
        text = f"{self._series_text(XID, labels)} = {code} at {_when(t)}"
        return self._detection("dcgm.xid", category, SEVERITY_BY_ACTION[action], action,
                               "root", labels, host, text, t, xid=code,
                               detail=f"XID {code} on {host} GPU {labels.get(self.labels.gpu)} "
                                      f"(DCGM via {self.source})")

    def _counter(self, name, labels, host, increase: float, t: float) -> Detection:
        rule, category, severity, action, role, what = COUNTERS[name]
        text = f"{self._series_text(name, labels)} rose by {increase:g} by {_when(t)}"
        return self._detection(rule, category, severity, action, role, labels, host, text, t,
                               detail=f"{increase:g} {what} on {host} GPU "
                                      f"{labels.get(self.labels.gpu)}")

    def _flag(self, name, labels, host, t: float, v: float) -> Detection:
        rule, severity, action, what = FLAGS[name]
        text = f"{self._series_text(name, labels)} = {v:g} at {_when(t)}"
        return self._detection(rule, "gpu_hardware", severity, action, "root", labels, host,
                               text, t, detail=f"{what} on {host} GPU "
                                               f"{labels.get(self.labels.gpu)}")

    def _info(self, labels, host, t: float, what: str) -> Detection:
        text = f"{self._series_text(labels.get('__name__', ''), labels)}: {what}"
        return self._detection("dcgm.thermal", "gpu_hardware", "info", "none", "cause",
                               labels, host, text, t, detail=f"thermal throttling on {host}")

    def _detection(self, rule, category, severity, action, role, labels, host, text, t, *,
                   xid: int | None = None, detail: str = "") -> Detection:
        uuid = labels.get(self.labels.uuid)
        if uuid and uuid not in detail:
            detail = f"{detail} ({uuid})" if detail else uuid
        return Detection(rule=rule, category=category, severity=severity, action_hint=action,
                         role=role, host=host, gpu=labels.get(self.labels.gpu),
                         pci=self.labels.pci_of(labels), xid=xid, detail=detail,
                         evidence=(Evidence(text, self.source, None, t),))

    def _series_text(self, name: str, labels: Mapping[str, str]) -> str:
        keep = [self.labels.host, self.labels.gpu, self.labels.uuid]
        inner = ",".join(f"{k}={quote(labels[k])}" for k in keep if labels.get(k))
        return f"{name}{{{inner}}}"


def counter_increase(base: float | None, points: Sequence[tuple[float, float]]
                     ) -> tuple[float, float]:
    """How much a counter rose over ``points`` after the value ``base`` (None:
    the first point is the base), counting a drop as a reset to zero; and when
    it first rose."""
    total, first = 0.0, 0.0
    last = base
    for t, v in points:
        if last is not None:
            delta = v - last if v >= last else v
            if delta > 0:
                total += delta
                first = first or t
        last = v
    return total, first


def _merge(a: Detection, b: Detection) -> Detection:
    return replace(a, evidence=(a.evidence + b.evidence)[:4])


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
