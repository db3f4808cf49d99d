"""Talking to a source over HTTP: credentials loaded from files (never shown),
one client with timeouts and bounded retries, and a health tracker that turns
a dead source into one log line and a counter.
"""
from __future__ import annotations

import email.utils
import json
import logging
import re
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import requests

from ...errors import ConfigError
from .base import (SourceAuthError, SourceError, SourceRateLimited, SourceResponseError,
                   SourceTimeout, SourceUnavailable)

log = logging.getLogger(__name__)

AUTH_KINDS = ("none", "bearer", "basic")
MAX_BODY = 64 << 20          # bytes one response may hold before we give up on it
POST_OVER = 3000             # encoded parameters longer than this go in a POST body
RETRY_STATUSES = frozenset({500, 502, 503, 504})
BACKOFF = 0.5                # first wait between retries; doubled each time
MAX_DOWN_DELAY = 300.0       # longest pause before a dead source is tried again


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
