"""What the goodput ledger reads (:class:`LedgerQueries`, mixed into the
store): the jobs active in a window, each attempt's GPU count from the node
hooks' reports, the checkpoints on a job's timeline, and when each job
recommendation first acted on Slurm. The ledger itself is
:mod:`recovery_agent.detect.ledger`."""
from __future__ import annotations

import json
import re

from sqlite_utils import Database

_STEP = re.compile(r"\bstep (\d+)\b")


class LedgerQueries:
    """Mixed into :class:`~recovery_agent.store.Store`."""

    db: Database

    def ledger_jobs(self, cluster: str, since: float, until: float) -> list[dict]:
        """The cluster's jobs with an attempt that ran, or a job recommendation
        made, in [since, until], by row id."""
        return list(self.db.query(
            "select j.* from jobs j where j.cluster = ? and (exists (select 1 from "
            "attempts a where a.job = j.id and coalesce(a.start_time, a.first_seen) <= ? "
            "and (a.end_time is null or a.end_time = 0 or a.end_time >= ?)) or exists "
            "(select 1 from recommendations r where r.job = j.id and r.scope = 'job' and "
            "r.created between ? and ?)) order by j.id",
            [cluster, until, since, since, until]))

    def attempt_gpus(self, job_pk: int) -> dict[int, int]:
        """GPUs of each attempt as the node hooks counted them: the sum over
        the attempt's reporting nodes of the most GPUs one of that node's
        reports listed (attempts without such a report are absent)."""
        rows = self.db.execute(
            "select attempt, sum(n) from (select attempt, node, max(gpu_count) as n from "
            "node_reports where job = ? and attempt is not null and gpu_count is not null "
            "group by attempt, node) group by attempt", [job_pk]).fetchall()
        return {int(a): int(n) for a, n in rows if n}

    def job_checkpoints(self, job_pk: int) -> list[dict]:
        """Every checkpoint on a job's timeline ({attempt, time, step, seen}),
        by time: the ``checkpoint`` events (their data's file time, else the
        time the agent saw it) and each attempt's newest recorded checkpoint.
        ``seen``: when the agent first recorded it (its first event's time;
        None for an attempt's checkpoint without an event)."""
        out: dict[tuple, dict] = {}
        for row in self.db["events"].rows_where("job = ? and kind = 'checkpoint'", [job_pk],
                                                order_by="ts, id"):
            data = json.loads(row["data"]) if row["data"] else {}
            step = data.get("step")
            if step is None:
                found = _STEP.search(row["message"] or "")
                step = int(found.group(1)) if found else None
            when = float(data.get("time") or row["ts"])
            out.setdefault((row["attempt"], step, round(when, 3)), {
                "attempt": row["attempt"], "time": when, "step": step,
                "seen": float(row["ts"])})
        for row in self.db["attempts"].rows_where("job = ? and ckpt_time is not null",
                                                  [job_pk], select="attempt, ckpt_step, "
                                                  "ckpt_time"):
            same = [c for c in out.values() if c["attempt"] == row["attempt"]
                    and c["step"] == row["ckpt_step"]]
            if not same:
                out[(row["attempt"], row["ckpt_step"], row["ckpt_time"])] = {
                    "attempt": row["attempt"], "time": float(row["ckpt_time"]),
                    "step": row["ckpt_step"], "seen": None}
        return sorted(out.values(), key=lambda c: c["time"])

    def first_step_times(self, job_pk: int) -> dict[int, float]:
        """When each of a job's recommendations first acted on Slurm (its first
        recorded step), by recommendation id."""
        rows = self.db.execute(
            "select s.rec, min(s.ts) from rec_steps s join recommendations r on r.id = s.rec "
            "where r.job = ? group by s.rec", [job_pk]).fetchall()
        return {int(rec): float(ts) for rec, ts in rows}

    # -- what later history says of our decisions (detect/hindsight) ---------
    def ledger_blames(self, cluster: str, since: float, until: float) -> list[dict]:
        """The recommendations that excluded or drained nodes (done; in monitor
        mode, would have) made in [since, until], oldest first, each with its
        nodes (``nodes``: excluded and target nodes) and its job's row id,
        attempt, Slurm id and user."""
        rows = self.db.query(
            "select r.id, r.job, r.attempt, r.scope, r.action, r.reason_category, r.mode, "
            "r.created, r.target_nodes, r.exclude, r.user, j.job_id from recommendations r "
            "left join jobs j on j.id = r.job where r.cluster = ? and r.created between ? "
            "and ? and r.status in ('done', 'would_have') and r.action in "
            "('requeue_exclude', 'drain_node') order by r.created, r.id",
            [cluster, since, until])
        out = []
        for row in rows:
            nodes = [*json.loads(row.pop("exclude") or "[]"),
                     *json.loads(row.pop("target_nodes") or "[]")]
            out.append({**row, "nodes": list(dict.fromkeys(nodes))})
        return out

    def node_facts(self, node: str, after: float, until: float) -> list[dict]:
        """What the store recorded of ``node`` in (after, until], by time: its
        hook reports (``kind`` report; ``bad`` when its GPUs failed or it
        carried XIDs), strikes blamed on it (``strike``; a hang's suspicion of
        every node of the job is left out), attempts that started there and
        completed (``job``) and our resumes of it (``resume``). Each names
        its job's row id, attempt and user (``job_user``) where it has one."""
        facts = [dict(r, kind="report") for r in self.db.query(
            "select r.received as time, r.job, r.attempt, r.hook as detail, "
            "(select user from jobs where id = r.job) as job_user, "
            "(r.gpu_ok = 0 or exists (select 1 from xids x where x.report = r.id)) as bad "
            "from node_reports r where r.node = ? and r.received > ? and r.received <= ?",
            [node, after, until])]
        facts += [dict(r, kind="strike", bad=1, attempt=None) for r in self.db.query(
            "select ts as time, job, category as detail, "
            "(select user from jobs where id = strikes.job) as job_user from strikes where node = ? "
            "and ts > ? and ts <= ? and category != 'hang_suspect'", [node, after, until])]
        facts += [dict(r, kind="job", bad=0) for r in self.db.query(
            "select a.start_time as time, a.job, a.attempt, j.job_id as detail, j.user as job_user "
            "from attempts a "
            "join jobs j on j.id = a.job where a.start_time > ? and a.start_time <= ? and "
            "a.state = 'COMPLETED' and exists (select 1 from json_each(a.nodes) n where "
            "n.value = ?)", [after, until, node])]
        facts += [dict(r, kind="resume", bad=0, job=None, attempt=None) for r in self.db.query(
            "select created as time, id as rec, rule as detail from recommendations where "
            "scope = 'node' and action = 'resume_node' and status = 'done' and created > ? "
            "and created <= ? and exists (select 1 from json_each(target_nodes) t where "
            "t.value = ?)", [after, until, node])]
        return sorted(facts, key=lambda f: f["time"])

    def ledger_stops(self, cluster: str, since: float, until: float) -> list[dict]:
        """The job recommendations that stopped a job (done; in monitor mode,
        would have) made in [since, until], with the job's row."""
        return list(self.db.query(
            "select r.id as rec, r.created, r.mode, r.reason_category, j.* from "
            "recommendations r join jobs j on j.id = r.job where r.cluster = ? and "
            "r.scope = 'job' and r.action = 'stop' and r.status in ('done', 'would_have') "
            "and r.created between ? and ? order by r.created, r.id",
            [cluster, since, until]))

    def same_named_jobs(self, cluster: str, user: str, name: str, since: float,
                        until: float) -> list[dict]:
        """The cluster's jobs of ``user`` named ``name`` submitted in [since,
        until], by submit time."""
        return list(self.db.query(
            "select * from jobs where cluster = ? and user = ? and name = ? and "
            "submit_time between ? and ? order by submit_time, id",
            [cluster, user, name, since, until]))
