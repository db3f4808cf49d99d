"""The small query-language helpers the sources share: string quoting, RE2
escaping and alternation, the pattern prefilter pushed into log queries, and
RFC 3339 times with nanoseconds.
"""
from __future__ import annotations

import calendar
import json
import logging
import re
import time
from typing import Any, Iterable, Sequence

from ...detect.engines import TRACEBACK_LITERAL, required_literals

log = logging.getLogger(__name__)


# -- query language helpers -----------------------------------------------------------

_RE2_SPECIAL = set("\\.+*?()|[]{}^$")
LABEL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
FIELD_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:-]*$")


def re2_escape(text: str) -> str:
    """``text`` as an RE2 literal: metacharacters backslashed, control
    characters as ``\\xHH`` (Python's re.escape escapes spaces, which RE2 refuses)."""
    out = []
    for ch in text:
        if ch in _RE2_SPECIAL:
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def quote(text: str) -> str:
    """A double-quoted string literal that PromQL, LogQL and LogsQL all read
    back as ``text`` (Go string syntax: JSON's escapes are a subset)."""
    return json.dumps(text, ensure_ascii=False)


def alternation(values: Iterable[str]) -> str:
    """An RE2 alternation matching exactly one of ``values`` (escaped)."""
    return "|".join(re2_escape(v) for v in sorted(set(values)))


# An exception line ending a Python traceback names its class: most end so.
EXCEPTION_LINE = r"\b[A-Z][A-Za-z0-9_]*(?:Error|Exception|Interrupt|Exit)\b"


def prefilter_regex(rules: Sequence[Any], extra: Iterable[str] = ()) -> str | None:
    """One RE2 regex a line must match to be worth scanning, from the literals
    the scanner's own prefilter reads off each rule (see detect.engines).

    Caseless literal sets become ``(?i:...)``; literals holding another literal
    are dropped. Traceback-scoped rules without a literal are covered by the
    traceback opener and :data:`EXCEPTION_LINE`. A line rule without any
    usable literal makes an exact prefilter impossible: None (fetch every line).
    ``extra`` adds RE2 alternatives of the caller's (a progress pattern, say).
    """
    exact: set[str] = {TRACEBACK_LITERAL}
    caseless: set[str] = set()
    alternatives = [EXCEPTION_LINE, *extra]
    for rule in rules:
        found = required_literals(rule.regex)
        if found is None:
            if getattr(rule, "scope", "line") == "traceback":
                continue
            log.info("pattern %s has no literal to push down; fetching unfiltered lines",
                     getattr(rule, "id", "?"))
            return None
        (caseless if found[1] else exact).update(found[0])
    caseless = _minimal(caseless)
    exact = {s for s in _minimal(exact) if not any(c in s.lower() for c in caseless)}
    parts = [alternation(exact)] if exact else []
    if caseless:
        parts.append(f"(?i:{alternation(caseless)})")
    return "|".join(parts + alternatives)


def _minimal(literals: set[str]) -> set[str]:
    """Drop every literal that contains a shorter one of the set (it adds nothing)."""
    keep: list[str] = []
    for lit in sorted(literals, key=len):
        if not any(k in lit for k in keep):
            keep.append(lit)
    return set(keep)


# -- time -----------------------------------------------------------------------------

_RFC3339 = re.compile(r"^(\d{4})-(\d\d)-(\d\d)[Tt ](\d\d):(\d\d):(\d\d)(?:\.(\d{1,9})\d*)?"
                      r"(Z|z|[+-]\d\d:?\d\d)$")


def parse_rfc3339_ns(text: str) -> int:
    """Nanoseconds since the epoch from RFC 3339 with up to 9 fraction digits
    (datetime stops at microseconds). ValueError when it is not such a time."""
    match = _RFC3339.match(text.strip())
    if not match:
        raise ValueError(f"not an RFC 3339 time: {text!r}")
    y, mo, d, h, mi, s, frac, zone = match.groups()
    seconds = calendar.timegm((int(y), int(mo), int(d), int(h), int(mi), int(s), 0, 0, 0))
    if zone not in ("Z", "z"):
        sign = 1 if zone[0] == "+" else -1
        digits = zone[1:].replace(":", "")
        seconds -= sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
    return seconds * 1_000_000_000 + int((frac or "0").ljust(9, "0"))


def format_rfc3339_ns(ns: int) -> str:
    """``2024-05-01T10:00:00.123456789Z`` for nanoseconds since the epoch."""
    seconds, frac = divmod(ns, 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{frac:09d}Z"


def to_ns(seconds: float) -> int:
    return int(round(seconds * 1_000_000_000))
