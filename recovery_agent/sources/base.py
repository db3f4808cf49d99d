"""What every external source shares: errors, credentials, one HTTP client with
timeouts and bounded retries, a health tracker that turns a dead source into
one log line and a counter, cursors that survive restarts, and the small
query-language helpers (quoting, RE2 escaping, the pattern prefilter).

Nothing here knows Prometheus, Loki or VictoriaLogs; their modules build on it.
"""
from __future__ import annotations

import calendar
import email.utils
import hashlib
import json
import logging
import os
import re
import tempfile
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import requests

from ..detect.engines import TRACEBACK_LITERAL, required_literals
from ..errors import ConfigError, RecoveryError

log = logging.getLogger(__name__)

AUTH_KINDS = ("none", "bearer", "basic")
MAX_BODY = 64 << 20          # bytes one response may hold before we give up on it
POST_OVER = 3000             # encoded parameters longer than this go in a POST body
RETRY_STATUSES = frozenset({500, 502, 503, 504})
BACKOFF = 0.5                # first wait between retries; doubled each time
MAX_DOWN_DELAY = 300.0       # longest pause before a dead source is tried again


# -- errors ---------------------------------------------------------------------------

class SourceError(RecoveryError):
    """A source could not answer usefully. ``kind`` names the failure for counters."""

    kind = "error"


class SourceUnavailable(SourceError):
    """Connection refused, DNS failure, or 5xx answers after the retries."""

    kind = "unavailable"


class SourceTimeout(SourceError):
    """The source did not answer within the timeout."""

    kind = "timeout"


class SourceRateLimited(SourceError):
    """429 answers after the retries, or a Retry-After longer than we wait."""

    kind = "rate_limited"


class SourceAuthError(SourceError):
    """401/403: the credentials are missing, wrong or not allowed to read."""

    kind = "auth"


class SourceResponseError(SourceError):
    """An answer we cannot use: not JSON, the wrong shape, an error status, cut off."""

    kind = "malformed"


class LabelSchemaError(SourceError):
    """The data lacks the labels (fields) the configuration expects."""

    kind = "labels"


# -- credentials ----------------------------------------------------------------------

@dataclass(frozen=True)
class Credentials:
    """How to authenticate, loaded from a file. The secret never shows in repr()."""

    kind: str = "none"
    secret: str = field(default="", repr=False)
    username: str = ""
    path: str = ""

    def __repr__(self) -> str:
        shown = "<redacted>" if self.secret else "<none>"
        return (f"Credentials(kind={self.kind!r}, username={self.username!r}, "
                f"secret={shown}, path={self.path!r})")

    __str__ = __repr__

    @classmethod
    def load(cls, kind: str, path: str, key: str = "credentials_file") -> "Credentials":
        """Read a bearer token (the whole file) or ``user:password`` (basic) from
        ``path``. Errors name the key and the path, never the content."""
        if kind not in AUTH_KINDS:
            raise ConfigError(f"{key}: auth must be one of {', '.join(AUTH_KINDS)}, "
                              f"got {kind!r}")
        if kind == "none":
            return cls()
        if not path:
            raise ConfigError(f"{key}: auth = {kind} needs a credentials file")
        try:
            text = Path(path).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"{key}: cannot read {path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{key}: {path} is not UTF-8 text") from None
        if not text:
            raise ConfigError(f"{key}: {path} is empty")
        if kind == "bearer":
            if any(c.isspace() for c in text):
                raise ConfigError(f"{key}: {path} must hold one token without spaces")
            return cls(kind, text, "", path)
        user, sep, password = text.partition(":")
        if not sep or not user or "\n" in text:
            raise ConfigError(f"{key}: {path} must hold one line user:password")
        return cls(kind, password, user, path)


class _Auth(requests.auth.AuthBase):
    """Adds the Authorization header per request, so it never sits in a
    session's headers where a debug dump would show it."""

    def __init__(self, creds: Credentials) -> None:
        self._creds = creds

    def __call__(self, r):
        if self._creds.kind == "bearer":
            r.headers["Authorization"] = f"Bearer {self._creds.secret}"
        elif self._creds.kind == "basic":
            requests.auth.HTTPBasicAuth(self._creds.username, self._creds.secret)(r)
        return r

    def __repr__(self) -> str:
        return f"_Auth({self._creds.kind})"


