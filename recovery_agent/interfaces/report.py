"""``recovery-ctl report``: how would monitor mode have done against the humans?

For a time window, each ``would_have`` recommendation is set against what
actually happened in Slurm to the same job attempt and nodes:

* a job attempt requeued by someone (its next attempt exists: Slurm's restart
  count went up without a requeue of ours), or cancelled, or left ended;
* nodes drained by someone else within the window, with their reason, user
  and time: those the node state history holds (the watch loop records each
  change it sees, :mod:`recovery_agent.watch.nodestates`), so a drain lifted
  before the report ran counts too, and those ``sinfo`` shows now.

Agreement: we would have requeued and a human requeued; we would have stopped
and nobody requeued. Node exclusion precision and recall compare the nodes we
would have excluded or drained with the nodes humans drained in the window.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

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


def human_drains(history: Iterable[Mapping], listed: Iterable[Node], since: float,
                 until: float, ours_now: Mapping[str, bool]) -> dict[str, str]:
    """Node -> why, of the drains someone else set within ``since``..``until``
    (by Slurm's reason time): from the recorded ``history`` (a drain is ours
    when any state recorded of it, the same node, reason and time, was
    ours) and from the nodes ``listed`` now (``ours_now``: whether each one's
    drain is ours, by the store's record). A drain no longer in place says
    so. The first such drain of a node in the window names it."""
    now = {n.name: n for n in listed}
    drains: dict[tuple, dict] = {}
    for row in history:
        if not row.get("drained") or not row.get("reason"):
            continue
        key = (row["node"], row["reason"], row.get("reason_time"))
        kept = drains.setdefault(key, {"user": row.get("reason_user"), "ours": False})
        kept["ours"] = kept["ours"] or bool(row.get("ours"))
    for node in listed:
        if node.drained and node.reason:
            key = (node.name, node.reason, node.reason_time)
            kept = drains.setdefault(key, {"user": node.reason_user, "ours": False})
            kept["ours"] = kept["ours"] or bool(ours_now.get(node.name))
    out: dict[str, str] = {}
    for (name, reason, when), drain in sorted(drains.items(),
                                              key=lambda item: (item[0][2] or 0, item[0][0])):
        if drain["ours"] or name in out or not since <= (when or 0) <= until:
            continue
        shown = now.get(name)
        standing = (shown is not None and shown.drained and shown.reason == reason
                    and shown.reason_time == when)
        out[name] = f"{reason} ({drain['user'] or '?'})" + ("" if standing else
                                                             ", lifted since")
    return out


def build(store: Store, nodes: list[Node], since: float, until: float,
          cluster: str | None = None) -> Report:
    """Score the ``would_have`` recommendations of ``since``..``until``
    against what humans did: the jobs' later attempts, and the drains of
    ``cluster``'s node state history and of ``nodes`` (Slurm's listing now)."""
    report = Report(since, until)
    history = store.drain_states(cluster, since, until)
    ours_now = {n.name: our_drain(store.node(n.name), n) for n in nodes if n.drained}
    report.human_nodes.update(human_drains(history, nodes, since, until, ours_now))
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
