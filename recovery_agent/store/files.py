"""The store's file: how it is created, opened, checked and kept private.

The store holds every user's jobs, evidence lines and recommendations, so it
is the agent's alone: created 0600 (SQLite gives its -wal and -shm files the
main file's mode) in a directory made 0700, and tightened at agent start when
someone loosened it. A store that is empty, damaged or not SQLite is refused
with what happened and what to do, never replaced or half read.
"""
from __future__ import annotations

import logging
import os
import sqlite3
import stat
import threading
import time
from pathlib import Path
from urllib.parse import quote

from ..errors import StoreError

log = logging.getLogger(__name__)

PRIVATE = 0o600
CHECK_SECONDS = 60.0      # the start-up integrity check gives up after this long
CHECK_ERRORS = 5          # and lists at most this many problems
_DAMAGE = ("SQLITE_CORRUPT", "SQLITE_NOTADB")


# -- a connection that notices damage ------------------------------------------

def _is_damage(exc: BaseException) -> bool:
    name = getattr(exc, "sqlite_errorname", "") or ""
    text = str(exc)
    return (name.startswith(_DAMAGE) or "malformed" in text or "not a database" in text)


class _Cursor(sqlite3.Cursor):
    """A cursor whose reads report a damaged file to the connection."""

    def _run(self, call, *args):
        try:
            return call(*args)
        except sqlite3.DatabaseError as exc:
            self.connection.noticed(exc)
            raise

    def execute(self, *args):
        return self._run(super().execute, *args)

    def executemany(self, *args):
        return self._run(super().executemany, *args)

    def executescript(self, *args):
        return self._run(super().executescript, *args)

    def __next__(self):
        return self._run(super().__next__)

    def fetchone(self):
        return self._run(super().fetchone)

    def fetchmany(self, *args):
        return self._run(super().fetchmany, *args)

    def fetchall(self):
        return self._run(super().fetchall)


class Connection(sqlite3.Connection):
    """The store's one connection. A statement or read that finds the file
    damaged ("database disk image is malformed") sets ``health["damaged"]``,
    which stays: /healthz then answers 503, as /metrics does."""

    health: dict | None = None
    path: str = ""

    def cursor(self, factory=_Cursor):
        return super().cursor(factory)

    def execute(self, *args):
        return self.cursor().execute(*args)

    def executemany(self, *args):
        return self.cursor().executemany(*args)

    def executescript(self, *args):
        return self.cursor().executescript(*args)

    def noticed(self, exc: sqlite3.DatabaseError) -> None:
        if self.health is None or not _is_damage(exc) or self.health.get("damaged"):
            return
        self.health["damaged"] = f"{exc} ({self.path})"
        log.error("the store %s is damaged: %s (an agent's /healthz answers 503 from now "
                  "on). %s", self.path, exc, recover_hint(Path(self.path)))


# -- messages --------------------------------------------------------------------

def recover_hint(path: Path) -> str:
    return (f"Stop the agent, then restore a backup (a package upgrade leaves "
            f"{path.name}.backup-<time> beside it) or rescue what is readable: "
            f"sqlite3 {path} .recover | sqlite3 {path}.recovered, check it, then "
            f"mv {path}.recovered {path}. To start afresh instead, move {path} away "
            "(its history is then gone).")


def damaged(path: Path, detail: str) -> StoreError:
    return StoreError(f"the store {path} is damaged ({detail}); the agent does not start "
                      f"on a damaged store. {recover_hint(path)}")


def _who() -> str:
    return f"uid {os.geteuid()}"


def _mode(path: Path) -> str:
    """The mode and owner of ``path``, or of the directory above it that shuts
    this user out."""
    try:
        st = path.stat()
    except PermissionError:
        for parent in reversed(path.parents):
            if not os.access(parent, os.X_OK):
                try:
                    st = parent.stat()
                except OSError:
                    break
                return (f"its directory {parent} is mode {stat.S_IMODE(st.st_mode):04o}, "
                        f"owner uid {st.st_uid}")
        return "mode unknown"
    except OSError as exc:
        return exc.strerror or str(exc)
    return f"mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}"


def not_readable(path: Path) -> StoreError:
    return StoreError(f"cannot read the store {path} as {_who()}: permission denied "
                      f"({_mode(path)}). The store holds every user's jobs and only the "
                      "agent's user may read it; ask the agent instead (recovery-ctl "
                      "without --db, or --url), which shows you your own jobs")


def not_writable(path: Path) -> StoreError:
    return StoreError(f"cannot change the store {path} as {_who()}: it is not writable "
                      f"here ({_mode(path)}, directory {_mode(path.parent)}). Send the "
                      "change to the agent instead (drop --db, or use --url); with the "
                      "agent down, run it as the agent's user (root)")


def explain(path: Path, exc: BaseException, verb: str = "open") -> StoreError:
    """A StoreError saying what an SQLite or OS error at open means for the store."""
    if isinstance(exc, sqlite3.DatabaseError) and _is_damage(exc):
        if "not a database" in str(exc):
            return damaged(path, "it is not an SQLite database: the file is overwritten "
                                 "or its first page is garbage")
        return damaged(path, str(exc))
    if isinstance(exc, PermissionError) or "unable to open" in str(exc):
        if not os.access(path, os.R_OK):
            return not_readable(path)
    if "readonly" in str(exc) or "read-only" in str(exc):
        return not_writable(path)
    return StoreError(f"cannot {verb} store {path}: {exc}")


