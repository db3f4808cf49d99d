"""The store's recommendations (the audit unit) and their execution steps:
adding, reading and updating one, and the queries the actuator, the decider,
the watch loop and the API need (:class:`RecQueries`, mixed into the store)."""
from __future__ import annotations

import json
import threading
import time
from typing import Any, Iterable, Mapping

from sqlite_utils import Database
from sqlite_utils.db import NotFoundError

from ..errors import StoreError
from .records import JSON_COLUMNS, JSON_OBJECTS, OPEN_STATUSES, Recommendation, Status


def sql_list(statuses) -> str:
    """Statuses as an SQL list: ``'proposed', 'executing'``."""
    return ", ".join(f"'{Status(s).value}'" for s in statuses)


# a hold not known to be lifted: open ones, and ended ones whose release failed
_HOLDING = sql_list((*OPEN_STATUSES, Status.FAILED, Status.EXPIRED))
# drains that count against the budget: on their way, done, or would-have
_BUDGETED = sql_list((*OPEN_STATUSES, Status.DONE, Status.WOULD_HAVE))


def decode_rec(row: Mapping[str, Any]) -> Recommendation:
    """A stored row as a :class:`Recommendation`: its JSON columns decoded (an
    empty one is [] or, for the evidence and the attribution, {})."""
    row = dict(row)
    for key in JSON_COLUMNS:
        row[key] = json.loads(row[key]) if row.get(key) else (
            {} if key in JSON_OBJECTS else [])
    return Recommendation.from_row(row)


def encode_rec(values: dict[str, Any]) -> dict[str, Any]:
    """Columns of a recommendation as stored, in place: the JSON columns as
    text (a tuple as a list), a Status as its plain value."""
    for key in JSON_COLUMNS:
        if key in values and not isinstance(values[key], str):
            values[key] = json.dumps(values[key], sort_keys=True, default=str)
    if isinstance(values.get("status"), Status):
        values["status"] = values["status"].value
    return values


class RecQueries:
    """Mixed into :class:`~recovery_agent.store.Store`."""

    db: Database
    lock: threading.RLock

    # -- recommendations (the audit unit) -----------------------------------
    def add_recommendation(self, values: Mapping[str, Any]) -> int:
        """Insert one recommendation; JSON-able fields are encoded. The caller
        holds the lock and, usually, a transaction with the verdict."""
        now = time.time()
        row = encode_rec({"created": now, "updated": now, "tries": 0, "scope": "job",
                          **values})
        return self.db["recommendations"].insert(row).last_pk

    def rec(self, pk: int) -> Recommendation:
        try:
            return decode_rec(self.db["recommendations"].get(pk))
        except NotFoundError:
            raise StoreError(f"no recommendation {pk}") from None

    def recommendations(self, status: str | Iterable[str] | None = None,
                        job_pk: int | None = None) -> list[Recommendation]:
        where, args = [], []
        if status is not None:
            wanted = [str(status)] if isinstance(status, str) else [str(s) for s in status]
            where.append(f"status in ({', '.join('?' * len(wanted))})")
            args += wanted
        if job_pk is not None:
            where.append("job = ?")
            args.append(job_pk)
        rows = self.db["recommendations"].rows_where(" and ".join(where) or None, args,
                                                      order_by="id")
        return [decode_rec(r) for r in rows]

    def job_rec(self, job_pk: int, attempt: int, run_start: int | None = None
                ) -> Recommendation | None:
        """The job recommendation of one attempt; with ``run_start``, of the run
        of that attempt that started then (one made before runs were told
        apart, without a run, counts for every run of its attempt)."""
        where, args = "job = ? and attempt = ? and scope = 'job'", [job_pk, attempt]
        if run_start is not None:
            where += " and (run_start is null or run_start = ?)"
            args.append(run_start)
        rows = list(self.db["recommendations"].rows_where(where, args, order_by="id",
                                                          limit=1))
        return decode_rec(rows[0]) if rows else None

    def open_twin(self, rec: Recommendation) -> int | None:
        """An older open job recommendation for the same Slurm job (cluster, job
        id, submit time) and attempt as ``rec``, in action mode, if any: two
        must never act on one failure."""
        rows = list(self.db["recommendations"].rows_where(
            "scope = 'job' and mode = 'action' and id < ? and cluster = ? and job_id = ? "
            "and restart_at = ? and coalesce(submit_time, 0) = ? and status in "
            f"({sql_list(OPEN_STATUSES)})",
            [rec.id, rec.cluster, rec.job_id, rec.restart_at,
             rec.submit_time or 0], order_by="id", limit=1))
        return rows[0]["id"] if rows else None

    def update_rec(self, pk: int, **values: Any) -> None:
        """Change some columns of one recommendation (and its ``updated`` time)."""
        values = encode_rec(values)
        values["updated"] = time.time()
        self.db["recommendations"].update(pk, values)

    def save_rec(self, rec: Recommendation, *changed: str) -> None:
        """Write the ``changed`` columns of ``rec``, the record one of its moves
        returned (the caller holds a transaction, as for :meth:`update_rec`)."""
        self.update_rec(rec.id, **{key: getattr(rec, key) for key in changed})

    def add_step(self, rec: int, step: str, state: str, detail: str = "",
                 ts: float | None = None) -> None:
        """Record one execution step as it happens (before and after each Slurm call)."""
        with self.lock, self.db.atomic():
            self.db["rec_steps"].insert({"rec": rec, "step": step, "state": state,
                                         "ts": ts or time.time(), "detail": detail[:2000]})

    def steps(self, rec: int) -> list[dict]:
        return list(self.db["rec_steps"].rows_where("rec = ?", [rec], order_by="id"))

    # -- what the actuator, the decider, the watch loop and the API ask -----
    def holding_recs(self, since: float) -> list[Recommendation]:
        """Job recommendations created since ``since`` that put a hold on their
        job not known to be lifted (open ones, and ended ones whose release
        failed), by id."""
        return [decode_rec(row) for row in self.db["recommendations"].rows_where(
            f"scope = 'job' and held_at is not null and status in ({_HOLDING}) "
            "and created >= ?",
            [since], order_by="id")]

    def drains_since(self, since: float) -> int:
        """How many drain recommendations created since ``since`` count against
        the drain budget (on their way, done, or would-have in monitor mode)."""
        return self.db["recommendations"].count_where(
            f"action = 'drain_node' and created >= ? and status in ({_BUDGETED})", [since])

    def has_rec(self, pk: int) -> bool:
        """Is there a recommendation with this id?"""
        return bool(self.db["recommendations"].count_where("id = ?", [pk]))

    def expired_claims(self, now: float) -> list[Recommendation]:
        """External recommendations claimed (executing) whose claim ran out
        before ``now``."""
        return [decode_rec(row) for row in self.db["recommendations"].rows_where(
            "mode = 'external' and status = 'executing' and claim_expires < ?", [now])]

    def mark_running_again(self, job_pk: int, attempt: int, when: float,
                           before_run: int | None = None) -> None:
        """Note when a job runs again after the job recommendation of its
        ``attempt`` (once: a time already noted stays), holding the store lock.
        ``before_run``: only the recommendations of runs of that attempt that
        started before it (the attempt itself runs again)."""
        where, args = "", [when, job_pk, attempt]
        if before_run is not None:
            where = " and coalesce(run_start, 0) < ?"
            args.append(before_run)
        with self.lock:
            self.db.execute(
                "update recommendations set running_again_at = ? where job = ? and "
                "attempt = ? and scope = 'job' and running_again_at is null" + where, args)
