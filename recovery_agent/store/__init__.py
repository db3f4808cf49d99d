"""The agent's one SQLite file, through sqlite-utils, in WAL mode.

Only this package touches SQLite: every statement is a method of
:class:`Store`, which opens, checks and migrates the file and holds its
transactions here; its queries are grouped by what they serve and mixed into
it: :mod:`.jobs` (jobs and attempts), :mod:`.timeline` (events, detections),
:mod:`.recs` (recommendations, their steps), :mod:`.nodes` (strikes, nodes,
the hooks' reports), :mod:`.state` (the agent's own state, its claim, log
cursors), :mod:`.counts` (the metrics), :mod:`.ledger` (the goodput
ledger's inputs) and :mod:`.operator` (operators' changes, the node states the
watch loop saw); the verdict's node-evidence
queries are :mod:`.reports`, the lock file :mod:`.lock`. A recommendation
comes out as a :class:`~.records.Recommendation` (its JSON columns decoded in
:mod:`.recs`, nowhere else). A job is keyed by (cluster, job id, submit time),
so a job id reused after a slurmctld reset starts a fresh history.
"""
from __future__ import annotations

import sqlite3
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from sqlite_utils import Database

from ..errors import StoreError
from . import files
from .counts import CountQueries
from .jobs import JobQueries, same_job
from .ledger import LedgerQueries
from .lock import StoreLock
from .migrations import MIGRATIONS, applied, migrate
from .nodes import NodeQueries
from .operator import OperatorQueries
from .records import FINAL_STATUSES, OPEN_STATUSES, IllegalMove, Recommendation, Status
from .recs import RecQueries
from .state import StateQueries
from .timeline import TimelineQueries

__all__ = ["Store", "StoreLock", "MIGRATIONS", "OPEN_STATUSES", "FINAL_STATUSES", "same_job",
           "Error", "DatabaseError", "STORE_ERRORS", "Recommendation", "Status",
           "IllegalMove"]

# SQLite's errors, for the callers that must tell a failing store from other
# failures without importing sqlite3 themselves
Error = sqlite3.Error
DatabaseError = sqlite3.DatabaseError      # also a damaged or unreadable file
STORE_ERRORS = (StoreError, sqlite3.Error)  # whatever a store write may raise

# The recommendation lifecycle (DESIGN.md), its open and final statuses: .records


class Store(JobQueries, TimelineQueries, RecQueries, NodeQueries, StateQueries,
            CountQueries, LedgerQueries, OperatorQueries):
    """Open (creating and migrating as needed) the store at ``path``.

    A new store file is made 0600 (see :mod:`.files`); an empty or damaged
    one is refused. ``readonly``: open it with SQLite's ``mode=ro``, creating
    and migrating nothing (a store with migrations pending is refused, as this
    code could misread it). ``check``: run a bounded ``PRAGMA quick_check``
    before anything else (the agent does, at start)."""

    def __init__(self, path: str | Path, readonly: bool = False, check: bool = False) -> None:
        self.path = Path(path)
        self.readonly = readonly
        # one connection shared by the API threads and the watch loop: every
        # multi-statement write holds this lock so transactions never interleave
        self.lock = threading.RLock()
        # how the agent's loops fare with this store, in memory (a store that
        # cannot be written cannot record that it cannot be written)
        self.health: dict = {"error": None, "errors": 0}
        self.migrations_run: list[str] = []
        conn = None
        try:
            conn = files.connect(self.path, readonly, self.health)
            self.db = Database(conn)
            if check:
                files.quick_check(conn, self.path)
            self.db.execute("PRAGMA foreign_keys = ON")
            if readonly:
                self._refuse_pending()
                return
            self.db.enable_wal()
            self.db.execute("PRAGMA synchronous = NORMAL")
            self.migrations_run = migrate(self.db)
        except (sqlite3.Error, OSError, StoreError) as exc:
            if conn is not None:
                conn.close()
            if isinstance(exc, StoreError):
                raise
            raise files.explain(self.path, exc) from None

    def _refuse_pending(self) -> None:
        done = set(applied(self.db))
        pending = [name for name, _ in MIGRATIONS if name not in done]
        if pending:
            raise StoreError(f"the store {self.path} predates this version: migrations "
                             f"{', '.join(pending)} are pending, and a read-only open "
                             "applies none. The agent applies them when it starts (or "
                             "run the package's store-upgrade as the agent's user)")

    def tighten(self) -> list[str]:
        """Make the store's files private (0600) where they are looser; one line
        per file changed (the agent logs them at start)."""
        return files.tighten(self.path)

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def transaction(self) -> Iterator["Store"]:
        """Hold the store lock and one transaction (a savepoint when one is
        open already) around several store calls: all of them or none."""
        with self.lock, self.db.atomic():
            yield self

    @property
    def journal_mode(self) -> str:
        return self.db.journal_mode

    def applied_migrations(self) -> list[str]:
        return applied(self.db)
