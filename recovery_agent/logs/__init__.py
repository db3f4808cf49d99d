"""Log sources: the job output files the agent follows, and the lines that
arrive inside node reports. Files a user names are opened with that user's
rights (:mod:`.userfs`)."""
from .tail import (CursorStore, LogLine, MemoryCursorStore, Notice, SqliteCursorStore, Tailer,
                   lines_from_report)
from .userfs import NotFollowed, Rights

__all__ = ["CursorStore", "LogLine", "MemoryCursorStore", "Notice", "NotFollowed", "Rights",
           "SqliteCursorStore", "Tailer", "lines_from_report"]
