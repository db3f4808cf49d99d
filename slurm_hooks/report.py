"""What a hook reports for an opted-in job (or, for the health check, the node):
the job's identity and directive, a GPU snapshot, the kernel's XIDs, the exit
status (epilog) and the preflight verdict (prolog)."""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from . import gpu, kmsg, settings, spec
from .delivery import Deliverer
from .node import node_name, node_path, setup_logging

log = logging.getLogger("slurm_hooks")
REPORT_VERSION = 1


# An epilog whose job failed, or that saw XIDs, carries the evidence a verdict
# needs: when the agent does not take it, it tries again after these pauses
# (about 3 s more at most with the default 0.5 s timeout) before spooling it.
EPILOG_RETRY_PAUSES = (0.5, 1.0)


def job_identity(environ: Mapping[str, str]) -> dict:
    """The job as the hook environment names it (``1234`` or ``1200_7``)."""
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or ""
    array_job, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and task and task.isdigit():
        printable = f"{array_job}_{task}"
    else:
        printable, array_job, task = job_id, None, None
    raw, source = spec.from_environ(environ)
    start = environ.get("SLURM_JOB_START_TIME", "")   # 24.11 and later
    return {
        "job_id": printable, "numeric_id": int(job_id) if job_id.isdigit() else None,
        "array_job_id": int(array_job) if array_job else None,
        "array_task_id": int(task) if task else None,
        "attempt": int(environ.get("SLURM_JOB_RESTART_COUNT") or environ.get(
            "SLURM_RESTART_COUNT") or 0),
        "user": environ.get("SLURM_JOB_USER", ""),
        "partition": environ.get("SLURM_JOB_PARTITION", ""),
        "nodes": environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST", ""),
        "spec": raw or "", "spec_source": source,
        "start_time": int(start) if start.isdigit() else None,
    }


def exit_status(environ: Mapping[str, str]) -> dict:
    """The job's exit as the epilog sees it: ``SLURM_JOB_EXIT_CODE2`` is code:signal."""
    code, _, sig = environ.get("SLURM_JOB_EXIT_CODE2", "").partition(":")
    return {"code": int(code) if code.isdigit() else None,
            "signal": int(sig) if sig.isdigit() and int(sig) else None}


def preflight(cfg: settings.Settings, gpus: dict, xids: list[dict]) -> dict:
    """Critical GPU faults that make this node unfit to start a job."""
    faults = []
    fatal = sorted({x["xid"] for x in xids if kmsg.is_fatal(x)})
    if fatal:
        faults.append(f"fatal XID(s) in the kernel log: {', '.join(map(str, fatal))}")
    expected = cfg.expected_gpus
    if expected and not gpus.get("ok"):
        faults.append(f"NVML failed: {gpus.get('error')}")
    elif expected and len(gpus.get("gpus", [])) < expected:
        faults.append(f"{len(gpus.get('gpus', []))} GPUs visible, {expected} expected")
    for g in gpus.get("gpus", []):
        if g.get("lost"):
            faults.append(f"GPU {g.get('index')} is lost")
        if g.get("remapped_rows_failure"):
            faults.append(f"GPU {g.get('index')} has a row-remap failure")
    return {"mode": cfg.preflight, "verdict": "fault" if faults else "ok",
            "faults": faults}


def _xids(cfg: settings.Settings, node: str, since: float | None) -> list[dict]:
    source = cfg.kernel_log
    if source.startswith("file:"):
        source = "file:" + node_path(source[5:], node)
    try:
        return kmsg.read_xids(source, since)
    except kmsg.KernelLogError as exc:
        log.warning("kernel log unreadable (%s): no XIDs this time", exc)
        return []


def _start_marker(spool: Path, job: dict) -> Path:
    return spool / "jobs" / f"{job['job_id']}.{job['attempt']}.start"


def _noted_start(spool: Path, job: dict) -> float | None:
    """When this node's prolog noted the attempt's start (see :func:`_note_start`)."""
    try:
        return float(_start_marker(spool, job).read_text().strip())
    except (OSError, ValueError):
        return None


