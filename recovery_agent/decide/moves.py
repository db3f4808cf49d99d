"""From a degraded node to stored ``migrate`` recommendations and refusals:
the glue between the store, the scheduler and the pure decision of
:mod:`.proactive`, as :mod:`.decider` is for failures.

Only jobs that opted in (a row in the store) are considered, and only while
Slurm shows them RUNNING on the node. Each move is stored before anything acts
on it: a job recommendation (action ``migrate``, its signal, target and wait
bound in ``attribution.migrate``) and a ``drain_node`` child for the node,
``would_have`` in monitor mode, ``blocked_by_budget`` never (a move over the
drain budget is refused instead). Each refusal is an event on the job's
timeline (kind ``move_refused``, its rule and node in the data).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from slurm_hooks import spec as specs

from ..errors import SchedulerError
from ..store import OPEN_STATUSES, Status
from .decider import Decider, environment_mode
from .proactive import (EnvRules, MoveLimits, NodeCondition, NodePlan, Room, RunningJob,
                        plan_node)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Moved:
    plan: NodePlan | None
    recs: tuple[int, ...] = ()


def node_condition(rows: list[dict], node: str) -> NodeCondition | None:
    """The node's condition from its degradation records (newest first, as
    ``Store.node_degradation`` gives them): each GPU's newest record, the
    node at its worst GPU's level. None when it was never scored above 0."""
    newest: dict[str, dict] = {}
    for row in rows:
        newest.setdefault(str(row.get("gpu")), row)
    if not newest:
        return None
    worst = max(newest.values(), key=lambda r: float(r.get("score") or 0.0))
    evidence = tuple({**hit, "gpu": gpu} for gpu, row in sorted(newest.items())
                     for hit in row.get("rules") or () if isinstance(hit, dict))
    return NodeCondition(node, str(worst.get("level") or "ok"),
                         float(worst.get("score") or 0.0), evidence)