def redact_url(url: str) -> str:
    """``url`` without user info, query or fragment: safe for logs and messages."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))


# -- the HTTP client ------------------------------------------------------------------

@dataclass(frozen=True)
class Endpoint:
    """Where a source lives and how to talk to it (repr shows no secret)."""

    url: str
    credentials: Credentials = Credentials()
    timeout: float = 10.0
    retries: int = 2
    max_retry_wait: float = 30.0
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """``host:port`` of the URL, for evidence sources and log lines."""
        parts = urllib.parse.urlsplit(self.url)
        return f"{parts.hostname}:{parts.port}" if parts.port else str(parts.hostname)


class HttpClient:
    """GET (or POST, for long parameters) with a timeout and bounded retries.

    Retried: refused connections, 5xx, and 429 (after the Retry-After it names,
    when that is no longer than ``max_retry_wait``). Not retried: timeouts (a
    slow server stays slow, and the watch loop must not stall), 4xx. Every
    failure is a :class:`SourceError` whose message names the URL path.
    """

    def __init__(self, endpoint: Endpoint, *, sleep: Callable[[float], None] = time.sleep,
                 session: requests.Session | None = None) -> None:
        self.endpoint = endpoint
        self.sleep = sleep
        self.session = session or requests.Session()
        self._auth = _Auth(endpoint.credentials)
        self.base = endpoint.url.rstrip("/")

    def __repr__(self) -> str:
        return f"HttpClient({redact_url(self.endpoint.url)!r})"

    def get_json(self, path: str, params: Mapping[str, Any] | Sequence[tuple[str, Any]]
                 ) -> Any:
        """The decoded JSON body; SourceResponseError when it is not JSON."""
        body = self.fetch(path, params)
        try:
            return json.loads(body)
        except ValueError as exc:
            raise SourceResponseError(f"{path}: the answer is not JSON ({exc}): "
                                      f"{_snippet(body)}") from None

    def fetch(self, path: str, params: Mapping[str, Any] | Sequence[tuple[str, Any]]) -> bytes:
        """The raw body of a 200 answer, after the retries the endpoint allows."""
        items = list(params.items()) if isinstance(params, Mapping) else list(params)
        encoded = urllib.parse.urlencode(items)
        method = "POST" if len(encoded) > POST_OVER else "GET"
        error: SourceError | None = None
        for attempt in range(self.endpoint.retries + 1):
            wait = BACKOFF * (2 ** attempt)
            try:
                return self._once(method, path, items)
            except _Retry as retry:
                error = retry.error
                wait = retry.wait if retry.wait is not None else wait
            if attempt < self.endpoint.retries:
                log.debug("%s%s: %s; retrying in %.1fs", self.endpoint.label, path, error, wait)
                self.sleep(wait)
        assert error is not None
        raise error

    def _once(self, method: str, path: str, items: list[tuple[str, Any]]) -> bytes:
        url = self.base + path
        kw: dict[str, Any] = {"params": items} if method == "GET" else {"data": items}
        where = redact_url(url)
        try:
            with self.session.request(method, url, headers=dict(self.endpoint.headers),
                                      auth=self._auth, timeout=self.endpoint.timeout,
                                      stream=True, allow_redirects=False, **kw) as resp:
                status = resp.status_code
                deadline = time.monotonic() + 2 * self.endpoint.timeout
                body = (_read(resp, where, deadline, self.endpoint.timeout) if status == 200
                        else resp.raw.read(2048, decode_content=True))
                retry_after = resp.headers.get("Retry-After")
        except requests.Timeout:
            raise SourceTimeout(f"{where}: no answer within {self.endpoint.timeout:g}s") from None
        except requests.ConnectionError as exc:
            raise _Retry(SourceUnavailable(f"{where}: cannot connect: {_reason(exc)}")) from None
        except requests.RequestException as exc:
            raise SourceUnavailable(f"{where}: {_reason(exc)}") from None
        if status == 200:
            return body
        return self._failed(status, body, retry_after, where)

    def _failed(self, status: int, body: bytes, retry_after: str | None, where: str) -> bytes:
        text = _snippet(body)
        if status == 429:
            wait = parse_retry_after(retry_after)
            if wait is not None and wait > self.endpoint.max_retry_wait:
                raise SourceRateLimited(f"{where}: rate limited (429); the server asks to "
                                        f"wait {wait:g}s, more than the "
                                        f"{self.endpoint.max_retry_wait:g}s we wait")
            raise _Retry(SourceRateLimited(f"{where}: rate limited (429): {text}"), wait)
        if status in RETRY_STATUSES:
            raise _Retry(SourceUnavailable(f"{where}: HTTP {status}: {text}"))
        if status in (401, 403):
            raise SourceAuthError(f"{where}: HTTP {status}: check the source's auth and "
                                  f"credentials file")
        raise SourceResponseError(f"{where}: HTTP {status}: {text}")


class _Retry(Exception):
    def __init__(self, error: SourceError, wait: float | None = None) -> None:
        self.error, self.wait = error, wait


def _read(resp: requests.Response, where: str, deadline: float, timeout: float) -> bytes:
    """The whole body, within a total deadline (a server dribbling bytes would
    otherwise never trip the per-read timeout) and a size cap."""
    chunks, size = [], 0
    try:
        for chunk in resp.iter_content(1 << 16):
            size += len(chunk)
            if size > MAX_BODY:
                raise SourceResponseError(f"{where}: answer larger than {MAX_BODY >> 20} MiB; "
                                          f"narrow the query")
            if time.monotonic() > deadline:
                raise SourceTimeout(f"{where}: answer not complete within {2 * timeout:g}s")
            chunks.append(chunk)
    except requests.exceptions.ChunkedEncodingError:
        raise SourceResponseError(f"{where}: the answer was cut off (truncated)") from None
    except requests.exceptions.ConnectionError as exc:
        if "timed out" in str(exc).lower():
            raise SourceTimeout(f"{where}: no answer within {timeout:g}s") from None
        raise SourceResponseError(f"{where}: the answer was cut off: {_reason(exc)}") from None
    return b"".join(chunks)


def _reason(exc: Exception) -> str:
    """The innermost useful words of a requests exception (no URL repeats)."""
    inner: BaseException = exc
    while inner.__cause__ is not None or inner.__context__ is not None:
        inner = inner.__cause__ or inner.__context__  # type: ignore[assignment]
    text = str(inner) or type(inner).__name__
    match = re.search(r"\[Errno -?\d+\] ([^')]+)", text)
    return match.group(1) if match else text[:200]


def _snippet(body: bytes | str, size: int = 200) -> str:
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    text = " ".join(text.split())
    return text[:size] + ("..." if len(text) > size else "") if text else "(empty body)"


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header: delta seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


# -- health: one log line per outage, counters for export ------------------------------

class Health:
    """Whether a source works, and when a failing one is next tried.

    A failure logs one warning; repeats stay at debug level until the source
    answers again (one info line). A failing source is skipped for a while,
    doubling from ``base_delay`` up to five minutes, so a blackholed server
    cannot stall every cycle. ``errors_total`` and ``errors_by_kind`` are for a
    metrics exporter.
    """

    def __init__(self, name: str, base_delay: float = 30.0,
                 logger: logging.Logger | None = None) -> None:
        self.name = name
        self.base_delay = max(base_delay, 1.0)
        self.log = logger or log
        self.errors_total = 0
        self.errors_by_kind: Counter[str] = Counter()
        self.consecutive = 0
        self.last_error = ""
        self.down_since: float | None = None
        self.retry_at = 0.0
        self.last_ok: float | None = None

    @property
    def up(self) -> bool:
        return self.down_since is None

    def allow(self, now: float) -> bool:
        """True when the source may be queried now (up, or its pause is over)."""
        return now >= self.retry_at

    def ok(self, now: float) -> None:
        if self.down_since is not None:
            self.log.info("source %s: answering again after %d failed queries (down %.0fs)",
                          self.name, self.consecutive, now - self.down_since)
        self.down_since, self.consecutive, self.retry_at = None, 0, 0.0
        self.last_ok = now

    def failed(self, error: Exception, now: float) -> None:
        kind = getattr(error, "kind", "error")
        self.errors_total += 1
        self.errors_by_kind[kind] += 1
        self.consecutive += 1
        self.last_error = str(error)
        delay = min(self.base_delay * 2 ** (self.consecutive - 1), MAX_DOWN_DELAY)
        self.retry_at = now + delay
        if self.down_since is None:
            self.down_since = now
            self.log.warning("source %s: %s; carrying on without it (next try in %.0fs, "
                             "further failures logged at debug level)", self.name, error, delay)
        else:
            self.log.debug("source %s: still failing (%d): %s", self.name, self.consecutive,
                           error)

    def skipped_reason(self) -> str:
        return f"skipped: failing since the last {self.consecutive} queries ({self.last_error})"


# -- cursors --------------------------------------------------------------------------

CURSOR_VERSION = 1


class CursorStore:
    """Small JSON state per source, keyed by job, saved atomically.

    ``directory`` None keeps it in memory only. A corrupt or foreign file is
    logged and replaced, never fatal: the worst case is reading a window twice.
    """

    def __init__(self, directory: str | Path | None, name: str) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ValueError(f"cursor name {name!r}")
        self.path = Path(directory) / f"{name}.json" if directory else None
        self.data: dict[str, dict] = {}
        self.dirty = False
        self._load()

    def _load(self) -> None:
        if self.path is None or not self.path.exists():
            return
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
            if raw.get("version") != CURSOR_VERSION or not isinstance(raw.get("cursors"), dict):
                raise ValueError("unknown layout")
            self.data = {str(k): v for k, v in raw["cursors"].items() if isinstance(v, dict)}
        except (OSError, ValueError, AttributeError) as exc:
            log.warning("cursor file %s unreadable (%s); starting afresh", self.path, exc)
            self.data = {}

    def get(self, key: str) -> dict | None:
        return self.data.get(key)

    def put(self, key: str, value: dict) -> None:
        if self.data.get(key) != value:
            self.data[key] = value
            self.dirty = True

    def forget(self, key: str) -> None:
        if self.data.pop(key, None) is not None:
            self.dirty = True

    def keys(self) -> list[str]:
        return list(self.data)

    def save(self) -> None:
        """Write the file if anything changed: temp file, fsync, rename."""
        if self.path is None or not self.dirty:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"version": CURSOR_VERSION, "cursors": self.data},
                          sort_keys=True, separators=(",", ":"))
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.dirty = False


# -- what log sources return ----------------------------------------------------------

@dataclass(frozen=True)
class LogLine:
    """One log line from a store: what the scanner needs, and where it was seen.

    ``stream`` identifies the log stream (labels): feed each stream to its own
    scanner stream so multi-line tracebacks are not mixed across nodes.
    """

    source: str
    text: str
    time: float
    host: str | None = None
    stream: str = ""
    ns: int = 0
    feed: str = ""      # "job": the job's own output (user-written); "nodes": node logs


@dataclass
class PollResult:
    """Lines from one poll of one source for one job, and how it went.

    ``more``: the page budget ran out; the cursor sits after the last line
    delivered, so the next poll goes on from there. ``truncated``: lines were
    skipped (more than a page at a single instant). ``error`` is set, and
    ``lines`` may be partial, when the source failed; the cursor then stays
    after the last complete page.
    """

    source: str
    job_id: str
    lines: list[LogLine] = field(default_factory=list)
    error: str | None = None
    error_kind: str | None = None
    warnings: list[str] = field(default_factory=list)
    more: bool = False
    truncated: bool = False
    pages: int = 0


def line_digest(*parts: str) -> str:
    """A short stable digest of a line and its stream, for de-duplication."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()


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


