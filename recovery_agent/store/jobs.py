"""The store's jobs and their attempts: registering a job under its key
(cluster, job id, submit time; see :func:`same_job`), and the queries the watch
loop, hook ingest and the API need (:class:`JobQueries`, mixed into the store)."""
from __future__ import annotations

import json
import sqlite3
import threading
import time
from typing import Any, Iterable, Mapping

from sqlite_utils import Database
from sqlite_utils.db import NotFoundError

from ..errors import StoreError
from ..scheduler.base import Job
from .timeline import _dumps


# a job's category as a list shows it: that of its last job recommendation (the
# verdict that decided it), else of its last detection
_CATEGORY = ("coalesce((select r.reason_category from recommendations r where r.job = j.id "
             "and r.scope = 'job' order by r.id desc limit 1), (select d.category from "
             "detections d where d.job = j.id order by d.id desc limit 1))")


class JobQueries:
    """Mixed into :class:`~recovery_agent.store.Store`."""

    db: Database
    lock: threading.RLock

    # -- jobs and attempts -------------------------------------------------
    def record_job(self, job: Job, cluster: str, env: str = "default", mode: str = "monitor",
                   spec: str = "") -> int:
        """Insert or refresh a job; return its row id. A job id reused after a
        slurmctld reset becomes a new row (see :meth:`match_job`)."""
        now = time.time()
        values = {"numeric_id": job.numeric_id, "array_job_id": job.array_job_id,
                  "array_task_id": job.array_task_id, "name": job.name, "user": job.user,
                  "env": env, "mode": mode, "spec": spec, "state": job.state,
                  "restart_count": job.restart_count, "last_seen": now}
        if job.command:    # a hook's report names no script: keep the listing's
            values["command"] = job.command
        try:
            with self.db.atomic():
                row = self.match_job(cluster, job)
                if row is None:
                    key = {"cluster": cluster, "job_id": job.job_id,
                           "submit_time": job.submit_time or 0}
                    return self.db["jobs"].insert({**key, **values, "first_seen": now}).last_pk
                if not row["submit_time"] and job.submit_time:
                    # stored before its submit time was known: this is that job
                    values["submit_time"] = job.submit_time
                self.db["jobs"].update(row["id"], values)
                return row["id"]
        except sqlite3.Error as exc:
            raise StoreError(f"cannot record job {job.job_id}: {exc}") from None

    def adopt_printable_id(self, cluster: str, job: Job) -> None:
        """A node hook may name an array task by its numeric id (22.05's prolog
        environment lacks the array variables); once the scheduler names it
        (``1200_7``), the row stored under the numeric id takes that name."""
        if job.array_task_id is None or str(job.numeric_id) == job.job_id:
            return
        old = list(self.db["jobs"].rows_where(
            "cluster = ? and job_id = ? and array_task_id is null",
            [cluster, str(job.numeric_id)], order_by="id desc", limit=1))
        if not old or self.find_job(cluster, job.job_id) is not None:
            return
        self.db["jobs"].update(old[0]["id"], {
            "job_id": job.job_id, "array_job_id": job.array_job_id,
            "array_task_id": job.array_task_id, "numeric_id": job.numeric_id})

    def match_job(self, cluster: str, job: Job) -> dict | None:
        """The stored row of this job, if any.

        The key is (cluster, job id, submit time of the first attempt seen).
        Slurm gives a requeued job a new submit time, so a listing with a later
        submit time is still the same job when its restart count went up (and
        its user and name, where known, agree); a reused id starts again at
        restart count 0 and so never matches an old job."""
        submit = job.submit_time or 0
        row = self._job_row(cluster, job.job_id, submit)
        if row is not None or not submit:
            return row
        rows = list(self.db["jobs"].rows_where("cluster = ? and job_id = ?",
                                               [cluster, job.job_id], order_by="id desc",
                                               limit=1))
        if not rows:
            return None
        return rows[0] if same_job(rows[0], job) else None

    def _job_row(self, cluster: str, job_id: str, submit_time: int) -> dict | None:
        rows = list(self.db["jobs"].rows_where(
            "cluster = ? and job_id = ? and submit_time = ?", [cluster, job_id, submit_time],
            limit=1))
        return rows[0] if rows else None

    def job(self, pk: int) -> dict:
        try:
            return self.db["jobs"].get(pk)
        except NotFoundError:
            raise StoreError(f"no job with row id {pk}") from None

    def find_job_exact(self, cluster: str, job_id: str, submit_time: int) -> dict | None:
        return self._job_row(cluster, job_id, submit_time)

    def find_job(self, cluster: str, job_id: str) -> dict | None:
        """The newest job of that id (the one after any id reuse): the last
        registered, since a new job's submit time may not be known yet."""
        rows = list(self.db["jobs"].rows_where("cluster = ? and job_id = ?", [cluster, job_id],
                                               order_by="id desc", limit=1))
        return rows[0] if rows else None

    def watch_rows(self, cluster: str, finished: Iterable[str], since: float) -> list:
        """The jobs rows the watch loop needs each cycle: every unfinished job of
        the cluster, and finished ones seen since ``since``. Only the columns it
        reads, as sqlite3.Row (indexable by name): a store holding months of
        finished jobs costs a cycle nothing for them."""
        states = list(finished)
        cur = self.db.conn.cursor()
        cur.row_factory = sqlite3.Row
        marks = ",".join("?" * len(states))
        return cur.execute(
            "select id, cluster, job_id, submit_time, user, name, state, last_seen, "
            "restart_count, env, mode, spec "
            f"from jobs where cluster = ? and (state not in ({marks}) or last_seen is null "
            "or last_seen >= ?) order by id", [cluster, *states, since]).fetchall()

    def jobs(self, state: str | None = None) -> list[dict]:
        if state:
            return list(self.db["jobs"].rows_where("state = ?", [state], order_by="id"))
        return list(self.db["jobs"].rows_where(order_by="id"))

    def record_attempt(self, job_pk: int, job: Job) -> int:
        """Insert or refresh the attempt numbered by the job's restart count
        (its output paths only when the listing names them: a hook's report
        does not)."""
        now = time.time()
        values = {"nodes": _dumps(list(job.nodes)), "batch_host": job.batch_host,
                  "start_time": job.start_time, "end_time": job.end_time, "state": job.state,
                  "exit_code": job.exit_code, "exit_signal": job.exit_signal, "last_seen": now}
        values.update({key: path for key, path in (("stdout", job.stdout),
                                                    ("stderr", job.stderr)) if path})
        with self.db.atomic():
            rows = list(self.db["attempts"].rows_where("job = ? and attempt = ?",
                                                       [job_pk, job.restart_count], limit=1))
            if rows:
                self.db["attempts"].update(rows[0]["id"], values)
                return rows[0]["id"]
            return self.db["attempts"].insert({"job": job_pk, "attempt": job.restart_count,
                                               "first_seen": now, **values}).last_pk

    def set_attempt_checkpoint(self, job_pk: int, attempt: int, path: str, step: int | None,
                               when: float) -> None:
        """Note the newest checkpoint of an attempt (the attempt row must exist)."""
        with self.db.atomic():
            self.db.execute("update attempts set ckpt_path = ?, ckpt_step = ?, ckpt_time = ? "
                            "where job = ? and attempt = ?", [path, step, when, job_pk, attempt])

    def set_attempt_step(self, job_pk: int, attempt: int, step: int, when: float) -> None:
        """Note the last training step an attempt's log reported (the attempt
        row must exist)."""
        with self.db.atomic():
            self.db.execute("update attempts set last_step = ?, last_step_time = ? "
                            "where job = ? and attempt = ?", [step, when, job_pk, attempt])

    def attempts(self, job_pk: int) -> list[dict]:
        rows = list(self.db["attempts"].rows_where("job = ?", [job_pk], order_by="attempt"))
        for row in rows:
            row["nodes"] = json.loads(row["nodes"] or "[]")
        return rows

    # -- what the watch loop, hook ingest and the API ask of jobs -----------
    def touch_seen(self, seen: Mapping[int, float]) -> None:
        """Set ``last_seen`` of many jobs ({row id: time}) in one statement and
        one transaction, holding the store lock."""
        with self.lock, self.db.atomic():
            self.db.conn.executemany("update jobs set last_seen = ? where id = ?",
                                     [(t, pk) for pk, t in seen.items()])

    def set_job_state(self, job_pk: int, state: str) -> None:
        """Set a job's stored state (``GONE`` when the agent lets it go),
        holding the store lock."""
        with self.lock:
            self.db["jobs"].update(job_pk, {"state": state})

    def jobs_without_submit_time(self, cluster: str) -> list[dict]:
        """The cluster's jobs stored before their submit time was known (0)."""
        return list(self.db["jobs"].rows_where("cluster = ? and submit_time = 0", [cluster]))

    def set_submit_time(self, job_pk: int, submit_time: int) -> None:
        """Give a job row its submit time (the caller checked the key is free)."""
        self.db["jobs"].update(job_pk, {"submit_time": submit_time})

    def merge_job(self, src_pk: int, dst_pk: int) -> None:
        """Fold job row ``src_pk`` into ``dst_pk``, the same Slurm job stored
        twice: everything recorded under ``src_pk`` (reports, XIDs, events,
        detections, recommendations, strikes, attempts ``dst_pk`` lacks) moves
        to ``dst_pk``, and ``src_pk`` goes. The caller holds a transaction."""
        have = {r["attempt"] for r in self.db["attempts"].rows_where("job = ?", [dst_pk],
                                                                     select="attempt")}
        if have:
            marks = ", ".join("?" * len(have))
            self.db.execute(f"delete from attempts where job = ? and attempt in ({marks})",
                            [src_pk, *sorted(have)])
        for table in ("attempts", "node_reports", "xids", "events", "detections",
                      "recommendations", "strikes"):
            self.db.execute(f"update {table} set job = ? where job = ?", [dst_pk, src_pk])
        self.db["jobs"].delete(src_pk)

    def find_jobs(self, cluster: str, state: str | None = None, user: str | None = None,
                  env: str | None = None, limit: int = 500,
                  before: int | None = None) -> list[dict]:
        """The cluster's jobs, newest (highest row id) first, filtered by
        whichever of state, user and env are given, at most ``limit``;
        ``before``: only rows with an id below it (the next page of a list
        that ended at that id)."""
        where, args = ["cluster = ?"], [cluster]
        for key, value in (("state", state), ("user", user), ("env", env)):
            if value:
                where.append(f'"{key}" = ?')
                args.append(value)
        if before is not None:
            where.append("id < ?")
            args.append(before)
        return list(self.db["jobs"].rows_where(" and ".join(where), args,
                                               order_by="id desc", limit=limit))

    def search_jobs(self, cluster: str, state: str | None = None, user: str | None = None,
                    env: str | None = None, node: str | None = None,
                    category: str | None = None, text: str | None = None,
                    limit: int = 100, before: int | None = None) -> list[dict]:
        """The cluster's jobs as the Console lists them: newest first, each
        with its ``category`` (that of its last job recommendation, else of its
        last detection), filtered by whichever are given: state, user, env, a
        node one of its attempts ran on, a category, and ``text`` found (any
        case) in its job id, name or user; ``before``: only rows with a lower
        row id (the next page)."""
        where, args = ["j.cluster = ?"], [cluster]
        for key, value in (("state", state), ("user", user), ("env", env)):
            if value:
                where.append(f'j."{key}" = ?')
                args.append(value)
        if node:
            where.append("exists (select 1 from attempts a, json_each(a.nodes) n "
                         "where a.job = j.id and n.value = ?)")
            args.append(node)
        if category:
            where.append(f"{_CATEGORY} = ?")
            args.append(category)
        if text:
            where.append("instr(lower(j.job_id || ' ' || coalesce(j.name, '') || ' ' "
                         "|| coalesce(j.user, '')), ?) > 0")
            args.append(text.lower())
        if before is not None:
            where.append("j.id < ?")
            args.append(before)
        return list(self.db.query(
            f"select j.*, {_CATEGORY} as category from jobs j where {' and '.join(where)} "
            "order by j.id desc limit ?", [*args, limit]))

    def job_facets(self, cluster: str, user: str | None = None) -> dict[str, list[str]]:
        """The values the Console's job filters offer: the states, environments
        and users of the cluster's jobs (of ``user``'s only, when given), and
        the categories of their detections and job recommendations, each sorted."""
        mine = ' and j."user" = ?2' if user is not None else ""

        def values(sql: str) -> list[str]:
            args = [cluster] if user is None else [cluster, user]
            return sorted(r[0] for r in self.db.execute(sql, args).fetchall() if r[0])
        return {
            "state": values(f"select distinct state from jobs j where cluster = ?1{mine}"),
            "env": values(f"select distinct env from jobs j where cluster = ?1{mine}"),
            "user": values(f'select distinct "user" from jobs j where cluster = ?1{mine}'),
            "category": values(
                "select category from detections d join jobs j on j.id = d.job "
                f"where j.cluster = ?1{mine} union select reason_category from "
                "recommendations r join jobs j on j.id = r.job where j.cluster = ?1 "
                f"and r.scope = 'job'{mine}"),
        }

    def array_tasks(self, cluster: str, array_job_id: int) -> list[dict]:
        """The stored tasks of a job array, by task id."""
        return list(self.db["jobs"].rows_where(
            "cluster = ? and array_job_id = ?", [cluster, array_job_id],
            order_by="array_task_id"))

    def last_category(self, job_pk: int) -> str | None:
        """What the agent concluded about a job: the category of its latest
        verdict, else of its latest detection (None when it has neither)."""
        verdict = list(self.db["events"].rows_where(
            "job = ? and kind = 'verdict'", [job_pk], order_by="id desc", limit=1))
        category = json.loads(verdict[0]["data"] or "{}").get("category") \
            if verdict else None
        if category is None:
            last = list(self.db["detections"].rows_where(
                "job = ?", [job_pk], order_by="id desc", limit=1))
            category = last[0]["category"] if last else None
        return category

    def last_detection_category(self, job_pk: int) -> str | None:
        """The category of a job's latest detection (None when it has none)."""
        last = list(self.db["detections"].rows_where(
            "job = ?", [job_pk], select="category", order_by="id desc", limit=1))
        return last[0]["category"] if last else None


def same_job(row: Mapping[str, Any], job: Job) -> bool:
    """Is ``job`` (as Slurm lists it now) the job stored in ``row``?

    The key is (cluster, job id, submit time of the first attempt). Slurm gives
    a requeued job a new submit time, so a later submit time is still the same
    job when its restart count went up (never down) and its user and name,
    where both are known, agree. A job id reused after a slurmctld state reset
    starts again at restart count 0 with another submit time: never the same.
    A row stored before its submit time was known (0) is the same job while
    the user agrees."""
    stored = row["submit_time"] or 0
    submit = job.submit_time or 0
    if not stored or not submit:
        return _agree(row["user"], job.user)
    if stored == submit:
        return True
    return (job.restart_count > 0 and stored <= submit
            and (row["restart_count"] or 0) <= job.restart_count
            and _agree(row["user"], job.user) and _agree(row["name"], job.name))


def _agree(stored: str | None, listed: str | None) -> bool:
    return not stored or not listed or stored == listed
