"""Getting a report to the agent, or to disk until the agent is back.

``send`` POSTs one body with a short timeout and a munge credential bound to the
body. What the agent does not take goes to a node-local spool as one file per
report, written atomically; every later hook run replays the spool oldest first
before sending its own report. A spool file that cannot be parsed is moved to
``corrupt/``; one the agent rejects as malformed is moved to ``rejected/``.
Nothing is deleted unless the agent has stored it.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
import urllib.parse
from pathlib import Path

from . import munge

log = logging.getLogger("slurm_hooks")
SENT, DUPLICATE, REJECTED, FAILED = "sent", "duplicate", "rejected", "failed"
REPLAY_MAX_FILES = 50
REPLAY_MAX_SECONDS = 2.0


class Deliverer:
    def __init__(self, agent_url: str, timeout: float, spool_dir: str | Path,
                 munge_socket: str = "", sign: bool = True) -> None:
        parts = urllib.parse.urlsplit(agent_url)
        self.https = parts.scheme == "https"
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if self.https else 80)
        self.base = parts.path.rstrip("/")
        self.timeout = timeout
        self.spool_dir = Path(spool_dir)
        self.munge_socket = munge_socket
        self.sign = sign

    # -- one POST ----------------------------------------------------------
    def send(self, hook: str, body: bytes) -> str:
        """POST ``body`` to /v1/hooks/<hook>; SENT, DUPLICATE, REJECTED (the
        agent says the body is bad) or FAILED (try again later)."""
        headers = {"Content-Type": "application/json"}
        if self.sign:
            try:
                headers["Authorization"] = "Munge " + munge.sign_body(body, self.munge_socket)
            except munge.MungeError as exc:
                log.warning("cannot sign report: %s", exc)
                return FAILED
        try:
            status, answer = self._post(f"{self.base}/v1/hooks/{hook}", body, headers)
        except OSError as exc:
            log.info("agent unreachable (%s): spooling", exc)
            return FAILED
        if status in (200, 201):
            return DUPLICATE if status == 200 else SENT
        if status in (400, 404, 413):
            log.error("agent rejected %s report (%s): %s", hook, status, answer[:300])
            return REJECTED
        log.warning("agent answered %s: %s", status, answer[:300])
        return FAILED

    def _post(self, path: str, body: bytes, headers: dict) -> tuple[int, str]:
        """(status, start of the answer). Plain HTTP is spoken over a bare socket:
        http.client drags in the email and ssl packages, a third of a hook's
        start-up; HTTPS uses http.client."""
        if self.https:
            import http.client
            conn = http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout)
            try:
                conn.request("POST", path, body=body, headers=headers)
                resp = conn.getresponse()
                return resp.status, resp.read(4096).decode(errors="replace")
            except http.client.HTTPException as exc:
                raise OSError(f"bad HTTP answer: {exc}") from None
            finally:
                conn.close()
        head = [f"POST {path} HTTP/1.1", f"Host: {self.host}:{self.port}",
                f"Content-Length: {len(body)}", "Connection: close"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        request = ("\r\n".join(head) + "\r\n\r\n").encode() + body
        deadline = time.monotonic() + self.timeout
        with socket.create_connection((self.host, self.port), timeout=self.timeout) as sock:
            sock.sendall(request)
            data = b""
            while len(data) < 8192:  # the agent closes the connection after answering
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                chunk = sock.recv(8192)
                if not chunk:
                    break
                data += chunk
        status_line = data.split(b"\r\n", 1)[0].decode(errors="replace")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
            raise OSError(f"not an HTTP answer: {status_line[:80]!r}")
        return int(parts[1]), data.partition(b"\r\n\r\n")[2].decode(errors="replace")

    # -- the spool ---------------------------------------------------------
    def spool(self, hook: str, report_id: str, body: bytes) -> Path | None:
        """Write the report to the spool atomically; None (and a log line) when
        even that fails, e.g. on a full disk."""
        name = f"{time.time_ns():020d}-{hook}-{report_id}.json"
        try:
            self.spool_dir.mkdir(parents=True, exist_ok=True)
            tmp = self.spool_dir / f".{name}.tmp"
            with open(tmp, "wb") as fh:
                fh.write(body)
                fh.flush()
                os.fsync(fh.fileno())
            final = self.spool_dir / name
            os.replace(tmp, final)
            return final
        except OSError as exc:
            what = "spool disk is full" if exc.errno == errno.ENOSPC else exc.strerror
            log.error("report %s LOST for now: cannot spool to %s: %s", report_id,
                      self.spool_dir, what)
            try:
                tmp.unlink()
            except (OSError, UnboundLocalError):
                pass
            return None

    def pending(self) -> list[Path]:
        try:
            return sorted(p for p in self.spool_dir.glob("*.json") if p.is_file())
        except OSError:
            return []

    def _set_aside(self, path: Path, folder: str, why: str) -> None:
        target = self.spool_dir / folder
        try:
            target.mkdir(exist_ok=True)
            os.replace(path, target / path.name)
            log.error("spool file %s moved to %s/: %s", path.name, folder, why)
        except OSError as exc:
            log.error("spool file %s is %s and cannot be moved aside: %s", path.name, why, exc)

    def replay(self) -> tuple[int, bool]:
        """Send spooled reports, oldest first, within a small budget. Returns
        (how many left the spool, whether the agent took everything tried)."""
        files = self.pending()
        if not files:
            return 0, True
        try:
            lock = open(self.spool_dir / ".replay.lock", "w")
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return 0, True  # another hook on this node is replaying
        done, started = 0, time.monotonic()
        try:
            for path in files[:REPLAY_MAX_FILES]:
                if time.monotonic() - started > REPLAY_MAX_SECONDS:
                    break
                outcome = self._replay_one(path)
                if outcome == FAILED:
                    return done, False
                done += 1
            return done, True
        finally:
            lock.close()

    def _replay_one(self, path: Path) -> str:
        try:
            body = path.read_bytes()
            hook = json.loads(body)["hook"]
            if not isinstance(hook, str):
                raise ValueError("hook is not a string")
        except FileNotFoundError:
            return SENT  # another replayer took it
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self._set_aside(path, "corrupt", f"unreadable ({exc})")
            return REJECTED
        outcome = self.send(hook, body)
        if outcome in (SENT, DUPLICATE):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        elif outcome == REJECTED:
            self._set_aside(path, "rejected", "the agent refused it as malformed")
        return outcome

    # -- both ----------------------------------------------------------------
    def deliver(self, hook: str, report_id: str, body: bytes) -> str:
        """Replay the spool, then send this report (or spool it)."""
        _replayed, agent_ok = self.replay()
        outcome = self.send(hook, body) if agent_ok else FAILED
        if outcome == FAILED:
            return "spooled" if self.spool(hook, report_id, body) else "lost"
        if outcome == REJECTED:
            path = self.spool(hook, report_id, body)
            if path is not None:
                self._set_aside(path, "rejected", "the agent refused it as malformed")
        return outcome
