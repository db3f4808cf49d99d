"""The tailer's descriptors (see :mod:`recovery_agent.inputs.tail`): at most
``max_open`` kept open, least recently used closed first, each opened by path
and its inode checked; a read error recorded per path, logged once, and a
refusal recorded as a :class:`~recovery_agent.inputs.logline.Notice`.
"""
from __future__ import annotations

import logging
import os
import stat

from . import userfs
from .followed import _Watch
from .logline import Notice
from .userfs import NotFollowed

log = logging.getLogger("recovery_agent.inputs.tail")   # the tailer's, as before its split

# O_NOFOLLOW: a log replaced by a symlink (to /etc/shadow, say) is never read
_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
               | getattr(os, "O_NOFOLLOW", 0))


class Descriptors:
    """The tailer's part that opens, keeps and closes descriptors (a part of
    :class:`~recovery_agent.inputs.tail.Tailer`, whose state it shares: the
    watches, the open descriptors, the directory cache, the limits)."""

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
