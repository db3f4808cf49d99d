"""The goodput ledger's inputs, gathered from the store: one job's record or
those of every job active in a window (:func:`job_record`, :func:`window`),
the blames and stops later history judges (:func:`blame_checks`,
:func:`stop_checks`), and the assumptions from the config's ``[ledger]``
section. The computation is :mod:`recovery_agent.detect.ledger` and
:mod:`recovery_agent.detect.hindsight` (pure); docs/goodput.md defines the
figures. ``user`` (a reader who sees only their own jobs) narrows every part
to that user's jobs."""
from __future__ import annotations

import math
import time
from datetime import datetime

from ..config import Config
from ..config import parse_duration
from ..detect.hindsight import (Blame, NodeFact, Stop, SubmittedJob, blame_summary,
                                check_blame, check_stop, stop_summary)
from ..detect.ledger import (AttemptRecord, Assumptions, DecisionRecord, Incident, JobRecord,
                             SavedCheckpoint, aggregate, incidents)
from ..errors import RecoveryError
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
                       seen_within_s=led.seen_within, time_slack_s=led.time_slack,
                       blame_horizon_s=led.blame_horizon,
                       resubmit_within_s=led.resubmit_within)


def window_time(text: str | float | None, now: float, what: str = "since") -> float | None:
    """A window bound as the API takes it: Unix seconds, an ISO time (this
    host's zone unless it names one), or a duration back from ``now`` (30m,
    2h, 7d). ValueError names what is wrong."""
    if text is None or text == "":
        return None
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(value):
            raise ValueError(f"{what}={text!r}: not a time")
        return value
    try:
        return now - parse_duration(text, what)
    except RecoveryError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise ValueError(f"{what}={text!r}: use Unix seconds, an ISO time "
                         "(2026-11-29T10:00) or a duration back from now (30m, 2h, 7d)"
                         ) from None


def job_record(store: Store, row: dict) -> JobRecord:
    """A stored job (its ``jobs`` row) as the ledger reads it."""
    pk = row["id"]
    gpus = store.attempt_gpus(pk)
    attempts = tuple(AttemptRecord(
        attempt=a["attempt"], start=_time(a["start_time"]),
        end=None if (a["state"] or "") in RUNNING else _time(a["end_time"]),
        state=a["state"], nodes=tuple(a["nodes"]), gpus=gpus.get(a["attempt"]),
        first_seen=a["first_seen"], last_step=a.get("last_step"),
        last_step_time=a.get("last_step_time")) for a in store.attempts(pk))
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


def window(store: Store, cluster: str, since: float, until: float,
           user: str | None = None) -> list[JobRecord]:
    return [job_record(store, row) for row in store.ledger_jobs(cluster, since, until)
            if user is None or (row["user"] or "") == user]


def in_window(inc: Incident, since: float, until: float) -> bool:
    """An incident belongs to the window its failure time falls in (an
    incident without one: the window of its job's activity)."""
    return inc.failure is None or since <= inc.failure <= until


# -- what later history says -----------------------------------------------------
def blame_checks(store: Store, cfg: Config, since: float, until: float, now: float,
                 user: str | None = None) -> dict:
    """Each node we excluded or drained in the window (one per node and
    decision: a job's exclusion and the drain it asked for are one blame),
    judged by what the node did within ``ledger.blame_horizon`` after."""
    horizon = cfg.ledger.blame_horizon
    blames: dict[tuple, Blame] = {}
    attempt_of: dict[int, tuple] = {}
    for row in store.ledger_blames(cfg.agent.cluster, since, until):
        if user is not None and (row["user"] or "") != user:
            continue
        for node in row["nodes"]:
            key = (node, row["job"], row["attempt"]) if row["job"] else (node, row["id"])
            if key in blames:
                continue
            blames[key] = Blame(rec=row["id"], node=node, time=row["created"],
                                action=row["action"], category=row["reason_category"],
                                mode=row["mode"], job_id=row["job_id"], user=row["user"])
            attempt_of[row["id"]] = (row["job"], row["attempt"])
    checks = []
    for blame in blames.values():
        mine = attempt_of[blame.rec]
        facts = [NodeFact(time=f["time"], kind=f["kind"], bad=bool(f["bad"]),
                          detail=_shown(f, user), rec=f.get("rec"))
                 for f in store.node_facts(blame.node, blame.time,
                                           min(now, blame.time + horizon))
                 # the failed attempt's own late reports and strikes are the blame's
                 # evidence, not what came after
                 if not (f.get("job") == mine[0] and f.get("attempt") in (mine[1], None)
                         and f["kind"] in ("report", "strike")
                         and f["time"] <= blame.time + 600)]
        checks.append(check_blame(blame, facts, horizon))
    return blame_summary(checks)


def _shown(fact: dict, user: str | None) -> str:
    """A fact's detail (a job id, a hook, a category) as ``user`` may see it:
    another user's job on the node counts as evidence, but says nothing of
    that job, as the node pages do for others' strikes."""
    if user is not None and fact.get("job") is not None and (fact.get("job_user") or "") != user:
        return ""
    return str(fact.get("detail") or "")


def _submitted(row: dict) -> SubmittedJob:
    return SubmittedJob(pk=row["id"], job_id=row["job_id"], user=row["user"] or "",
                        name=row["name"] or "", command=row.get("command") or "",
                        spec=row["spec"] or "", submit_time=row["submit_time"] or None,
                        state=row["state"] or "UNKNOWN",
                        attempts=(row["restart_count"] or 0) + 1)


