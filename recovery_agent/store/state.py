"""The agent's own small state in the store: keys and values, which agent
process acts on the store (its claim), and where the log tailer stopped
(:class:`StateQueries`, mixed into the store)."""
from __future__ import annotations

import json
import os
import secrets
import socket
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

from sqlite_utils import Database

from ..errors import StoreError
from .timeline import _dumps


class StateQueries:
    """Mixed into :class:`~recovery_agent.store.Store`."""

    db: Database
    lock: threading.RLock
    path: Path

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
