"""The agent's one SQLite file, through sqlite-utils, in WAL mode.

Only this package touches SQLite. A job is keyed by (cluster, job id, submit
time), so a job id reused after a slurmctld reset starts a fresh history.
"""
from __future__ import annotations

import fcntl
import json
import os
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

__all__ = ["Store", "StoreLock", "MIGRATIONS", "OPEN_STATUSES", "FINAL_STATUSES"]

# The recommendation lifecycle (DESIGN.md): proposed -> executing -> a final status.
OPEN_STATUSES = ("proposed", "executing")
FINAL_STATUSES = ("done", "failed", "expired", "would_have", "blocked_by_budget",
                  "released_by_watchdog", "cancelled")
_REC_JSON = ("target_nodes", "evidence", "attribution", "pattern_ids", "exclude")


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
            # how the agent's loops fare with this store, in memory (a store that
            # cannot be written cannot record that it cannot be written)
            self.health: dict = {"error": None, "errors": 0}
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
        """Insert or refresh a job; return its row id. A job id reused after a
        slurmctld reset becomes a new row (see :meth:`match_job`)."""
        now = time.time()
        values = {"numeric_id": job.numeric_id, "array_job_id": job.array_job_id,
                  "array_task_id": job.array_task_id, "name": job.name, "user": job.user,
                  "env": env, "mode": mode, "spec": spec, "state": job.state,
                  "restart_count": job.restart_count, "last_seen": now}
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
        last = rows[0]
        if not last["submit_time"]:
            return last
        same = (job.restart_count > 0 and last["submit_time"] <= submit
                and (last["restart_count"] or 0) <= job.restart_count
                and (not job.user or not last["user"] or job.user == last["user"])
                and (not job.name or not last["name"] or job.name == last["name"]))
        return last if same else None

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
            "select id, cluster, job_id, state, last_seen, restart_count, env, mode, spec "
            f"from jobs where cluster = ? and (state not in ({marks}) or last_seen is null "
            "or last_seen >= ?) order by id", [cluster, *states, since]).fetchall()

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

    # -- recommendations (the audit unit) -----------------------------------
    def add_recommendation(self, values: Mapping[str, Any]) -> int:
        """Insert one recommendation; JSON-able fields are encoded. The caller
        holds the lock and, usually, a transaction with the verdict."""
        now = time.time()
        row = {"created": now, "updated": now, "tries": 0, "scope": "job", **values}
        for key in _REC_JSON:
            if key in row and not isinstance(row[key], str):
                row[key] = _dumps(row[key])
        return self.db["recommendations"].insert(row).last_pk

    def decode_rec(self, row: dict) -> dict:
        for key in _REC_JSON:
            row[key] = json.loads(row[key]) if row.get(key) else ([] if key != "attribution"
                                                                  and key != "evidence"
                                                                  else {})
        return row

    def rec(self, pk: int) -> dict:
        try:
            return self.decode_rec(self.db["recommendations"].get(pk))
        except NotFoundError:
            raise StoreError(f"no recommendation {pk}") from None

    def recommendations(self, status: str | Iterable[str] | None = None,
                        job_pk: int | None = None) -> list[dict]:
        where, args = [], []
        if status is not None:
            wanted = [status] if isinstance(status, str) else list(status)
            where.append(f"status in ({', '.join('?' * len(wanted))})")
            args += wanted
        if job_pk is not None:
            where.append("job = ?")
            args.append(job_pk)
        rows = self.db["recommendations"].rows_where(" and ".join(where) or None, args,
                                                      order_by="id")
        return [self.decode_rec(r) for r in rows]

    def job_rec(self, job_pk: int, attempt: int) -> dict | None:
        rows = list(self.db["recommendations"].rows_where(
            "job = ? and attempt = ? and scope = 'job'", [job_pk, attempt], limit=1))
        return self.decode_rec(rows[0]) if rows else None

    def update_rec(self, pk: int, **values: Any) -> None:
        for key in _REC_JSON:
            if key in values and not isinstance(values[key], str):
                values[key] = _dumps(values[key])
        values["updated"] = time.time()
        self.db["recommendations"].update(pk, values)

    def add_step(self, rec: int, step: str, state: str, detail: str = "") -> None:
        """Record one execution step as it happens (before and after each Slurm call)."""
        with self.lock, self.db.atomic():
            self.db["rec_steps"].insert({"rec": rec, "step": step, "state": state,
                                         "ts": time.time(), "detail": detail[:2000]})

    def steps(self, rec: int) -> list[dict]:
        return list(self.db["rec_steps"].rows_where("rec = ?", [rec], order_by="id"))

    # -- nodes: strikes, our drains --------------------------------------
    def add_strike(self, node: str, category: str, weight: float, job_pk: int | None = None,
                   user: str = "", rec: int | None = None, ts: float | None = None) -> None:
        self.db["strikes"].insert({"node": node, "ts": ts or time.time(), "job": job_pk,
                                   "user": user, "category": category, "weight": weight,
                                   "rec": rec})

    def strikes(self, node: str | None = None, since: float = 0.0) -> list[dict]:
        if node is None:
            return list(self.db["strikes"].rows_where("ts >= ?", [since], order_by="ts"))
        return list(self.db["strikes"].rows_where("node = ? and ts >= ?", [node, since],
                                                  order_by="ts"))

    def node(self, name: str) -> dict | None:
        rows = list(self.db["nodes"].rows_where("name = ?", [name], limit=1))
        return rows[0] if rows else None

    def set_node(self, name: str, **values: Any) -> None:
        self.db["nodes"].upsert({"name": name, **values, "updated": time.time()}, pk="name")

    # -- the agent's own small state ------------------------------------
    def set_state(self, key: str, value: Any) -> None:
        with self.lock, self.db.atomic():
            self.db["agent_state"].upsert({"key": key, "value": _dumps(value),
                                           "updated": time.time()}, pk="key")

    def get_state(self, key: str, default: Any = None) -> Any:
        rows = list(self.db["agent_state"].rows_where("key = ?", [key], limit=1))
        return json.loads(rows[0]["value"]) if rows else default

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


class StoreLock:
    """An exclusive lock beside the store file (``<store>.lock``): one agent
    per store. The kernel drops it when the holder dies, even by SIGKILL."""

    def __init__(self, store_path: str | Path) -> None:
        self.path = Path(f"{store_path}.lock")
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise StoreError naming the holder's pid."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise StoreError(f"another recovery-agent (pid {holder}) already uses the store "
                             f"{str(self.path)[:-5]}; stop it first") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def held_elsewhere(self) -> bool:
        """True when some live process holds the lock (this one does not take it)."""
        if not self.path.exists():
            return False
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
