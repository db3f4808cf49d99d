"""``recovery-ctl report``: how would monitor mode have done against the humans?

For a time window, each ``would_have`` recommendation is set against what
actually happened in Slurm to the same job attempt and nodes:

* a job attempt requeued by someone (its next attempt exists: Slurm's restart
  count went up without a requeue of ours), or cancelled, or left ended;
* nodes drained by someone else, with their reason (``sinfo``: reason, user,
  time; a drain lifted since cannot be seen).

Agreement: we would have requeued and a human requeued; we would have stopped
and nobody requeued. Node exclusion precision and recall compare the nodes we
would have excluded or drained with the nodes humans drained in the window.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..decide.policy import our_drain
from ..scheduler.base import Node
from ..store import Status, Store

REQUEUES = ("requeue", "requeue_exclude", "kill_requeue")


@dataclass
class Report:
    since: float
    until: float
    compared: int = 0
    agreed: int = 0
    differ: list[dict] = field(default_factory=list)
    our_nodes: set[str] = field(default_factory=set)
    human_nodes: dict[str, str] = field(default_factory=dict)   # node -> reason

    @property
    def agreement(self) -> float | None:
        return self.agreed / self.compared if self.compared else None

    @property
    def precision(self) -> float | None:
        if not self.our_nodes:
            return None
        return len(self.our_nodes & set(self.human_nodes)) / len(self.our_nodes)

    @property
    def recall(self) -> float | None:
        if not self.human_nodes:
            return None
        return len(self.our_nodes & set(self.human_nodes)) / len(self.human_nodes)

    def as_dict(self) -> dict:
        return {"since": self.since, "until": self.until, "compared": self.compared,
                "agreed": self.agreed, "agreement": self.agreement,
                "node_precision": self.precision, "node_recall": self.recall,
                "our_nodes": sorted(self.our_nodes), "human_drains": self.human_nodes,
                "differ": self.differ}


def build(store: Store, nodes: list[Node], since: float, until: float) -> Report:
    report = Report(since, until)
    for node in nodes:
        when = node.reason_time or 0
        if node.drained and node.reason and not our_drain(store.node(node.name), node) \
                and since <= when <= until:
            report.human_nodes[node.name] = f"{node.reason} ({node.reason_user or '?'})"
    for rec in store.recommendations(Status.WOULD_HAVE):
        if not since <= rec.created <= until:
            continue
        if rec.scope == "node":
            report.our_nodes.update(rec.target_nodes)
            continue
        report.our_nodes.update(rec.exclude or [])
        job = store.job(rec.job)
        later = [a for a in store.attempts(rec.job) if a["attempt"] > rec.attempt]
        if later:
            human = "requeued"
        elif job["state"] == "CANCELLED":
            human = "cancelled"
        else:
            human = f"left {job['state']}"
        ours_requeue = rec.action in REQUEUES
        agree = ours_requeue == (human == "requeued")
        report.compared += 1
        if agree:
            report.agreed += 1
        else:
            report.differ.append({"rec": rec.id, "job": rec.job_id,
                                  "attempt": rec.attempt, "would_have": rec.action,
                                  "nodes": list(rec.exclude or rec.target_nodes),
                                  "humans": human, "reason": rec.reason})
    return report
