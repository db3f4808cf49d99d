"""The goodput ledger, pure: what each incident cost a job, and what recovery
saved against plain Slurm (issue 19; every figure is defined in docs/goodput.md).

The inputs are plain records (:class:`AttemptRecord`, :class:`DecisionRecord`,
:class:`SavedCheckpoint`, gathered into a :class:`JobRecord` by
``interfaces/ledger``); the assumptions are :class:`Assumptions`. Nothing here
reads a store, a file or the clock. A figure the inputs cannot support is
``None`` with its reason in :attr:`Incident.unknown`, never an estimate.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

# Slurm states in which an attempt ended badly (an incident even when no
# decision was taken)
FAILED_STATES = frozenset({"FAILED", "NODE_FAIL", "BOOT_FAIL", "OUT_OF_MEMORY", "TIMEOUT",
                           "DEADLINE"})
DONE_STATES = frozenset({"COMPLETED"})
# job states after which nothing more happens to the job
FINAL_STATES = FAILED_STATES | DONE_STATES | frozenset({"CANCELLED", "PREEMPTED", "GONE",
                                                         "REVOKED"})
# actions that move the job away from a node (what plain Slurm would not do)
EXCLUDING = frozenset({"requeue_exclude", "drain_node"})
# categories whose fault stays with a node until someone excludes it
NODE_FAULTS = frozenset({"gpu_hardware", "interconnect", "node", "hardware", "gpu"})
OUTCOMES = ("recovered", "stopped", "given_up", "unknown")


@dataclass(frozen=True)
class Assumptions:
    """What plain Slurm would have done, as parameters (docs/goodput.md).

    ``requeue_delay_s``: the wait Slurm puts on a requeued job before it may
    start again (its BeginTime; ~120 s measured on the dev cluster).
    ``repeat_on_node``: when the fault stays with a node and nothing would
    have excluded it, plain Slurm loses one more attempt (as long as the
    failed one ran, plus one more requeue delay).
    ``restart_after_decision_s``: in monitor mode, how long after our decision
    the job would have run again had we acted (the figure is ours to state).
    ``hang_noticed_after_s``: how long plain Slurm leaves a hung job before
    someone ends it; None (the default): unknown, so a hang's saving is unknown.
    ``seen_within_s``: an attempt first seen later than this after its start
    ran before the agent watched it.
    ``time_slack_s``: a checkpoint of the failed attempt dated at most this
    after the failure was saved at the failure (work lost 0): the failure time
    can be Slurm's end time, cut to whole seconds (up to 1 s early), and a
    checkpoint's comes from a node's clock (the save line's stamp, the file's
    mtime) or, for a line without a stamp, from when the agent read it (about
    a second late); later than that, work lost is unknown.
    ``blame_horizon_s``: how long after a node was excluded or drained its
    later health checks and jobs count as evidence for or against the blame.
    ``resubmit_within_s``: how soon after a stop the same job submitted again
    by its user counts as a resubmission."""

    requeue_delay_s: float = 120.0
    repeat_on_node: bool = True
    restart_after_decision_s: float = 30.0
    hang_noticed_after_s: float | None = None
    seen_within_s: float = 120.0
    time_slack_s: float = 3.0
    blame_horizon_s: float = 7 * 86400.0
    resubmit_within_s: float = 86400.0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class SavedCheckpoint:
    time: float
    step: int | None = None
    attempt: int | None = None


@dataclass(frozen=True)
class AttemptRecord:
    attempt: int
    start: float | None
    end: float | None
    state: str | None
    nodes: tuple[str, ...] = ()
    gpus: int | None = None          # GPUs of the attempt; None: unknown
    first_seen: float | None = None  # when the agent first saw it
    last_step: int | None = None     # the last step the log reported, when known
    last_step_time: float | None = None   # when it reported it


@dataclass(frozen=True)
class DecisionRecord:
    """The job recommendation of one attempt, with its times."""

    attempt: int
    action: str
    category: str | None
    mode: str
    status: str
    rule: str | None = None
    nodes: tuple[str, ...] = ()      # the nodes it blamed (target or excluded)
    failure: float | None = None
    detected: float | None = None
    acted: float | None = None       # first step on Slurm
    running_again: float | None = None


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    env: str
    user: str
    state: str
    attempts: tuple[AttemptRecord, ...]
    decisions: tuple[DecisionRecord, ...] = ()
    checkpoints: tuple[SavedCheckpoint, ...] = ()
    first_seen: float | None = None  # when the agent registered the job


@dataclass
class Incident:
    """One failed attempt and what followed (seconds; GPU-seconds)."""

    job_id: str
    attempt: int
    env: str
    user: str
    category: str
    nodes: tuple[str, ...]
    mode: str
    action: str
    outcome: str = "unknown"
    failure: float | None = None
    detected: float | None = None
    acted: float | None = None
    running_again: float | None = None
    gpus: int | None = None
    work_lost_s: float | None = None
    steps_lost: int | None = None
    downtime_s: float | None = None
    gpu_s_lost: float | None = None
    plain_downtime_s: float | None = None
    saved_s: float | None = None
    gpu_s_saved: float | None = None
    would_have: bool = False         # monitor mode: saved_s is what acting would have saved
    unknown: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dict(self.__dict__, nodes=list(self.nodes), unknown=dict(self.unknown))


def _forward(*times: float | None) -> bool:
    """Do the known times run forward (none earlier than the one before)?"""
    known = [t for t in times if t is not None]
    return all(a <= b for a, b in zip(known, known[1:]))


def incidents(job: JobRecord, assume: Assumptions = Assumptions()) -> list[Incident]:
    """The job's incidents: each attempt that ended in a failure state or got a
    job decision acting on it, in attempt order."""
    decided = {d.attempt: d for d in job.decisions if d.action != "none"}
    attempts = sorted(job.attempts, key=lambda a: a.attempt)
    out = [_unseen(job, n) for n in range(attempts[0].attempt if attempts else 0)]
    for i, att in enumerate(attempts):
        dec = decided.get(att.attempt)
        if dec is None and (att.state or "") not in FAILED_STATES:
            continue
        out.append(_incident(job, att, dec, attempts[i + 1:], assume))
    return out


def _unseen(job: JobRecord, attempt: int) -> Incident:
    """An attempt that ended (the job was requeued) before the agent watched it."""
    inc = Incident(job.job_id, attempt, job.env, job.user, "unknown", (), "none", "none")
    inc.unknown["attempt"] = "it ended before the agent watched the job"
    return inc


def _incident(job: JobRecord, att: AttemptRecord, dec: DecisionRecord | None,
              later: list[AttemptRecord], assume: Assumptions) -> Incident:
    inc = Incident(job.job_id, att.attempt, job.env, job.user,
                   (dec.category if dec else None) or "unknown",
                   (dec.nodes if dec else ()) or (), dec.mode if dec else "none",
                   dec.action if dec else "none", gpus=att.gpus,
                   would_have=bool(dec and dec.mode == "monitor"))
    inc.failure = (dec.failure if dec else None) or att.end
    if dec is not None:
        inc.detected, inc.acted = dec.detected, dec.acted
        inc.running_again = dec.running_again
    nxt = later[0] if later else None
    if inc.running_again is None and nxt is not None:
        inc.running_again = nxt.start
    if inc.failure is None:
        inc.unknown["failure"] = "the attempt has no end and no decision dated its failure"
    elif not _forward(att.start, inc.failure, inc.detected, inc.acted, inc.running_again):
        inc.unknown["times"] = "times go backwards (a clock jump): nothing is computed"
        inc.outcome = _outcome(job, att, dec, later, None)
        return inc
    _work_lost(job, att, inc, assume)
    _downtime(job, inc)
    if att.gpus is None:
        inc.unknown["gpus"] = "no GPU count for the attempt (no node report gave one)"
    elif inc.work_lost_s is not None and inc.downtime_s is not None:
        inc.gpu_s_lost = att.gpus * (inc.work_lost_s + inc.downtime_s)
    inc.outcome = _outcome(job, att, dec, later, inc.failure)
    _counterfactual(att, dec, inc, assume)
    return inc


def _work_lost(job: JobRecord, att: AttemptRecord, inc: Incident,
               assume: Assumptions) -> None:
    """Failure minus the newest checkpoint before it (never before the
    attempt's start: what earlier attempts lost is theirs)."""
    if inc.failure is None:
        return
    before = [c for c in job.checkpoints if c.time <= inc.failure]
    after = [c.time - inc.failure for c in job.checkpoints
             if c.time > inc.failure and c.attempt == att.attempt]
    if any(late > assume.time_slack_s for late in after):
        inc.unknown["work_lost"] = "a checkpoint of this attempt is dated after its failure"
        return
    if after:
        # saved at the failure, as far as the clocks tell (Slurm's whole seconds;
        # a save line without a stamp, dated when the agent read it): nothing lost
        inc.work_lost_s = 0.0
        _steps_lost(att, max((c for c in job.checkpoints if c.time > inc.failure
                              and c.attempt == att.attempt), key=lambda c: c.time), inc, assume)
        return
    if not before:
        late = (att.first_seen is not None and att.start is not None
                and att.first_seen > att.start + assume.seen_within_s)
        inc.unknown["work_lost"] = (
            "the attempt ran before the agent watched it: checkpoints before then were "
            "not seen" if late else "no checkpoint seen before the failure")
        return
    newest = max(before, key=lambda c: c.time)
    if att.start is None:
        inc.unknown["work_lost"] = "the attempt's start is unknown"
        return
    since = max(newest.time, att.start)
    inc.work_lost_s = inc.failure - since
    _steps_lost(att, newest, inc, assume)


def _steps_lost(att: AttemptRecord, ckpt: SavedCheckpoint, inc: Incident,
                assume: Assumptions) -> None:
    """The last step the attempt's log reported minus the step of the
    checkpoint it falls back to. The job resumes from that checkpoint whichever
    attempt wrote it, so an earlier attempt's counts too, as long as the log's
    steps went beyond it (else the two do not count the same steps)."""
    if att.last_step is None:
        inc.unknown["steps_lost"] = "the log reported no step (no known step line)"
    elif ckpt.step is None:
        inc.unknown["steps_lost"] = "the checkpoint's step is not known"
    elif inc.failure is not None and att.last_step_time is not None \
            and att.last_step_time > inc.failure + assume.time_slack_s:
        inc.unknown["steps_lost"] = "the last step reported is dated after the failure"
    elif att.last_step < ckpt.step and ckpt.attempt != att.attempt:
        inc.unknown["steps_lost"] = ("the log's steps stay below the checkpoint's: it "
                                     "resumed from an older one")
    else:
        inc.steps_lost = max(0, att.last_step - ckpt.step)


def _downtime(job: JobRecord, inc: Incident) -> None:
    if inc.failure is None:
        return
    if inc.running_again is None:
        inc.unknown["downtime"] = ("the job did not run again" if job.state in FINAL_STATES
                                   else "the job is not running again yet")
        return
    inc.downtime_s = inc.running_again - inc.failure


def _outcome(job: JobRecord, att: AttemptRecord, dec: DecisionRecord | None,
             later: list[AttemptRecord], failure: float | None) -> str:
    """recovered: the job later completed, or a later checkpoint went beyond
    the one at the failure; stopped: we stopped it (or would have, in
    monitor mode); given up: it ended without either; else unknown."""
    if dec is not None and dec.action == "stop":
        return "stopped"
    if any((a.state or "") in DONE_STATES for a in later) or (
            later and job.state in DONE_STATES):
        return "recovered"
    at_failure = [c for c in job.checkpoints if c.attempt is not None
                  and c.attempt <= att.attempt]
    beyond = [c for c in job.checkpoints if c.attempt is not None and c.attempt > att.attempt]
    if beyond:
        if failure is None:
            return "recovered"
        best = max((c.step for c in at_failure if c.step is not None), default=None)
        if any((c.step is not None and best is not None and c.step > best)
               or (best is None and c.time > failure) for c in beyond):
            return "recovered"
    if job.state in FINAL_STATES and not (dec and dec.status in ("proposed", "executing")):
        return "given_up"
    return "unknown"


def _counterfactual(att: AttemptRecord, dec: DecisionRecord | None, inc: Incident,
                    assume: Assumptions) -> None:
    """Plain Slurm's downtime for this incident, and the saving against ours
    (in monitor mode: what our recommendation would have saved against what
    happened)."""
    if dec is None or dec.action in ("none", "stop"):
        inc.plain_downtime_s = None
        inc.saved_s = 0.0 if dec is not None else None
        if dec is None:
            inc.unknown["saved"] = "no decision: nothing to compare"
        return
    if inc.failure is None:
        inc.unknown["saved"] = "the failure time is unknown"
        return
    if dec.action == "kill_requeue" or inc.category == "hang":
        if assume.hang_noticed_after_s is None:
            inc.unknown["saved"] = ("a hang: how long plain Slurm leaves it is an assumption "
                                    "left unset (hang_noticed_after_s)")
            return
        noticed = assume.hang_noticed_after_s
    else:
        ended = att.end if att.end is not None and att.end >= inc.failure else inc.failure
        noticed = ended - inc.failure
    plain = noticed + assume.requeue_delay_s
    stays = (dec.action in EXCLUDING or bool(dec.nodes)) and inc.category in NODE_FAULTS
    if assume.repeat_on_node and stays and att.start is not None:
        plain += (inc.failure - att.start) + assume.requeue_delay_s
    inc.plain_downtime_s = plain
    if inc.would_have:
        if inc.downtime_s is None or inc.detected is None:
            inc.unknown["saved"] = ("monitor mode, and the job did not run again: what "
                                    "acting would have saved cannot be measured")
            return
        ours = (inc.detected - inc.failure) + assume.restart_after_decision_s
        inc.saved_s = inc.downtime_s - ours
    else:
        if inc.downtime_s is None:
            inc.unknown["saved"] = "our downtime is not known yet"
            return
        inc.saved_s = plain - inc.downtime_s
    if inc.gpus is not None:
        inc.gpu_s_saved = inc.gpus * inc.saved_s


# -- aggregates ------------------------------------------------------------
def percentile(values: list[float], share: float) -> float | None:
    """Nearest-rank percentile (``share`` in 0..1); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(round(share * len(ordered), 9)))
    return ordered[min(len(ordered), rank) - 1]


def median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


@dataclass
class JobTime:
    """One job's allocated and productive GPU-seconds (for ETTR); None when
    some figure it needs is unknown."""

    allocated: float | None
    productive: float | None


# attempt states with no end yet: it runs (or waits to) at the window's end
LIVE_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "RESIZING",
                         "COMPLETING", "STAGE_OUT", "SIGNALING"})


def overlap(start: float, end: float, since: float | None, until: float | None) -> float:
    """Seconds of [start, end] inside [since, until] (None: unbounded)."""
    low = start if since is None else max(start, since)
    high = end if until is None else min(end, until)
    return max(0.0, high - low)


def job_time(job: JobRecord, found: list[Incident], since: float | None = None,
             until: float | None = None, now: float | None = None) -> JobTime:
    """The job's GPU-seconds inside [since, until] (None: its whole life).
    Allocated: Σ GPUs × the part of each attempt's run inside the window (an
    attempt still running counts up to ``until`` or ``now``, the earlier), plus the part of each
    incident's downtime inside it (the job waited, not of its own accord);
    productive: allocated minus the part of each incident's lost GPU time
    inside the window (its work lost, then its downtime). An incident after
    which the job never ran again costs its work lost only: the allocation
    ended with it."""
    allocated = 0.0
    for att in job.attempts:
        end = att.end
        if end is None and (att.state or "") in LIVE_STATES:
            bounds = [t for t in (until, now) if t is not None]
            end = min(bounds) if bounds else None
        if att.start is None or end is None or att.gpus is None or end < att.start:
            return JobTime(None, None)
        allocated += att.gpus * overlap(att.start, end, since, until)
    lost = 0.0
    for inc in found:
        parts = _lost_spans(job, inc)
        if parts is None:
            return JobTime(None, None)
        (lost_from, failure), waited = parts
        gpus = inc.gpus or 0
        down = overlap(failure, waited, since, until) if waited is not None else 0.0
        lost += gpus * (overlap(lost_from, failure, since, until) + down)
        allocated += gpus * down
    return JobTime(allocated, allocated - lost)


def _lost_spans(job: JobRecord, inc: Incident
                ) -> tuple[tuple[float, float], float | None] | None:
    """(work lost from, failure) and the end of the downtime (None: the job
    never ran again, nothing waited), or None when a figure is unknown."""
    if inc.failure is None or inc.work_lost_s is None or inc.gpus is None:
        return None
    span = (inc.failure - inc.work_lost_s, inc.failure)
    if inc.downtime_s is not None:
        return span, inc.failure + inc.downtime_s
    if job.state in FINAL_STATES and inc.running_again is None \
            and inc.attempt == max(a.attempt for a in job.attempts):
        return span, None
    return None


def aggregate(jobs: Iterable[JobRecord], by: str | None = None,
              assume: Assumptions = Assumptions(),
              keep: Callable[[Incident], bool] = lambda inc: True,
              since: float | None = None, until: float | None = None,
              now: float | None = None) -> dict[str, dict]:
    """The ledger per group (``by``: env, user, category or node; None: one
    group ``all``): counts by outcome, MTTR, GPU-hours lost and saved, ETTR,
    and how many figures were unknown. ``keep``: which incidents count (those
    of a window); ETTR counts the part of each job inside [since, until]."""
    groups: dict[str, dict] = {}

    def group(key: str) -> dict:
        return groups.setdefault(key, {"incidents": 0, **{o: 0 for o in OUTCOMES},
                                       "_down": [], "gpu_s_lost": 0.0, "gpu_s_saved": 0.0,
                                       "would_have_gpu_s_saved": 0.0, "unknown_lost": 0,
                                       "unknown_saved": 0, "_alloc": 0.0, "_prod": 0.0,
                                       "ettr_jobs": 0, "ettr_unknown_jobs": 0})
    for job in jobs:
        found = incidents(job, assume)
        if by in (None, "env", "user"):
            key = "all" if by is None else (job.env if by == "env" else job.user) or "-"
            times = job_time(job, found, since, until, now)
            g = group(key)
            if times.allocated is None:
                g["ettr_unknown_jobs"] += 1
            elif times.allocated > 0:
                g["_alloc"] += times.allocated
                g["_prod"] += times.productive or 0.0
                g["ettr_jobs"] += 1
        for inc in filter(keep, found):
            for key in _keys(inc, by):
                _add(group(key), inc)
    return {key: _finish(g) for key, g in sorted(groups.items())}


def _keys(inc: Incident, by: str | None) -> list[str]:
    if by is None:
        return ["all"]
    if by == "node":
        return list(inc.nodes) or ["-"]
    return [getattr(inc, by) or "-"]


def _add(g: dict, inc: Incident) -> None:
    g["incidents"] += 1
    g[inc.outcome] += 1
    if inc.outcome == "recovered" and inc.downtime_s is not None:
        g["_down"].append(inc.downtime_s)
    if inc.gpu_s_lost is None:
        g["unknown_lost"] += 1
    else:
        g["gpu_s_lost"] += inc.gpu_s_lost
    if inc.gpu_s_saved is None:
        g["unknown_saved"] += 1
    elif inc.would_have:
        g["would_have_gpu_s_saved"] += inc.gpu_s_saved
    else:
        g["gpu_s_saved"] += inc.gpu_s_saved


def _finish(g: dict) -> dict:
    down = g.pop("_down")
    alloc, prod = g.pop("_alloc"), g.pop("_prod")
    g["mttr_median_s"] = median(down)
    g["mttr_p95_s"] = percentile(down, 0.95)
    g["gpu_hours_lost"] = g.pop("gpu_s_lost") / 3600
    g["gpu_hours_saved"] = g.pop("gpu_s_saved") / 3600
    g["would_have_gpu_hours_saved"] = g.pop("would_have_gpu_s_saved") / 3600
    g["ettr"] = prod / alloc if alloc > 0 else None
    return g
