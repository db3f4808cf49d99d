"""Follow the output files of tracked jobs, many at once, cheaply.

Each poll stats every watched path and reads only the files whose inode, size
or mtime changed, within a byte budget per file and per poll. It returns the
complete lines that appeared since the previous poll.

* A path that does not exist yet costs one failed stat per poll until it does.
* A file shorter than the read position was truncated: reading restarts at 0.
* A new inode at the path (rotation, replacement), or the path seen missing and
  back, first finishes the old file, through the descriptor still open or found
  by inode beside it (``out.1``), delivers its partial last line, then reads
  the new file from 0.
* Inode numbers come back quickly (ext4, tmpfs), and a requeued job's output is
  truncated and rewritten under the same inode. So each read starts one byte
  early: if that byte is not the one read there before, the file is read again
  from 0.
* Line numbers start at 1 in each file; truncation and a new inode start again.
* A line longer than ``max_line`` bytes is cut there; the rest of it, up to its
  newline, is skipped without being held in memory.
* At most ``max_open`` descriptors stay open, least recently used closed first;
  a file is reopened by path, its inode checked, and read at the saved offset.
* Errors (permission, a directory in place of the file, I/O) are recorded per
  path and logged once; they never escape :meth:`Tailer.poll`.
* A path added with a user's :class:`~recovery_agent.inputs.userfs.Rights` is
  read only as that user could read it (:mod:`recovery_agent.inputs.userfs`): its
  directory is walked from ``/`` with the user's rights and kept open
  (:class:`~recovery_agent.inputs.userfs.DirCache`), the per-poll look is one
  ``fstatat`` relative to it, and every open goes through the same checks.
  A refusal is recorded once as a :class:`Notice` (``not_followed``).
* Floods: a poll reads at most ``file_budget`` bytes of one file, ``read_budget``
  in all, and stops starting new reads after ``time_budget`` seconds, the
  caller's work on the lines yielded by :meth:`Tailer.poll_iter` included. A
  file more than ``max_backlog`` bytes ahead of its reader is skipped to its
  last ``keep_tail`` bytes (from a line start; the lines skipped are counted, so
  line numbers stay right), and the skip is recorded as a :class:`Notice`
  (``skipped``): the end of a flood, where a failure shows, is read in seconds
  rather than after the whole flood. Memory stays bounded per file: lines are
  yielded a ``STEP`` at a time, :meth:`Tailer.flush_iter` included.

Cursors (inode, offset just after the last newline delivered, lines delivered)
go to a :class:`CursorStore` every ``save_interval`` seconds and on
:meth:`Tailer.close`, so an agent restart resumes where it stopped. After a
crash, up to ``save_interval`` seconds of lines may come again, and a partial
line delivered by :meth:`Tailer.flush_partial` comes again once, with its
line number, if the file is followed again after a restart.
"""
from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from typing import Iterator

from ..errors import RecoveryError
from . import userfs
from .followed import _Watch
from .logline import MAX_LINE, Cursor, CursorStore, LogLine, Notice
from .tailfds import Descriptors
from .tailread import STEP, Reading
from .userfs import Rights

log = logging.getLogger(__name__)

FILE_BUDGET = 8 << 20        # bytes read from one file in one poll
READ_BUDGET = 32 << 20       # bytes read from all files in one poll
TIME_BUDGET = 1.0            # seconds after which a poll starts no new read
MAX_BACKLOG = 16 << 20       # a file further ahead than this is skipped to its tail
KEEP_TAIL = 2 << 20          # bytes kept at the end of a skipped file


# How far behind our clock a file's mtime may be and still be believed: the
# storage's clock (a file server's) against this host's, kept by NTP.
MTIME_SLACK = 1.0


def written_at(mtime: float, looked: float | None, now: float) -> float | None:
    """When the bytes of a file that changed since our last look were last
    written: its mtime, which no line of them postdates, so a line stamped
    with it is never older than it is (a hang's clock never runs ahead). The
    mtime is the storage's clock, so it is believed only between our last
    look (less MTIME_SLACK: the change came after it) and now; outside that,
    or on a first look, None (stamp with the time of reading)."""
    if looked is None or not looked - MTIME_SLACK <= mtime <= now:
        return None
    return mtime


