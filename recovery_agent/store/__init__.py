"""The agent's one SQLite file, through sqlite-utils, in WAL mode.

Only this package touches SQLite: every statement is a method of
:class:`Store` (the queries beyond the core ones are grouped in :mod:`.jobs`,
:mod:`.recs`, :mod:`.nodes` and :mod:`.counts`, mixed into it; the verdict's
node-evidence queries are :mod:`.reports`). A recommendation comes out as a
:class:`~.records.Recommendation` (its JSON columns decoded in :mod:`.recs`,
nowhere else). A job is keyed by (cluster, job
id, submit time), so a job id reused after a slurmctld reset starts a fresh
history.
"""
from __future__ import annotations

import fcntl
import json
import os
import secrets
import socket
import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from sqlite_utils import Database
from sqlite_utils.db import NotFoundError

from ..errors import StoreError
from ..scheduler.base import Job
from . import files
from .counts import CountQueries
from .jobs import JobQueries
from .migrations import MIGRATIONS, applied, migrate
from .nodes import NodeQueries
from .records import FINAL_STATUSES, OPEN_STATUSES, IllegalMove, Recommendation, Status
from .recs import RecQueries, decode_rec, encode_rec, sql_list

__all__ = ["Store", "StoreLock", "MIGRATIONS", "OPEN_STATUSES", "FINAL_STATUSES", "same_job",
           "Error", "DatabaseError", "STORE_ERRORS", "Recommendation", "Status",
           "IllegalMove"]

# SQLite's errors, for the callers that must tell a failing store from other
# failures without importing sqlite3 themselves
Error = sqlite3.Error
DatabaseError = sqlite3.DatabaseError      # also a damaged or unreadable file
STORE_ERRORS = (StoreError, sqlite3.Error)  # whatever a store write may raise

# The recommendation lifecycle (DESIGN.md), its open and final statuses: .records


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


class Store(JobQueries, RecQueries, NodeQueries, CountQueries):
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

    def note_invalid_spec(self, job_pk: int, raw: str, problem: str, attempt: int | None,
                          source: str) -> bool:
        """Put a job's invalid recovery spec on its timeline, once per job (every
        hook report and the poll see the same spec); True when written now."""
        if self.db["events"].count_where("job = ? and kind = 'spec_invalid'", [job_pk]):
            return False
        self.add_event(job_pk, "spec_invalid", f"invalid recovery spec {raw[:80]!r}: "
                       f"{problem}; monitoring only", attempt=attempt, source=source)
        return True

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

    def job_rec(self, job_pk: int, attempt: int) -> Recommendation | None:
        rows = list(self.db["recommendations"].rows_where(
            "job = ? and attempt = ? and scope = 'job'", [job_pk, attempt], limit=1))
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

    # -- nodes: strikes, our drains --------------------------------------
    def add_strike(self, node: str, category: str, weight: float, job_pk: int | None = None,
                   user: str = "", rec: int | None = None, ts: float | None = None,
                   witnessed: bool = False) -> None:
        """One failure blamed on ``node``; ``witnessed`` when evidence the job
        did not write itself speaks against the node."""
        self.db["strikes"].insert({"node": node, "ts": ts or time.time(), "job": job_pk,
                                   "user": user, "category": category, "weight": weight,
                                   "rec": rec, "witnessed": int(witnessed)})

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

    # -- which agent acts on this store ------------------------------------
    def claim(self, fresh_within: float) -> str:
        """Take the store for this process and return its claim token. Refused
        (StoreError) while another agent's heartbeat is fresh: it runs, reaching
        the same file by another path (a hard link, a bind mount, another host)
        that the lock file cannot see. A dead agent's claim on this host is
        taken over at once."""
        me = {"pid": os.getpid(), "host": socket.gethostname()}
        owner = self.get_state(CLAIM) or {}
        beat = (self.get_state("heartbeat") or {}).get("time") or 0
        other = (owner.get("pid"), owner.get("host")) != (me["pid"], me["host"])
        if owner and other and time.time() - beat < fresh_within and _may_live(owner):
            raise StoreError(
                f"another recovery-agent (pid {owner.get('pid')} on {owner.get('host')}) "
                f"uses the store {self.path} (heartbeat {time.time() - beat:.0f}s ago), "
                "through another path to the same file; stop it first")
        token = secrets.token_hex(8)
        self.set_state(CLAIM, {**me, "token": token, "since": time.time()})
        return token

    def claimed_by(self, token: str) -> bool:
        """Does the claim ``token`` still hold (no later agent took the store)?"""
        return (self.get_state(CLAIM) or {}).get("token") == token

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


CLAIM = "agent_claim"   # agent_state key: which agent process acts on this store


def _may_live(owner: Mapping[str, Any]) -> bool:
    """Could the agent that made this claim still run? On this host its pid
    must be alive; of another host only its heartbeat tells."""
    if owner.get("host") != socket.gethostname():
        return True
    try:
        pid = int(owner.get("pid") or 0)
        if pid <= 0:
            return False
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    try:   # a pid reused by some other program is no agent
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return b"recovery" in fh.read()
    except OSError:
        return True


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


class StoreLock:
    """An exclusive lock beside the store file (``<store>.lock``): one agent
    per store. The kernel drops it when the holder dies, even by SIGKILL."""

    def __init__(self, store_path: str | Path) -> None:
        # beside the file itself: two paths to one store (a symlink, a symlinked
        # directory) must meet at one lock
        self.path = Path(f"{os.path.realpath(store_path)}.lock")
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
        self.fd = fd
        try:   # the holder's pid, for the message above; a full disk may refuse it
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass

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

    def lost(self) -> str:
        """Why this process no longer holds the lock ("" while it does): the lock
        file was removed or replaced, so another process may have locked a new
        one."""
        if self.fd is None:
            return "the store lock is not held"
        try:
            here, now = os.fstat(self.fd), os.stat(self.path)
        except OSError as exc:
            return f"the store lock {self.path} is gone ({exc.strerror})"
        if (here.st_dev, here.st_ino) != (now.st_dev, now.st_ino):
            return f"the store lock {self.path} was replaced"
        return ""

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
