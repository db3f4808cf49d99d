"""The tailer's reading of one followed file (see
:mod:`recovery_agent.inputs.tail`): the per-poll look at its path; truncation,
a new inode and a rewrite under the same inode; the rotated file finished by
its inode; a flood skipped to its tail; new bytes split into lines.
"""
from __future__ import annotations

import logging
import os
import stat
import time

from . import userfs
from .followed import _Watch
from .logline import LogLine, Notice, _text
from .userfs import NotFollowed

log = logging.getLogger("recovery_agent.inputs.tail")   # the tailer's, as before its split

CHUNK = 256 * 1024           # one pread
STEP = 1 << 20               # bytes read between two yields of poll_iter/flush_iter
SKIP_REPORT_EVERY = 300.0    # further skips of one file are reported this often


def _lstat(path: str) -> os.stat_result:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise NotFollowed(f"{path} is a symbolic link; not followed")
    return st


class Reading:
    """The tailer's part that reads one followed file (a part of
    :class:`~recovery_agent.inputs.tail.Tailer`, whose state it shares: the
    limits, the notices, the descriptors of
    :class:`~recovery_agent.inputs.tailfds.Descriptors`)."""

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
