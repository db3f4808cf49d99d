"""Multi-pattern engines: which lines of a block which rules may match.

A block is complete lines joined by LF, as bytes. Both engines return the
candidate lines, each as (index in the block, byte offset, rule indexes);
the scanner confirms every candidate with the rule's Python regex (which also
supplies the named groups), so the engines yield identical detections as long
as neither misses a line that Python would match. The pseudo rule TRACEBACK
marks lines that open a Python traceback.

* ``re``: a literal prefilter. Each rule gets the literals one of which must
  occur in any line it matches (read off the parsed regex). Lines and literals
  are compared normalized (ASCII lowercase, digits as 0), so lines differing
  only in numbers collapse into one shape; each distinct shape is searched
  once per literal with ``bytes.find``. A training log has few shapes.
* ``hyperscan``: every rule in one compiled database, scanned over the whole
  block at once; each reported match end marks its line.

``make_engine(rules, "auto")`` takes hyperscan when it imports and compiles,
else ``re``; :func:`hyperscan_probe` says why not.
"""
from __future__ import annotations

import logging
import re
from bisect import bisect_right
from collections import defaultdict
from itertools import accumulate
from re import _constants as sre_c  # type: ignore[attr-defined]
from re import _parser as sre_parse  # type: ignore[attr-defined]
from typing import Iterator, Sequence

from ..errors import ConfigError
from .patterns import REGEX_FLAGS, Rule

log = logging.getLogger(__name__)

ENGINES = ("auto", "re", "hyperscan")
MIN_LITERAL = 3
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")

# ([(line index, offset of the line in the block, rules that may match it)],
#  number of lines in the block)
Candidates = tuple[list[tuple[int, int, set[int]]], int]


# -- required literals -------------------------------------------------------------

def required_literals(regex: str) -> tuple[frozenset[str], bool] | None:
    """Strings one of which occurs in every match of ``regex``, and whether they
    are to be compared caseless (lowercased); None when no useful set exists."""
    tree = sre_parse.parse(regex, REGEX_FLAGS)
    caseless = bool(tree.state.flags & sre_c.SRE_FLAG_IGNORECASE) or _scoped_caseless(tree)
    found = _best(tree)
    if not found or min(map(len, found)) < MIN_LITERAL:
        return None
    if caseless:
        found = {s.translate(_ASCII_LOWER) for s in found}
    return frozenset(found), caseless


def _scoped_caseless(tree) -> bool:
    for op, av in tree:
        if op is sre_c.SUBPATTERN and av[1] & sre_c.SRE_FLAG_IGNORECASE:
            return True
        if any(_scoped_caseless(sub) for sub in _nested(op, av)):
            return True
    return False


def _nested(op, av) -> list:
    if op is sre_c.SUBPATTERN:
        return [av[3]]
    if op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT):
        return [av[2]]
    if op is sre_c.BRANCH:
        return list(av[1])
    return []


def _score(options: set[str]) -> tuple:
    shortest = min(map(len, options))
    return (min(shortest, 6), -len(options), shortest)


def _best(seq) -> set[str] | None:
    """The best-scoring required literal set of one parsed sequence."""
    found: list[set[str]] = []
    run: list[str] = []
    for op, av in seq:
        if op is sre_c.LITERAL:
            run.append(chr(av))
            continue
        if run:
            found.append({"".join(run)})
            run = []
        inner: set[str] | None = None
        if op is sre_c.SUBPATTERN:
            inner = _best(av[3])
        elif op is sre_c.BRANCH:
            options = [_best(alt) for alt in av[1]]
            if all(options):
                inner = set().union(*options)
        elif op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT) and av[0] >= 1:
            inner = _best(av[2])
        if inner:
            found.append(inner)
    if run:
        found.append({"".join(run)})
    return max(found, key=_score) if found else None


# -- engines -----------------------------------------------------------------------

# The prefilter compares in a normalized space: ASCII letters lowered and every
# digit made "0". A line holding a literal still holds the normalized literal,
# and lines that differ only in numbers (steps, losses, ranks, addresses)
# become one, so a log is searched once per distinct line shape.
_NORMALIZE = bytes.maketrans(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ123456789",
                             b"abcdefghijklmnopqrstuvwxyz000000000")
TRACEBACK = -1      # pseudo rule: the line opens a Python traceback
TRACEBACK_LITERAL = "Traceback (most recent call last)"
SHAPE_CACHE = 16384     # single lines: candidate rules remembered per line shape