def stop_checks(store: Store, cfg: Config, since: float, until: float,
                user: str | None = None) -> dict:
    """Each stop in the window, and whether its user submitted the job again
    unchanged within ``ledger.resubmit_within`` and it then ran fine."""
    within = cfg.ledger.resubmit_within
    found, claimed = [], set()   # a resubmission answers for one stop only
    for row in store.ledger_stops(cfg.agent.cluster, since, until):
        if user is not None and (row["user"] or "") != user:
            continue
        stop = Stop(rec=row["rec"], time=row["created"], mode=row["mode"],
                    job=_submitted(row), category=row["reason_category"])
        others = [_submitted(r) for r in store.same_named_jobs(
            cfg.agent.cluster, row["user"] or "", row["name"] or "", stop.time - 60,
            stop.time + within)] if row["name"] else []
        verdict = check_stop(stop, [o for o in others if o.pk not in claimed], within)
        claimed.update(o.pk for o in others if o.job_id == verdict["resubmitted_as"])
        found.append(verdict)
    return stop_summary(found)


# -- the report ----------------------------------------------------------------------
def report(store: Store, cfg: Config, since: float, until: float,
           by: str | None = None, user: str | None = None, now: float | None = None,
           checks: bool = True) -> dict:
    """The ledger over [since, until]: groups (see ``detect.ledger.aggregate``),
    every incident, the precision of node blame and the false-stop evidence
    (unless ``checks`` is false), and the assumptions it rests on. A running
    attempt counts up to ``until`` or ``now``, the earlier."""
    now = time.time() if now is None else now
    assume = assumptions(cfg)
    jobs = window(store, cfg.agent.cluster, since, until, user)
    found = [inc for job in jobs for inc in incidents(job, assume)
             if in_window(inc, since, until)]
    return {"since": since, "until": until, "by": by or "all",
            "assumptions": assume.as_dict(),
            "groups": aggregate(jobs, by, assume, keep=lambda i: in_window(i, since, until),
                                since=since, until=until, now=now),
            "incidents": [inc.as_dict() for inc in found],
            "blame": blame_checks(store, cfg, since, until, now, user) if checks else None,
            "false_stops": stop_checks(store, cfg, since, until, user) if checks else None}


def summarize(found: list[dict]) -> dict:
    """One job's incidents (as dicts) and their totals: what ``show job``'s
    goodput line says."""
    lost = [i["gpu_s_lost"] for i in found if i["gpu_s_lost"] is not None]
    saved = [i["saved_s"] for i in found if i["saved_s"] is not None]
    steps = [i["steps_lost"] for i in found if i.get("steps_lost") is not None]
    return {"incidents": len(found), "gpu_s_lost": sum(lost) if lost else None,
            "unknown_lost": len(found) - len(lost),
            "steps_lost": sum(steps) if steps else None,
            "unknown_steps": len(found) - len(steps),
            "saved_s": sum(saved) if saved else None, "unknown_saved": len(found) - len(saved),
            "would_have": any(i["would_have"] for i in found),
            "detail": list(found)}


def job_summary(store: Store, cfg: Config, row: dict) -> dict:
    """One job's ledger: its incidents and their totals."""
    return summarize([i.as_dict() for i in incidents(job_record(store, row),
                                                     assumptions(cfg))])


def job_report(store: Store, cfg: Config, row: dict, now: float | None = None) -> dict:
    """The report of one job over its whole history (what ``GET
    /v1/goodput?job=`` answers): its groups and incidents, with the summary
    ``show job`` prints."""
    now = time.time() if now is None else now
    assume = assumptions(cfg)
    record = job_record(store, row)
    found = incidents(record, assume)
    since = min([a.start for a in record.attempts if a.start is not None]
                + [row["first_seen"] or now])
    return {"since": since, "until": now, "by": "all", "job": row["job_id"],
            "assumptions": assume.as_dict(),
            "groups": aggregate([record], None, assume, since=since, until=now, now=now),
            "incidents": [i.as_dict() for i in found],
            "summary": summarize([i.as_dict() for i in found])}


def overview(store: Store, cfg: Config, since: float, until: float,
             user: str | None = None, now: float | None = None) -> dict:
    """What the Console's goodput page draws, from one pass over the window's
    jobs: the cluster's figures (``all``), the groups by category, environment
    and node, every incident, and the checks on node blame and stops."""
    now = time.time() if now is None else now
    assume = assumptions(cfg)
    jobs = window(store, cfg.agent.cluster, since, until, user)
    found = [inc for job in jobs for inc in incidents(job, assume)
             if in_window(inc, since, until)]

    def groups(by: str | None) -> dict:
        return aggregate(jobs, by, assume, keep=lambda i: in_window(i, since, until),
                         since=since, until=until, now=now)
    return {"since": since, "until": until, "assumptions": assume.as_dict(),
            "all": groups(None).get("all"), "category": groups("category"),
            "env": groups("env"), "node": groups("node"),
            "incidents": [inc.as_dict() for inc in found],
            "blame": blame_checks(store, cfg, since, until, now, user),
            "false_stops": stop_checks(store, cfg, since, until, user)}
