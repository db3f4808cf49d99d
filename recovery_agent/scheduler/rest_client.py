"""The HTTP side of the REST backend: one request to slurmrestd, checked.

Every answer is held to the same rules before a backend sees it: a JSON
object (never HTML, never a truncated body), from the OpenAPI version that was
asked for, without entries in its ``errors`` list. Anything else is a
:class:`~recovery_agent.errors.SchedulerError` whose ``argv`` is the call
(``["GET", "/slurm/v0.0.38/jobs/"]``), whose ``returncode`` is the HTTP status
(``None`` when no answer came) and whose ``stderr`` is what slurmrestd said.

Reads are retried, a bounded number of times with a short backoff, on
connection errors and on 5xx answers that carry no Slurm error. A change is
retried only when the connection could not even be opened: an answer that
was lost after slurmctld received the request may have done its work, and a
second requeue is not harmless.

Authentication is ``auth/jwt`` (a token file, or a token ``scontrol token``
issues through the argv seam, renewed before it expires and once after a
401) or ``rest_auth/local`` (a unix socket: slurmrestd takes the caller's
uid from the socket, and no token is sent).
"""
from __future__ import annotations

import getpass
import http.client
import json
import logging
import os
import re
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping
from urllib.parse import quote, urlencode, urlsplit

from ..config.schema import REST_VERSIONS
from ..errors import ConfigError, SchedulerError
from .runner import SlurmRunner

log = logging.getLogger(__name__)

SUPPORTED_VERSIONS = REST_VERSIONS   # newest first
SPEC_PATHS = ("/openapi/v3", "/openapi")
MAX_BODY = 512 * 1024 * 1024        # a 100,000-job listing is a few hundred MB at most
_VERSION_PATH = re.compile(r"^/slurm/(v\d+\.\d+\.\d+)/")
_BACKOFF = 0.5


@dataclass(frozen=True)
class RestSettings:
    """How to reach slurmrestd (the ``rest_*`` keys of ``[scheduler]``)."""

    url: str = ""                 # http(s)://host:port[/prefix] or unix:/path/to.sock
    auth: str = "jwt"             # "jwt" or "local"
    token_file: str = ""          # jwt: a file holding the token (or SLURM_JWT=...)
    user: str = ""                # X-SLURM-USER-NAME; empty: the agent's own user
    token_lifespan: int = 3600    # jwt without a file: lifespan asked of `scontrol token`
    version: str = ""             # pin an OpenAPI version; empty: the newest offered
    ca_file: str = ""             # https: CA bundle to trust (empty: the system's)
    timeout: float = 30.0
    retries: int = 2              # extra attempts of a read after a 5xx/connection error
    fallback: str = "cli"         # what the server's version lacks: "cli" or "none"

    @classmethod
    def from_config(cls, scheduler_cfg) -> "RestSettings":
        return cls(url=scheduler_cfg.rest_url, auth=scheduler_cfg.rest_auth,
                   token_file=scheduler_cfg.rest_token_file, user=scheduler_cfg.rest_user,
                   token_lifespan=int(scheduler_cfg.rest_token_lifespan),
                   version=scheduler_cfg.rest_version, ca_file=scheduler_cfg.rest_ca_file,
                   timeout=scheduler_cfg.command_timeout, retries=scheduler_cfg.rest_retries,
                   fallback=scheduler_cfg.rest_fallback)