class Mover:
    """Plans and stores the moves off one node at a time (see the module)."""

    def __init__(self, decider: Decider) -> None:
        self.decider = decider
        self.cfg, self.store, self.scheduler = decider.cfg, decider.store, decider.scheduler

    def plan(self, node: str, now: float | None = None) -> Moved:
        now = self.decider.clock() if now is None else now
        condition = node_condition(self.store.node_degradation(node), node)
        if condition is None or condition.level != "degraded" or self.scheduler is None:
            return Moved(None)
        try:
            listing = self.scheduler.list_jobs()
            nodes = self.scheduler.list_nodes()
        except SchedulerError as exc:
            log.warning("node=%s no move planned: Slurm unreachable: %s", node, exc)
            return Moved(None)
        cluster = self.cfg.agent.cluster
        tracked = []
        for job in listing:
            if job.state == "RUNNING" and node in job.nodes:
                row = self.store.match_job(cluster, job)
                if row is not None:
                    tracked.append((job, row))
        if not tracked:
            return Moved(None)
        with self.store.lock:
            running = [self._running(job, row) for job, row in tracked]
            room = Room(healthy=tuple(n.name for n in nodes if n.available
                                      and not self._degraded(n.name, node)),
                        drain_refusal=self.decider._over_budget(node, now))
            envs = {name: EnvRules(environment_mode(self.cfg, self.store, name),
                                   self.cfg.environment(name).proactive)
                    for name in {"default", *(r.env for r in running)}
                    if name == "default" or name in self.cfg.environments}
            limits = MoveLimits(self.cfg.proactive.migrate_cooldown,
                                self.cfg.proactive.checkpoint_wait)
            plan = plan_node(condition, running, envs, room, limits, now)
            if plan is None:
                return Moved(None)
            with self.store.transaction():
                recs = self._store(plan, condition, tracked, now)
        if recs and any(m.moves and m.mode != "monitor" for m in plan.jobs):
            for wake in self.decider.on_new_work:
                wake()
        return Moved(plan, tuple(recs))

    def _degraded(self, name: str, node: str) -> bool:
        if name == node:
            return True
        found = node_condition(self.store.node_degradation(name, limit=50), name)
        return found is not None and found.level == "degraded"

    def _running(self, job, row: dict) -> RunningJob:
        try:
            spec = specs.parse(row["spec"] or "")
        except specs.SpecError:
            spec = specs.RecoverySpec(mode="monitor")
        recs = self.store.recommendations(job_pk=row["id"])
        moved = [r.created for r in recs if r.action == "migrate" and r.status in (
            Status.DONE, Status.EXECUTING, Status.PROPOSED)]
        busy = [r.id for r in recs if r.scope == "job" and r.status in OPEN_STATUSES]
        return RunningJob(job.job_id, tuple(job.nodes), env=row["env"] or spec.env,
                          job_mode=spec.mode, ckpt_signal=spec.ckpt_signal,
                          proactive=spec.proactive, slurm_signal=job.signal,
                          excluded=tuple(job.excluded_nodes),
                          last_migration=max(moved) if moved else None,
                          open_recommendation=busy[0] if busy else None)

    def _store(self, plan: NodePlan, condition: NodeCondition, tracked: list,
               now: float) -> list[int]:
        by_id = {job.job_id: (job, row) for job, row in tracked}
        recs: list[int] = []
        first_move = None
        evidence = [{"pattern": h.get("rule"), "category": "degraded", "node": plan.node,
                     "gpu": h.get("gpu"), "xid": None, "detail": h.get("detail"),
                     "lines": []} for h in condition.evidence]
        for move in plan.jobs:
            job, row = by_id[move.job_id]
            if not move.moves:
                self.store.add_event(row["id"], "move_refused", move.reason,
                                     attempt=job.restart_count, source="policy",
                                     data={"node": plan.node, "rule": move.rule})
                continue
            status = Status.WOULD_HAVE if move.mode == "monitor" else Status.PROPOSED
            pk = self.store.add_recommendation({
                "job": row["id"], "attempt": job.restart_count, "job_id": job.job_id,
                "cluster": row["cluster"], "env": row["env"], "mode": move.mode,
                "trigger": "degraded", "scope": "job", "action": "migrate",
                "rule": move.rule, "reason": move.reason, "reason_category": "degraded",
                "target_nodes": [plan.node], "exclude": list(move.exclude),
                "status": status, "restart_at": job.restart_count,
                "submit_time": job.submit_time or row["submit_time"],
                "run_start": job.run_start, "detected_at": now, "failure_at": None,
                "workload": row["name"] or "", "user": row["user"] or "", "actor": "agent",
                "pattern_ids": sorted({h.get("rule") for h in condition.evidence
                                       if h.get("rule")}),
                "evidence": evidence,
                "attribution": {"blame": "node", "category": "degraded",
                                "nodes": [plan.node], "reason": move.reason,
                                "action": "migrate", "ran_on": list(job.nodes),
                                "migrate": {"signal": move.signal, "target": move.target,
                                            "checkpoint_wait": move.checkpoint_wait,
                                            "score": condition.score}}})
            recs.append(pk)
            first_move = first_move or (pk, row, job, move, status)
            self.store.add_event(row["id"], "recommendation",
                                 f"#{pk} migrate off {plan.node} {status}: {move.reason}",
                                 attempt=job.restart_count, source="policy",
                                 data={"rec": pk, "action": "migrate", "mode": move.mode})
        if plan.drain and first_move is not None:
            pk, row, job, move, status = first_move
            recs.append(self.store.add_recommendation({
                "scope": "node", "parent": pk, "action": "drain_node", "rule": "degraded",
                "reason": plan.drain_reason, "reason_category": "degraded",
                "target_nodes": [plan.node], "exclude": [], "mode": plan.drain_mode,
                "status": Status.WOULD_HAVE if plan.drain_mode == "monitor"
                else Status.PROPOSED, "job": row["id"], "attempt": job.restart_count,
                "job_id": job.job_id, "cluster": row["cluster"], "env": row["env"],
                "trigger": "degraded", "evidence": evidence, "actor": "agent",
                "detected_at": now}))
            if plan.drain_mode != "monitor":
                self.decider._drained_at.append(self.decider.mono())
        return recs
