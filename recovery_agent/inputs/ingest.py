"""Hook reports in: validate a report, then store it whole or not at all.

The HTTP layer (``recovery_agent.interfaces.api``) only authenticates and hands the bytes
here. A report is identified by its ``report_id``: a spooled report delivered
twice is stored once. A report replayed from a node's spool carries a
``delivery`` object (see :mod:`slurm_hooks.delivery`): it is stored as late and
said so on the job's timeline. A job report whose attempt was judged already is
marked ``after_verdict``: the watch loop then counts its fatal XIDs against the
node.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import time
from bisect import insort
from dataclasses import dataclass, replace
from typing import Any

from slurm_hooks import spec as specs

from ..config.schema import ProactiveConfig
from ..detect import degradation
from ..errors import RecoveryError
from .jobcache import JobCache
from ..scheduler.base import FINISHED_STATES, Job
from ..store import Store
from ..store import reports as report_rows

log = logging.getLogger(__name__)
ENDED = FINISHED_STATES | {"GONE"}   # stored rows of jobs that have ended

HOOKS = ("prolog", "epilog", "health")
REPLAYERS = (*HOOKS, "hook", "replayer")   # who may have replayed a spooled report
_ID = re.compile(r"[0-9a-f]{32}")
_NODE = re.compile(r"[A-Za-z0-9._-]{1,128}")
_JOB_ID = re.compile(r"[0-9]{1,12}(_[0-9]{1,9})?")
MAX_GPUS = 64
MAX_XIDS = 500
MAX_LOG_LINES = 2000


class ReportError(RecoveryError):
    """The report is malformed; the message says what is wrong."""


@dataclass(frozen=True)
class StoredReport:
    row_id: int
    duplicate: bool
    job_row: int | None


def _want(obj: dict, key: str, kinds: tuple, where: str, required: bool = True) -> Any:
    value = obj.get(key)
    if value is None:
        if required:
            raise ReportError(f"{where}{key}: missing")
        return None
    if isinstance(value, bool) and bool not in kinds:
        raise ReportError(f"{where}{key}: expected {kinds[0].__name__}, got a boolean")
    if not isinstance(value, kinds):
        raise ReportError(f"{where}{key}: expected {kinds[0].__name__}, "
                          f"got {type(value).__name__}")
    return value


def _objects(parent: dict, key: str, limit: int, where: str, needs: dict) -> None:
    """``parent[key]`` is a list of at most ``limit`` objects, each with the
    fields of ``needs`` (name -> accepted types)."""
    items = _want(parent, key, (list,), where)
    if len(items) > limit:
        raise ReportError(f"{where}{key}: more than {limit} entries")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ReportError(f"{where}{key}[{i}]: expected an object")
        for field_name, kinds in needs.items():
            _want(item, field_name, kinds, f"{where}{key}[{i}].")


def validate(hook: str, report: Any) -> dict:
    """Check a decoded report; return it, or raise ReportError naming the field."""
    if hook not in HOOKS:
        raise ReportError(f"unknown hook {hook!r} (expected one of {', '.join(HOOKS)})")
    if not isinstance(report, dict):
        raise ReportError("report: expected a JSON object")
    if _want(report, "version", (int,), "") != 1:
        raise ReportError(f"version: unsupported report version {report['version']!r}")
    if _want(report, "hook", (str,), "") != hook:
        raise ReportError(f"hook: report says {report['hook']!r} but was sent to /{hook}")
    if not _ID.fullmatch(_want(report, "report_id", (str,), "")):
        raise ReportError("report_id: expected 32 lowercase hex digits")
    if not _NODE.fullmatch(_want(report, "node", (str,), "")):
        raise ReportError(f"node: invalid node name {report['node']!r}")
    _want(report, "cluster", (str,), "")
    _want(report, "created", (int, float), "")
    job = _want(report, "job", (dict,), "", required=hook != "health")
    if job is not None:
        if not _JOB_ID.fullmatch(_want(job, "job_id", (str,), "job.")):
            raise ReportError(f"job.job_id: invalid job id {job['job_id']!r}")
        attempt = _want(job, "attempt", (int,), "job.")
        if attempt < 0:
            raise ReportError("job.attempt: must not be negative")
        if len(_want(job, "spec", (str,), "job.")) > 4 * specs.MAX_LENGTH:
            raise ReportError("job.spec: far too long")
        for key in ("start_time", "started"):   # which run of the attempt (optional)
            when = _want(job, key, (int, float), "job.", required=False)
            if when is not None and (isinstance(when, bool) or not math.isfinite(when)
                                     or when < 0):
                raise ReportError(f"job.{key}: not a time")
    gpus = _want(report, "gpus", (dict,), "")
    _objects(gpus, "gpus", MAX_GPUS, "gpus.", {"index": (int,)})
    _objects(report, "xids", MAX_XIDS, "", {"xid": (int,), "raw": (str,)})
    if report.get("log_lines") is not None:
        _objects(report, "log_lines", MAX_LOG_LINES, "", {"text": (str,)})
    if hook == "epilog":
        _want(report, "exit", (dict,), "")
    _delivery(report)
    return report


def _delivery(report: dict) -> None:
    """The optional ``delivery`` object of a replayed report."""
    delivery = _want(report, "delivery", (dict,), "", required=False)
    if delivery is None:
        return
    spooled = _want(delivery, "spooled_at", (int, float), "delivery.", required=False)
    if spooled is not None and not math.isfinite(spooled):
        raise ReportError("delivery.spooled_at: not a finite time")
    tries = _want(delivery, "tries", (int,), "delivery.", required=False)
    if tries is not None and not 0 <= tries <= 1_000_000:
        raise ReportError("delivery.tries: expected 0 to 1000000")
    by = _want(delivery, "by", (str,), "delivery.", required=False)
    if by is not None and by not in REPLAYERS:
        raise ReportError(f"delivery.by: expected one of {', '.join(REPLAYERS)}")


def _same_owner(owner: dict, row: dict) -> bool:
    """Whether a row stored without its submit time is the job ``owner`` holds
    that key for: another row of the same id whose user agrees."""
    return owner["id"] != row["id"] and (not owner["user"] or not row["user"]
                                         or owner["user"] == row["user"])


def _run_start(job: dict | None) -> float | None:
    """Which run of its attempt a report belongs to: Slurm's start time where the
    hook saw it (24.11 and later), else the time the node's prolog noted."""
    if not job:
        return None
    for key in ("start_time", "started"):
        if isinstance(job.get(key), (int, float)) and not isinstance(job.get(key), bool):
            return float(job[key])
    return None


