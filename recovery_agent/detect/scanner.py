"""The log scanner: lines in, detections out, over every loaded rule at once.

``Scanner(rules, engine="auto"|"re"|"hyperscan")`` compiles the rules once
(see :mod:`.engines`). ``scan_lines`` and ``scan_bytes`` run a whole log;
``stream(source)`` gives a :class:`ScanStream` for a tailer: ``feed(line,
lineno)`` one line at a time, or ``feed_bytes(chunk)`` for raw chunks (a
partial last line waits for the next chunk), keeping multi-line state.

Lines are processed in blocks: the engine names the candidate lines of a
block, and only those (and the lines of an open traceback) are decoded and
checked with the rules' Python regexes, which also supply the named groups.

Multi-line context (the traceback and summary state: :mod:`.tracebacks`):

* A Python traceback (``Traceback (most recent call last):``, indented frames,
  then the exception line) is ONE detection, classified by its exception line:
  the line rules are tried on it first (a CUDA or NCCL error inside a
  ``RuntimeError`` keeps its own category), then the ``scope = "traceback"``
  rules. Launcher prefixes (``[rank3]:``, ``[default0]:``, srun's ``3: ``) are
  looked through. A traceback cut off before its exception line yields nothing.
* torchrun's ``ChildFailedError`` summary after such a traceback is folded into
  the same detection: its root-cause block (exit code, signal, host, rank)
  decides the rule, host and rank.
* Rules with ``lookback`` take a PCI address or GPU UUID from the few lines
  before a hit when the hit names none (kernel messages wrapped over lines).

A detection's host is the one its rule's ``host`` group names (a peer); a
rule without that group gets the node the line's prefixes name, and the rank
when the rule names none (:func:`~.origin.line_origin`).

Every line is cut to ``max_line`` bytes (64 KiB) before matching, CR/LF
endings are accepted, invalid UTF-8 is replaced: any input is scanned.
"""
from __future__ import annotations

import re
from collections import deque
from dataclasses import replace
from typing import Iterable, Iterator, Sequence

from slurm_hooks import kmsg

from .engines import TRACEBACK, TRACEBACK_LITERAL, make_engine
from .model import Detection, Evidence
from .origin import line_origin, names_no_node
from .patterns import Rule, xid_action, xid_category
from .tracebacks import (TB_MAX_LINES, TB_MAX_OTHER, _Summary, _Traceback, _traceback_kind,
                         ignored_before, lead_of)

__all__ = ["MAX_LINE", "Scanner", "ScanStream"]

MAX_LINE = 64 * 1024
EVIDENCE_MAX = 2048
BLOCK_LINES = 1 << 16    # scan_lines joins this many lines per block

_PCI = re.compile(r"\b(?:PCI:)?([0-9A-Fa-f]{4,8}):([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})(?:\.[0-7])?\b")
_BUS_DEVICE = re.compile(r"[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}")
_GPU_UUID = re.compile(r"\bGPU-[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}\b")
_SEVERITY_BY_ACTION = {"requeue_exclude": "critical", "requeue": "error", "stop": "error",
                       "kill_requeue": "error", "none": "warning"}


def _decode(raw: bytes, limit: int) -> str:
    return raw[:limit].rstrip(b"\r").decode("utf-8", "replace")


