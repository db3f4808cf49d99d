"""The state of one path the tailer follows (see
:mod:`recovery_agent.inputs.tail`): where its reader is, the partial line it
holds, its descriptor, its error, its skips not yet reported.
"""
from __future__ import annotations

import os

from .logline import Cursor
from .userfs import Rights


class _Watch:
    """The state of one followed path."""

    __slots__ = ("path", "key", "ino", "pos", "last", "start", "lineno", "partial", "capped",
                 "mark", "mark_lineno", "gone", "sig", "fd", "error", "behind", "served",
                 "saved", "rights", "reported", "skipped", "skip_said", "folder", "name",
                 "looked", "written")

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
        self.looked: float | None = None   # wall time of the last poll's look at it
        self.written: float | None = None  # when the lines read this poll were written

    def restart(self, ino: int) -> None:
        self.ino, self.pos, self.start, self.lineno = ino, 0, 0, 0
        self.mark = self.mark_lineno = 0
        self.last = self.partial = b""
        self.capped = self.gone = False
