"""The store's queries on recommendations that the actuator, the decider, the
watch loop and the API need beyond adding, reading and updating one (those
live in the package itself)."""
from __future__ import annotations

import threading

from sqlite_utils import Database


class RecQueries:
    """Mixed into :class:`~recovery_agent.store.Store`."""

    db: Database
    lock: threading.RLock

    def holding_recs(self, since: float) -> list[dict]:
        """Job recommendations created since ``since`` that put a hold on their
        job not known to be lifted (open ones, and ended ones whose release
        failed), by id, undecoded (the watchdog decodes those it acts on)."""
        return list(self.db["recommendations"].rows_where(
            "scope = 'job' and held_at is not null and status in "
            "('proposed', 'executing', 'failed', 'expired') and created >= ?",
            [since], order_by="id"))

    def drains_since(self, since: float) -> int:
        """How many drain recommendations created since ``since`` count against
        the drain budget (on their way, done, or would-have in monitor mode)."""
        return self.db["recommendations"].count_where(
            "action = 'drain_node' and created >= ? and status in "
            "('proposed', 'executing', 'done', 'would_have')", [since])

    def has_rec(self, pk: int) -> bool:
        """Is there a recommendation with this id?"""
        return bool(self.db["recommendations"].count_where("id = ?", [pk]))

    def expired_claims(self, now: float) -> list[dict]:
        """External recommendations claimed (executing) whose claim ran out
        before ``now``, undecoded."""
        return list(self.db["recommendations"].rows_where(
            "mode = 'external' and status = 'executing' and claim_expires < ?", [now]))

    def mark_running_again(self, job_pk: int, attempt: int, when: float) -> None:
        """Note when a job runs again after the job recommendation of its
        ``attempt`` (once: a time already noted stays), holding the store lock."""
        with self.lock:
            self.db.execute(
                "update recommendations set running_again_at = ? where job = ? and "
                "attempt = ? and scope = 'job' and running_again_at is null",
                [when, job_pk, attempt])
