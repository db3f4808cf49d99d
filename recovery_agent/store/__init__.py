"""The agent's one SQLite file, through sqlite-utils, in WAL mode.

Only this package touches SQLite. A job is keyed by (cluster, job id, submit
time), so a job id reused after a slurmctld reset starts a fresh history.
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from sqlite_utils import Database
from sqlite_utils.db import NotFoundError

from ..errors import StoreError
from ..scheduler.base import Job
from .migrations import MIGRATIONS, applied, migrate

__all__ = ["Store", "MIGRATIONS"]


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


class Store:
    """Open (creating and migrating as needed) the store at ``path``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(str(self.path), timeout=30, check_same_thread=False)
            self.db = Database(conn)
            # one connection shared by the API threads and the watch loop: every
            # multi-statement write holds this lock so transactions never interleave
            self.lock = threading.RLock()
            self.db.enable_wal()
            self.db.execute("PRAGMA foreign_keys = ON")
            self.db.execute("PRAGMA synchronous = NORMAL")
            self.migrations_run = migrate(self.db)
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(f"cannot open store {self.path}: {exc}") from None

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def journal_mode(self) -> str:
        return self.db.journal_mode

    def applied_migrations(self) -> list[str]:
        return applied(self.db)

    # -- jobs and attempts -------------------------------------------------
    def record_job(self, job: Job, cluster: str, env: str = "default", mode: str = "monitor",
                   spec: str = "") -> int:
        """Insert or refresh a job; return its row id. The key includes the
        submit time, so a reused job id becomes a new row."""
        now = time.time()
        key = {"cluster": cluster, "job_id": job.job_id, "submit_time": job.submit_time or 0}
        values = {"numeric_id": job.numeric_id, "array_job_id": job.array_job_id,
                  "array_task_id": job.array_task_id, "name": job.name, "user": job.user,
                  "env": env, "mode": mode, "spec": spec, "state": job.state,
                  "restart_count": job.restart_count, "last_seen": now}
        try:
            with self.db.atomic():
                row = self._job_row(**key)
                if row is None and key["submit_time"]:
                    # stored before its submit time was known: this is that job
                    row = self._job_row(cluster, job.job_id, 0)
                    if row is not None:
                        values["submit_time"] = key["submit_time"]
                if row is None:
                    return self.db["jobs"].insert({**key, **values, "first_seen": now}).last_pk
                self.db["jobs"].update(row["id"], values)
                return row["id"]
        except sqlite3.Error as exc:
            raise StoreError(f"cannot record job {job.job_id}: {exc}") from None

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

    def jobs(self, state: str | None = None) -> list[dict]:
        if state:
            return list(self.db["jobs"].rows_where("state = ?", [state], order_by="id"))
        return list(self.db["jobs"].rows_where(order_by="id"))

    def record_attempt(self, job_pk: int, job: Job) -> int:
        """Insert or refresh the attempt numbered by the job's restart count."""
        now = time.time()
        values = {"nodes": _dumps(list(job.nodes)), "batch_host": job.batch_host,
                  "start_time": job.start_time, "end_time": job.end_time, "state": job.state,
                  "exit_code": job.exit_code, "exit_signal": job.exit_signal, "last_seen": now}
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

    def attempts(self, job_pk: int) -> list[dict]:
        rows = list(self.db["attempts"].rows_where("job = ?", [job_pk], order_by="attempt"))
        for row in rows:
            row["nodes"] = json.loads(row["nodes"] or "[]")
        return rows

    # -- the timeline ------------------------------------------------------
    def add_event(self, job_pk: int | None, kind: str, message: str, attempt: int | None = None,
                  source: str = "", data: Any = None, ts: float | None = None) -> int:
        return self.db["events"].insert({
            "job": job_pk, "attempt": attempt, "ts": ts or time.time(), "kind": kind,
            "source": source, "message": message, "data": _dumps(data) if data else None,
        }).last_pk

    def timeline(self, job_pk: int) -> Iterator[dict]:
        for row in self.db["events"].rows_where("job = ?", [job_pk], order_by="ts, id"):
            row["data"] = json.loads(row["data"]) if row["data"] else None
            yield row

    # -- detections ----------------------------------------------------------
    def record_detection(self, job_pk: int | None, attempt: int | None, detection,
                         ts: float | None = None) -> int:
        """Store one :class:`~recovery_agent.detect.model.Detection` with its evidence."""
        evidence = [{"text": e.text, "source": e.source, "line": e.line, "time": e.time}
                    for e in detection.evidence]
        return self.db["detections"].insert({
            "job": job_pk, "attempt": attempt, "ts": ts or time.time(),
            "category": detection.category, "pattern_id": detection.rule,
            "severity": detection.severity, "node": detection.host,
            "gpu": detection.gpu, "rank": detection.rank,
            "source": evidence[0]["source"] if evidence else "",
            "evidence": _dumps({"lines": evidence, "detail": detection.detail,
                                "action_hint": detection.action_hint, "pci": detection.pci,
                                "xid": detection.xid}),
        }).last_pk

    def detections(self, job_pk: int) -> list[dict]:
        rows = list(self.db["detections"].rows_where("job = ?", [job_pk], order_by="ts, id"))
        for row in rows:
            row["evidence"] = json.loads(row["evidence"] or "{}")
        return rows

    # -- log cursors -------------------------------------------------------
    def log_cursors(self) -> dict[str, tuple[int, int, int]]:
        """Where the log tailer stopped: {path: (inode, offset, lineno)}."""
        rows = self.db.execute('select path, inode, "offset", lineno from log_cursors')
        return {path: (inode, offset, lineno) for path, inode, offset, lineno in rows}

    def save_log_cursors(self, cursors: Mapping[str, tuple[int, int, int]]) -> None:
        """Insert or update many cursors in one transaction."""
        now = time.time()
        rows = [(path, ino, off, n, now) for path, (ino, off, n) in cursors.items()]
        try:
            with self.db.atomic():
                self.db.conn.executemany(
                    'insert into log_cursors (path, inode, "offset", lineno, updated) '
                    "values (?, ?, ?, ?, ?) on conflict(path) do update set "
                    'inode = excluded.inode, "offset" = excluded."offset", '
                    "lineno = excluded.lineno, updated = excluded.updated", rows)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot save log cursors: {exc}") from None

    def forget_log_cursors(self, paths: Iterable[str]) -> None:
        try:
            with self.db.atomic():
                self.db.conn.executemany("delete from log_cursors where path = ?",
                                         [(path,) for path in paths])
        except sqlite3.Error as exc:
            raise StoreError(f"cannot forget log cursors: {exc}") from None
