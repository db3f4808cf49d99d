"""From a verdict to stored recommendations: the glue between the watch loop,
the policy and the actuator.

Everything a decision rests on is gathered here (the job's history and
limits, node strikes, the drain budget), :func:`~recovery_agent.decide.policy.decide`
is called, and the outcome is written in one transaction with the verdict:
the write-ahead audit row exists before any Slurm call, and an agent that dies
mid-way leaves either both or neither.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from slurm_hooks import spec as specs

from ..config import Config
from ..detect.attempts import PriorAttempt
from ..detect.model import Detection, Verdict
from ..errors import SchedulerError
from .policy import (STRIKE_WEIGHTS, BudgetState, Decision, History, Limits, NodeFacts,
                     Strike, confined, decide, drain_budget, effective_mode, lemon_score,
                     our_drain, voiced)
from ..scheduler.base import Job, Scheduler
from ..store import Recommendation, Status, Store

log = logging.getLogger(__name__)
NODE_ACTIONS = ("drain_node", "resume_node")
MODE_OVERRIDES = "mode_overrides"   # the agent-state key of recovery-ctl mode's changes
SIZE_TTL = 60.0   # seconds a listing's node count serves the exclusion check


def mode_overrides(store: Store) -> dict[str, str]:
    """Environment modes changed at run time (``recovery-ctl mode``), by env name."""
    return dict(store.get_state(MODE_OVERRIDES, {}) or {})


def environment_mode(cfg: Config, store: Store, env: str) -> str:
    """An environment's mode now: as configured, or as changed at run time with
    ``recovery-ctl mode``. An unknown name is the ``default`` environment."""
    env = env if env in cfg.environments else "default"
    return mode_overrides(store).get(env, cfg.environment(env).mode)


@dataclass(frozen=True)
class Outcome:
    decision: Decision
    mode: str
    recs: tuple[int, ...]


class Decider:
    def __init__(self, cfg: Config, store: Store, scheduler: Scheduler | None = None,
                 clock=time.time, mono=time.monotonic) -> None:
        self.cfg, self.store, self.scheduler, self.clock = cfg, store, scheduler, clock
        self.mono = mono
        self._drained_at: deque[float] = deque()   # this process's drains, monotonic
        self.on_new_work: list = []   # callables: wake the actuator
        # a callable giving the node state poll's last listing, (time, nodes) or
        # None (the watch loop's, set by it): a listing the cluster size may take
        self.polled_nodes = None

    # -- the job's limits and history -------------------------------------
    def limits(self, spec: specs.RecoverySpec) -> Limits:
        env = self.cfg.environment(spec.env)
        return Limits(max_restarts=spec.max_restarts if spec.max_restarts is not None
                      else env.max_restarts,
                      unknown_max_restarts=env.unknown_max_restarts,
                      no_progress_attempts=env.no_progress_attempts,
                      straggler_action=env.straggler_action,
                      drain_hardware=env.drain_hardware,
                      interconnect_strikes=env.interconnect_strikes)

    def mode(self, spec: specs.RecoverySpec) -> str:
        """The environment's mode (as configured, or as changed at run time with
        ``recovery-ctl mode``), lowered by the job's own directive."""
        return effective_mode(environment_mode(self.cfg, self.store, spec.env), spec.mode)

    def scores(self, now: float) -> dict[str, float]:
        """Every struck node's decayed lemon score."""
        pol = self.cfg.policy
        by_node: dict[str, list[Strike]] = {}
        for s in self.store.strikes(since=now - 10 * pol.lemon_half_life):
            by_node.setdefault(s["node"], []).append(_strike(s))
        return {n: lemon_score([(s.ts, s.weight) for s in voiced(strikes)], now,
                               pol.lemon_half_life)
                for n, strikes in by_node.items()}

    def history(self, job_pk: int, attempt: int, spec: specs.RecoverySpec,
                job: Job | None, nodes: tuple[str, ...], run_start: int | None = None
                ) -> History:
        attempts = [a for a in self.store.attempts(job_pk) if a["attempt"] <= attempt]
        without = 0
        for row in sorted(attempts, key=lambda a: a["attempt"], reverse=True):
            if row["ckpt_path"]:
                break
            without += 1
        tracks = bool(spec.ckpt) or any(a["ckpt_path"] for a in attempts)
        earlier = [r for r in self.store.recommendations(job_pk=job_pk)
                   if r.scope == "job" and _before(r, attempt, run_start)]
        # the unexplained budget counts from the last attempt that saved a checkpoint:
        # a job that advances between rare unexplained failures keeps its retries
        since = max((a["attempt"] for a in attempts if a["ckpt_path"]), default=None)
        unknown = sum(1 for r in earlier if _unexplained(r)
                      and r.status in (Status.DONE, Status.EXECUTING, Status.PROPOSED)
                      and (since is None or r.attempt >= since))
        excluded: list[str] = []
        for r in earlier:
            if r.status == Status.DONE:
                excluded += [n for n in r.exclude if n not in excluded]
        if job is not None:
            excluded += [n for n in job.excluded_nodes if n not in excluded]
        # a move off a degraded node (decide/moves.py) is a restart that no failure
        # caused: it does not spend the job's max-restarts
        moves = sum(1 for r in earlier if r.action == "migrate" and r.status == Status.DONE)
        return History(restarts=max(0, attempt - moves), unknown_requeues=unknown,
                       attempts_without_ckpt=without, tracks_checkpoints=tracks,
                       excluded=tuple(excluded), nodes_needed=max(1, len(nodes)),
                       nodes=tuple(nodes), previous=_previous(attempts, earlier))

    def node_facts(self, blamed: tuple[str, ...], now: float,
                   category: str | None = None, user: str = "",
                   witnessed: tuple[str, ...] = ()) -> NodeFacts:
        """Node facts for a decision; the failure being decided (of ``user``'s
        job, ``witnessed`` naming the nodes evidence the job did not write
        speaks against) counts as a strike on its blamed nodes (it is stored
        with the decision). Interconnect strikes are counted as
        :func:`~.policy.voiced` hears them."""
        pol = self.cfg.policy
        lemons = tuple(sorted(n for n, score in self.scores(now).items()
                              if pol.lemon_threshold and score >= pol.lemon_threshold))
        window = now - pol.strike_window
        ic = {}
        for n in blamed:
            strikes = [_strike(s) for s in self.store.strikes(n, since=window)
                       if s["category"] == "interconnect"]
            if category == "interconnect":
                strikes.append(Strike(now, STRIKE_WEIGHTS["interconnect"], user, n in witnessed))
            ic[n] = len(voiced(strikes))
        rows = self.store.held_back_nodes()
        return NodeFacts(lemons=lemons,
                         drained_by_us=tuple(r["name"] for r in rows if r["drained_by_us"]),
                         operator_excluded=tuple(r["name"] for r in rows
                                                 if r["excluded_by_operator"]),
                         interconnect_strikes=ic, cluster_nodes=self._cluster_size())

    def _cluster_size(self) -> int | None:
        """How many nodes Slurm lists, from a listing under SIZE_TTL seconds
        old: the last one made here, or the node state poll's when that is
        newer (one parse of a 10,000-node listing serves both)."""
        now = self.clock()
        cached = getattr(self, "_size", None)
        polled = self.polled_nodes() if self.polled_nodes is not None else None
        if polled is not None and polled[1] and 0 <= now - polled[0] < SIZE_TTL and (
                not cached or polled[0] > cached[1]):
            cached = self._size = (len(polled[1]), polled[0])
        if cached and now - cached[1] < SIZE_TTL:
            return cached[0]
        if self.scheduler is None:
            return None
        try:
            size = len(self.scheduler.list_nodes())
        except SchedulerError as exc:
            log.warning("cannot list nodes for the exclusion check: %s", exc)
            return None
        self._size = (size, self.clock())
        return size

    # -- deciding ------------------------------------------------------------
    def decide_attempt(self, job_pk: int, attempt: int, spec: specs.RecoverySpec,
                       verdict: Verdict, *, trigger: str, job: Job | None,
                       nodes: tuple[str, ...], detections: list[Detection],
                       seen_at: list[float | None] | None = None,
                       started: float | None = None, verdict_event: dict | None = None,
                       run_start: int | None = None) -> Outcome | None:
        """Decide about one attempt and store the outcome (with ``verdict_event``,
        when given, in the same transaction). None when the attempt already
        has a decision. ``run_start``: Slurm's start time of the run decided
        (slurmctld may run an attempt again at the same restart count; each
        run gets one decision)."""
        now = self.clock()
        state = job.state if job is not None else "UNKNOWN"
        # blame stays inside the attempt's allocation, whatever the evidence names
        verdict = confined(verdict, nodes)
        witnessed = tuple(sorted({d.host for d in detections
                                  if d.host and d.origin != "job" and d.severity != "info"}))
        with self.store.lock:
            if self.store.job_rec(job_pk, attempt, run_start) is not None:
                if verdict_event:
                    self.store.add_event(job_pk, **verdict_event)
                return None
            row = self.store.job(job_pk)
            history = self.history(job_pk, attempt, spec, job, nodes, run_start)
            facts = self.node_facts(tuple(verdict.nodes), now, verdict.category,
                                    row["user"] or "", witnessed)
            decision = decide(verdict, trigger=trigger, state=state, history=history,
                              limits=self.limits(spec), facts=facts, witnessed=witnessed)
            mode = self.mode(spec)
            with self.store.transaction():   # the lock is held already
                if verdict_event:
                    self.store.add_event(job_pk, **verdict_event)
                recs = self._store(row, attempt, decision, mode, verdict, trigger, job,
                                   detections, seen_at or [], started, now, witnessed,
                                   run_start, nodes)
        if recs and mode != "monitor":
            for wake in self.on_new_work:
                wake()
        if decision.acts:
            log.info("job=%s attempt=%s decision=%s rule=%s mode=%s exclude=%s drain=%s",
                     row["job_id"], attempt, decision.action, decision.rule, mode,
                     ",".join(decision.exclude), ",".join(decision.drain))
        return Outcome(decision, mode, tuple(recs))

    def _store(self, row: dict, attempt: int, decision: Decision, mode: str,
               verdict: Verdict, trigger: str, job: Job | None,
               detections: list[Detection], seen_at: list[float | None],
               started: float | None, now: float,
               witnessed: tuple[str, ...] = (), run_start: int | None = None,
               ran_on: tuple[str, ...] = ()) -> list[int]:
        job_pk = row["id"]
        user = row["user"] or ""
        for node in decision.blamed:
            kind = "straggler" if trigger == "straggler" else (verdict.category or "")
            weight = STRIKE_WEIGHTS.get(kind, 0.5)
            self.store.add_strike(node, kind or "unknown", weight, job_pk, user, ts=now,
                                  witnessed=node in witnessed)
        if decision.rule == "hang":
            for node in (job.nodes if job else ()):
                self.store.add_strike(node, "hang_suspect", STRIKE_WEIGHTS["hang_suspect"],
                                      job_pk, user, ts=now)
        if not decision.acts:
            return []
        status = Status.WOULD_HAVE if mode == "monitor" else Status.PROPOSED
        used = [detections[i] for i in verdict.rests_on if i < len(detections)]
        seen = [seen_at[i] for i in verdict.rests_on if i < len(seen_at) and seen_at[i]]
        evidence = [{"pattern": d.rule, "category": d.category, "node": d.host,
                     "gpu": d.gpu, "xid": d.xid,
                     "lines": [{"text": e.text, "source": e.source, "line": e.line,
                                "time": e.time} for e in d.evidence[:3]]} for d in used]
        failure_at = self._failure_time(used, seen, job, started, now)
        common = {"job": job_pk, "attempt": attempt, "job_id": row["job_id"],
                  "cluster": row["cluster"], "env": row["env"], "mode": mode,
                  "trigger": trigger, "attribution": {
                      "blame": verdict.blame, "category": verdict.category,
                      "confidence": verdict.confidence, "nodes": list(verdict.nodes),
                      "gpus": list(verdict.gpus), "reason": verdict.reason,
                      # what the next attempt's decision reads (History.previous)
                      "action": verdict.action, "signature": verdict.signature,
                      "suspects": list(verdict.suspects), "where": list(verdict.where),
                      "unexplained": verdict.unexplained,
                      # where this run ran (the attempt row shows its latest run)
                      "ran_on": list(ran_on)},
                  "pattern_ids": sorted({d.rule for d in used}), "evidence": evidence,
                  "restart_at": attempt,
                  # Slurm renews the submit time at each requeue: keep this attempt's
                  "submit_time": (job.submit_time if job is not None and job.submit_time
                                  else row["submit_time"]),
                  "failure_at": failure_at, "detected_at": now,
                  "workload": row["name"] or "", "user": user, "actor": "agent",
                  "run_start": run_start}
        pk = self.store.add_recommendation({
            **common, "scope": "job", "action": decision.action, "rule": decision.rule,
            "reason": decision.reason, "reason_category": decision.category,
            "target_nodes": list(decision.blamed), "exclude": list(decision.exclude),
            "status": status})
        recs = [pk]
        if decision.dropped:
            self.store.add_event(job_pk, "policy", "exclusions given up so the job still "
                                 f"fits: {', '.join(decision.dropped)}", attempt=attempt,
                                 source="policy")
        for node in decision.drain:
            recs.append(self._drain_rec(common, pk, node, decision, status, now))
        self.store.add_event(job_pk, "recommendation",
                             f"#{pk} {decision.action} ({decision.rule}) {status}"
                             + (f"; exclude {','.join(decision.exclude)}"
                                if decision.exclude else "")
                             + (f"; drain {','.join(decision.drain)}" if decision.drain
                                else ""),
                             attempt=attempt, source="policy",
                             data={"rec": pk, "action": decision.action, "mode": mode,
                                   "reason": decision.reason})
        return recs

    def _drain_rec(self, common: dict, parent: int, node: str, decision: Decision,
                   status: Status, now: float) -> int:
        blocked = self._over_budget(node, now)
        category = "lemon" if node not in decision.blamed else (decision.category or "")
        pk = self.store.add_recommendation({
            **common, "scope": "node", "parent": parent, "action": "drain_node",
            "rule": "lemon" if category == "lemon" else decision.rule,
            "reason": blocked or f"{category} on {node}", "reason_category": category,
            "target_nodes": [node], "exclude": [],
            "status": Status.BLOCKED_BY_BUDGET if blocked else status,
            "error": blocked or None})
        if not blocked:
            self._drained_at.append(self.mono())
        if blocked:
            log.warning("drain of %s blocked: %s", node, blocked)
            self.store.add_event(common["job"], "blocked_by_budget",
                                 f"#{pk} drain {node} blocked: {blocked}",
                                 attempt=common["attempt"], source="policy")
        return pk

    def _over_budget(self, node: str, now: float) -> str:
        pol = self.cfg.policy
        drains = self.store.drains_since(now - 3600)
        # the wall clock may jump forward and age recent drains out of the
        # hour; this process's own drains are also counted on the monotonic
        # clock (a jump back only makes the query above count more)
        mono = self.mono()
        while self._drained_at and mono - self._drained_at[0] >= 3600:
            self._drained_at.popleft()
        drains = max(drains, len(self._drained_at))
        sizes: dict[str, int] = {}
        ours: dict[str, int] = {}
        partitions: tuple[str, ...] = ()
        if self.scheduler is not None:
            try:
                listed = self.scheduler.list_nodes()
            except SchedulerError as exc:
                return f"cannot check the drain budget, Slurm unreachable: {exc}"
            # drains on their way count; monitor mode's would-have drains stand
            # in for drains only for a day, or they would fill the budget for
            # good (and count against real drains after a switch to action)
            pending = {r.target_nodes[0] for r in self.store.recommendations(
                (Status.PROPOSED, Status.EXECUTING, Status.WOULD_HAVE))
                if r.action == "drain_node" and r.target_nodes
                and (r.status != Status.WOULD_HAVE or (r.created or 0) >= now - 86400)}
            # ours only while Slurm still shows our drain: a node a human resumed
            # or drained again no longer counts against our budget
            by_name = {n.name: n for n in listed}
            drained = {r["name"] for r in self.store.drained_nodes()
                       if our_drain(r, by_name.get(r["name"]))} | pending
            for n in listed:
                for part in n.partitions:
                    sizes[part] = sizes.get(part, 0) + 1
                    if n.name in drained:
                        ours[part] = ours.get(part, 0) + 1
                if n.name == node:
                    partitions = n.partitions
        return drain_budget(partitions, BudgetState(drains, sizes, ours),
                            pol.max_drains_per_hour, pol.max_drained_percent)

    @staticmethod
    def _failure_time(used: list[Detection], seen: list[float], job: Job | None,
                      started: float | None, now: float) -> float:
        """When the failure first showed: the earliest of the evidence's own
        times, the moments the agent saw it, and the job's end (node clocks
        may be skewed, so the result is kept between the attempt's start and
        now)."""
        times = [e.time for d in used for e in d.evidence if e.time] + list(seen)
        if job is not None and job.end_time:
            times.append(float(job.end_time))
        if not times:
            return now
        low = started if started else float("-inf")
        return max(low, min(min(times), now))


