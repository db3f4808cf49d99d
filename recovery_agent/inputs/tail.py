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
import stat
import time
from collections import OrderedDict
from typing import Iterable, Iterator, Mapping, NamedTuple, Protocol

from ..errors import RecoveryError
from . import userfs
from .userfs import NotFollowed, Rights

log = logging.getLogger(__name__)

MAX_LINE = 64 * 1024         # bytes kept of one line
FILE_BUDGET = 8 << 20        # bytes read from one file in one poll
READ_BUDGET = 32 << 20       # bytes read from all files in one poll
TIME_BUDGET = 1.0            # seconds after which a poll starts no new read
MAX_BACKLOG = 16 << 20       # a file further ahead than this is skipped to its tail
KEEP_TAIL = 2 << 20          # bytes kept at the end of a skipped file
CHUNK = 256 * 1024           # one pread
STEP = 1 << 20               # bytes read between two yields of poll_iter/flush_iter
MAX_REPORT_LINES = 10_000    # log lines taken from one node report
SKIP_REPORT_EVERY = 300.0    # further skips of one file are reported this often
# O_NOFOLLOW: a log replaced by a symlink (to /etc/shadow, say) is never read
_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
               | getattr(os, "O_NOFOLLOW", 0))


def _lstat(path: str) -> os.stat_result:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise NotFollowed(f"{path} is a symbolic link; not followed")
    return st


class Notice(NamedTuple):
    """Something a job's timeline should say about its output: ``kind`` is
    ``not_followed`` (a refusal, once per path and key) or ``skipped``
    (``skipped`` bytes passed over in a flood)."""

    key: str
    path: str
    kind: str
    message: str
    skipped: int = 0

Cursor = tuple[int, int, int]  # (inode, offset, lineno)


class LogLine(NamedTuple):
    """One complete line of a job's output.

    ``offset`` is the byte offset of the line's start in its file (-1 for lines
    that came inside a node report); ``capped`` says the line was cut at the
    length limit. A named tuple, because thousands are made each second.
    """

    key: str
    path: str
    lineno: int
    text: str
    offset: int
    capped: bool = False


class CursorStore(Protocol):
    """Where the tailer keeps its cursors between agent runs."""

    def load_all(self) -> dict[str, Cursor]: ...

    def save_many(self, cursors: Mapping[str, Cursor]) -> None: ...

    def forget(self, paths: Iterable[str]) -> None: ...


class MemoryCursorStore:
    """Cursors in a dict: for tests and for running without a store."""

    def __init__(self) -> None:
        self.cursors: dict[str, Cursor] = {}

    def load_all(self) -> dict[str, Cursor]:
        return dict(self.cursors)

    def save_many(self, cursors: Mapping[str, Cursor]) -> None:
        self.cursors.update(cursors)

    def forget(self, paths: Iterable[str]) -> None:
        for path in paths:
            self.cursors.pop(path, None)


class SqliteCursorStore:
    """Cursors in the agent's store (table ``log_cursors``)."""

    def __init__(self, store) -> None:
        self.store = store

    def load_all(self) -> dict[str, Cursor]:
        return self.store.log_cursors()

    def save_many(self, cursors: Mapping[str, Cursor]) -> None:
        self.store.save_log_cursors(cursors)

    def forget(self, paths: Iterable[str]) -> None:
        self.store.forget_log_cursors(paths)


def _text(raw: bytes) -> str:
    text = raw.decode("utf-8", "replace")
    if text.endswith("\r"):
        text = text[:-1]
    if "\x00" in text:
        text = text.replace("\x00", "")
    return text


class _Watch:
    """The state of one followed path."""

    __slots__ = ("path", "key", "ino", "pos", "last", "start", "lineno", "partial", "capped",
                 "mark", "mark_lineno", "gone", "sig", "fd", "error", "behind", "served",
                 "saved", "rights", "reported", "skipped", "skip_said", "folder", "name")

    def __init__(self, path: str, key: str, cursor: Cursor | None,
                 rights: Rights | None = None) -> None:
        self.path = path
        self.folder, self.name = os.path.split(path)
        self.key = key
        self.rights = rights           # None: read as the agent itself
        self.reported = False          # a refusal is on its key's timeline
        self.skipped = [0, 0]          # bytes and lines skipped, not yet reported
        self.skip_said = float("-inf")  # when a skip was last reported
        self.ino, self.pos, self.lineno = cursor if cursor else (None, 0, 0)
        self.last = b"\n" if self.pos else b""  # the byte at pos - 1
        self.start = self.pos          # offset of the held partial line
        self.partial = b""             # at most max_line bytes
        self.capped = False            # the held line went past max_line
        self.mark, self.mark_lineno = self.pos, self.lineno  # after the last newline
        self.gone = False              # the path was seen missing
        self.sig: tuple | None = None  # (inode, size, mtime) when last read
        self.fd: int | None = None
        self.error: str | None = None
        self.behind = False            # unread bytes left by the budget
        self.served = 0                # the poll that last read it
        self.saved = cursor

    def restart(self, ino: int) -> None:
        self.ino, self.pos, self.start, self.lineno = ino, 0, 0, 0
        self.mark = self.mark_lineno = 0
        self.last = self.partial = b""
        self.capped = self.gone = False


