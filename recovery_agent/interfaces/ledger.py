"""The goodput ledger's inputs, gathered from the store: one job's record or
those of every job active in a window (:func:`job_record`, :func:`window`),
and the assumptions from the config's ``[ledger]`` section. The computation is
:mod:`recovery_agent.detect.ledger` (pure); docs/goodput.md defines the figures."""
from __future__ import annotations

from ..config import Config
from ..detect.ledger import (AttemptRecord, Assumptions, DecisionRecord, Incident, JobRecord,
                             SavedCheckpoint, aggregate, incidents)
from ..store import Store

BY = ("env", "user", "category", "node")
# states of an attempt not ended yet: the end time Slurm lists then is when it
# would reach its time limit, not an end
RUNNING = frozenset({"PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "RESIZING",
                     "COMPLETING", "STAGE_OUT", "SIGNALING"})


def assumptions(cfg: Config) -> Assumptions:
    led = cfg.ledger
    return Assumptions(requeue_delay_s=led.requeue_delay, repeat_on_node=led.repeat_on_node,
                       restart_after_decision_s=led.restart_after_decision,
                       hang_noticed_after_s=led.hang_noticed_after or None,
                       seen_within_s=led.seen_within, time_slack_s=led.time_slack)


def job_record(store: Store, row: dict) -> JobRecord:
    """A stored job (its ``jobs`` row) as the ledger reads it."""
    pk = row["id"]
    gpus = store.attempt_gpus(pk)
    attempts = tuple(AttemptRecord(
        attempt=a["attempt"], start=_time(a["start_time"]),
        end=None if (a["state"] or "") in RUNNING else _time(a["end_time"]),
        state=a["state"], nodes=tuple(a["nodes"]), gpus=gpus.get(a["attempt"]),
        first_seen=a["first_seen"]) for a in store.attempts(pk))
    acted = store.first_step_times(pk)
    decisions = tuple(DecisionRecord(
        attempt=r.attempt, action=r.action, category=r.reason_category,
        mode=r.mode, status=str(r.status.value), rule=r.rule,
        nodes=tuple(dict.fromkeys((*r.target_nodes, *r.exclude))),
        failure=r.failure_at, detected=r.detected_at, acted=acted.get(r.id),
        running_again=r.running_again_at)
        for r in store.recommendations(job_pk=pk) if r.scope == "job" and r.attempt is not None)
    checkpoints = tuple(SavedCheckpoint(time=c["time"], step=c["step"], attempt=c["attempt"])
                        for c in store.job_checkpoints(pk))
    return JobRecord(job_id=row["job_id"], env=row["env"] or "", user=row["user"] or "",
                     state=row["state"] or "UNKNOWN", attempts=attempts, decisions=decisions,
                     checkpoints=checkpoints, first_seen=row["first_seen"])


def _time(value) -> float | None:
    """Slurm's 0 (or nothing) for a time not reached yet: None."""
    return float(value) if value else None


def window(store: Store, cluster: str, since: float, until: float) -> list[JobRecord]:
    return [job_record(store, row) for row in store.ledger_jobs(cluster, since, until)]


def in_window(inc: Incident, since: float, until: float) -> bool:
    """An incident belongs to the window its failure time falls in (an
    incident without one: the window of its job's activity)."""
    return inc.failure is None or since <= inc.failure <= until


def report(store: Store, cfg: Config, since: float, until: float,
           by: str | None = None) -> dict:
    """The ledger over [since, until]: groups (see ``detect.ledger.aggregate``),
    every incident, and the assumptions it rests on."""
    assume = assumptions(cfg)
    jobs = window(store, cfg.agent.cluster, since, until)
    found = [inc for job in jobs for inc in incidents(job, assume)
             if in_window(inc, since, until)]
    return {"since": since, "until": until, "by": by or "all",
            "assumptions": assume.as_dict(),
            "groups": aggregate(jobs, by, assume, keep=lambda i: in_window(i, since, until)),
            "incidents": [inc.as_dict() for inc in found]}


def job_summary(store: Store, cfg: Config, row: dict) -> dict:
    """One job's ledger: its incidents and their totals."""
    assume = assumptions(cfg)
    found = incidents(job_record(store, row), assume)
    lost = [i.gpu_s_lost for i in found if i.gpu_s_lost is not None]
    saved = [i.saved_s for i in found if i.saved_s is not None]
    return {"incidents": len(found), "gpu_s_lost": sum(lost) if lost else None,
            "unknown_lost": len(found) - len(lost),
            "saved_s": sum(saved) if saved else None, "unknown_saved": len(found) - len(saved),
            "would_have": any(i.would_have for i in found),
            "detail": [i.as_dict() for i in found]}
