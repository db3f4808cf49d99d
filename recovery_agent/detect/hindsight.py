"""What later history says of our decisions, pure (the goodput ledger's
checks on itself; docs/goodput.md defines each figure):

* **precision of node blame**: of the nodes we excluded or drained (or, in
  monitor mode, would have), how many failed a later health check or job
  (confirmed) and how many were cleared by clean ones, within a horizon;
* **false-stop evidence**: a job we stopped (or would have) that its user
  submitted again unchanged, and that then ran fine.

The inputs are plain records gathered from the store by
``interfaces/ledger``; nothing here reads a store or the clock.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from .ledger import DONE_STATES, FAILED_STATES, FINAL_STATES

BLAME_VERDICTS = ("confirmed", "cleared", "no_evidence")
STOP_VERDICTS = ("ran_fine", "failed_again", "pending", "not_resubmitted")


@dataclass(frozen=True)
class Blame:
    """One node one recommendation excluded or drained (or would have)."""

    rec: int
    node: str
    time: float
    action: str
    category: str | None
    mode: str
    job_id: str | None = None
    user: str | None = None


@dataclass(frozen=True)
class NodeFact:
    """One thing the store recorded of a node after a blame: ``bad`` when it
    speaks against the node, else it speaks for it. ``kind``: ``report`` (a
    hook's report: its GPUs failing or XIDs in it, or clean), ``strike``
    (another decision blamed the node), ``job`` (a later attempt ran there and
    completed), ``resume`` (we resumed our drain after clean reports)."""

    time: float
    kind: str
    bad: bool
    detail: str = ""
    rec: int | None = None     # the recommendation it came from, if any


@dataclass
class BlameCheck:
    blame: Blame
    verdict: str = "no_evidence"
    evidence: list[NodeFact] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {**self.blame.__dict__, "verdict": self.verdict,
                "evidence": [f.__dict__ for f in self.evidence[:5]]}


def check_blame(blame: Blame, facts: Iterable[NodeFact], horizon: float) -> BlameCheck:
    """The blame against what the node did next, within ``horizon`` seconds:
    confirmed when anything spoke against it (a failing report, another
    decision's blame), else cleared when something spoke for it, else no
    evidence. The blaming recommendation's own strike is not evidence."""
    later = sorted((f for f in facts if blame.time < f.time <= blame.time + horizon
                    and f.rec != blame.rec), key=lambda f: f.time)
    bad = [f for f in later if f.bad]
    good = [f for f in later if not f.bad]
    if bad:
        return BlameCheck(blame, "confirmed", bad)
    if good:
        return BlameCheck(blame, "cleared", good)
    return BlameCheck(blame, "no_evidence", [])


def blame_summary(checks: list[BlameCheck]) -> dict:
    """Counts by verdict, the distinct nodes, and precision = confirmed /
    (confirmed + cleared) (None when neither: nothing to judge by)."""
    counts = {v: sum(1 for c in checks if c.verdict == v) for v in BLAME_VERDICTS}
    judged = counts["confirmed"] + counts["cleared"]
    return {"blames": len(checks), "nodes": len({c.blame.node for c in checks}),
            **counts, "would_have": sum(1 for c in checks if c.blame.mode == "monitor"),
            "precision": counts["confirmed"] / judged if judged else None,
            "detail": [c.as_dict() for c in checks]}


@dataclass(frozen=True)
class SubmittedJob:
    """A job as the false-stop check compares it."""

    pk: int
    job_id: str
    user: str
    name: str
    command: str        # the batch script's path ("" when Slurm did not list it)
    spec: str           # the recovery directive
    submit_time: float | None
    state: str
    attempts: int = 1


@dataclass(frozen=True)
class Stop:
    rec: int
    time: float
    mode: str
    job: SubmittedJob
    category: str | None = None


def unchanged(stopped: SubmittedJob, other: SubmittedJob) -> bool:
    """The same job submitted again: same user, name and directive, and the
    same batch script where Slurm listed it for both."""
    if other.pk == stopped.pk or not (stopped.name or stopped.command) or (
            other.user, other.name, other.spec) != (stopped.user, stopped.name, stopped.spec):
        return False
    return not (stopped.command and other.command) or stopped.command == other.command


def check_stop(stop: Stop, candidates: Iterable[SubmittedJob], within: float) -> dict:
    """What became of a stopped job: resubmitted unchanged within ``within``
    seconds of the stop, and then completed (``ran_fine``: evidence the stop
    was false), failed again, or not ended yet (``pending``); else
    ``not_resubmitted``."""
    again = sorted((c for c in candidates if unchanged(stop.job, c)
                    and c.submit_time is not None
                    and stop.time - 60 <= c.submit_time <= stop.time + within),
                   key=lambda c: c.submit_time or 0)
    verdict, which = "not_resubmitted", None
    for job in again:
        which = job
        if job.state in DONE_STATES:
            verdict = "ran_fine"
            break
        verdict = "failed_again" if job.state in FAILED_STATES | FINAL_STATES else "pending"
    return {"rec": stop.rec, "job_id": stop.job.job_id, "user": stop.job.user,
            "name": stop.job.name, "time": stop.time, "mode": stop.mode,
            "category": stop.category, "verdict": verdict,
            "resubmitted_as": which.job_id if which else None,
            "script_compared": bool(which and stop.job.command and which.command)}


def stop_summary(found: list[dict]) -> dict:
    counts = {v: sum(1 for f in found if f["verdict"] == v) for v in STOP_VERDICTS}
    return {"stops": len(found), **counts,
            "would_have": sum(1 for f in found if f["mode"] == "monitor"),
            "detail": found}