def normalize(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass").translate(_NORMALIZE)


class ReEngine:
    """Python ``re`` behind a literal prefilter over distinct normalized lines."""

    name = "re"

    def __init__(self, rules: Sequence[Rule]) -> None:
        table: dict[bytes, set[int]] = defaultdict(set)
        self.always: list[int] = []       # rules without a usable literal
        for index, rule in enumerate(rules):
            found = required_literals(rule.regex)
            if found is None:
                self.always.append(index)
                continue
            for literal in found[0]:
                table[normalize(literal)].add(index)
        table[normalize(TRACEBACK_LITERAL)].add(TRACEBACK)
        self.literals = sorted(table.items())
        self._shapes: dict[bytes, set[int]] = {}

    def candidates(self, data: bytes, start: int = 0, end: int | None = None,
                   limit: int | None = None) -> Candidates:
        """The candidate lines of ``data[start:end]`` (offsets into ``data``).
        A line longer than ``limit`` needs no care here: a literal of its cut
        head is in the whole line too, and Python confirms on the head."""
        end = len(data) if end is None else end
        if (start, end) == (0, len(data)):
            return self._candidates(data)
        found, count = self._candidates(data[start:end])
        return [(i, start + at, rules) for i, at, rules in found], count

    def _candidates(self, data: bytes) -> Candidates:
        normal = data.translate(_NORMALIZE)
        if b"\n" not in normal:      # one line (a tailer feeding): shapes repeat, so remember
            rules = self._shapes.get(normal)
            if rules is None:
                rules = {r for literal, found in self.literals if literal in normal for r in found}
                rules.update(self.always)
                if len(self._shapes) >= SHAPE_CACHE:
                    self._shapes.clear()
                self._shapes[normal] = rules
            return ([(0, 0, set(rules))] if rules else []), 1
        shapes = normal.split(b"\n")
        distinct = list(dict.fromkeys(shapes))
        if len(distinct) * 2 <= len(shapes):
            by_start: dict[int, set[int]] = {}
            for j, rules in _find_all(distinct, self.literals).items():
                for start in _whole_lines(normal, distinct[j]):
                    by_start[start] = rules
        else:
            by_start = _find_starts(normal, self.literals)
        if self.always:
            for start in _whole_lines_all(normal):
                by_start[start] = by_start.get(start, set()) | set(self.always)
        return _numbered(normal, by_start), len(shapes)


def _find_all(lines: Sequence[bytes], literals) -> dict[int, set[int]]:
    """{index into lines: rules whose literal occurs in that line}."""
    text = b"\n".join(lines)
    starts = list(accumulate((len(line) + 1 for line in lines[:-1]), initial=0))
    last = len(starts) - 1
    out: dict[int, set[int]] = defaultdict(set)
    for literal, rules in literals:
        pos = text.find(literal)
        while pos >= 0:
            i = bisect_right(starts, pos) - 1
            out[i].update(rules)
            if i >= last:
                break
            pos = text.find(literal, starts[i + 1])
    return out


def _find_starts(text: bytes, literals) -> dict[int, set[int]]:
    """{offset of a line: rules whose literal occurs in it}, over a whole block."""
    out: dict[int, set[int]] = defaultdict(set)
    for literal, rules in literals:
        pos = text.find(literal)
        while pos >= 0:
            out[text.rfind(b"\n", 0, pos) + 1].update(rules)
            end = text.find(b"\n", pos)
            pos = -1 if end < 0 else text.find(literal, end + 1)
    return out


def _whole_lines(text: bytes, line: bytes) -> Iterator[int]:
    """Offsets of the lines of ``text`` equal to ``line``."""
    if text.startswith(line + b"\n") or text == line:
        yield 0
    needle = b"\n" + line + b"\n"
    pos = text.find(needle)
    while pos >= 0:
        yield pos + 1
        pos = text.find(needle, pos + len(line) + 1)
    if len(text) > len(line) and text.endswith(b"\n" + line):
        yield len(text) - len(line)


def _whole_lines_all(text: bytes) -> Iterator[int]:
    pos = 0
    while pos >= 0:
        yield pos
        pos = text.find(b"\n", pos)
        pos = pos + 1 if pos >= 0 else -1


def _numbered(text: bytes, by_start: dict[int, set[int]],
              first: int = 0) -> list[tuple[int, int, set[int]]]:
    """(line index, offset, rules) in line order; indexes by counting newlines
    from offset ``first`` (the block's start in ``text``)."""
    out, index, previous = [], 0, first
    for start in sorted(by_start):
        index += text.count(b"\n", previous, start)
        previous = start
        out.append((index, start, by_start[start]))
    return out


class HyperscanEngine:
    """One hyperscan block-mode database over every rule (plus the traceback
    header), scanned over a whole block of lines at once."""

    name = "hyperscan"

    def __init__(self, rules: Sequence[Rule]) -> None:
        import hyperscan
        expressions = [_widen(rule.regex).encode("utf-8") for rule in rules]
        expressions.append(re.escape(TRACEBACK_LITERAL).encode())
        self.traceback_id = len(rules)
        self.database = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
        try:
            self.database.compile(expressions=expressions, ids=list(range(len(expressions))),
                            elements=len(expressions),
                            flags=[hyperscan.HS_FLAG_MULTILINE] * len(expressions))
        except hyperscan.error:
            raise ConfigError(_which_rule_fails(hyperscan, rules)) from None

    def candidates(self, data: bytes, start: int = 0, end: int | None = None,
                   limit: int | None = None) -> Candidates:
        """The candidate lines of ``data[start:end]`` (offsets into ``data``),
        scanned in place: no copy of the block. A line longer than ``limit``
        bytes is matched on its first ``limit`` bytes only, as Python then
        confirms it (a rule anchored at the line's end may match the cut head
        and not the whole line): its hits from the whole block are dropped and
        its head is scanned on its own."""
        end = len(data) if end is None else end
        hits: list[tuple[int, int]] = []
        traceback_id = self.traceback_id

        def on_match(rule: int, first: int, last: int, flags: int, offset: int) -> None:
            hits.append((offset + max(last - 1, 0), TRACEBACK if rule == traceback_id else rule))

        view = memoryview(data)
        self.database.scan(view[start:end], match_event_handler=on_match, context=start)
        long = _long_lines(data, limit, start, end) if limit else []
        if long:
            heads = [line_start for line_start, _ in long]
            kept = []
            for pos, rule in hits:
                i = bisect_right(heads, pos) - 1
                if i < 0 or pos >= long[i][1]:
                    kept.append((pos, rule))
            hits = kept
            for line_start, _ in long:
                self.database.scan(view[line_start:line_start + limit],
                                   match_event_handler=on_match, context=line_start)
        by_start: dict[int, set[int]] = {}
        for pos, rule in sorted(hits):
            by_start.setdefault(max(data.rfind(b"\n", start, pos) + 1, start), set()).add(rule)
        found = _numbered(data, by_start, start)
        last = found[-1][1] if found else start
        return found, (found[-1][0] if found else 0) + data.count(b"\n", last, end) + 1


def _long_lines(data: bytes, limit: int, first: int, last: int) -> list[tuple[int, int]]:
    """(start, end) of each line of ``data[first:last]`` longer than ``limit``
    bytes, in order. A line that long covers a whole aligned window of
    limit/2 bytes holding no newline, so only those windows are looked at."""
    step, out, skip_to = max(limit // 2, 1), [], first
    for pos in range(first, last, step):
        if pos < skip_to or data.find(b"\n", pos, min(pos + step, last)) >= 0:
            continue
        start = max(data.rfind(b"\n", first, pos) + 1, first)
        end = data.find(b"\n", pos, last)
        end = last if end < 0 else end
        if end - start > limit:
            out.append((start, end))
        skip_to = end
    return out


_BOUNDED = re.compile(r"(?<!\\)\{(\d+),(\d+)\}")


def _widen(regex: str) -> str:
    """The regex with every ``{m,n}`` made ``{m,}`` for hyperscan: Python counts
    characters where hyperscan counts bytes, and unbounded repeats are cheaper
    for hyperscan than long bounded ones. Only more lines can match, and
    Python confirms each."""
    return _BOUNDED.sub(lambda m: "{%s,}" % m.group(1), regex)


def _which_rule_fails(hyperscan, rules: Sequence[Rule]) -> str:
    for rule in rules:
        db = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
        try:
            db.compile(expressions=[_widen(rule.regex).encode("utf-8")], ids=[0], elements=1,
                       flags=[hyperscan.HS_FLAG_MULTILINE])
        except hyperscan.error as exc:
            return f"{rule.source}: rule {rule.id!r}: hyperscan cannot compile the regex: {exc}"
    return "hyperscan could not compile the pattern database"


def hyperscan_probe() -> str | None:
    """None when the hyperscan engine can run here, else why not."""
    try:
        import hyperscan  # noqa: F401
    except Exception as exc:   # ImportError, or a missing libhs behind it
        return f"hyperscan does not import: {exc} (pip install 'slurm-recovery[fast]')"
    return None


def make_engine(rules: Sequence[Rule], engine: str = "auto"):
    """An engine over ``rules``: ``re``, ``hyperscan`` or ``auto`` (hyperscan
    when it imports and compiles every rule, else ``re``)."""
    if engine not in ENGINES:
        raise ConfigError(f"engine {engine!r} is not one of {', '.join(ENGINES)}")
    if engine == "re":
        return ReEngine(rules)
    why = hyperscan_probe()
    if engine == "hyperscan":
        if why:
            raise ConfigError(why)
        return HyperscanEngine(rules)
    if why is None:
        try:
            return HyperscanEngine(rules)
        except ConfigError as exc:
            log.warning("scanner: falling back to re: %s", exc)
    return ReEngine(rules)
