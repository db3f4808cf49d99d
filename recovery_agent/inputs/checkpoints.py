"""The newest checkpoint file under a job's ``ckpt=`` path, found with the job
user's rights (:mod:`.userfs`).

:func:`newest_checkpoint` stats a bounded number of entries and returns the
newest finished file of theirs, as a
:class:`~recovery_agent.detect.checkpoint.CheckpointFound`; which names count
(no temporary or hidden ones) and which entry is the newest is the pure reading
of :mod:`recovery_agent.detect.checkpoint`. This module is the part that
touches the file system.
"""
from __future__ import annotations

import glob
import os
import stat

from ..detect.checkpoint import CheckpointFound, ignored_name, newest_found
from . import userfs

__all__ = ["MAX_DEPTH", "MAX_ENTRIES", "newest_checkpoint"]

MAX_ENTRIES = 5000   # directory entries examined per scan, at most
MAX_DEPTH = 3        # levels of subdirectories entered below the ckpt directory
                     # (or below a directory a glob matched)


class _Budget:
    def __init__(self, entries: int) -> None:
        self.left = entries

    def take(self) -> bool:
        self.left -= 1
        return self.left >= 0


def _newest_under(here: userfs.Dir, path: str, depth: int,
                  budget: _Budget) -> CheckpointFound | None:
    """The newest non-temporary file below the directory ``here`` (``path``)."""
    return newest_found(_found_under(here, path, depth, budget))


def _found_under(here: userfs.Dir, path: str, depth: int, budget: _Budget):
    """What each entry of ``here`` holds (None: nothing that counts), in
    listing order, until the listing ends or fails."""
    try:
        for name, st in here.entries(budget.take):
            if ignored_name(name):
                continue
            yield _examine(here, name, st, os.path.join(path, name), depth, budget)
    except OSError:
        pass  # vanished, not readable by the user: what was seen so far stands


def _examine(parent: userfs.Dir, name: str, st: os.stat_result, path: str, depth: int,
             budget: _Budget) -> CheckpointFound | None:
    """A file counts when it is the user's own and readable by them; a
    directory is looked into (links among entries are neither followed nor
    entered, so a link loop cannot eat the budget)."""
    if stat.S_ISREG(st.st_mode):
        try:
            parent.check_file(name, st)
        except OSError:
            return None
        return CheckpointFound(path, st.st_mtime)
    if stat.S_ISDIR(st.st_mode) and depth > 0:
        try:
            with parent.child(name) as sub:
                return _newest_under(sub, path, depth - 1, budget)
        except OSError:
            return None
    return None


def newest_checkpoint(ckpt_spec: str, max_entries: int = MAX_ENTRIES,
                      max_depth: int = MAX_DEPTH,
                      rights: userfs.Rights | None = None) -> CheckpointFound | None:
    """The newest finished checkpoint file under ``ckpt_spec`` (an absolute
    file, directory or glob), as ``(path, mtime)``; None when there is none.

    ``rights``: the job user's (:class:`~recovery_agent.inputs.userfs.Rights`).
    The spec is then resolved as that user could (directories they may search,
    listings they may read, no links of theirs followed) and only files they
    own count; None looks as the agent itself (any owner), for tests and tools.

    Temporary and hidden names (``*.tmp``, ``.foo``, ``tmp-checkpoint-500``) are
    skipped with everything below them. At most ``max_entries`` directory entries
    are read and ``max_depth`` levels of subdirectories entered below the path
    or a glob's matches, so a huge tree costs a bounded scan (the answer is then the newest
    among the entries seen).
    """
    if not ckpt_spec or not os.path.isabs(ckpt_spec):
        return None
    budget = _Budget(max_entries)
    magic = glob.has_magic(ckpt_spec)
    return newest_found(
        _examine(match.parent, match.name, match.st, match.path, max_depth + 1, budget)
        for match in userfs.glob(ckpt_spec, rights or userfs.AGENT, budget.take)
        if not (magic and ignored_name(match.name)))
