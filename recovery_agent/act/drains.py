"""The node drains: draining a node and resuming it, the record that makes a
drain ours (what Slurm showed right after our call: reason, user, time), the
drains let go once someone else resumed or re-drained the node, and a resume
recommendation for each node we drained whose health reports have been clean
for ``policy.resume_after``.
"""
from __future__ import annotations

import logging

from ..decide.policy import our_drain
from ..errors import NodeNotFound, SchedulerError
from ..store import OPEN_STATUSES, Recommendation, Status
from .steps import may_have_run

log = logging.getLogger("recovery_agent.act.actuator")   # the actuator's, as before its split
DRAIN_TAG = "rcv:"
OLD_DRAIN_TAG = "recovery:"   # the wording before drain reasons were cut to fit sinfo -R
REASON_WIDTH = 20   # sinfo -R's REASON column (%20E): a longer reason is cut there
# short labels for the reason Slurm shows; the full reason stays in our store
_LABELS = {"gpu_hardware": "gpu", "interconnect": "net", "nccl_timeout_hang": "hang",
           "cuda_error": "cuda", "oom": "oom", "system_software": "sys",
           "application": "app", "segfault": "segv", "lemon": "lemon",
           "straggler": "slow", "hang_suspect": "hang", "degraded": "degraded",
           "": "fault"}


def drain_xid(rec: Recommendation, node: str | None = None) -> int | None:
    """The XID the drain rests on: the first in the verdict's evidence on
    ``node``, else the first on any node; None when the evidence names none."""
    items = [e for e in (rec.evidence if isinstance(rec.evidence, list) else [])
             if isinstance(e, dict) and isinstance(e.get("xid"), int)]
    on_node = [e for e in items if e.get("node") == node]
    return (on_node or items or [{"xid": None}])[0]["xid"]


def drain_reason(rec_id: int, category: str, xid: int | None = None) -> str:
    """The reason we give slurmctld, at most :data:`REASON_WIDTH` characters so
    ``sinfo -R`` shows it whole: our tag, the XID or a short category, and the
    recommendation (``rcv:xid79 #12``, ``rcv:net #40``). The tag only helps a
    reader: what makes a drain ours is the record :func:`our_drain` checks."""
    label = f"xid{xid}" if xid is not None and 0 <= xid < 10000 else _LABELS.get(
        category or "", "".join(c for c in (category or "") if c.isalnum())[:5] or "fault")
    suffix = f" #{rec_id}"
    room = max(REASON_WIDTH - len(DRAIN_TAG) - len(suffix), 0)
    return f"{DRAIN_TAG}{label[:room]}{suffix}"[:REASON_WIDTH]


def slurm_reason(rec: Recommendation, node: str) -> str:
    """:func:`drain_reason` for this drain recommendation of ``node`` (a lemon
    drain names no XID: the evidence that made it was another node's)."""
    category = rec.reason_category or ""
    return drain_reason(rec.id, category, None if category == "lemon" else drain_xid(rec, node))


def drain_detail(rec: Recommendation, node: str | None = None) -> str:
    """The full reason, for our store and ``recovery-ctl show node``: which
    recommendation, why, the XID, and the job it came from."""
    xid = drain_xid(rec, node)
    why = rec.reason or rec.reason_category or "fault"
    text = (f"recovery #{rec.id} {rec.reason_category or 'fault'}: {why}"
            + (f" (xid {xid})" if xid is not None and "xid" not in why.lower() else "")
            + (f", job {rec.job_id}" if rec.job_id else ""))
    return text[:500]


def ours(reason: str) -> bool:
    """Does the reason read like one of ours (today's tag or the older
    wording)? Wording only: what makes a drain ours is the record
    :func:`our_drain` checks."""
    return reason.startswith((DRAIN_TAG, OLD_DRAIN_TAG))


