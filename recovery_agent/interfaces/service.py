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

Every change taken is an audit record (``operator_actions``: who, when, the
state before and after, why) written with the change; :meth:`Service.audit`
lists them with the recommendations. A refused change records nothing; a
refusal for the caller's role is logged with their uid.
"""
from __future__ import annotations

import grp
import heapq
import json
import logging
import pwd
import re
import time
from dataclasses import dataclass
from typing import Any

from ..config import MODES, Config
from ..decide.decider import MODE_OVERRIDES, Decider, environment_mode, mode_overrides
from ..errors import RecoveryError, StoreError
from ..decide.policy import effective_mode
from ..scheduler import Scheduler, scheduler_for
from ..store import Recommendation, Status, Store
from . import ledger

log = logging.getLogger(__name__)
STATUSES = tuple(s.value for s in Status)
# a node's stored columns, as every node reads (None where the store has no row)
NODE_COLUMNS = ("name", "cluster", "drained_by_us", "drain_reason", "drained_at", "drain_rec",
                "drain_slurm_reason", "drain_slurm_user", "drain_slurm_time",
                "excluded_by_operator", "last_health", "updated")
# a character that is not white space in Python's str.strip() nor in JSON Schema's
# (ECMA) \s: a reason needs one (the API's schema states this very pattern)
VISIBLE = r"[^\t\n\v\f\r \x1c-\x1f\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff]"
# a node reads as suspect from this share of the lemon threshold (where it is drained)
SUSPECT_SHARE = 0.25
_JSON_KEYS = ("nodes", "target_nodes", "exclude", "pattern_ids", "evidence", "attribution",
              "data", "last_health")


def degradation_view(by_gpu: dict[str, dict]) -> dict:
    """A node's degradation as every reader gets it, from each GPU's newest
    record (docs/proactive.md): the node's level and score are its worst
    GPU's; ``since`` is when that GPU's record was made (a GPU that stopped
    reporting keeps its last record)."""
    gpus = [{"gpu": gpu, "level": r.get("level", "ok"), "score": float(r.get("score") or 0.0),
             "rules": [h.get("rule") for h in r.get("rules") or ()], "time": r.get("time")}
            for gpu, r in sorted(by_gpu.items())]
    worst = max(gpus, key=lambda g: g["score"], default=None)
    if worst is None or worst["score"] <= 0:
        return {"level": "ok", "score": 0.0, "since": None, "gpus": gpus}
    return {"level": worst["level"], "score": worst["score"], "since": worst["time"],
            "gpus": gpus}


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


class SlurmUnavailable(ServiceError):
    """Slurm could not be asked (no backend here, or its command failed)."""
    status = 503


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


def operator_record(row: dict) -> dict:
    """An operator change as the audit trail shows it (``created``: its time,
    as a recommendation's)."""
    return {"kind": "operator", "id": row["id"], "created": row["ts"],
            "action": row["action"], "actor": row["actor"], "actor_uid": row["actor_uid"],
            "role": row["role"], "via": row["via"], "target": row["target"],
            "env": row["env"], "node": row["node"], "rec": row["rec"],
            "job_id": row["job_id"], "user": row["job_user"], "before": row["before"],
            "after": row["after"], "reason": row["reason"], "data": row["data"] or {}}


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
    def __init__(self, cfg: Config, store: Store, clock=time.time,
                 scheduler: Scheduler | None = None, via: str = "api") -> None:
        self.cfg, self.store, self.clock = cfg, store, clock
        # how changes reach the store: "api" (the agent's), "store" (recovery-ctl --db)
        self.via = via
        self.scheduler = scheduler          # made from the config when first needed
        self._slurm_nodes: tuple[float, set[str]] | None = None

    # -- reads ---------------------------------------------------------------
    def job_row(self, job_id: str) -> dict:
        row = self.store.find_job(self.cfg.agent.cluster, job_id)
        if row is None:
            raise NotFound(f"job {job_id} is not tracked")
        return row

    def jobs(self, state: str | None = None, user: str | None = None,
             env: str | None = None, limit: int = 500, who: Caller | None = None,
             before: int | None = None) -> list[dict]:
        """Tracked jobs, newest first; a user (``who``) gets only their own.
        ``before``: only jobs with a row id (``id``) below it, the next page."""
        if not sees_all(who):
            user = who.name
        rows = self.store.find_jobs(self.cfg.agent.cluster, state=state, user=user, env=env,
                                    limit=limit, before=before)
        for row in rows:
            # what the agent concluded (the latest verdict), else what it last saw
            row["last_detection"] = self.store.last_category(row["id"])
            recs = [r for r in self.store.recommendations(job_pk=row["id"])
                    if r.scope == "job"]
            row["category"] = self.category(row["id"], recs)
            row["last_recommendation"] = (f"{recs[-1].action} {recs[-1].status}"
                                          if recs else None)
            row["effective_mode"] = self.effective_mode(row)
        return [decoded(r) for r in rows]

    def category(self, job_pk: int, recs: list[Recommendation]) -> str | None:
        """The category a job's summary names: that of the verdict that decided
        its last job recommendation (what was done, and why), else of the
        decision itself; only a job without one names its last detection's.
        A later attempt that ended well (its verdict names no category) does
        not hide why the job was recovered."""
        if recs:
            last = recs[-1]
            found = (last.attribution or {}).get("category") or last.reason_category
            if found:
                return found
        return self.store.last_detection_category(job_pk)

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
        recs = self.store.recommendations(job_pk=row["id"])
        row["category"] = self.category(row["id"], [r for r in recs if r.scope == "job"])
        # false: the directive names an environment the config lacks (runs as default)
        row["env_known"] = row["env"] in self.cfg.environments
        return {"job": decoded(row), "attempts": self.store.attempts(row["id"]),
                "detections": self.store.detections(row["id"]),
                "recommendations": [r.to_dict() for r in recs]}

    def job_goodput(self, job_id: str, who: Caller | None = None) -> dict:
        """The job's goodput ledger: its incidents and their totals
        (:mod:`.ledger`)."""
        row = self.job_row(job_id)
        may_read(who, row["user"], f"job {job_id}")
        return ledger.job_summary(self.store, self.cfg, row)

    def goodput(self, since: float | str | None = None, until: float | str | None = None,
                by: str | None = None, who: Caller | None = None,
                job: str | None = None) -> dict:
        """The goodput ledger of the cluster over a window (:mod:`.ledger`);
        ``since`` and ``until`` as :func:`.ledger.window_time` reads them
        (default: the last 30 days). A user's covers their own jobs; ``job``
        gives one job's whole history instead."""
        now = self.clock()
        if by is not None and by not in ledger.BY:
            raise BadRequest(f"by={by!r}: one of {', '.join(ledger.BY)}")
        if job is not None:
            row = self.job_row(job)
            may_read(who, row["user"], f"job {job}")
            return ledger.job_report(self.store, self.cfg, row, now=now)
        try:
            start = ledger.window_time(since, now, "since")
            end = ledger.window_time(until, now, "until")
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        start = now - 30 * 86400 if start is None else start
        end = now if end is None else end
        end = max(end, start)    # a window that ends before it starts is empty
        return ledger.report(self.store, self.cfg, start, end, by,
                             user=None if sees_all(who) else who.name, now=now)

    def goodput_overview(self, since: float, until: float | None = None,
                         who: Caller | None = None) -> dict:
        """What the Console's goodput page shows (:func:`.ledger.overview`): a
        user's covers their own jobs."""
        now = self.clock()
        return ledger.overview(self.store, self.cfg, since, now if until is None else until,
                               user=None if sees_all(who) else who.name, now=now)

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

    def nodes(self, who: Caller | None = None) -> list[dict]:
        """Every node the store knows or a strike names, by name, each as
        :meth:`node_view` shows it."""
        scores = self.scores()
        rows = {r["name"]: r for r in self.store.nodes()}
        strikes: dict[str, list[dict]] = {}
        for strike in self.store.strikes():
            strikes.setdefault(strike["node"], []).append(strike)
        degradation = self.store.degradation_now()
        names = sorted({*rows, *scores, *strikes, *degradation})
        return [self.node_view(name, rows.get(name), strikes.get(name, []),
                               scores.get(name, 0.0), who, degradation.get(name, {}))
                for name in names]

    def node(self, name: str, who: Caller | None = None) -> dict:
        """A node with its strikes. Nodes are the cluster's, as in sinfo, so every
        reader sees them; a user sees which job and user each strike came from
        only for their own jobs."""
        row = self.store.node(name)
        strikes = self.store.strikes(name)
        degradation = self.store.degradation_now(name).get(name, {})
        if row is None and not strikes and not degradation:
            raise NotFound(f"node {name} is not known")
        return self.node_view(name, row, strikes, self.scores().get(name, 0.0), who,
                              degradation)

    def node_view(self, name: str, row: dict | None, strikes: list[dict], score: float,
                  who: Caller | None = None, degradation: dict | None = None) -> dict:
        """One node as every reader gets it (``show node``, ``show nodes``, the
        API): the stored columns (None where the store has no row), the lemon
        score, its strikes (a list; another user's job and user blanked for a
        user) and ``health``/``health_detail``, what an operator reads."""
        out: dict[str, Any] = {key: None for key in NODE_COLUMNS}
        out.update(decoded(row or {}))
        out.pop("strikes", None)      # the table's old count column, never kept up
        out["name"] = name
        out["cluster"] = out.get("cluster") or self.cfg.agent.cluster
        out["drained_by_us"] = bool(out.get("drained_by_us"))
        out["excluded_by_operator"] = bool(out.get("excluded_by_operator"))
        out["suspect_score"] = float(score)
        strikes = [{**s, "job_id": self._printable_id(s["job"])} for s in strikes]
        if not sees_all(who):
            strikes = [s if (s["user"] or "") == who.name
                       else {**s, "job": None, "job_id": None, "user": None} for s in strikes]
        out["strikes"] = strikes
        out["strike_count"] = len(strikes)
        out["health"], out["health_detail"] = self.health(out)
        out["degradation"] = degradation_view(degradation or {})
        return out

    def _printable_id(self, job_pk: int | None) -> str | None:
        """The Slurm job id (``4410``, ``1234_7``) of a job row, None without one."""
        if job_pk is None:
            return None
        try:
            return self.store.job(job_pk)["job_id"]
        except StoreError:
            return None

    def suspect_at(self) -> float:
        """The lemon score from which a node reads as suspect: a share
        (SUSPECT_SHARE) of ``policy.lemon_threshold``, where it would be
        drained (with the lemon check off, of its default)."""
        threshold = self.cfg.policy.lemon_threshold or Config().policy.lemon_threshold
        return threshold * SUSPECT_SHARE

    def health(self, node: dict) -> tuple[str, str]:
        """(health, what an operator reads) for a node as :meth:`node_view`
        builds it: drained by us (and why: the XIDs of our drain's evidence
        on it, else its category), excluded by an operator (and why), suspect
        (its lemon score reaches :meth:`suspect_at`), else ok."""
        if node["drained_by_us"]:
            why = (self.drain_cause(node["name"], node.get("drain_rec"))
                   or str(node.get("drain_reason") or "").removeprefix("recovery:").strip())
            return "drained", "drained by recovery" + (f" ({why})" if why else "")
        if node["excluded_by_operator"]:
            reason = (self.store.last_exclusion(node["name"]) or {}).get("reason")
            return "excluded", "excluded by operator" + (f" ({reason})" if reason else "")
        score = node["suspect_score"]
        if score > 0 and score >= self.suspect_at():
            return "suspect", f"suspect (score {round(score, 2):g})"
        return "ok", "ok"

    def drain_cause(self, name: str, rec_id: int | None) -> str:
        """Why we drained ``name``, from our drain recommendation: ``xid 79``
        when its evidence names XIDs on that node, else its category."""
        if not rec_id or not self.store.has_rec(rec_id):
            return ""
        rec = self.store.rec(rec_id)
        evidence = rec.evidence if isinstance(rec.evidence, list) else []
        xids = sorted({e["xid"] for e in evidence if isinstance(e, dict) and e.get("xid")
                       and e.get("node") in (name, None)})
        if xids:
            return "xid " + ", ".join(map(str, xids))
        return rec.reason_category or (rec.attribution or {}).get("category") or ""

    def environments(self) -> dict[str, dict]:
        """Each environment's mode now, the config file's, and where the one in
        effect comes from: ``source`` "file", or "operator" with who set it
        (``set_by``, ``set_uid``), when (``set_at``) and why (``reason``), from
        the audit record of that change."""
        overrides = mode_overrides(self.store)
        return {name: {"configured": env.mode, "mode": overrides.get(name, env.mode),
                       "max_restarts": env.max_restarts,
                       **self.mode_source(name, overrides)}
                for name, env in self.cfg.environments.items()}

    def mode_source(self, env: str, overrides: dict[str, str]) -> dict:
        if env not in overrides:
            return {"source": "file", "set_by": None, "set_uid": None, "set_at": None,
                    "reason": None}
        last = self.store.last_operator_action(("mode", "mode_clear"), env)
        if last is None or last["action"] != "mode":   # set before changes were recorded
            return {"source": "operator", "set_by": None, "set_uid": None, "set_at": None,
                    "reason": None}
        return {"source": "operator", "set_by": last["actor"], "set_uid": last["actor_uid"],
                "set_at": last["ts"], "reason": last["reason"]}

    def recs(self, status: str | None = None, env: str | None = None,
             mode: str | None = None, job: str | None = None,
             limit: int = 500, who: Caller | None = None,
             before: int | None = None) -> list[Recommendation]:
        """Newest first; a user (``who``) gets those of their own jobs (with the
        drains those jobs' failures led to). ``before``: only those with an id
        below it, the next page."""
        self.expire_claims()
        if status and status not in STATUSES:
            raise BadRequest(f"status must be one of {', '.join(STATUSES)}")
        job_pk = self.job_row(job)["id"] if job else None
        rows = self.store.recommendations(status, job_pk=job_pk)
        rows = [r for r in rows if (not env or r.env == env)
                and (not mode or r.mode == mode) and (before is None or r.id < before)
                and (sees_all(who) or (r.user or "") == who.name)]
        return rows[::-1][:limit]

    def recommendations(self, status: str | None = None, env: str | None = None,
                        mode: str | None = None, job: str | None = None,
                        limit: int = 500, who: Caller | None = None,
                        before: int | None = None) -> list[dict]:
        """:meth:`recs` as the API shows them."""
        return [r.to_dict() for r in self.recs(status, env, mode, job, limit, who, before)]

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
              job: str | None = None, who: Caller | None = None) -> list[dict]:
        """The audit trail in the window, in time order: every recommendation
        (by creation time) with its steps (``kind`` "recommendation"), and
        every operator change (``kind`` "operator": who, when, before and
        after, why). ``job``: only that job's recommendations and the changes
        made to them. A user (``who``) gets those of their own jobs; changes
        that belong to no job (modes, exclusions) are for admins."""
        job_pk = self.job_row(job)["id"] if job else None
        recs = []
        for rec in self.store.recommendations(job_pk=job_pk):
            if since is not None and rec.created < since:
                continue
            if until is not None and rec.created > until:
                continue
            if not sees_all(who) and (rec.user or "") != who.name:
                continue
            recs.append({"kind": "recommendation", **rec.to_dict(),
                         "steps": self.store.steps(rec.id)})
        changes = self.changes(since, until, job_pk, who)
        return list(heapq.merge(recs, changes, key=lambda r: r["created"]))

    def changes(self, since: float | None = None, until: float | None = None,
                job_pk: int | None = None, who: Caller | None = None,
                limit: int | None = None) -> list[dict]:
        """Operator changes in time order (the newest ``limit``), as
        :meth:`audit` shows them and to whom."""
        rows = self.store.operator_actions(since, until, job_pk,
                                           limit=limit if sees_all(who) else None)
        if not sees_all(who):
            rows = [r for r in rows if r["job"] is not None
                    and (r["job_user"] or "") == who.name]
            rows = rows[-limit:] if limit else rows
        return [operator_record(row) for row in rows]

    # -- writes ----------------------------------------------------------------
    # Each change and its audit record are one transaction: the operator_actions
    # row (who, when, the state before and after, the reason) and, as before,
    # an ``api_<verb>`` line on the timeline (the job's, for a recommendation).
    # A refused call changes nothing and records nothing there: the agent's
    # log says who was refused what (see _refuse).
    def _record(self, who: Caller, action: str, message: str, *, target: str,
                before: str | None, after: str | None, reason: str = "",
                rec: Recommendation | None = None, env: str | None = None,
                node: str | None = None, **data: Any) -> None:
        """Write one operator change's record; call it inside the change's
        transaction."""
        job_pk = rec.job if rec is not None else None
        self.store.add_operator_action({
            "ts": self.clock(), "action": action, "actor": who.name, "actor_uid": who.uid,
            "role": "admin" if who.admin else "user", "via": self.via, "target": target,
            "env": env, "node": node, "rec": rec.id if rec is not None else None,
            "job": job_pk, "job_id": rec.job_id if rec is not None else None,
            "job_user": rec.user if rec is not None else None, "before": before,
            "after": after, "reason": reason or None}, data=data or None)
        verb = "mode" if action == "mode_clear" else action
        self.store.add_event(job_pk, f"api_{verb}", f"{message} (by {who.name}, uid {who.uid})",
                             source="api", data={"uid": who.uid, "user": who.name,
                                                 **({"env": env} if env else {}),
                                                 **({"node": node} if node else {}),
                                                 **({"rec": rec.id} if rec else {}),
                                                 **({"reason": reason} if reason else {}),
                                                 "before": before, "after": after, **data})
        log.info("%s by %s (uid %s, via %s): %s", action, who.name, who.uid, self.via,
                 message)

    def _refuse(self, who: Caller, verb: str, why: str) -> Forbidden:
        """The refusal of ``who``'s ``verb``, said in the agent's log (the
        audit trail records changes, not attempts)."""
        log.warning("refused %s by %s (uid %s, via %s): %s", verb, who.name, who.uid,
                    self.via, why)
        return Forbidden(why)

    def _admin(self, who: Caller, what: str) -> None:
        if not who.admin:
            raise self._refuse(who, what, f"only admins {what} ({who} is not one)")

    def _may_act(self, who: Caller, rec: Recommendation, verb: str) -> None:
        """Who may ack, complete or cancel a recommendation: admins (site
        controllers run as one) any. A user only cancels a job recommendation
        of their own job: a node's drain or resume is admin business even when
        their job's failure led to it, and ack/complete claim to act on Slurm,
        which a user's claim never does."""
        if who.admin:
            return
        if (rec.user or "") != who.name:
            raise self._refuse(who, verb, f"recommendation {rec.id} is for a job of "
                               f"{rec.user or 'another user'}; {who.name} may act only "
                               "on their own jobs")
        if (rec.scope or "job") != "job":
            raise self._refuse(who, verb, f"recommendation {rec.id} is a {rec.action} of "
                               f"{', '.join(rec.target_nodes or []) or 'a node'}: "
                               "node-level recommendations are for admins "
                               f"({who} is not one)")
        if verb != "cancel":
            raise self._refuse(who, verb, f"only admins {verb} recommendations (a site "
                               "controller claims one, acts on Slurm, then completes it; "
                               f"{who} is not an admin); as the job's owner you may "
                               "cancel it")

    def _environment(self, env: str) -> None:
        if env not in self.cfg.environments:
            raise NotFound(f"no environment {env!r} in the config")

    def set_mode(self, who: Caller, env: str, mode: str, reason: str = "") -> dict:
        """Set an environment's mode at run time; it wins over the config file
        until :meth:`clear_mode`."""
        self._admin(who, "change modes")
        self._environment(env)
        if mode not in MODES:
            raise BadRequest(f"mode must be one of {', '.join(MODES)}")
        reason = reason[:500]
        with self.store.transaction():
            overrides = mode_overrides(self.store)
            before = overrides.get(env, self.cfg.environments[env].mode)
            overrides[env] = mode
            self.store.set_state(MODE_OVERRIDES, overrides)
            self._record(who, "mode", f"environment {env}: {before} -> {mode}", target=env,
                         env=env, before=before, after=mode, reason=reason)
        return {"env": env, "mode": mode, "before": before, "source": "operator"}

    def clear_mode(self, who: Caller, env: str, reason: str = "") -> dict:
        """Give an environment back its config file's mode. One the file
        rules already is left as it is, and nothing is recorded."""
        self._admin(who, "change modes")
        self._environment(env)
        configured = self.cfg.environments[env].mode
        with self.store.transaction():
            overrides = mode_overrides(self.store)
            if env not in overrides:
                return {"env": env, "mode": configured, "before": configured,
                        "source": "file", "cleared": False}
            before = overrides.pop(env)
            self.store.set_state(MODE_OVERRIDES, overrides)
            self._record(who, "mode_clear", f"environment {env}: {before} -> {configured} "
                         "(the config file's)", target=env, env=env, before=before,
                         after=configured, reason=reason[:500])
        return {"env": env, "mode": configured, "before": before, "source": "file",
                "cleared": True}

    def slurm_node_names(self) -> set[str]:
        """The nodes Slurm knows (sinfo), asked at most every 5 s. Raises
        SlurmUnavailable when Slurm cannot be asked: that never means "none"."""
        now = self.clock()
        if self._slurm_nodes and now - self._slurm_nodes[0] < 5:
            return self._slurm_nodes[1]
        sched = self.scheduler = self.scheduler or scheduler_for(self.cfg)
        if sched is None:
            raise SlurmUnavailable("cannot ask Slurm which nodes it has: no usable "
                                   "scheduler backend here (see the agent's log)")
        try:
            names = {n.name for n in sched.list_nodes()}
        except RecoveryError as exc:
            raise SlurmUnavailable(f"cannot ask Slurm which nodes it has: {exc}") from None
        self._slurm_nodes = (now, names)
        return names

    def _unchecked(self, name: str, force: bool) -> str:
        """Why a node Slurm does not know (or cannot say it knows) is excluded
        anyway under ``force`` ("" when Slurm knows it); without ``force``, the
        refusal."""
        hint = "; to exclude it anyway, force it (recovery-ctl exclude --force)"
        try:
            if name in self.slurm_node_names():
                return ""
            why = f"Slurm has no node {name!r}"
            if not force:
                raise NotFound(why + hint)
        except SlurmUnavailable as exc:
            why = str(exc)
            if not force:
                raise SlurmUnavailable(f"{why}; {name} not excluded{hint}") from None
        return why

    def exclude(self, who: Caller, name: str, reason: str, force: bool = False) -> dict:
        self._admin(who, "exclude nodes")
        if not re.search(VISIBLE, reason):
            raise BadRequest("a reason is required")
        forced = self._unchecked(name, force)
        reason = reason[:500]
        with self.store.transaction():
            before = self._exclusion(name)
            self.store.set_node(name, excluded_by_operator=1)
            self._record(who, "exclude", f"node {name} excluded from retries: {reason}"
                         + (f" (forced: {forced})" if forced else ""), target=name, node=name,
                         before=before, after="excluded", reason=reason,
                         **({"forced": forced} if forced else {}))
        return {"node": name, "excluded": True, **({"forced": forced} if forced else {})}

    def _exclusion(self, name: str) -> str:
        row = self.store.node(name)
        return "excluded" if row and row.get("excluded_by_operator") else "included"

    def include(self, who: Caller, name: str, reason: str = "") -> dict:
        self._admin(who, "include nodes")
        if self.store.node(name) is None:
            raise NotFound(f"node {name} is not known")
        with self.store.transaction():
            before = self._exclusion(name)
            self.store.set_node(name, excluded_by_operator=0)
            self._record(who, "include", f"node {name} no longer excluded", target=name,
                         node=name, before=before, after="included", reason=reason[:500])
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

    def ack(self, who: Caller, rec_id: int, reason: str = "") -> dict:
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
            self._record(who, "ack", f"recommendation #{rec_id} claimed", target=f"#{rec_id}",
                         rec=rec, before=Status(rec.status).value, after=Status.EXECUTING.value,
                         reason=reason[:500], claimed_by=claim, claim_expires=now + ttl)
        self.store.add_step(rec_id, "claimed", "ok", f"{who.name} until +{ttl:g}s")
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
            self._record(who, "complete", f"recommendation #{rec_id} {outcome}",
                         target=f"#{rec_id}", rec=rec, before=Status(rec.status).value,
                         after=outcome, reason=detail, outcome=outcome)
        self.store.add_step(rec_id, "completed", "ok" if outcome == "done" else "failed",
                            detail)
        return {"id": rec_id, "status": outcome}

    def cancel(self, who: Caller, rec_id: int, reason: str = "") -> dict:
        rec = self._rec(rec_id)
        steps = self.store.steps(rec_id)
        self._may_act(who, rec, "cancel")
        started = any(s["step"] not in ("claimed", "claim_expired") for s in steps)
        if not rec.status.is_open or started:
            raise Conflict(f"recommendation {rec_id} is {rec.status}"
                           + (" and already acting on Slurm" if started else ""))
        reason = reason[:500]
        with self.store.transaction():
            why = f"cancelled by {who.name}" + (f": {reason}" if reason else "")
            self.store.save_rec(rec.finished(Status.CANCELLED, error=why), "status", "error")
            self._record(who, "cancel", f"recommendation #{rec_id} cancelled",
                         target=f"#{rec_id}", rec=rec, before=Status(rec.status).value,
                         after=Status.CANCELLED.value, reason=reason)
        return {"id": rec_id, "status": "cancelled"}