def _job_window(hook: str, cfg: settings.Settings, spool: Path, job: dict | None, now: float) -> float | None:
    """Since when to collect XIDs: boot-long for the prolog's preflight, the
    job's start (noted by the prolog) for the epilog, a recent window otherwise."""
    if hook == "prolog":
        return None if cfg.preflight != "off" else now - cfg.xid_window
    if hook == "epilog" and job:
        noted = _noted_start(spool, job)
        return noted if noted is not None else now - cfg.xid_window
    return now - cfg.xid_window


def build_report(hook: str, cfg: settings.Settings, environ: Mapping[str, str], node: str,
                 spool: Path) -> dict:
    now = time.time()
    job = job_identity(environ) if hook != "health" else None
    if job is not None:
        # which run of the attempt this is, as this node saw it start: slurmctld
        # may run an attempt again at the same restart count
        job["started"] = now if hook == "prolog" else _noted_start(spool, job)
    snapshot = gpu.snapshot(node_path(cfg.nvml_library, node),
                            node_path(cfg.gpu_state_file, node))
    since = _job_window(hook, cfg, spool, job, now)
    xids = _xids(cfg, node, since)
    report = {"version": REPORT_VERSION, "hook": hook, "report_id": os.urandom(16).hex(),
              "created": now, "cluster": environ.get("SLURM_CLUSTER_NAME", ""),
              "node": node, "job": job, "gpus": snapshot, "xids": xids}
    if hook == "epilog":
        report["exit"] = exit_status(environ)
    if hook in ("prolog", "health") and cfg.preflight != "off":
        report["preflight"] = preflight(cfg, snapshot, xids)
        if hook == "prolog" and since is None:
            # only XIDs recent enough to matter to this job travel with the report
            report["xids"] = [x for x in xids if x.get("time") is None
                              or x["time"] >= now - cfg.xid_window
                              or kmsg.is_fatal(x)]
    return report


def _urgent(report: dict) -> bool:
    """An epilog report worth a few seconds more of the node's time: its job
    failed, or the kernel logged XIDs during it."""
    end = report.get("exit") or {}
    return bool(report["xids"] or end.get("code") or end.get("signal"))


def run_hook(hook: str, environ: Mapping[str, str]) -> int:
    """Build, deliver, and decide the exit code (non-zero only for an enforced
    preflight fault)."""
    cfg = settings.load(environ)
    node = node_name(environ)
    setup_logging(cfg, node)
    for problem in cfg.problems:
        log.warning("config: %s", problem)
    spool = Path(node_path(cfg.spool_dir, node))
    report = build_report(hook, cfg, environ, node, spool)
    job = report.get("job")
    if hook == "prolog" and job:
        _note_start(spool, job, report["created"])
    body = json.dumps(report, separators=(",", ":")).encode()
    deliverer = Deliverer(cfg.agent_url, cfg.timeout, spool,
                          cfg.munge_socket, sign=True)
    urgent = hook == "epilog" and _urgent(report)
    outcome = deliverer.deliver(hook, report["report_id"], body,
                                pauses=EPILOG_RETRY_PAUSES if urgent else ())
    if hook == "epilog" and outcome == "spooled":
        from . import replay
        if replay.start(spool, environ):
            log.info("epilog report spooled: a replayer retries for %.0fs", replay.WINDOW)
    log.info("%s job=%s attempt=%s gpus=%s xids=%s delivery=%s", hook,
             job and job["job_id"], job and job["attempt"], report["gpus"].get("count"),
             len(report["xids"]), outcome)
    verdict = report.get("preflight") or {}
    if hook == "prolog" and verdict.get("verdict") == "fault":
        log.error("preflight: %s", "; ".join(verdict["faults"]))
        if cfg.preflight == "enforce":
            print(f"slurm-recovery preflight: {'; '.join(verdict['faults'])}",
                  file=sys.stderr)
            return 1
    if hook == "epilog" and job:
        try:
            _start_marker(spool, job).unlink()
        except OSError:
            pass
    return 0


def _note_start(spool: Path, job: dict, when: float) -> None:
    try:
        marker = _start_marker(spool, job)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{when}\n")
    except OSError as exc:
        log.warning("cannot note job start in %s: %s", spool, exc)