class Drains:
    """The actuator's part that drains and resumes nodes (a part of
    :class:`~recovery_agent.act.actuator.Actuator`, whose state it shares:
    the config, the store and the scheduler)."""

    # -- node actions -------------------------------------------------------------
    def _advance_node(self, rec: Recommendation, now: float) -> None:
        name = (rec.target_nodes or (None,))[0]
        if not name:
            self._finish(rec, Status.FAILED, "no node named")
            return
        try:
            node = self.scheduler.get_node(name)
        except NodeNotFound:
            self._finish(rec, Status.FAILED, f"node {name} no longer exists")
            return
        rec = self._begin(rec)
        if rec.action == "drain_node":
            reason = slurm_reason(rec, name)
            if node.drained:
                # ours only if this recommendation's own drain got there (the
                # agent died after the call): that exact reason, and our call
                if node.reason == reason and "drain" in may_have_run(
                        self.store.steps(rec.id)):
                    self._mark_drained(rec, name, reason, now, node)
                    self._finish(rec, Status.DONE)
                else:
                    self._finish(rec, Status.DONE, f"already drained by someone else "
                                 f"({node.reason or 'no reason'}); not ours to resume")
                return
            try:
                self._step(rec, "drain", lambda: self.scheduler.drain_node(name, reason),
                           reason)
            except NodeNotFound:
                self._finish(rec, Status.FAILED, f"node {name} no longer exists")
                return
            self._mark_drained(rec, name, reason, now)
            self._finish(rec, Status.DONE)
        elif rec.action == "resume_node":
            if not node.drained:
                self._disown(name)
                self._finish(rec, Status.DONE, "the node is no longer drained")
                return
            if not our_drain(self.store.node(name), node):
                self._disown(name)
                self._finish(rec, Status.EXPIRED, f"drained by someone else now ({node.reason}, "
                             f"set by {node.reason_user or '?'})")
                return
            self._step(rec, "resume", lambda: self.scheduler.resume_node(name))
            self._disown(name)
            self._finish(rec, Status.DONE)
        else:
            self._finish(rec, Status.FAILED, f"unknown node action {rec.action!r}")

    def _mark_drained(self, rec: Recommendation, name: str, reason: str, now: float,
                      node=None) -> None:
        """Record the drain as ours: what Slurm shows right after it (reason,
        user, timestamp) is what later tells our drain from anyone else's."""
        if node is None:
            try:
                node = self.scheduler.get_node(name)
            except SchedulerError as exc:
                log.warning("rec=%s drained %s but cannot read it back (%s); its drain "
                            "is recorded by reason only", rec.id, name, exc)
        shown = node if node is not None and node.drained and node.reason == reason else None
        with self.store.transaction():
            # drain_reason: the full text; drain_slurm_reason: the short one Slurm shows
            self.store.set_node(name, drained_by_us=1, drain_reason=drain_detail(rec, name),
                                drained_at=now,
                                drain_rec=rec.id,
                                drain_slurm_reason=shown.reason if shown else reason,
                                drain_slurm_user=shown.reason_user if shown else None,
                                drain_slurm_time=shown.reason_time if shown else None)

    def _disown(self, name: str) -> None:
        with self.store.transaction():
            self.store.set_node(name, drained_by_us=0, drain_reason=None, drain_rec=None,
                                drain_slurm_reason=None, drain_slurm_user=None,
                                drain_slurm_time=None)

    # -- resuming our drains ------------------------------------------------------
    def reconcile_drains(self) -> list[str]:
        """Forget the drains that are no longer ours: the node was resumed, or
        drained again by someone else (Slurm's reason time changed). They stop
        counting against the drain budget and are never resumed by us. Returns
        the nodes let go; a listing that fails changes nothing."""
        rows = self.store.drained_nodes()
        if not rows:
            return []
        try:
            listed = {n.name: n for n in self.scheduler.list_nodes()}
        except SchedulerError as exc:
            log.warning("cannot check our drains against Slurm: %s", exc)
            return []
        gone = []
        for row in rows:
            node = listed.get(row["name"])
            if node is None or our_drain(row, node):
                continue
            why = ("resumed" if not node.drained else
                   f"drained again by {node.reason_user or 'someone else'} "
                   f"({node.reason or 'no reason'})")
            log.info("node %s is no longer drained by us: %s", row["name"], why)
            self._disown(row["name"])
            gone.append(row["name"])
        return gone

    def resume_clean_nodes(self, now: float) -> list[int]:
        """A resume recommendation for each node we drained whose health reports
        have been clean for ``policy.resume_after``."""
        self.reconcile_drains()
        after = self.cfg.policy.resume_after
        if not after:
            return []
        made = []
        for node in self.store.drained_nodes():
            name = node["name"]
            if any(r.action == "resume_node" and r.target_nodes == (name,)
                   for r in self.store.recommendations(OPEN_STATUSES)):
                continue
            since = node["drained_at"] or now
            reports = self.store.reports_since(name, since)
            dirty = [r["received"] for r in reports if not r["gpu_ok"]
                     or self.store.report_xid_count(r["id"])]
            clean_from = max([since, *dirty])
            clean = [r for r in reports if r["received"] > clean_from]
            if not clean or now - clean_from < after:
                continue
            with self.store.transaction():
                pk = self.store.add_recommendation({
                    "scope": "node", "action": "resume_node", "rule": "healthy_again",
                    "reason": f"health reports clean for {now - clean_from:.0f}s "
                              f"({len(clean)} report(s))",
                    "reason_category": "recovered", "target_nodes": [name], "mode": "action",
                    "status": Status.PROPOSED, "actor": "agent", "exclude": []})
            made.append(pk)
        return made