class Tailer:
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
        todo = []
        any_behind = False
        for w in self._watches.values():
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

    def _look(self, w: _Watch) -> os.stat_result:
        """The per-poll look at a path: lstat as the agent, or, with a user's
        rights, fstatat in its directory walked with those rights."""
        if w.rights is None:
            return _lstat(w.path)
        if not w.name:
            raise NotFollowed(f"{w.path} names a directory, not a file")
        st = self._dirs.get(w.folder, w.rights).lstat(w.name)
        if stat.S_ISLNK(st.st_mode):
            raise NotFollowed(f"{w.path} is a symbolic link; not followed")
        return st

    def _service(self, w: _Watch, st: os.stat_result | None, limit: int,
                 out: list[LogLine]) -> int:
        """Read up to ``limit`` bytes of one file; return the bytes read."""
        try:
            if st is None:  # gone: finish what its descriptor still holds
                got = self._read(w, w.fd, limit, out) if w.fd is not None else None
                used, eof = got or (0, True)
                w.behind = not eof
                if eof:
                    self._close(w)
                return used
            if not stat.S_ISREG(st.st_mode):
                raise NotFollowed(f"{w.path} is {userfs.kind(st.st_mode)}, not a regular "
                                  "file")
            used = 0
            if w.ino is None:
                w.restart(st.st_ino)
            elif w.ino != st.st_ino or w.gone:
                used, done = self._finish_old(w, limit, out)
                if not done:
                    w.behind = True
                    return used
                log.info("log replaced, reading the new file from its start: path=%s", w.path)
                w.restart(st.st_ino)
            elif st.st_size < w.pos:
                log.warning("log truncated, reading again from its start: path=%s size=%d "
                            "offset=%d", w.path, st.st_size, w.pos)
                self._finish(w, out)
                w.restart(st.st_ino)
            got = self._read_current(w, st, limit - used, out)
            if got is None:  # replaced between stat and open: the next poll sees it
                w.sig = None
                return used
            w.behind = not got[1]
            w.sig = (st.st_ino, st.st_size, st.st_mtime_ns)
            if w.error:
                log.info("log readable again: path=%s", w.path)
                w.error = None
            return used + got[0]
        except OSError as exc:
            self._fail(w, exc)
            return 0

    def _read_current(self, w: _Watch, st: os.stat_result, limit: int,
                      out: list[LogLine]) -> tuple[int, bool] | None:
        """Read the file the path names now, opening it if needed."""
        if w.fd is not None:
            self._open.move_to_end(w.path)
            fd = w.fd
        else:
            fd = self._open_fd(w, w.path, st)
            if fd is None:
                return None
        try:
            if self.max_backlog and st.st_size - w.pos > self.max_backlog:
                self._skip(w, fd, st.st_size, out)
            got = self._read(w, fd, limit, out, st.st_size)
            if got is None:
                log.warning("log rewritten under the same inode, reading again from its "
                            "start: path=%s", w.path)
                self._finish(w, out)
                w.restart(st.st_ino)
                got = self._read(w, fd, limit, out, st.st_size)
            return got
        finally:
            if w.fd != fd:  # not kept open
                os.close(fd)

    def _finish_old(self, w: _Watch, limit: int, out: list[LogLine]) -> tuple[int, bool]:
        """Read the rest of the file the path no longer names; deliver its
        partial line at its end. Return (bytes read, finished)."""
        if w.fd is not None:
            got = self._read(w, w.fd, limit, out)
        else:
            found = self._find_inode(w)
            fd = self._open_fd(w, found) if found else None
            got = None
            if fd is not None:
                try:
                    got = self._read(w, fd, limit, out)
                finally:
                    if w.fd != fd:
                        os.close(fd)
        used, eof = got or (0, True)
        if eof:
            self._finish(w, out)
            self._close(w)
        return used, eof

    def _skip(self, w: _Watch, fd: int, size: int, out: list[LogLine]) -> None:
        """Jump to the last ``keep_tail`` bytes of a file that ran too far ahead,
        at a line start; count the lines passed over, so numbers stay right."""
        if w.pos and os.pread(fd, 1, w.pos - 1) != w.last:
            return     # rewritten under the same inode: _read starts it again
        start = size - self.keep_tail
        window = os.pread(fd, CHUNK + 1, start - 1)   # from the byte before start
        cut = window.find(b"\n")
        target = start + cut if cut >= 0 else start
        held = bool(w.partial or w.capped)
        self._finish(w, out)           # the line begun before the skip, as far as it got
        lines = _count_lines(fd, w.pos, target) - (1 if held else 0)
        skipped = target - w.pos
        w.pos = w.start = w.mark = target
        w.lineno += max(lines, 0)
        w.mark_lineno = w.lineno
        w.last = b"\n" if cut >= 0 else window[:1]
        w.capped = cut < 0             # no line start in reach: the head of this one is gone
        w.skipped[0] += skipped
        w.skipped[1] += max(lines, 0)
        self.skipped_bytes += skipped
        log.warning("log far ahead of its reader, skipped to its tail: path=%s skipped=%d "
                    "bytes lines=%d", w.path, skipped, lines)
        self._say_skipped(w)

    def _say_skipped(self, w: _Watch, force: bool = False) -> None:
        """Report the bytes skipped in ``w``: the first skip at once, later ones
        at most every SKIP_REPORT_EVERY seconds, and what is left when it ends."""
        skipped, lines = w.skipped
        now = time.monotonic()
        if not skipped or (not force and now - w.skip_said < SKIP_REPORT_EVERY):
            return
        w.skip_said, w.skipped = now, [0, 0]
        self.notices.append(Notice(
            w.key, w.path, "skipped",
            f"skipped {skipped / 1e6:.1f} MB of output ({lines} lines) of {w.path}: it was "
            f"written faster than the agent reads; reading on from its last "
            f"{self.keep_tail / 1e6:.1f} MB", skipped))

    def _find_inode(self, w: _Watch) -> str | None:
        """The rotated file (same directory, name starting with ours) that still
        has the inode we followed."""
        folder, name = os.path.split(w.path)
        if w.rights is not None:     # listed only if the user may list it
            try:
                for found, st in self._dirs.get(folder, w.rights).entries():
                    if found != name and found.startswith(name) and st.st_ino == w.ino:
                        return os.path.join(folder, found)
            except OSError:
                pass
            return None
        try:
            with os.scandir(folder or ".") as entries:
                for entry in entries:
                    if entry.name != name and entry.name.startswith(name) \
                            and entry.inode() == w.ino:
                        return entry.path
        except OSError:
            pass
        return None

    def _read(self, w: _Watch, fd: int, limit: int, out: list[LogLine],
              size: int | None = None) -> tuple[int, bool] | None:
        """Read from ``w.pos`` up to ``limit`` bytes and at most to ``size`` (the
        file's size when last stat'ed); return (bytes read, at the end).

        The first read starts a byte early: if that byte is not the one read
        there before, the file was truncated and rewritten, or another file got
        its inode number, and the answer is None. Reads ask for what the file
        holds, not a fixed chunk: a large buffer costs an mmap per call.
        """
        if size is None:
            size = os.fstat(fd).st_size
        used = 0
        back = 1 if w.pos else 0
        while True:
            want = min(CHUNK, limit - used, size - w.pos)
            if want < 0:
                want = 0
            if not want and not back:
                return used, w.pos >= size
            data = os.pread(fd, want + back, w.pos - back)
            if back:
                if data[:1] != w.last:
                    return None
                data = data[1:]
                back = 0
            if data:
                self._feed(w, data, out)
                used += len(data)
            if len(data) < want:
                return used, True

    def _feed(self, w: _Watch, data: bytes, out: list[LogLine]) -> None:
        """Split new bytes into lines; hold the unfinished last one."""
        cap = self.max_line
        pieces = data.split(b"\n")
        tail = pieces.pop()
        offset = w.pos
        w.pos += len(data)
        w.last = data[-1:]
        if pieces:
            first = pieces[0]
            if w.partial or w.capped:
                self._hold(w, first)
                raw, capped = w.partial, w.capped
                w.partial, w.capped = b"", False
            else:
                raw, capped = (first, False) if len(first) <= cap else (first[:cap], True)
            offset += len(first) + 1
            w.lineno += 1
            out.append(LogLine(w.key, w.path, w.lineno, _text(raw), w.start, capped))
            for piece in pieces[1:]:
                w.lineno += 1
                if len(piece) <= cap:
                    out.append(LogLine(w.key, w.path, w.lineno, _text(piece), offset))
                else:
                    out.append(LogLine(w.key, w.path, w.lineno, _text(piece[:cap]), offset, True))
                offset += len(piece) + 1
            w.start = w.mark = offset
            w.mark_lineno = w.lineno
        if tail:
            self._hold(w, tail)

    def _hold(self, w: _Watch, data: bytes) -> None:
        room = self.max_line - len(w.partial)
        if room > 0:
            w.partial += data[:room]
        if len(data) > room:
            w.capped = True

    def _finish(self, w: _Watch, out: list[LogLine]) -> None:
        """Deliver the held partial line as a line of its own."""
        if w.partial or w.capped:
            w.lineno += 1
            out.append(LogLine(w.key, w.path, w.lineno, _text(w.partial), w.start, w.capped))
            w.partial, w.capped = b"", False
        w.start = w.pos

    # -- descriptors -------------------------------------------------------
    def _open_fd(self, w: _Watch, path: str, looked: os.stat_result | None = None
                 ) -> int | None:
        """Open ``path`` if it still is ``w``'s inode (else None).

        The descriptor is kept as ``w.fd``, closing the least recently used one
        at the limit, unless that one was used in this poll or the last: then
        the caller closes it after reading. With more busy files than
        descriptors, plain LRU would close each one just before its next use.
        """
        if w.rights is None:
            fd = os.open(path, _OPEN_FLAGS)
        else:         # looked: this poll's look at the path in the same directory
            folder, name = os.path.split(path)
            fd = userfs.open_in(self._dirs.get(folder, w.rights), name, self.allowed_roots,
                                path, looked if path == w.path else None)
        try:
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            raise
        if st.st_ino != w.ino or not stat.S_ISREG(st.st_mode):
            os.close(fd)
            return None
        if len(self._open) >= self.max_open:
            oldest = next(iter(self._open.values()))
            if oldest.served >= self._polls - 1:
                return fd
            self._close(oldest)
        w.fd = fd
        self._open[w.path] = w
        return fd

    def _close(self, w: _Watch) -> None:
        if w.fd is not None:
            try:
                os.close(w.fd)
            except OSError:
                pass
            w.fd = None
        self._open.pop(w.path, None)

    def _fail(self, w: _Watch, exc: OSError) -> None:
        message = f"{type(exc).__name__}: {exc.strerror or exc}"
        if message != w.error:
            log.warning("cannot read log: path=%s error=%s", w.path, message)
            w.error = message
        if isinstance(exc, NotFollowed) and not w.reported:
            w.reported = True
            self.notices.append(Notice(w.key, w.path, "not_followed", str(exc)))
        w.sig = None
        w.behind = False
        self._close(w)

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