# -- what every log source does per poll ------------------------------------------------

@dataclass
class FeedRead:
    """What reading one feed (one query) from its cursor gave."""

    lines: list[LogLine]
    cursor: dict
    pages: int = 0
    more: bool = False
    truncated: bool = False
    warnings: list[str] = field(default_factory=list)


def page_forward(fetch: Callable[[int, int, int], list], cursor: dict, end_ns: int,
                 limit: int, max_pages: int) -> tuple[list, FeedRead]:
    """Read forward from ``cursor`` to ``end_ns`` a page at a time.

    ``fetch(start, end, limit)`` returns the oldest ``limit`` entries (objects
    with ``ns`` and ``digest``) in [start, end), sorted by time. The next page
    starts at the last timestamp seen (inclusive), and the entries at that
    boundary already delivered are dropped by digest. A full page all at one
    instant, all delivered, is stepped past (``truncated``). The cursor is
    ``{"ns": start, "seen": [digests at start]}``.
    """
    start = int(cursor["ns"])
    seen = set(cursor.get("seen", ()))
    out: list = []
    read = FeedRead([], {})
    complete = False
    while read.pages < max_pages and start < end_ns:
        entries = fetch(start, end_ns, limit)
        read.pages += 1
        fresh = [e for e in entries if not (e.ns == start and e.digest in seen)]
        out.extend(fresh)
        if len(entries) < limit:
            start, seen, complete = end_ns, set(), True
            break
        last = entries[-1].ns
        at_last = {e.digest for e in entries if e.ns == last}
        if last != start:
            start, seen = last, at_last
        elif fresh:
            seen |= at_last
        else:
            read.truncated = True
            start, seen = last + 1, set()
    read.more = not complete and start < end_ns
    read.cursor = {"ns": start, "seen": sorted(seen)}
    return out, read


