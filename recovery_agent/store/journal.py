"""The side journal: what the fail-open path did while the store could not be
written.

The watchdog releases a job held too long even when the store is full or
read-only: releasing first matters more than writing it down first. What it
did then goes here (in memory, and appended to ``<store>.journal`` when that
file can be written), and into the store as soon as the store takes writes
again. Only the fail-open release uses it; every other action still needs its
audit row written before the Slurm call.
"""
from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from ..errors import StoreError

log = logging.getLogger(__name__)
STORE_ERRORS = (StoreError, sqlite3.Error)


class SideJournal:
    """Entries are ``{"kind": "step" | "finish", "rec": id, ...}`` in order."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        self.entries: list[dict] = []
        self._lock = threading.Lock()
        self._load()

    def _load(self) -> None:
        """Entries an earlier process wrote and could not replay (it died)."""
        if self.path is None or not self.path.exists():
            return
        try:
            text = self.path.read_text(encoding="utf-8")
        except OSError as exc:
            log.error("cannot read the side journal %s: %s", self.path, exc)
            return
        for line in text.splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue   # a line cut short by a full disk
            if isinstance(entry, dict) and entry.get("kind") in ("step", "finish"):
                self.entries.append(entry)

    def add(self, kind: str, rec: int, **fields: Any) -> None:
        entry = {"kind": kind, "rec": rec, "ts": time.time(), **fields}
        with self._lock:
            self.entries.append(entry)
        if self.path is None:
            return
        try:
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(entry, sort_keys=True) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:   # the same full disk, most likely: memory holds it
            log.error("side journal %s not written (%s); kept in memory until the store "
                      "takes it", self.path, exc.strerror or exc)

    def __len__(self) -> int:
        return len(self.entries)

    def replay(self, store) -> int:
        """Write the entries into the store, oldest first; return how many. Stops
        at the first refused write (the rest wait for the next try)."""
        with self._lock:
            todo = list(self.entries)
        done = 0
        for entry in todo:
            try:
                self._apply(store, entry)
            except STORE_ERRORS:
                break
            done += 1
        if done:
            with self._lock:
                self.entries = self.entries[done:]
                rest = list(self.entries)
            self._rewrite(rest)
            log.info("side journal: %d entr%s written to the store", done,
                     "y" if done == 1 else "ies")
        return done

    @staticmethod
    def _apply(store, entry: dict) -> None:
        note = " (recorded late: the store could not be written then)"
        if entry["kind"] == "step":
            store.add_step(entry["rec"], entry["step"], entry["state"],
                           (entry.get("detail") or "") + note, ts=entry["ts"])
            return
        with store.lock, store.db.atomic():
            values = {"status": entry["status"], "error": entry.get("error") or None,
                      "next_try": None}
            if entry.get("lifted"):
                values["held_at"] = None
            store.update_rec(entry["rec"], **values)
            job = entry.get("job")
            if job is not None:
                store.add_event(job, f"rec_{entry['status']}",
                                f"#{entry['rec']} {entry.get('action', '')} {entry['status']}"
                                + (f": {entry['error']}" if entry.get("error") else "")
                                + note, attempt=entry.get("attempt"), source="actuator",
                                ts=entry["ts"])

    def _rewrite(self, rest: list[dict]) -> None:
        if self.path is None:
            return
        try:
            if not rest:
                self.path.unlink(missing_ok=True)
                return
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(json.dumps(e, sort_keys=True) + "\n" for e in rest),
                           encoding="utf-8")
            tmp.replace(self.path)
        except OSError as exc:
            log.error("cannot rewrite the side journal %s: %s", self.path, exc)