def _arrival(hook: str, report: dict, row: dict) -> str:
    """The timeline line for a stored report: ``late epilog report from node2
    (spooled 34s ago, 3 tries, replayed by the health check)`` for a replay."""
    after = ", after this attempt's verdict" if row["after_verdict"] else ""
    if not row["late"]:
        return f"{hook} report from {report['node']}{after}"
    delivery = report["delivery"]
    facts = []
    if delivery.get("spooled_at") is not None:
        facts.append(f"spooled {max(0.0, row['received'] - delivery['spooled_at']):.0f}s ago")
    if delivery.get("tries"):
        facts.append(f"{delivery['tries']} tries")
    by = delivery.get("by")
    if by in HOOKS:
        facts.append("replayed by the " + ("health check" if by == "health" else by))
    elif by == "replayer":
        facts.append("replayed by the epilog's replayer")
    text = f"late {hook} report from {report['node']}"
    return text + (f" ({', '.join(facts)})" if facts else "") + after


def parse_body(hook: str, body: bytes) -> dict:
    try:
        decoded = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ReportError(f"body is not JSON: {exc}") from None
    return validate(hook, decoded)


class Ingest:
    """Stores validated reports.

    ``jobs`` (a :class:`~recovery_agent.inputs.jobcache.JobCache`) supplies the
    scheduler's record of a job, whose submit time completes the job's key.
    Ingest never waits for it: a job the cache does not know yet is stored with
    submit time 0 and completed when the background refresh lands.
    """

    def __init__(self, store: Store, cluster: str, jobs: JobCache | None = None,
                 proactive: ProactiveConfig | None = None) -> None:
        self.store = store
        self.cluster = cluster
        self.jobs = jobs
        # thresholds of the degradation score; None scores nothing
        self.proactive = proactive
        # node -> its GPU readings within the score's window, oldest first:
        # read from the store once per node, then kept up with each report
        # (reading every report of the window again made each report cost as
        # much as all the node's reports before it)
        self._series: dict[str, list] = {}
        # called with (job row id, attempt, report) for reports that carry
        # log lines, after they are stored (the watch loop scans them)
        self.log_listeners: list = []
        # called with the job's row id once a report that brings evidence on it
        # is stored: an epilog, XIDs or log lines (the watch loop's next cycle comes now)
        self.evidence_listeners: list = []
        if jobs is not None:
            jobs.on_refresh.append(self.complete_submit_times)

    def attach_jobs(self, jobs: JobCache) -> None:
        """Use a job cache from now on (Slurm became reachable after the start)."""
        jobs.on_refresh.append(self.complete_submit_times)
        self.jobs = jobs

    def _known_job(self, cluster: str, job: dict, hook: str, created: float = 0,
                   late: bool = False) -> Job:
        """The job as the scheduler last listed it, else as the store knows it
        (the same job while it lives), else a new one awaiting its submit time.

        A first prolog (attempt 0, sent at once, not replayed from a spool) is
        a job that has just started: it is never a job whose stored row has
        ended, or whose listing ended before the report was made. Such a
        listing is older than the report (slurmctld's state was reset and the
        id handed out again), so it is not used."""
        found = self.jobs.peek(job["job_id"]) if self.jobs is not None else None
        first = hook == "prolog" and job["attempt"] == 0 and not late
        if found is not None and first and (
                (found.is_finished and found.end_time and created
                 and found.end_time < created - 1)
                or ((row := self.store.match_job(cluster, found)) is not None
                    and row["state"] in ENDED and not self._runs_again(row, found))):
            found = None
        if found is not None:
            self.store.adopt_printable_id(cluster, found)
            return found
        if self.jobs is not None:
            self.jobs.refresh_soon()
        existing = self.store.find_job(cluster, job["job_id"])
        # a first prolog for an id whose stored job has ended is a reused id
        reused = (existing is not None and hook == "prolog" and job["attempt"] == 0
                  and existing["state"] in ENDED)
        submit = existing["submit_time"] if existing and not reused else 0
        return Job(job_id=job["job_id"], numeric_id=int(job["job_id"].split("_")[0]),
                   submit_time=submit, state="RUNNING" if hook == "prolog" else "UNKNOWN",
                   array_job_id=job.get("array_job_id"), array_task_id=job.get("array_task_id"),
                   user=job.get("user") or "")

    def _runs_again(self, row: dict, found: Job) -> bool:
        """Whether a stored job that ended is, as listed now, the same job back
        at restart count 0 (slurmctld runs the attempt again: a controller
        restarted from older state puts it back in the queue itself). Its
        submit time is the stored one, and the listing is newer than the end of
        the stored run: it started, or is to start (pending), after that end. A
        listing from before the end (a cache older than a reset) shows the old
        run, or its expected start before it ran. Slurm's times are whole
        seconds: a run that ended within the second it started shows its start
        equal to its end, so only a start after the end is another run."""
        if found.restart_count != 0 or not found.submit_time \
                or found.submit_time != row["submit_time"]:
            return False
        ended = next((a["end_time"] for a in self.store.attempts(row["id"])
                      if a["attempt"] == 0), None)
        if not ended:
            return False
        return bool(found.start_time and found.start_time > ended)

    def _job(self, cluster: str, node: str, job: dict, hook: str,
             created: float = 0, late: bool = False) -> tuple[int, int]:
        try:
            spec, problem = specs.parse(job["spec"]), ""
        except specs.SpecError as exc:
            # the comment form is not checked at submit time: watch, never act
            spec, problem = specs.RecoverySpec(mode="monitor"), str(exc)
        found = self._known_job(cluster, job, hook, created, late)
        attempt = job["attempt"]
        newest = replace(found, restart_count=max(found.restart_count, attempt))
        pk = self.store.record_job(newest, cluster=cluster, env=spec.env,
                                   mode=spec.mode or "", spec=spec.canonical())
        # the hook's own count names the attempt: a late epilog belongs to its attempt
        self.store.record_attempt(pk, replace(found, restart_count=attempt))
        if problem:
            self.store.note_invalid_spec(pk, job["spec"], problem, attempt, f"hooks/{node}")
        return pk, attempt

    def store_report(self, hook: str, report: dict, sender_uid: int | None = None) -> StoredReport:
        """Store one validated report atomically; a known report_id is a no-op."""
        with self.store.transaction():
            existing = self.store.report_by_id(report["report_id"])
            if existing:
                return StoredReport(existing["id"], True, existing["job"])
            cluster = report["cluster"] or self.cluster
            job_pk = attempt = None
            if report.get("job"):
                job_pk, attempt = self._job(cluster, report["node"], report["job"], hook,
                                            report.get("created") or 0,
                                            report.get("delivery") is not None)
            row = self._report_row(hook, report, cluster, job_pk, attempt, sender_uid)
            if job_pk is not None:   # judged already: the watch loop counts its XIDs
                row["after_verdict"] = int(self._after_verdict(hook, row, job_pk, attempt))
            report_pk = self.store.add_report(row)
            self._store_xids(report, report_pk, job_pk, attempt)
            self._node_health(report)
            if self.proactive is not None:
                self._degradation(report, report_pk, cluster)
            if job_pk is not None:
                self.store.add_event(job_pk, f"hook_{hook}", _arrival(hook, report, row),
                                     attempt=attempt, source="hooks",
                                     data={"report": report["report_id"],
                                           "xids": len(report["xids"]),
                                           "gpus": report["gpus"].get("count"),
                                           "after_verdict": bool(row["after_verdict"]),
                                           **({"delivery": report["delivery"]}
                                              if row["late"] else {})})
        if job_pk is not None and report.get("log_lines"):
            for listener in self.log_listeners:
                listener(job_pk, attempt, report)
        if job_pk is not None and (hook == "epilog" or report["xids"]
                                   or report.get("log_lines")):
            for listener in self.evidence_listeners:
                listener(job_pk)
        return StoredReport(report_pk, False, job_pk)

    def _after_verdict(self, hook: str, row: dict, job_pk: int, attempt: int) -> bool:
        """Whether the report's run had its verdict before the report came. A
        prolog sent at once (not replayed) starts its run: never after that
        run's verdict, whatever an earlier run of the same attempt had."""
        if hook == "prolog" and not row["late"]:
            return False
        return report_rows.report_judged(self.store, job_pk, attempt, row["run_start"])

    def _report_row(self, hook, report, cluster, job_pk, attempt, sender_uid) -> dict:
        gpus = report["gpus"]
        exit_info = report.get("exit") or {}
        delivery = report.get("delivery")
        return {"report_id": report["report_id"], "hook": hook, "cluster": cluster,
                "late": int(delivery is not None), "after_verdict": 0,
                "spooled_at": (delivery or {}).get("spooled_at"),
                "delivery": json.dumps(delivery) if delivery is not None else None,
                "node": report["node"], "job": job_pk, "attempt": attempt,
                "created": report["created"], "received": time.time(),
                "gpu_ok": int(bool(gpus.get("ok"))), "gpu_count": len(gpus["gpus"]),
                "gpus": json.dumps(gpus["gpus"]),
                "preflight": json.dumps(report.get("preflight")),
                "exit_code": exit_info.get("code"), "exit_signal": exit_info.get("signal"),
                "sender_uid": sender_uid, "body": json.dumps(report),
                "run_start": _run_start(report.get("job"))}

    def _store_xids(self, report: dict, report_pk: int, job_pk, attempt) -> None:
        by_pci = {str(g.get("pci_short", "")).lower(): g for g in report["gpus"]["gpus"]}
        for xid in report["xids"]:
            pci = str(xid.get("pci") or "").lower()
            gpu = by_pci.get(pci, {})
            fingerprint = hashlib.sha1(f"{report['node']}\0{xid['raw']}".encode()).hexdigest()
            self.store.add_xid({
                "report": report_pk, "job": job_pk, "attempt": attempt,
                "node": report["node"], "kind": xid.get("kind", "xid"), "xid": xid["xid"],
                "pci": pci, "gpu_index": gpu.get("index"), "gpu_uuid": gpu.get("uuid"),
                "time": xid.get("time"), "message": xid.get("message"), "raw": xid["raw"],
                "fingerprint": fingerprint,
            })

    def _degradation(self, report: dict, report_pk: int, cluster: str) -> None:
        """Score the node's GPUs on the readings of its reports within the
        window (this one included) and record each GPU whose score changed.
        A report that reads no counter at all (NVML failed, or a report
        without the fields) changes nothing the score reads, so it is not
        scored again; the next report with readings is."""
        cfg, node = self.proactive, report["node"]
        now = time.time()
        mine = degradation.readings_from_snapshot(
            node, report.get("created") or now, report.get("gpus") or {},
            report.get("xids") or [])
        if not any(v not in (None, ()) for r in mine for v in r.values.values()):
            return
        since = now - cfg.window - 60
        series = self._series.get(node)
        if series is None:
            # received, not created: a report replayed from a spool counts with
            # the rest; the window then ends at the newest reading's own time
            series = []
            xids = self.store.node_xids_since(node, since)
            for row in self.store.reports_since(node, since):   # this report included
                try:
                    gpus = json.loads(row["gpus"] or "[]")
                except ValueError:
                    continue
                series += degradation.readings_from_snapshot(
                    row["node"], row["created"] or row["received"],
                    {"ok": bool(row["gpu_ok"]), "gpus": gpus}, xids.get(row["id"], []))
            series.sort(key=lambda r: r.time)
        else:
            for reading in mine:
                insort(series, reading, key=lambda r: r.time)
            series = [r for r in series if r.time >= since] if series[0].time < since \
                else series
        self._series[node] = series
        for gpu, score in degradation.score_node(series, cfg).items():
            record = degradation.score_change(self.store.last_degradation(node, gpu), score)
            if record is not None:
                self.store.add_degradation(cluster, record, report_pk)
                log.info("node=%s gpu=%s: degradation %s -> %s (%s)", node, gpu,
                         record["previous_level"], record["level"],
                         ", ".join(r["rule"] for r in record["rules"]) or "no rule fires")

    def _node_health(self, report: dict) -> None:
        gpus = report["gpus"]
        summary = {"hook": report["hook"], "time": report["created"], "ok": gpus.get("ok"),
                   "count": len(gpus["gpus"]), "error": gpus.get("error"),
                   "xids": sorted({x["xid"] for x in report["xids"]}),
                   "preflight": (report.get("preflight") or {}).get("verdict")}
        self.store.set_node(report["node"], cluster=report["cluster"],
                            last_health=json.dumps(summary))

    def complete_submit_times(self, listed: dict[str, Job]) -> None:
        """Give jobs stored before the scheduler listed them their real submit
        time (and so their full key), unless that key is taken already."""
        with self.store.transaction():
            rows = self.store.jobs_without_submit_time(self.cluster)
            for row in rows:
                job = listed.get(row["job_id"])
                if job is None or not job.submit_time:
                    continue
                if job.job_id != row["job_id"]:
                    self.store.adopt_printable_id(self.cluster, job)
                    row = self.store.job(row["id"])
                owner = self.store.find_job_exact(self.cluster, row["job_id"], job.submit_time)
                if owner is not None:
                    if _same_owner(owner, row) and self._runs_again(owner, job):
                        # stored anew by a first prolog that came after the stored
                        # job had ended: slurmctld ran the job again (the fresh
                        # listing gives it the stored submit time), not a reused id
                        self.store.merge_job(row["id"], owner["id"])
                        log.info("job=%s: a prolog's new row is the stored job run "
                                 "again at restart count 0; merged", row["job_id"])
                    continue
                if row["job_id"] != job.job_id:
                    continue   # its printable name is taken: leave it to the poller
                self.store.set_submit_time(row["id"], job.submit_time)