def _strike(row: dict) -> Strike:
    return Strike(row["ts"], row["weight"], row["user"] or "", bool(row.get("witnessed")))


def _unexplained(rec: Recommendation) -> bool:
    """Was this job recommendation a requeue of a failure without a cause: no
    evidence at all (rule ``unknown``), or symptoms and exit reports alone?"""
    if rec.rule in ("unknown", "unexplained"):
        return True
    attribution = rec.attribution or {}
    return bool(attribution.get("unexplained")) and rec.action in ("requeue", "kill_requeue")


def _before(rec: Recommendation, attempt: int, run_start: int | None) -> bool:
    """Whether ``rec`` decided an earlier attempt, or an earlier run of this
    one (slurmctld ran it again at the same restart count)."""
    if rec.attempt is None or rec.attempt != attempt:
        return rec.attempt is not None and rec.attempt < attempt
    return bool(run_start and rec.run_start and rec.run_start < run_start)


def _previous(attempts: list[dict], recs: list[Recommendation]) -> tuple[PriorAttempt, ...]:
    """The earlier attempts (and runs) that were judged: where each ran (as its
    recommendation recorded it, else its attempt row) and its verdict (as its
    job recommendation recorded it), oldest first."""
    nodes = {a["attempt"]: tuple(a["nodes"] or ()) for a in attempts}
    out = []
    for rec in sorted(recs, key=lambda r: (r.attempt, r.run_start or 0)):
        if rec.action == "migrate":
            continue   # moved off a degraded node: that attempt did not fail
        seen = rec.attribution or {}
        ran_on = tuple(seen.get("ran_on") or ()) or nodes.get(rec.attempt)
        if not seen or ran_on is None:
            continue
        verdict = Verdict(blame=seen.get("blame") or "unknown", category=seen.get("category"),
                          action=seen.get("action") or rec.action,
                          confidence=float(seen.get("confidence") or 0.0),
                          nodes=tuple(seen.get("nodes") or ()),
                          gpus=tuple(seen.get("gpus") or ()), reason=seen.get("reason") or "",
                          unexplained=bool(seen.get("unexplained")),
                          signature=seen.get("signature") or "",
                          suspects=tuple(seen.get("suspects") or ()))
        out.append(PriorAttempt(ran_on, verdict, rec.attempt))
    return tuple(out)