class _UnixConnection(http.client.HTTPConnection):
    """HTTP over a unix socket (slurmrestd's ``unix:/path`` listener)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class _NotConnected(Exception):
    """The connection could not be opened: the request never left."""


def _token_text(raw: str) -> str:
    """The token in a token file or in ``scontrol token``'s output
    (``SLURM_JWT=eyJ...``), without the name and the newline."""
    for line in raw.splitlines():
        line = line.strip()
        if line.startswith("SLURM_JWT="):
            return line[len("SLURM_JWT="):]
        if line and not line.startswith("#"):
            return line
    return ""


class TokenSource:
    """The JWT for each request: read from ``token_file`` (again whenever the
    file changes, so a cron job can rotate it), else issued by ``scontrol
    token`` through the runner and renewed at half its lifespan."""

    def __init__(self, settings: RestSettings, runner: SlurmRunner,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.runner = runner
        self.clock = clock
        self._token = ""
        self._stamp: float | tuple = 0.0
        self._lock = threading.Lock()

    def token(self, renew: bool = False) -> str:
        with self._lock:
            if self.settings.token_file:
                return self._from_file()
            if renew or not self._token or \
                    self.clock() - float(self._stamp) > self.settings.token_lifespan / 2:
                self._token = self._issue()
                self._stamp = self.clock()
            return self._token

    def _from_file(self) -> str:
        path = self.settings.token_file
        try:
            info = os.stat(path)
            stamp = (info.st_mtime_ns, info.st_size, info.st_ino)
            if stamp != self._stamp:
                with open(path, encoding="utf-8", errors="replace") as fh:
                    self._token = _token_text(fh.read(65536))
                self._stamp = stamp
        except OSError as exc:
            raise SchedulerError(f"slurmrestd token file {path}: {exc.strerror or exc}",
                                 argv=["read", path]) from None
        if not self._token:
            raise SchedulerError(f"slurmrestd token file {path} holds no token",
                                 argv=["read", path])
        return self._token

    def _issue(self) -> str:
        argv = ["scontrol", "token", f"lifespan={self.settings.token_lifespan}"]
        if self.settings.user:
            argv.insert(2, f"username={self.settings.user}")
        token = _token_text(self.runner.run(argv, timeout=15).stdout)
        if not token:
            raise SchedulerError("scontrol token printed no token (is AuthAltTypes=auth/jwt "
                                 "set in slurm.conf?)", argv=argv)
        return token


class RestClient:
    """Requests to one slurmrestd, each checked (see the module's docstring)."""

    def __init__(self, settings: RestSettings, runner: SlurmRunner | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not settings.url:
            raise ConfigError("scheduler.rest_url: not set (http://host:6820 or "
                              "unix:/run/slurmrestd/slurmrestd.socket)")
        self.settings = settings
        self.runner = runner or SlurmRunner()
        self.sleep = sleep
        self.tokens = TokenSource(settings, self.runner)
        self.user = settings.user or getpass.getuser()
        self.calls = 0
        if settings.url.startswith("unix:"):
            self._scheme, self._where, self._prefix = "unix", settings.url[len("unix:"):], ""
        else:
            parts = urlsplit(settings.url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigError(f"scheduler.rest_url: {settings.url!r} is neither "
                                  f"http(s)://host[:port] nor unix:/path")
            self._scheme = parts.scheme
            self._where = (parts.hostname, parts.port or (443 if parts.scheme == "https"
                                                          else 80))
            self._prefix = parts.path.rstrip("/")
        if settings.auth not in ("jwt", "local"):
            raise ConfigError(f"scheduler.rest_auth: must be jwt or local, "
                              f"got {settings.auth!r}")

    # -- one request -----------------------------------------------------------
    def _connection(self) -> http.client.HTTPConnection:
        timeout = self.settings.timeout
        if self._scheme == "unix":
            return _UnixConnection(self._where, timeout)
        host, port = self._where
        if self._scheme == "https":
            context = ssl.create_default_context(cafile=self.settings.ca_file or None)
            return http.client.HTTPSConnection(host, port, timeout=timeout, context=context)
        return http.client.HTTPConnection(host, port, timeout=timeout)

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self.settings.auth == "jwt":
            headers["X-SLURM-USER-NAME"] = self.user
            headers["X-SLURM-USER-TOKEN"] = self.tokens.token()
        elif self.settings.user:
            headers["X-SLURM-USER-NAME"] = self.settings.user
        return headers

    def _exchange(self, method: str, target: str,
                  body: bytes | None) -> tuple[int, str, bytes]:
        conn = self._connection()
        headers = self._headers()
        if body is not None:
            headers["Content-Type"] = "application/json"
        self.calls += 1
        try:
            try:
                conn.connect()
            except OSError as exc:
                raise _NotConnected(str(exc)) from None
            conn.request(method, target, body=body, headers=headers)
            resp = conn.getresponse()
            length = resp.getheader("Content-Length")
            if length is not None and length.isdigit() and int(length) > MAX_BODY:
                raise http.client.HTTPException(f"body of {length} bytes is too large")
            data = resp.read(MAX_BODY + 1)
            if len(data) > MAX_BODY:
                raise http.client.HTTPException("body is too large")
            if length is not None and length.isdigit() and len(data) < int(length):
                raise http.client.IncompleteRead(data, int(length) - len(data))
            return resp.status, resp.getheader("Content-Type") or "", data
        finally:
            conn.close()

    def request(self, method: str, path: str, *, query: Mapping[str, Any] | None = None,
                body: Mapping[str, Any] | None = None, changes: bool = False,
                version: str = "",
                benign: Callable[[Mapping[str, Any]], bool] | None = None) -> dict:
        """``method path`` as a checked JSON document. ``changes`` marks a call
        that alters Slurm state (retried only when it never left); ``version``
        is the OpenAPI version the answer must come from; ``benign`` picks the
        entries of ``errors`` known to be false reports of that version."""
        target = self._prefix + path + (f"?{urlencode(query)}" if query else "")
        call = [method, path + (f"?{urlencode(query)}" if query else "")]
        data = json.dumps(body).encode() if body is not None else None
        attempts = 1 + max(0, self.settings.retries)
        renewable = self.settings.auth == "jwt" and not self.settings.token_file
        last: SchedulerError | None = None
        attempt = 0
        while attempt < attempts:
            if attempt:
                self.sleep(_BACKOFF * attempt)
            attempt += 1
            try:
                status, ctype, raw = self._exchange(method, target, data)
            except _NotConnected as exc:
                last = SchedulerError(f"slurmrestd {' '.join(call)}: cannot connect to "
                                      f"{self.settings.url}: {exc}", argv=call, stderr=str(exc))
                continue
            except (OSError, http.client.HTTPException) as exc:
                last = SchedulerError(f"slurmrestd {' '.join(call)}: {_describe(exc)}",
                                      argv=call, stderr=str(exc))
                if changes:
                    raise last from None
                continue
            if status == 401 and renewable:
                # a token from scontrol may have expired: one fresh one, once
                renewable = False
                self.tokens.token(renew=True)
                attempt -= 1
                continue
            try:
                return self._checked(call, status, ctype, raw, version, benign)
            except _Retryable as exc:
                last = exc.error
                if changes and status != 503:
                    raise last from None
        assert last is not None
        raise last

    def _checked(self, call: list[str], status: int, ctype: str, raw: bytes,
                 version: str, benign=None) -> dict:
        where = f"slurmrestd {' '.join(call)}: HTTP {status}"
        text = raw.decode("utf-8", errors="replace")
        # 511: 24.11's slurmrestd when slurmctld refuses the token (error 1007,
        # "Protocol authentication error"); 22.05 said 500, later ones 401
        if status in (401, 403, 511):
            raise SchedulerError(f"{where} (not authenticated as {self.user!r}: check the "
                                 f"token and AuthAltTypes=auth/jwt)", argv=call,
                                 returncode=status, stderr=text[:300])
        doc = _json_object(text, ctype)
        # 404 is no such endpoint, unless Slurm says why in the body: 26.05
        # answers a requeue of an unknown job with 404 and "Invalid job id
        # specified" (seen live), which is the job's error, not the endpoint's
        if status == 404 and not (doc is not None and slurm_errors(doc)):
            raise SchedulerError(f"{where} (no such endpoint: not an OpenAPI version this "
                                 f"slurmrestd serves?)", argv=call, returncode=status,
                                 stderr=text[:300])
        if doc is None:
            kind = "an HTML page" if text.lstrip()[:1] == "<" else (
                "an empty body" if not text.strip() else "a body that is not a JSON object "
                "(truncated?)")
            error = SchedulerError(f"{where}: {kind} instead of JSON", argv=call,
                                   returncode=status, stderr=text[:300])
            if status >= 500:
                raise _Retryable(error)
            raise error
        if benign is not None and isinstance(doc.get("errors"), list):
            doc["errors"] = [e for e in doc["errors"] if not (isinstance(e, Mapping)
                                                            and benign(e))]
        said = slurm_errors(doc)
        if said:
            raise SchedulerError(f"{where}: {said[0]}", argv=call, returncode=status,
                                 stderr="\n".join(said))
        if status >= 500:
            raise _Retryable(SchedulerError(f"{where}", argv=call, returncode=status,
                                            stderr=text[:300]))
        if not 200 <= status < 300:
            raise SchedulerError(where, argv=call, returncode=status, stderr=text[:300])
        if version:
            answered = answered_version(doc)
            if answered and answered != version:
                raise SchedulerError(f"{where}: answered in OpenAPI {answered}, asked for "
                                     f"{version}", argv=call, returncode=status)
        return doc

    # -- the OpenAPI version ---------------------------------------------------
    def offered_versions(self) -> tuple[list[str], dict]:
        """The OpenAPI versions this slurmrestd serves, newest first, and its
        paths (from its own OpenAPI document)."""
        last: SchedulerError | None = None
        for path in SPEC_PATHS:
            try:
                spec = self.request("GET", path)
            except SchedulerError as exc:
                last = exc
                if exc.returncode == 404:
                    continue
                raise
            paths = spec.get("paths")
            if not isinstance(paths, Mapping):
                raise SchedulerError(f"slurmrestd GET {path}: no 'paths' in its OpenAPI "
                                     f"document", argv=["GET", path])
            found = {m.group(1) for p in paths for m in [_VERSION_PATH.match(p)] if m}
            return sorted(found, key=_version_key, reverse=True), dict(paths)
        assert last is not None
        raise last

    def choose_version(self) -> tuple[str, dict]:
        """The version to speak (the pinned one, else the newest both sides
        know) and the server's paths; SchedulerError when there is none."""
        offered, paths = self.offered_versions()
        wanted = [self.settings.version] if self.settings.version else list(SUPPORTED_VERSIONS)
        for version in wanted:
            if version in offered and version in SUPPORTED_VERSIONS:
                return version, paths
        raise SchedulerError(
            f"slurmrestd {self.settings.url} offers OpenAPI "
            f"{', '.join(offered) or 'no slurmctld versions'}; this backend speaks "
            f"{', '.join(wanted)}", argv=["GET", SPEC_PATHS[0]])


class _Retryable(Exception):
    def __init__(self, error: SchedulerError) -> None:
        super().__init__(str(error))
        self.error = error


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.lstrip("v").split("."))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, http.client.IncompleteRead):
        return (f"truncated body ({len(exc.partial)} bytes, "
                f"{exc.expected} more were announced)")
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timed out"
    return f"{type(exc).__name__}: {exc}"


def _json_object(text: str, ctype: str) -> dict | None:
    if "html" in ctype.lower():
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def slurm_errors(doc: Mapping[str, Any]) -> list[str]:
    """The entries of an answer's ``errors`` list, as text. 22.05 names the
    number ``errno`` or ``error_number`` depending on the endpoint."""
    errors = doc.get("errors")
    if not errors:
        return []
    said = []
    for err in errors if isinstance(errors, list) else [errors]:
        if isinstance(err, Mapping):
            number = err.get("error_number", err.get("errno"))
            parts = [str(err[k]) for k in ("source", "error", "description") if err.get(k)]
            text = ": ".join(parts) or json.dumps(dict(err))[:200]
            said.append(f"{text} (error {number})" if number not in (None, 0) else text)
        else:
            said.append(str(err))
    return said


def answered_version(doc: Mapping[str, Any]) -> str:
    """The OpenAPI version an answer says it came from: ``openapi/v0.0.38``
    (22.05) or ``data_parser/v0.0.42`` (23.11+); empty when it does not say."""
    plugin = (doc.get("meta") or {}).get("plugin") if isinstance(doc.get("meta"), Mapping) \
        else None
    if not isinstance(plugin, Mapping):
        return ""
    for key in ("data_parser", "type"):
        value = str(plugin.get(key) or "")
        match = re.search(r"(v\d+\.\d+\.\d+)$", value)
        if match:
            return match.group(1)
    return ""


def job_path(version: str, job_id: str, tail: str = "") -> str:
    return f"/slurm/{version}/job/{quote(str(job_id), safe='')}{tail}"


def node_path(version: str, name: str) -> str:
    return f"/slurm/{version}/node/{quote(name, safe='')}"
