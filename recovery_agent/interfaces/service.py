"""What the API and ``recovery-ctl`` can ask and change, over the store.

One place for the queries (jobs, timelines, nodes, recommendations, the audit
trail) and the operator and Advisor actions (mode, exclude/include, ack,
complete, cancel), with their rules: roles, ownership, stale claims. The HTTP
layer (:mod:`recovery_agent.interfaces.api_v1`), the Console and ``recovery-ctl --db`` all
call it, so they can never disagree.

The rules: an admin (``api.admin_uids``/``admin_groups``; a site controller runs
as one) reads and does everything. A user reads their own jobs, their tasks of
an array, the recommendations about their jobs, and the nodes (as sinfo shows
them, without other users' jobs in the strikes); the only change a user makes
is to cancel a job recommendation of their own job before it acts.
"""
from __future__ import annotations

import grp
import json
import logging
import pwd
import time
from dataclasses import dataclass
from typing import Any

from ..config import MODES, Config
from ..decide.decider import MODE_OVERRIDES, Decider, environment_mode, mode_overrides
from ..errors import RecoveryError
from ..decide.policy import effective_mode
from ..store import Recommendation, Status, Store

log = logging.getLogger(__name__)
STATUSES = tuple(s.value for s in Status)
_JSON_KEYS = ("nodes", "target_nodes", "exclude", "pattern_ids", "evidence", "attribution",
              "data", "last_health")


class ServiceError(RecoveryError):
    status = 400


class BadRequest(ServiceError):
    status = 400


class Forbidden(ServiceError):
    status = 403


class NotFound(ServiceError):
    status = 404


class Conflict(ServiceError):
    status = 409


@dataclass(frozen=True)
class Caller:
    uid: int
    name: str
    admin: bool

    def __str__(self) -> str:
        return f"{self.name} (uid {self.uid}, {'admin' if self.admin else 'user'})"


def role_of(cfg: Config, uid: int) -> Caller:
    """The caller's role: admin by uid or group membership, else user."""
    try:
        entry = pwd.getpwuid(uid)
        name, gid = entry.pw_name, entry.pw_gid
    except KeyError:
        name, gid = str(uid), None
    admin = uid in cfg.admin_uids
    for group in cfg.admin_groups:
        if admin:
            break
        try:
            found = grp.getgrnam(group)
        except KeyError:
            continue
        admin = gid == found.gr_gid or name in found.gr_mem
    return Caller(uid, name, admin)


def sees_all(who: Caller | None) -> bool:
    """Does this reader see every user's jobs? A trusted reader (None: the read
    token, or a read the agent trusts as it is) and admins do; a user sees their
    own."""
    return who is None or who.admin


def may_read(who: Caller | None, user: str | None, what: str) -> None:
    """Raise Forbidden unless ``who`` may read something of ``user``'s."""
    if not sees_all(who) and (user or "") != who.name:
        raise Forbidden(f"{what} belongs to {user or 'another user'}; {who.name} may read "
                        "only their own jobs")


def decoded(row: dict) -> dict:
    out = dict(row)
    for key in _JSON_KEYS:
        value = out.get(key)
        if isinstance(value, str) and value[:1] in "[{":
            try:
                out[key] = json.loads(value)
            except ValueError:
                pass
    return out