class Scanner:
    """Every rule compiled into one multi-pattern engine (see module docstring)."""

    def __init__(self, rules: Iterable[Rule], engine: str = "auto",
                 max_line: int = MAX_LINE) -> None:
        self.rules = tuple(rules)
        self.line_rules = tuple(r for r in self.rules if r.scope == "line")
        self.traceback_rules = tuple(r for r in self.rules if r.scope == "traceback")
        self.max_line = max_line
        self.engine = make_engine(self.line_rules, engine)
        self.lookback = max((r.lookback for r in self.rules), default=0)

    @property
    def engine_name(self) -> str:
        return self.engine.name

    def stream(self, source: str = "", origin: str = "") -> "ScanStream":
        """A fresh incremental scan of one source (one log file). ``origin`` says
        who wrote it (model.ORIGINS) and is stamped on its detections."""
        return ScanStream(self, source, origin)

    def scan_lines(self, lines: Iterable[str], source: str = "",
                   first_line: int = 1) -> list[Detection]:
        """Detections over a sequence of text lines, numbered from ``first_line``."""
        stream = self.stream(source)
        stream.lineno = first_line - 1
        out: list[Detection] = []
        for block in _blocks(lines, BLOCK_LINES):
            text = "\n".join(block)
            if text.count("\n") != len(block) - 1:      # a line holding a newline
                text = "\n".join(line.replace("\n", " ") for line in block)
            out.extend(stream.scan_block(text.encode("utf-8", "surrogatepass")))
        out.extend(stream.flush())
        return out

    def scan_bytes(self, data: bytes, source: str = "") -> list[Detection]:
        """Detections over a whole log held as bytes (lines split on LF)."""
        stream = self.stream(source)
        return stream.feed_bytes(data) + stream.flush()

    # -- one line --------------------------------------------------------------
    def hits(self, line: str, candidates: Iterable[int] | None) -> list[tuple[Rule, re.Match]]:
        """Confirmed (rule, match) pairs on one line, highest priority only."""
        found = []
        for index in sorted(candidates or ()):
            if index == TRACEBACK:
                continue
            rule = self.line_rules[index]
            match = rule.compiled.search(line)
            if match is not None:
                found.append((rule, match))
        if len(found) > 1:
            top = max(rule.priority for rule, _ in found)
            found = [hit for hit in found if hit[0].priority == top]
        return found

    def traceback_hit(self, body: str) -> tuple[Rule, re.Match] | None:
        """The best ``scope = "traceback"`` rule matching an exception line."""
        best = None
        for rule in self.traceback_rules:
            match = rule.compiled.search(body)
            if match is not None and (best is None or rule.priority > best[0].priority):
                best = (rule, match)
        return best

    def detection(self, rule: Rule, match: re.Match, line: str, lineno: int | None,
                  source: str, recent: Sequence[str] = (),
                  more: tuple[Evidence, ...] = (), detail: str = "") -> Detection:
        """The Detection for one confirmed hit, attribution groups filled in."""
        groups = match.groupdict()
        pci, gpu = _pci(groups.get("pci")), groups.get("gpu") or None
        if rule.lookback and not (pci or gpu):
            pci, gpu = _look_back(list(recent)[-rule.lookback:])
        xid = _int(groups.get("xid"))
        action, severity, category = rule.action, rule.severity, rule.category
        if rule.action_by_xid and xid is not None:
            event = kmsg.parse_xid(line)
            kind, message = (event["kind"], event["message"]) if event else ("xid", line)
            action = xid_action(xid, message, kind)
            # the driver's own Xid line names the program's faults; a daemon's
            # re-print keeps its rule's reading (the device plugin reports only
            # the XIDs it judges critical, and withdraws the GPU for them)
            if event is not None:
                category = xid_category(xid, action, kind, rule.category)
            severity = _SEVERITY_BY_ACTION[action]
            pci = pci or (event or {}).get("pci")
        host, rank = groups.get("host") or None, _int(groups.get("rank"))
        if host and names_no_node(host):
            host = None   # a loopback or redacted peer names no node (the rule still names a peer)
        if "host" not in rule.compiled.groupindex or rank is None:
            origin = line_origin(line)   # the node (and rank) the line's prefixes name
            if "host" not in rule.compiled.groupindex:
                host = origin.host
            rank = origin.rank if rank is None else rank
        evidence = (Evidence(line[:EVIDENCE_MAX], source, lineno),) + more
        return Detection(rule=rule.id, category=category, severity=severity,
                         action_hint=action, evidence=evidence, host=host,
                         rank=rank, pci=pci, gpu=gpu, xid=xid,
                         detail=detail or rule.description, role=rule.role,
                         emitter=rule.emitter, peer="host" in rule.compiled.groupindex)


