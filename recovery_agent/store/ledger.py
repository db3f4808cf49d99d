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
        """Every checkpoint on a job's timeline ({attempt, time, step}), by time:
        the ``checkpoint`` events (their data's file time, else the time the
        agent saw it) and each attempt's newest recorded checkpoint."""
        out: dict[tuple, dict] = {}
        for row in self.db["events"].rows_where("job = ? and kind = 'checkpoint'", [job_pk],
                                                order_by="ts, id"):
            data = json.loads(row["data"]) if row["data"] else {}
            step = data.get("step")
            if step is None:
                found = _STEP.search(row["message"] or "")
                step = int(found.group(1)) if found else None
            when = float(data.get("time") or row["ts"])
            out[(row["attempt"], step, round(when, 3))] = {"attempt": row["attempt"],
                                                          "time": when, "step": step}
        for row in self.db["attempts"].rows_where("job = ? and ckpt_time is not null",
                                                  [job_pk], select="attempt, ckpt_step, "
                                                  "ckpt_time"):
            same = [c for c in out.values() if c["attempt"] == row["attempt"]
                    and c["step"] == row["ckpt_step"]]
            if not same:
                out[(row["attempt"], row["ckpt_step"], row["ckpt_time"])] = {
                    "attempt": row["attempt"], "time": float(row["ckpt_time"]),
                    "step": row["ckpt_step"]}
        return sorted(out.values(), key=lambda c: c["time"])

    def first_step_times(self, job_pk: int) -> dict[int, float]:
        """When each of a job's recommendations first acted on Slurm (its first
        recorded step), by recommendation id."""
        rows = self.db.execute(
            "select s.rec, min(s.ts) from rec_steps s join recommendations r on r.id = s.rec "
            "where r.job = ? group by s.rec", [job_pk]).fetchall()
        return {int(rec): float(ts) for rec, ts in rows}
