"""The scanner's multi-line context: a Python traceback kept open until its
exception line (:func:`_traceback_kind` sorts each line), and torchrun's
``ChildFailedError`` summary after it, folded into the same detection
(:class:`_Summary`). The :class:`~.scanner.ScanStream` drives both."""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Protocol

from .engines import TRACEBACK_LITERAL
from .model import Detection, Evidence
from .patterns import Rule


class ScanStream(Protocol):
    """What of the scanner's stream (:class:`.scanner.ScanStream`) the
    tracebacks use: its scanner (``hits``, ``detection``) and its source."""

    scanner: Any
    source: str

TB_MAX_LINES = 400       # frames and code lines kept open at most
TB_MAX_OTHER = 20        # unrelated lines tolerated inside a traceback
SUMMARY_MAX = 80

_PREFIX = re.compile(r"^(?:\s*\d{1,6}: |\[(?:rank|default)?\d+\]: ?|\(\w*\s?pid=\d+[^)]*\) )+")
_EXC_COLON = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Z]\w*[a-z]\w*:(?:\s.*)?$")
_EXC_BARE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Interrupt|Exit)\s*$")
_SUMMARY_FIELD = re.compile(r"^\s*(host|rank|exitcode|traceback)\s*:\s*(.*?)\s*$")
_ROLE_ORDER = {"root": 0, "cause": 1, "symptom": 2, "exit": 3}


# Python's hook for an exception it cannot raise (sys.unraisablehook: in a
# destructor, a weakref callback, at interpreter exit) prints "Exception
# ignored in: <obj>" and then the traceback, and the program goes on
_IGNORED = re.compile(r"^Exception ignored in\b")


class _Traceback:
    __slots__ = ("header", "frames", "other", "ignored", "lead")

    def __init__(self, header: Evidence, ignored: bool = False,
                 lead: re.Pattern | None = None) -> None:
        self.header, self.frames, self.other = header, 0, 0
        self.ignored = ignored   # after "Exception ignored in": Python went on
        self.lead = lead         # the header's own prefix, as every line of it repeats it


# A logger that prefixes every line of a message, the traceback's too (vLLM's
# NewLineFormatter: "ERROR 12-17 23:28:01 [core.py:866] " before each line; a
# compose service's "name  | "; a markdown quote's "> "): what stands before
# the header on its line stands before each frame and the exception line, its
# digits (the clock, a line number) changing from line to line
_LEAD_MAX = 200
_DIGITS = re.compile(r"\d+")


def lead_of(line: str) -> re.Pattern | None:
    """The prefix before a traceback header (past the launcher prefixes), as
    a pattern its other lines match: its digits may differ. None when the
    header starts its line."""
    body = _PREFIX.sub("", line, count=1)
    at = body.find(TRACEBACK_LITERAL)
    lead = body[:at] if at > 0 else ""
    if not lead.strip() or len(lead) > _LEAD_MAX:
        return None
    return re.compile(r"\d+".join(re.escape(part) for part in _DIGITS.split(lead)))


def ignored_before(recent) -> bool:
    """Whether the line before a traceback header is the unraisable hook's."""
    last = None
    for last in recent:
        pass
    return last is not None and bool(_IGNORED.match(_PREFIX.sub("", last, count=1).strip()))


class _Summary:
    """torchrun's ChildFailedError report after its traceback, folded into one detection."""

    def __init__(self, base: Detection) -> None:
        self.base = base
        self.rules: list[tuple[int, Rule, re.Match, str, int]] = []
        self.fields: dict[str, str] = {}
        self.rulers = 0        # "=====" lines seen
        self.lines = 0
        self.root = False      # inside "Root Cause (first observed failure):"

    def add(self, stream: ScanStream, line: str, lineno: int, candidates) -> str:
        """Take one line: "more" (keep going), "done" (this line ended the
        summary) or "not_mine" (no summary here; the line is an ordinary one)."""
        self.lines += 1
        body = _PREFIX.sub("", line, count=1).strip()
        if body.startswith("====="):
            self.rulers += 1
            return "done" if self.rulers >= 2 else "more"
        if self.rulers == 0:
            return "not_mine" if body or self.lines > 2 else "more"
        if body.startswith("Root Cause"):
            self.root, self.fields = True, {}
        field = _SUMMARY_FIELD.match(body)
        if field and (self.root or field.group(1) not in self.fields):
            self.fields[field.group(1)] = field.group(2)
        for rule, match in stream.scanner.hits(line, candidates):
            self.rules.append((0 if self.root else 1, rule, match, line, lineno))
        return "done" if self.lines >= SUMMARY_MAX else "more"

    def finish(self, stream: ScanStream) -> list[Detection]:
        base = self.base
        if self.rules:
            _, rule, match, line, lineno = min(
                self.rules, key=lambda r: (r[0], -r[1].priority, _ROLE_ORDER[r[1].role]))
            base = stream.scanner.detection(rule, match, line, lineno, stream.source, (),
                                            base.evidence, base.detail)
        rank = re.match(r"\d+", self.fields.get("rank", ""))
        host = self.fields.get("host") or None
        return [replace(base, host=base.host or host,
                        rank=base.rank if base.rank is not None else
                        (int(rank.group()) if rank else None))]


def _traceback_kind(line: str, lead: re.Pattern | None = None) -> tuple[str, str]:
    """("frame" | "exception" | "other", the line without launcher prefixes
    and without the header's own prefix ``lead``)."""
    body = _PREFIX.sub("", line, count=1)
    if lead is not None:
        repeated = lead.match(body)
        if repeated:
            body = body[repeated.end():]
    if not body.strip() or body[0] in " \t" or body.lstrip().startswith("^"):
        return "frame", body
    if _EXC_COLON.match(body) or _EXC_BARE.match(body):
        return "exception", body
    return "other", body
