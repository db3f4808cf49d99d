"""The store's queries on jobs that the watch loop, hook ingest and the API
need beyond registering them (:meth:`Store.record_job` and the rest of the
job methods live in the package itself)."""
from __future__ import annotations

import json
import threading
from typing import Mapping

from sqlite_utils import Database


class JobQueries:
    """Mixed into :class:`~recovery_agent.store.Store`."""

    db: Database
    lock: threading.RLock

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

    def find_jobs(self, cluster: str, state: str | None = None, user: str | None = None,
                  env: str | None = None, limit: int = 500) -> list[dict]:
        """The cluster's jobs, newest (highest row id) first, filtered by
        whichever of state, user and env are given, at most ``limit``."""
        where, args = ["cluster = ?"], [cluster]
        for key, value in (("state", state), ("user", user), ("env", env)):
            if value:
                where.append(f'"{key}" = ?')
                args.append(value)
        return list(self.db["jobs"].rows_where(" and ".join(where), args,
                                               order_by="id desc", limit=limit))

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