class Tailer(Reading, Descriptors):
    """Follow many files by path; see the module docstring."""

    def __init__(self, cursor_store: CursorStore | None = None, *, max_open: int = 256,
                 max_line: int = MAX_LINE, file_budget: int = FILE_BUDGET,
                 read_budget: int = READ_BUDGET, save_interval: float = 5.0,
                 allowed_roots: tuple[str, ...] = (), time_budget: float = TIME_BUDGET,
                 max_backlog: int = MAX_BACKLOG, keep_tail: int = KEEP_TAIL) -> None:
        if min(max_open, max_line, file_budget, read_budget) < 1:
            raise ValueError("max_open, max_line and the budgets must be positive")
        if max_backlog and not 0 < keep_tail < max_backlog:
            raise ValueError("keep_tail must be above 0 and below max_backlog")
        self.max_open = max_open
        self.max_line = max_line
        self.file_budget = file_budget
        self.read_budget = read_budget
        self.time_budget = time_budget
        self.max_backlog = max_backlog      # 0: never skip
        self.keep_tail = keep_tail
        self.save_interval = save_interval
        self._store = cursor_store
        self._cursors = cursor_store.load_all() if cursor_store else {}
        self._watches: dict[str, _Watch] = {}
        self.allowed_roots = tuple(os.path.realpath(r) for r in allowed_roots if r)
        self.refused: dict[str, str] = {}
        self.notices: list[Notice] = []     # taken (and removed) by whoever reports them
        self.skipped_bytes = 0              # skipped in floods since this tailer started
        self._refusal_said: dict[str, str] = {}   # path -> key its refusal was reported for
        self._open: OrderedDict[str, _Watch] = OrderedDict()  # least recently used first
        self._dirs = userfs.DirCache()   # the directories of files read with rights
        self._polls = 0
        self._last_save = time.monotonic()

    # -- the watch list ----------------------------------------------------
    def add(self, path: str | os.PathLike, key: str, rights: Rights | None = None) -> None:
        """Follow ``path``, tagging its lines with ``key``; resume at its saved
        cursor if there is one. With ``rights`` (the job user's), the file is
        read only as that user could read it, and it must be theirs."""
        path = os.fspath(path)
        if rights is None and self.allowed_roots:  # with rights, the walk checks the roots
            real = os.path.realpath(path)
            if not any(real == root or real.startswith(root.rstrip("/") + "/")
                       for root in self.allowed_roots):
                reason = "outside the allowed log roots"
                if path not in self.refused:
                    log.warning("not following %s: %s (%s)", path, reason,
                                ", ".join(self.allowed_roots))
                self.refused[path] = reason
                if self._refusal_said.get(path) != key:
                    self._refusal_said[path] = key
                    self.notices.append(Notice(key, path, "not_followed",
                                               f"{path} is {reason} (agent.log_roots)"))
                return
        watch = self._watches.get(path)
        if watch is not None:
            if watch.key != key:
                watch.reported = False     # a new attempt: its timeline hears again
            watch.key = key
            if watch.rights != rights:
                watch.rights = rights
                self._close(watch)
                watch.sig = None
        else:
            self._watches[path] = _Watch(path, key, self._cursors.pop(path, None), rights)

    def remove(self, path: str | os.PathLike, forget: bool = False) -> None:
        """Stop following ``path``. Its cursor is kept (a requeued job may append
        to the same file) unless ``forget``."""
        path = os.fspath(path)
        self.refused.pop(path, None)
        self._refusal_said.pop(path, None)
        watch = self._watches.pop(path, None)
        if watch is None:
            return
        self._say_skipped(watch, force=True)
        self._close(watch)
        if forget:
            self._store_call("forget", [path])
            return
        if watch.ino is not None:
            self._cursors[path] = self._cursor(watch)   # a later add resumes here
            if watch.saved != self._cursor(watch):
                self._store_call("save_many", {path: self._cursor(watch)})

    @property
    def paths(self) -> list[str]:
        return list(self._watches)

    @property
    def open_count(self) -> int:
        return len(self._open)

    @property
    def backlog(self) -> int:
        """How many files have bytes the budget left unread."""
        return sum(1 for w in self._watches.values() if w.behind)

    @property
    def errors(self) -> dict[str, str]:
        return {w.path: w.error for w in self._watches.values() if w.error}

    # -- reading -----------------------------------------------------------
    def poll(self) -> list[LogLine]:
        """The complete lines written since the last poll, file by file, in order."""
        return list(self.poll_iter())

    def poll_iter(self) -> Iterator[LogLine]:
        """The lines :meth:`poll` returns, yielded about a ``STEP`` at a time:
        memory stays bounded, and the caller's work on the lines counts against
        ``time_budget`` (past it, files not yet read wait for the next poll,
        first in line then)."""
        self._polls += 1
        deadline = time.monotonic() + self.time_budget
        wall = time.time()
        todo = []
        any_behind = False
        for w in self._watches.values():
            before, w.looked, w.written = w.looked, wall, None
            try:
                st = self._look(w)
            except FileNotFoundError:
                w.error = None
                if w.fd is not None:  # deleted: read what its descriptor still has
                    todo.append((w, None))
                else:
                    w.behind = False
                w.gone = w.ino is not None
                continue
            except OSError as exc:
                self._fail(w, exc)
                continue
            if w.behind or w.sig != (st.st_ino, st.st_size, st.st_mtime_ns):
                w.written = written_at(st.st_mtime, before, wall)
                todo.append((w, st))
                any_behind = any_behind or w.behind
        if any_behind:  # least recently served first, so no file starves
            todo.sort(key=lambda item: item[0].served)
        budget = self.read_budget
        for i, w_st in enumerate(todo):
            w, st = w_st
            # past a budget, the rest waits (the first file is always served: progress)
            if i and (budget <= 0 or time.monotonic() >= deadline):
                w.behind = True
                continue
            w.served = self._polls
            left = min(budget, self.file_budget)
            while left > 0:
                out: list[LogLine] = []
                used = self._service(w, st, min(left, STEP), out)
                left -= used
                budget -= used
                yield from out
                if not w.behind or not used or time.monotonic() >= deadline:
                    break
        if time.monotonic() - self._last_save >= self.save_interval:
            self.save()

    def written(self, path: str) -> float | None:
        """When the lines this poll read from ``path`` were written, at the
        latest (see :func:`written_at`); None when the file's time cannot be
        trusted or the path is not followed."""
        w = self._watches.get(path)
        return w.written if w is not None else None

    def flush_partial(self, path: str | os.PathLike) -> list[LogLine]:
        """Read ``path`` to its end and deliver its last line even without a
        newline: for a job that has ended."""
        return list(self.flush_iter(path))

    def flush_iter(self, path: str | os.PathLike) -> Iterator[LogLine]:
        """:meth:`flush_partial`, yielded a ``STEP`` at a time (a file far
        behind is skipped to its tail first, as in a poll)."""
        watch = self._watches.get(os.fspath(path))
        if watch is None:
            return
        try:
            st = self._look(watch)
        except FileNotFoundError:
            st = None
        except OSError as exc:
            self._fail(watch, exc)
            return
        while True:
            out: list[LogLine] = []
            used = self._service(watch, st, STEP, out)
            yield from out
            if not watch.behind or not used:
                break
        out = []
        self._finish(watch, out)
        yield from out
        self._say_skipped(watch, force=True)

    # -- cursors -----------------------------------------------------------
    @staticmethod
    def _cursor(w: _Watch) -> Cursor:
        return (w.ino, w.mark, w.mark_lineno)

    def save(self) -> None:
        """Write the cursors that moved since the last save."""
        self._last_save = time.monotonic()
        changed = {path: self._cursor(w) for path, w in self._watches.items()
                   if w.ino is not None and w.saved != self._cursor(w)}
        if changed and self._store_call("save_many", changed):
            for path, cursor in changed.items():
                self._watches[path].saved = cursor

    def _store_call(self, method: str, arg) -> bool:
        if self._store is None:
            return False
        try:
            getattr(self._store, method)(arg)
            return True
        except (RecoveryError, OSError) as exc:
            log.warning("cannot %s log cursors: %s", method.replace("_", " "), exc)
            return False

    def close(self) -> None:
        """Save the cursors and close every descriptor."""
        self.save()
        for w in list(self._open.values()):
            self._close(w)
        self._dirs.close()

    def __enter__(self) -> "Tailer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
