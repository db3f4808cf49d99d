"""The log lines a node report carries (see
:mod:`recovery_agent.inputs.ingest`), as the tailer's :class:`LogLine`.
"""
from __future__ import annotations

from .logline import MAX_LINE, LogLine, _text

MAX_REPORT_LINES = 10_000    # log lines taken from one node report


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