class ScanStream:
    """Incremental scanning of one source; keeps traceback/summary state,
    the line count (``lineno``: the last line consumed) and a partial last line."""

    def __init__(self, scanner: Scanner, source: str = "", origin: str = "") -> None:
        self.scanner = scanner
        self.source = source
        self.origin = origin
        self.lineno = 0
        self.recent: deque[str] = deque(maxlen=max(scanner.lookback, 1))
        self._tb: _Traceback | None = None
        self._summary: _Summary | None = None
        self._tail = b""
        self._skip = False     # inside an over-long line whose head is held

    def feed(self, line: str, lineno: int | None = None) -> list[Detection]:
        """Scan one more line (numbered ``lineno``, else one past the last)."""
        if lineno is not None:
            self.lineno = lineno - 1
        line = line.rstrip("\r\n").replace("\n", " ")
        return self.scan_block(line.encode("utf-8", "surrogatepass"))

    def feed_bytes(self, chunk: bytes) -> list[Detection]:
        """Scan the complete lines of a raw chunk; an unfinished last line is kept."""
        limit = self.scanner.max_line
        if self._skip:
            newline = chunk.find(b"\n")
            if newline < 0:
                return []
            chunk, self._skip = chunk[newline:], False
        data = self._tail + chunk if self._tail else chunk
        cut = data.rfind(b"\n")
        self._tail = data[cut + 1:]
        if len(self._tail) > limit:
            self._tail, self._skip = self._tail[:limit], True
        if cut <= 0:
            return self.scan_block(b"") if cut == 0 else []
        return self.scan_block(data, cut)

    def flush(self) -> list[Detection]:
        """End of input: the held partial line, then a pending summary; a
        traceback still open (no exception line before the end) is read by
        the rules its header line matches (python.traceback_unfinished)."""
        out = self.scan_block(self._tail) if self._tail else []
        self._tail, self._skip = b"", False
        if self._summary:
            out.extend(self._stamped(self._summary.finish(self)))
        if self._tb is not None and not self._tb.ignored:
            out.extend(self._stamped(self._unfinished(self._tb.header)))
        self._summary = self._tb = None
        return out

    def _unfinished(self, header: Evidence) -> list[Detection]:
        hits = self.scanner.hits(header.text, range(len(self.scanner.line_rules)))
        return [self.scanner.detection(rule, match, header.text, header.line, self.source)
                for rule, match in hits]

    def _stamped(self, found: list[Detection]) -> list[Detection]:
        if not self.origin or not found:
            return found
        return [replace(d, origin=self.origin) for d in found]

    def scan_block(self, data: bytes, end: int | None = None) -> list[Detection]:
        """Scan complete lines joined by LF, ``data[:end]`` (all of it by
        default, no copy made), numbered from ``lineno + 1``. Lines longer
        than ``max_line`` are matched on their first ``max_line`` bytes: the
        engines and the regexes see the same heads."""
        limit, out = self.scanner.max_line, []
        end = len(data) if end is None else end
        if data.find(b"\r", 0, end) >= 0:
            data = data[:end].replace(b"\r\n", b"\n")
            end = len(data)
        wanted, count = self.scanner.engine.candidates(data, 0, end, limit)
        rules = {index: found for index, _, found in wanted}
        base, k, index, pos = self.lineno, 0, 0, 0
        while pos <= end:
            if self._tb is None and self._summary is None:
                if k == len(wanted):
                    break
                index, pos, _ = wanted[k]
            while k < len(wanted) and wanted[k][0] <= index:
                k += 1
            stop = data.find(b"\n", pos, end)
            stop = end if stop < 0 else stop
            recent = _Recent(data, pos, self.recent, self.scanner.lookback, limit)
            out.extend(self._step(_decode(data[pos:min(stop, pos + limit)], limit),
                                  base + index + 1, rules.get(index), recent))
            index, pos = index + 1, stop + 1
        self.lineno = base + count
        self._remember_tail(data, end)
        return self._stamped(out)

    def _remember_tail(self, data: bytes, end: int) -> None:
        """Keep the block's last lines decoded, for lookback into the next block."""
        lines, limit = [], self.scanner.max_line
        while len(lines) < self.scanner.lookback and end >= 0:
            start = data.rfind(b"\n", 0, end) + 1
            lines.insert(0, _decode(data[start:min(end, start + limit)], limit))
            end = start - 1
        self.recent.extend(lines)

    def _step(self, line: str, lineno: int, candidates, recent) -> list[Detection]:
        out: list[Detection] = []
        if self._summary is not None:
            state = self._summary.add(self, line, lineno, candidates)
            if state == "more":
                return out
            out, self._summary = self._summary.finish(self), None
            if state == "done":
                return out
        if self._tb is not None:
            kind, body = _traceback_kind(line, self._tb.lead)
            if kind == "frame":
                self._tb.frames += 1
                if self._tb.frames > TB_MAX_LINES:
                    self._tb = None
                return out
            if kind == "exception":
                return out + self._end_traceback(line, body, lineno, candidates, recent)
            self._tb.other += 1
            if self._tb.other > TB_MAX_OTHER:
                self._tb = None
        elif candidates and TRACEBACK in candidates and TRACEBACK_LITERAL in line:
            self._tb = _Traceback(Evidence(line[:EVIDENCE_MAX], self.source, lineno),
                                  ignored_before(recent), lead_of(line))
            return out
        return out + [self.scanner.detection(rule, match, line, lineno, self.source, recent)
                      for rule, match in self.scanner.hits(line, candidates)]

    def _end_traceback(self, line: str, body: str, lineno: int, candidates,
                       recent) -> list[Detection]:
        header, ignored, self._tb = self._tb.header, self._tb.ignored, None
        hits = self.scanner.hits(line, candidates)
        hit = hits[0] if hits else self.scanner.traceback_hit(body)
        if hit is None:
            return []
        name = body.split(":", 1)[0].strip()
        detection = self.scanner.detection(hit[0], hit[1], line, lineno, self.source, recent,
                                           (header,), f"traceback ending {name}")
        if ignored:     # the unraisable hook's report: Python printed it and went on
            return [replace(detection, severity="info", action_hint="none",
                            detail=f"{detection.detail} [an exception Python ignored (in a "
                                   "destructor or at exit): the program went on]")]
        if name.endswith("ChildFailedError"):
            self._summary = _Summary(detection)
            return []
        return [detection]