# -- opening -----------------------------------------------------------------------

DB_ERRORS = (sqlite3.Error,)   # what a store read or write may raise, for the edges


def must_exist(path: Path, writable: bool = False) -> None:
    """Raise StoreError unless a store file is at ``path`` that this user may
    read (and, with ``writable``, change: the file and its directory, where
    SQLite writes the -wal and -shm files)."""
    try:
        path.stat()
    except FileNotFoundError:
        raise StoreError(f"no store at {path} (has the agent run?)") from None
    except PermissionError:
        raise not_readable(path) from None
    if not os.access(path, os.R_OK):
        raise not_readable(path)
    if writable and not (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)):
        raise not_writable(path)


def make_directory(path: Path) -> None:
    """The store's directory, made 0700 when there is none (one that exists is
    left as its admin set it: the store file itself is private)."""
    if not os.path.isdir(path.parent):
        path.parent.mkdir(parents=True, mode=0o700, exist_ok=True)


def _new_file(path: Path) -> bool:
    """Create the store file 0600 if there is none; True when made here."""
    make_directory(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, PRIVATE)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def refuse_empty(path: Path) -> None:
    try:
        size = path.stat().st_size
    except OSError:
        return
    if size == 0:
        raise StoreError(
            f"the store {path} is an empty file (0 bytes): it holds no store, and the "
            "agent never leaves one empty (a failed copy or restore, or a disk that "
            "filled up?). It is not replaced by a fresh store, so that no history is "
            f"lost silently. Put the real store back (or a backup beside it, "
            f"{path.name}.backup-<time>), or remove the empty file to start afresh: "
            f"rm {path}")


def connect(path: Path, readonly: bool, health: dict) -> Connection:
    """The store's connection: read-only (``mode=ro``, nothing is created or
    changed), or read-write, creating a private file when there is none and
    refusing an empty one."""
    if readonly:
        must_exist(path)
        refuse_empty(path)
        conn = _read_only(path)
    else:
        if not _new_file(path):
            refuse_empty(path)
        conn = sqlite3.connect(str(path), timeout=30, check_same_thread=False,
                               factory=Connection)
    conn.health, conn.path = health, str(path)
    return conn


def _read_only(path: Path) -> Connection:
    """``mode=ro``; where SQLite cannot make the -shm file it needs for that
    (a directory this user cannot write) and no -wal holds changes, the file
    alone is the whole store: it is then read as ``immutable``."""
    def open_(query: str) -> Connection:
        return sqlite3.connect(f"file:{quote(str(path))}?{query}", uri=True, timeout=30,
                               check_same_thread=False, factory=Connection)
    conn = open_("mode=ro")
    try:
        conn.execute("select count(*) from sqlite_master").fetchone()
        return conn
    except sqlite3.OperationalError as exc:
        conn.close()
        if not (getattr(exc, "sqlite_errorname", "") or "").startswith("SQLITE_READONLY"):
            raise
        wal = Path(f"{path}-wal")
        if wal.exists() and wal.stat().st_size:
            raise StoreError(f"cannot read the store {path} read-only here: {wal} holds "
                             "changes (is the agent running?) and SQLite cannot make "
                             f"{path}-shm to read them, as {path.parent} is not writable "
                             f"by {_who()}; ask the agent instead (drop --db)") from None
    return open_("mode=ro&immutable=1")


def quick_check(conn: sqlite3.Connection, path: Path, seconds: float = CHECK_SECONDS,
                errors: int = CHECK_ERRORS) -> None:
    """SQLite's ``PRAGMA quick_check``, bounded in time: raise StoreError when
    the store is damaged; log and go on when the check runs out of time."""
    deadline = time.monotonic() + seconds
    # between statements' steps the progress handler stops it; inside SQLite's
    # one long integrity-check step only an interrupt does
    conn.set_progress_handler(lambda: time.monotonic() > deadline, 1000)
    timer = threading.Timer(seconds, conn.interrupt)
    timer.daemon = True
    timer.start()
    try:
        rows = [r[0] for r in conn.execute(f"PRAGMA quick_check({errors})")]
    except sqlite3.OperationalError as exc:
        if "interrupted" not in str(exc):
            raise
        log.warning("the store's integrity check stopped after %.0fs (%s is large); "
                    "starting without it", seconds, path)
        return
    except sqlite3.DatabaseError as exc:
        raise damaged(path, str(exc)) from None
    finally:
        timer.cancel()
        conn.set_progress_handler(None, 0)
    if rows != ["ok"]:
        raise damaged(path, "PRAGMA quick_check: " + "; ".join(rows[:errors]))


def tighten(path: Path) -> list[str]:
    """Make the store, its -wal/-shm and its backups 0600 where they are looser;
    one line for each file changed."""
    changed = []
    for item in [path, Path(f"{path}-wal"), Path(f"{path}-shm"),
                 *sorted(path.parent.glob(f"{path.name}.backup-*"))]:
        try:
            mode = stat.S_IMODE(item.stat().st_mode)
            if mode & ~PRIVATE:
                os.chmod(item, mode & PRIVATE)
                changed.append(f"{item}: {mode:04o} -> {mode & PRIVATE:04o}")
        except FileNotFoundError:
            continue
        except OSError as exc:
            changed.append(f"{item}: cannot make it private: {exc.strerror or exc}")
    return changed