class Service:
    def __init__(self, cfg: Config, store: Store, clock=time.time) -> None:
        self.cfg, self.store, self.clock = cfg, store, clock

    # -- reads ---------------------------------------------------------------
    def job_row(self, job_id: str) -> dict:
        row = self.store.find_job(self.cfg.agent.cluster, job_id)
        if row is None:
            raise NotFound(f"job {job_id} is not tracked")
        return row

    def jobs(self, state: str | None = None, user: str | None = None,
             env: str | None = None, limit: int = 500, who: Caller | None = None
             ) -> list[dict]:
        """Tracked jobs, newest first; a user (``who``) gets only their own."""
        if not sees_all(who):
            user = who.name
        rows = self.store.find_jobs(self.cfg.agent.cluster, state=state, user=user, env=env,
                                    limit=limit)
        for row in rows:
            # what the agent concluded (the latest verdict), else what it last saw
            row["last_detection"] = self.store.last_category(row["id"])
            recs = [r for r in self.store.recommendations(job_pk=row["id"])
                    if r.scope == "job"]
            row["last_recommendation"] = (f"{recs[-1].action} {recs[-1].status}"
                                          if recs else None)
            row["effective_mode"] = self.effective_mode(row)
        return [decoded(r) for r in rows]

    def array(self, array_id: str, who: Caller | None = None) -> list[dict]:
        """The tasks of a job array (each tracked on its own), or [] when not an
        array. A user (``who``) gets only their own tasks, and Forbidden for an
        array of someone else's."""
        if not array_id.isdigit():
            return []
        rows = self.store.array_tasks(self.cfg.agent.cluster, int(array_id))
        if rows and not sees_all(who):
            mine = [r for r in rows if (r["user"] or "") == who.name]
            if not mine:
                may_read(who, rows[0]["user"], f"array {array_id}")
            rows = mine
        tasks = []
        for task in rows:
            recs = [r for r in self.store.recommendations(job_pk=task["id"])
                    if r.scope == "job"]
            tasks.append({"job_id": task["job_id"], "user": task["user"],
                          "state": task["state"],
                          "restarts": task["restart_count"],
                          "recommendations": [f"#{r.id} {r.action} {r.status}"
                                              for r in recs]})
        return tasks

    def effective_mode(self, row: dict) -> str:
        """The mode the job's decisions take now: its environment's (as changed at
        run time), lowered by its own directive."""
        return effective_mode(environment_mode(self.cfg, self.store, row["env"]),
                              row["mode"] or None)

    def job(self, job_id: str, who: Caller | None = None) -> dict:
        row = self.job_row(job_id)
        may_read(who, row["user"], f"job {job_id}")
        row["effective_mode"] = self.effective_mode(row)
        # false: the directive names an environment the config lacks (runs as default)
        row["env_known"] = row["env"] in self.cfg.environments
        return {"job": decoded(row), "attempts": self.store.attempts(row["id"]),
                "detections": self.store.detections(row["id"]),
                "recommendations": [r.to_dict() for r in
                                    self.store.recommendations(job_pk=row["id"])]}

    def timeline(self, job_id: str, who: Caller | None = None) -> list[dict]:
        """The job's events with each recommendation step merged in, in time order."""
        row = self.job_row(job_id)
        may_read(who, row["user"], f"job {job_id}")
        events = list(self.store.timeline(row["id"]))
        for rec in self.store.recommendations(job_pk=row["id"]):
            for step in self.store.steps(rec.id):
                events.append({"id": None, "job": row["id"], "ts": step["ts"], "kind": "step",
                               "attempt": rec.attempt, "source": "actuator",
                               "message": f"#{rec.id} {step['step']} {step['state']}"
                                          + (f" {step['detail']}" if step["detail"] else ""),
                               "data": None})
        for x in self.store.job_xids(row["id"]):
            report = self.store.node_report(x["report"]) if x["report"] else None
            events.append({"id": None, "job": row["id"],
                           "ts": report["received"] if report else (x["time"] or 0),
                           "kind": "xid", "attempt": x["attempt"], "source": f"hooks/{x['node']}",
                           "message": f"{x['kind'].upper()} {x['xid']} on {x['node']}"
                                      + (f" GPU {x['gpu_index']}" if x["gpu_index"] is not None
                                         else "") + f": {x['message'] or ''}",
                           "data": {"raw": x["raw"], "node_time": x["time"]}})
        events.sort(key=lambda e: e["ts"])
        return events

    def scores(self) -> dict[str, float]:
        return Decider(self.cfg, self.store).scores(self.clock())

    def nodes(self) -> list[dict]:
        scores = self.scores()
        rows = [decoded(r) for r in self.store.nodes()]
        known = {r["name"] for r in rows}
        rows += [{"name": n, "drained_by_us": 0, "excluded_by_operator": 0}
                 for n in scores if n not in known]
        for row in rows:
            row["suspect_score"] = scores.get(row["name"], 0.0)
        return sorted(rows, key=lambda r: r["name"])

    def node(self, name: str, who: Caller | None = None) -> dict:
        """A node with its strikes. Nodes are the cluster's, as in sinfo, so every
        reader sees them; a user sees which job and user each strike came from
        only for their own jobs."""
        row = self.store.node(name)
        strikes = self.store.strikes(name)
        if row is None and not strikes:
            raise NotFound(f"node {name} is not known")
        row = decoded(row or {"name": name})
        row["suspect_score"] = self.scores().get(name, 0.0)
        if not sees_all(who):
            strikes = [s if (s["user"] or "") == who.name else {**s, "job": None, "user": None}
                       for s in strikes]
        row["strikes"] = strikes
        return row

    def environments(self) -> dict[str, dict]:
        overrides = mode_overrides(self.store)
        return {name: {"configured": env.mode, "mode": overrides.get(name, env.mode),
                       "max_restarts": env.max_restarts}
                for name, env in self.cfg.environments.items()}

    def recs(self, status: str | None = None, env: str | None = None,
             mode: str | None = None, job: str | None = None,
             limit: int = 500, who: Caller | None = None) -> list[Recommendation]:
        """Newest first; a user (``who``) gets those of their own jobs (with the
        drains those jobs' failures led to)."""
        self.expire_claims()
        if status and status not in STATUSES:
            raise BadRequest(f"status must be one of {', '.join(STATUSES)}")
        job_pk = self.job_row(job)["id"] if job else None
        rows = self.store.recommendations(status, job_pk=job_pk)
        rows = [r for r in rows if (not env or r.env == env)
                and (not mode or r.mode == mode)
                and (sees_all(who) or (r.user or "") == who.name)]
        return rows[::-1][:limit]

    def recommendations(self, status: str | None = None, env: str | None = None,
                        mode: str | None = None, job: str | None = None,
                        limit: int = 500, who: Caller | None = None) -> list[dict]:
        """:meth:`recs` as the API shows them."""
        return [r.to_dict() for r in self.recs(status, env, mode, job, limit, who)]

    def _rec(self, rec_id: int, who: Caller | None = None) -> Recommendation:
        if not self.store.has_rec(rec_id):
            raise NotFound(f"no recommendation {rec_id}")
        rec = self.store.rec(rec_id)
        may_read(who, rec.user, f"recommendation {rec_id}")
        return rec

    def recommendation(self, rec_id: int, who: Caller | None = None) -> dict:
        """One recommendation with its steps, as the API shows it."""
        rec = self._rec(rec_id, who)
        return {**rec.to_dict(), "steps": self.store.steps(rec_id)}

    def audit(self, since: float | None = None, until: float | None = None,
              job: str | None = None) -> list[dict]:
        """Every recommendation in the window (by creation time), with its steps."""
        job_pk = self.job_row(job)["id"] if job else None
        out = []
        for rec in self.store.recommendations(job_pk=job_pk):
            if since is not None and rec.created < since:
                continue
            if until is not None and rec.created > until:
                continue
            out.append({**rec.to_dict(), "steps": self.store.steps(rec.id)})
        return out

    # -- writes ----------------------------------------------------------------
    def _audit(self, job_pk: int | None, who: Caller, verb: str, message: str,
               **data: Any) -> None:
        with self.store.transaction():
            self.store.add_event(job_pk, f"api_{verb}", f"{message} (by {who.name}, "
                                 f"uid {who.uid})", source="api",
                                 data={"uid": who.uid, "user": who.name, **data})
        log.info("%s by uid %s: %s", verb, who.uid, message)

    def _admin(self, who: Caller, what: str) -> None:
        if not who.admin:
            raise Forbidden(f"only admins {what} ({who} is not one)")

    def _may_act(self, who: Caller, rec: Recommendation, verb: str) -> None:
        """Who may ack, complete or cancel a recommendation: admins (site
        controllers run as one) any. A user only cancels a job recommendation
        of their own job: a node's drain or resume is admin business even when
        their job's failure led to it, and ack/complete claim to act on Slurm,
        which a user's claim never does."""
        if who.admin:
            return
        if (rec.user or "") != who.name:
            raise Forbidden(f"recommendation {rec.id} is for a job of "
                            f"{rec.user or 'another user'}; {who.name} may act only "
                            "on their own jobs")
        if (rec.scope or "job") != "job":
            raise Forbidden(f"recommendation {rec.id} is a {rec.action} of "
                            f"{', '.join(rec.target_nodes or []) or 'a node'}: "
                            f"node-level recommendations are for admins ({who} is not one)")
        if verb != "cancel":
            raise Forbidden(f"only admins {verb} recommendations (a site controller claims "
                            f"one, acts on Slurm, then completes it; {who} is not an admin); "
                            "as the job's owner you may cancel it")

    def set_mode(self, who: Caller, env: str, mode: str) -> dict:
        self._admin(who, "change modes")
        if env not in self.cfg.environments:
            raise NotFound(f"no environment {env!r} in the config")
        if mode not in MODES:
            raise BadRequest(f"mode must be one of {', '.join(MODES)}")
        overrides = mode_overrides(self.store)
        before = overrides.get(env, self.cfg.environments[env].mode)
        overrides[env] = mode
        self.store.set_state(MODE_OVERRIDES, overrides)
        self._audit(None, who, "mode", f"environment {env}: {before} -> {mode}", env=env,
                    before=before, after=mode)
        return {"env": env, "mode": mode, "before": before}

    def exclude(self, who: Caller, name: str, reason: str) -> dict:
        self._admin(who, "exclude nodes")
        if not reason.strip():
            raise BadRequest("a reason is required")
        with self.store.transaction():
            self.store.set_node(name, excluded_by_operator=1)
        self._audit(None, who, "exclude", f"node {name} excluded from retries: {reason}",
                    node=name, reason=reason)
        return {"node": name, "excluded": True}

    def include(self, who: Caller, name: str) -> dict:
        self._admin(who, "include nodes")
        if self.store.node(name) is None:
            raise NotFound(f"node {name} is not known")
        with self.store.transaction():
            self.store.set_node(name, excluded_by_operator=0)
        self._audit(None, who, "include", f"node {name} no longer excluded", node=name)
        return {"node": name, "excluded": False}

    def expire_claims(self) -> int:
        now = self.clock()
        recs = self.store.expired_claims(now)
        for rec in recs:
            with self.store.transaction():
                self.store.save_rec(rec.claim_expired(), "status", "claimed_by",
                                    "claim_expires")
            self.store.add_step(rec.id, "claim_expired", "ok", f"claim of {rec.claimed_by}")
        return len(recs)

    def _moved_on(self, rec: Recommendation) -> str:
        if rec.job is None:
            return ""
        row = self.store.job(rec.job)
        if (row["restart_count"] or 0) > (rec.restart_at or 0):
            return f"the job has restarted since (restart {row['restart_count']})"
        return ""

    def ack(self, who: Caller, rec_id: int) -> dict:
        self.expire_claims()
        rec = self._rec(rec_id)
        self._may_act(who, rec, "ack")
        if rec.mode != "external":
            raise Conflict(f"recommendation {rec_id} is in {rec.mode} mode; only external "
                           "ones are claimed")
        if rec.status != Status.PROPOSED:
            raise Conflict(f"recommendation {rec_id} is {rec.status}"
                           + (f", claimed by {rec.claimed_by}" if rec.claimed_by else ""))
        stale = self._moved_on(rec)
        if stale:
            with self.store.transaction():
                self.store.save_rec(rec.finished(Status.EXPIRED, error=stale), "status",
                                    "error")
            raise Conflict(f"recommendation {rec_id} is stale: {stale}")
        now, ttl = self.clock(), self.cfg.api.claim_ttl
        claim = f"uid:{who.uid}"
        with self.store.transaction():
            self.store.save_rec(rec.executing(claim, now + ttl), "status", "claimed_by",
                                "claim_expires")
        self.store.add_step(rec_id, "claimed", "ok", f"{who.name} until +{ttl:g}s")
        self._audit(rec.job, who, "ack", f"recommendation #{rec_id} claimed", rec=rec_id)
        return {"id": rec_id, "status": "executing", "claimed_by": claim,
                "claim_expires": now + ttl}

    def complete(self, who: Caller, rec_id: int, outcome: str, detail: str = "") -> dict:
        rec = self._rec(rec_id)
        self._may_act(who, rec, "complete")
        if outcome not in ("done", "failed"):
            raise BadRequest("outcome must be done or failed")
        if rec.status != Status.EXECUTING or rec.mode != "external":
            raise Conflict(f"recommendation {rec_id} is {rec.status}, not claimed for "
                           "external execution")
        detail = detail[:2000]
        with self.store.transaction():
            ended = rec.finished(Status(outcome), done_at=self.clock(),
                                 error=detail if outcome == "failed" else None)
            self.store.save_rec(ended, "status", "done_at", "error")
        self.store.add_step(rec_id, "completed", "ok" if outcome == "done" else "failed",
                            detail)
        self._audit(rec.job, who, "complete", f"recommendation #{rec_id} {outcome}",
                    rec=rec_id, outcome=outcome)
        return {"id": rec_id, "status": outcome}

    def cancel(self, who: Caller, rec_id: int, reason: str = "") -> dict:
        rec = self._rec(rec_id)
        steps = self.store.steps(rec_id)
        self._may_act(who, rec, "cancel")
        started = any(s["step"] not in ("claimed", "claim_expired") for s in steps)
        if not rec.status.is_open or started:
            raise Conflict(f"recommendation {rec_id} is {rec.status}"
                           + (" and already acting on Slurm" if started else ""))
        with self.store.transaction():
            why = f"cancelled by {who.name}" + (f": {reason[:500]}" if reason else "")
            self.store.save_rec(rec.finished(Status.CANCELLED, error=why), "status", "error")
        self._audit(rec.job, who, "cancel", f"recommendation #{rec_id} cancelled",
                    rec=rec_id)
        return {"id": rec_id, "status": "cancelled"}