class _Recent:
    """The decoded lines before the one at ``pos`` (lookback), found only when asked."""

    __slots__ = ("data", "pos", "before", "count", "limit")

    def __init__(self, data: bytes, pos: int, before: deque, count: int, limit: int) -> None:
        self.data, self.pos, self.before, self.count, self.limit = data, pos, before, count, limit

    def __iter__(self) -> Iterator[str]:
        lines: list[str] = []
        end = self.pos - 1
        while end >= 0 and len(lines) < self.count:
            start = self.data.rfind(b"\n", 0, end) + 1
            lines.insert(0, _decode(self.data[start:min(end, start + self.limit)], self.limit))
            end = start - 1
        missing = self.count - len(lines)
        head = list(self.before)[-missing:] if missing and end < 0 else []
        return iter(head + lines)


def _blocks(lines: Iterable[str], size: int) -> Iterator[list[str]]:
    block: list[str] = []
    for line in lines:
        block.append(line)
        if len(block) >= size:
            yield block
            block = []
    if block:
        yield block


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _pci(value: str | None) -> str | None:
    if not value:
        return None
    match = _PCI.search(value)
    if match:
        return kmsg.normalize_pci(*match.groups())
    if _BUS_DEVICE.fullmatch(value):   # lspci leaves domain 0000 out
        return kmsg.normalize_pci("0", *value.split(":"))
    return value.lower()


def _look_back(lines: Sequence[str]) -> tuple[str | None, str | None]:
    for line in reversed(lines):
        match = _PCI.search(line)
        if match:
            return kmsg.normalize_pci(*match.groups()), None
        match = _GPU_UUID.search(line)
        if match:
            return None, match.group()
    return None, None
