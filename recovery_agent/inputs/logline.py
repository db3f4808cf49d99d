"""The lines the tailer delivers and where it keeps its cursors (see
:mod:`recovery_agent.inputs.tail`): :class:`LogLine`, one complete line of a
job's output; :class:`Notice`, what a job's timeline should say about its
output; the :class:`CursorStore` protocol, with a store in memory and one in
the agent's store.
"""
from __future__ import annotations

from typing import Iterable, Mapping, NamedTuple, Protocol

MAX_LINE = 64 * 1024         # bytes kept of one line


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
