"""Log sources: the job output files the agent follows, and the lines that
arrive inside node reports."""
from .tail import (CursorStore, LogLine, MemoryCursorStore, SqliteCursorStore, Tailer,
                   lines_from_report)

__all__ = ["CursorStore", "LogLine", "MemoryCursorStore", "SqliteCursorStore", "Tailer",
           "lines_from_report"]