class LogSource:
    """Polling a log store per job: one or two feeds (the job's own streams,
    its nodes' streams), each with a cursor, behind a health tracker.

    Subclasses say what the feeds are (:meth:`feeds`) and how one feed is paged
    (:meth:`read_feed`). :meth:`poll` never raises.
    """

    kind = "logs"

    def __init__(self, endpoint: Endpoint, *, page_limit: int = 1000, max_pages: int = 20,
                 interval: float = 30.0, delay: float = 30.0,
                 cursors: CursorStore | None = None, name: str | None = None,
                 http: HttpClient | None = None) -> None:
        self.name = name or self.kind
        self.endpoint = endpoint
        self.page_limit = max(1, page_limit)
        self.max_pages = max(1, max_pages)
        self.interval = interval
        self.delay = delay
        self.http = http or HttpClient(endpoint)
        self.cursors = cursors or CursorStore(None, self.name)
        self.health = Health(self.name, base_delay=interval)
        self.source = f"{self.kind}:{endpoint.label}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.endpoint.label!r})"

    def feeds(self, job_id: str, nodes: Sequence[str]) -> list[tuple[str, Any]]:
        raise NotImplementedError

    def read_feed(self, query: Any, cursor: dict, end_ns: int) -> FeedRead:
        raise NotImplementedError

    def poll(self, job_id: str, nodes: Sequence[str], since: float,
             now: float | None = None) -> PollResult:
        """New candidate lines of a job (its streams and its nodes') since the
        last poll, oldest first. The first poll starts at ``since``. Lines
        younger than ``delay`` wait for the next poll (stores ingest late).
        Call :meth:`save` once the lines are consumed."""
        now = time.time() if now is None else now
        result = PollResult(self.name, job_id)
        if not self.health.allow(now):
            result.error, result.error_kind = self.health.skipped_reason(), "skipped"
            return result
        end_ns = to_ns(now - self.delay)
        failed = False
        for feed, query in self.feeds(job_id, nodes):
            key = f"{job_id}/{feed}"
            cursor = self.cursors.get(key) or {"ns": to_ns(since)}
            if cursor.get("ns", 0) >= end_ns:
                continue
            try:
                read = self.read_feed(query, cursor, end_ns)
            except SourceError as exc:
                self._failed(result, exc, now)
                failed = True
                break
            except Exception as exc:    # a bug must not end the watch loop
                log.exception("source %s: job=%s poll failed", self.name, job_id)
                self._failed(result, exc, now)
                failed = True
                break
            self.cursors.put(key, read.cursor)
            result.lines.extend(replace(line, feed=feed) for line in read.lines)
            result.pages += read.pages
            result.more |= read.more
            result.truncated |= read.truncated
            result.warnings.extend(read.warnings)
        if not failed:
            self.health.ok(now)
        result.lines.sort(key=lambda line: (line.ns, line.stream))
        if result.truncated:
            log.warning("source %s: job=%s more than %d lines at one instant; some skipped",
                        self.name, job_id, self.page_limit)
        return result

    def _failed(self, result: PollResult, exc: Exception, now: float) -> None:
        self.health.failed(exc, now)
        result.error = str(exc) if isinstance(exc, SourceError) else f"internal error: {exc!r}"
        result.error_kind = getattr(exc, "kind", "internal")

    def forget(self, job_id: str) -> None:
        """The job ended: drop its cursors."""
        for key in self.cursors.keys():
            if key.startswith(f"{job_id}/"):
                self.cursors.forget(key)

    def save(self) -> None:
        self.cursors.save()


@dataclass
class Probe:
    """What a source showed when asked about recent data (for the check).

    ``jobs_seen`` None: the source cannot tell jobs apart (metrics); the check
    then judges jobs by their nodes.
    """

    newest: float | None = None
    count: int = 0
    nodes_seen: set[str] = field(default_factory=set)
    jobs_seen: set[str] | None = None
    labels_missing: list[str] = field(default_factory=list)
    labels_present: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
