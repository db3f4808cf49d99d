"""The store's queries on recommendations that the actuator, the decider, the
watch loop and the API need beyond adding, reading and updating one (those
live in the package itself)."""
from __future__ import annotations

import json
import threading
from typing import Any, Mapping

from sqlite_utils import Database

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

    def mark_running_again(self, job_pk: int, attempt: int, when: float) -> None:
        """Note when a job runs again after the job recommendation of its
        ``attempt`` (once: a time already noted stays), holding the store lock."""
        with self.lock:
            self.db.execute(
                "update recommendations set running_again_at = ? where job = ? and "
                "attempt = ? and scope = 'job' and running_again_at is null",
                [when, job_pk, attempt])
