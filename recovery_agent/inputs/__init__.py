"""What comes in: the job output files the agent follows (:mod:`.tail`, over
:mod:`.tailread`, :mod:`.tailfds` and one file's state in :mod:`.followed`;
files a user names are opened with that user's rights, :mod:`.userfs`), the
line and cursor types (:mod:`.logline`) and the lines inside node reports
(:mod:`.reportlines`); the newest checkpoint under a job's ``ckpt=`` path
(:mod:`.checkpoints`); the node hooks' reports (:mod:`.ingest`); the job
listing cache (:mod:`.jobcache`); external metric and log stores
(:mod:`.sources`); a site's attribution provider (:mod:`.provider`)."""
from .logline import CursorStore, LogLine, MemoryCursorStore, Notice, SqliteCursorStore
from .reportlines import lines_from_report
from .tail import Tailer
from .userfs import NotFollowed, Rights

__all__ = ["CursorStore", "LogLine", "MemoryCursorStore", "Notice", "NotFollowed", "Rights",
           "SqliteCursorStore", "Tailer", "lines_from_report"]