def _count_lines(fd: int, start: int, end: int) -> int:
    """Newlines in bytes [start, end) of ``fd``, read a STEP at a time."""
    count = 0
    while start < end:
        data = os.pread(fd, min(STEP, end - start), start)
        if not data:
            break
        count += data.count(b"\n")
        start += len(data)
    return count


def lines_from_report(report: dict, key: str | None = None,
                      max_line: int = MAX_LINE) -> list[LogLine]:
    """The lines a node report carries in its optional ``log_lines`` field,
    ``[{"text": ..., "source": ...}]``.

    The path is ``hook:<node>/<hook>``, with ``:<source>`` added when the entry
    names one; line numbers count within the report. The key defaults to the
    report's job id. Entries that are not objects with a text are skipped; text
    is cleaned as file lines are (length cap, CR, NUL).
    """
    entries = report.get("log_lines") if isinstance(report, dict) else None
    if not isinstance(entries, list):
        return []
    job = report.get("job")
    if key is None:
        key = str(job.get("job_id", "")) if isinstance(job, dict) else ""
    base = f"hook:{report.get('node', '')}/{report.get('hook', '')}"
    counts: dict[str, int] = {}
    out: list[LogLine] = []
    for entry in entries[:MAX_REPORT_LINES]:
        if not isinstance(entry, dict) or not isinstance(entry.get("text"), str):
            continue
        source = entry.get("source")
        path = f"{base}:{source}" if isinstance(source, str) and source else base
        raw = entry["text"].encode("utf-8", "replace")
        for piece in raw.rstrip(b"\n").split(b"\n"):
            counts[path] = counts.get(path, 0) + 1
            out.append(LogLine(key, path, counts[path], _text(piece[:max_line]), -1,
                               len(piece) > max_line))
    return out
