"""Getting a report to the agent, or to disk until the agent is back.

``send`` POSTs one body with a short timeout and a munge credential bound to the
body. What the agent does not take goes to a node-local spool as one file per
report, written atomically; every later hook run replays the spool (epilog
reports first, each kind oldest first) before sending its own report. A spool
file that cannot be parsed is moved to ``corrupt/``; one the agent rejects as
malformed is moved to ``rejected/``. Nothing is deleted unless the agent has
stored it.

Whatever lies in the spool is sent with this host's munge credential, so the
spool is used only while this uid owns it and nobody else may write to it, and
only files this uid owns are replayed (others go to ``untrusted/``): a user who
could plant a file there could otherwise forge node evidence against any node.

A replayed report is flagged as late: at replay time its body gains a
``delivery`` object (when it was spooled, how many POSTs it has had, which run
replays it), so the agent can tell evidence that waited on a node from evidence
that was never there. The munge credential is made when the body is sent, so
it covers that object too. A spool file's name carries the time it was spooled
and the POSTs tried so far: ``<ns>-<hook>-<report id>.t<tries>.json``.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import socket
import stat
import time
import urllib.parse
from pathlib import Path

from . import munge

log = logging.getLogger("slurm_hooks")
SENT, DUPLICATE, REJECTED, FAILED = "sent", "duplicate", "rejected", "failed"
REPLAY_MAX_FILES = 50
REPLAY_MAX_SECONDS = 2.0
# <spooled at, ns>-<hook>-<report id>[.t<POSTs tried>].json (no .t: an older hook's file)
_SPOOL_NAME = re.compile(r"^(\d{1,20})-[a-z]+-[^.]+(?:\.t(\d{1,6}))?\.json$")


def spool_facts(name: str) -> tuple[float | None, int | None]:
    """(when it was spooled, POSTs tried so far) from a spool file's name;
    None for what the name does not say."""
    match = _SPOOL_NAME.match(name)
    if not match:
        return None, None
    tries = int(match.group(2)) if match.group(2) is not None else None
    return int(match.group(1)) / 1e9, tries


def untrusted(spool: Path) -> str:
    """Why ``spool`` must not be used ('' when it may): it must be a directory
    of this uid that nobody else may write (or not exist yet)."""
    try:
        st = os.lstat(spool)
    except FileNotFoundError:
        return ""      # made by Deliverer.spool(), 0755
    except OSError as exc:
        return f"not checkable ({exc.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not {os.geteuid()}"
    if st.st_mode & 0o022:
        return f"writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return ""


def open_lock(path: Path) -> int:
    """A lock file's descriptor: created if need be, never truncated, never
    through a link."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)


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
    def spool(self, hook: str, report_id: str, body: bytes, tries: int = 1) -> Path | None:
        """Write the report to the spool atomically (``tries``: the POSTs it has
        had); None (and a log line) when even that fails, e.g. on a full disk."""
        name = f"{time.time_ns():020d}-{hook}-{report_id}.t{tries}.json"
        if not self.trusted():
            log.error("report %s LOST for now: will not spool to %s", report_id,
                      self.spool_dir)
            return None
        try:
            self.spool_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
            tmp = self.spool_dir / f".{name}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as fh:
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

    def trusted(self) -> bool:
        """Whether the spool directory may be used; logged when not."""
        why = untrusted(self.spool_dir)
        if why:
            log.error("spool %s is %s: it is neither replayed nor written", self.spool_dir,
                      why)
        return not why

    def pending(self) -> list[Path]:
        """Spooled reports in replay order: epilog reports first (a verdict may
        be waiting for their XIDs), then the others, each oldest first. A node
        whose spool filled with health reports while the agent was away still
        gets a failed job's evidence through in the first replay."""
        try:
            files = sorted(p for p in self.spool_dir.glob("*.json") if p.is_file())
        except OSError:
            return []
        return sorted(files, key=lambda p: "-epilog-" not in p.name)   # stable

    def _set_aside(self, path: Path, folder: str, why: str) -> None:
        target = self.spool_dir / folder
        try:
            target.mkdir(exist_ok=True)
            os.replace(path, target / path.name)
            log.error("spool file %s moved to %s/: %s", path.name, folder, why)
        except OSError as exc:
            log.error("spool file %s is %s and cannot be moved aside: %s", path.name, why, exc)

    def replay(self, by: str = "") -> tuple[int, bool]:
        """Send spooled reports in :meth:`pending` order within a small budget;
        ``by`` names the run that replays them (a hook, or the replayer). Returns
        (how many left the spool, whether the agent took everything tried)."""
        files = self.pending()
        if not files or not self.trusted():
            return 0, True
        try:
            lock = os.fdopen(open_lock(self.spool_dir / ".replay.lock"), "w")
        except OSError:
            return 0, True  # no lock to be had: the next run replays
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            return 0, True  # another hook on this node is replaying
        done, started = 0, time.monotonic()
        try:
            for path in files[:REPLAY_MAX_FILES]:
                if time.monotonic() - started > REPLAY_MAX_SECONDS:
                    break
                outcome = self._replay_one(path, by)
                if outcome == FAILED:
                    return done, False
                done += 1
            return done, True
        finally:
            lock.close()

    def _read_own(self, path: Path) -> bytes | None:
        """The file's bytes when it is a regular file of this uid that nobody
        else may write; None (and the file set aside) otherwise."""
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() \
                    and not st.st_mode & 0o022:
                with os.fdopen(fd, "rb") as fh:
                    fd = -1
                    return fh.read()
        finally:
            if fd >= 0:
                os.close(fd)
        self._set_aside(path, "untrusted", f"not a file of uid {os.geteuid()} that only it "
                        "may write (never sent)")
        return None

    def _replay_one(self, path: Path, by: str = "") -> str:
        try:
            data = self._read_own(path)
            if data is None:
                return REJECTED
            report = json.loads(data)
            hook = report["hook"]
            if not isinstance(hook, str):
                raise ValueError("hook is not a string")
        except FileNotFoundError:
            return SENT  # another replayer took it
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self._set_aside(path, "corrupt", f"unreadable ({exc})")
            return REJECTED
        spooled_at, tries = spool_facts(path.name)
        tries = (tries if tries is not None else 1) + 1
        report["delivery"] = {"spooled_at": spooled_at, "tries": tries, "by": by or "hook"}
        outcome = self.send(hook, json.dumps(report, separators=(",", ":")).encode())
        if outcome in (SENT, DUPLICATE):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        elif outcome == REJECTED:
            self._set_aside(path, "rejected", "the agent refused it as malformed")
        else:
            self._count_try(path, tries)
        return outcome

    def _count_try(self, path: Path, tries: int) -> None:
        """Note in the file's name that one more POST failed (a rename: no
        room needed); left as it is when even that fails."""
        stem = re.sub(r"\.t\d+$", "", path.name[:-len(".json")])
        try:
            os.replace(path, path.with_name(f"{stem}.t{tries}.json"))
        except OSError:
            pass

    # -- both ----------------------------------------------------------------
    def deliver(self, hook: str, report_id: str, body: bytes,
                pauses: tuple[float, ...] = ()) -> str:
        """Replay the spool, then send this report; after each pause of
        ``pauses`` try both again while the agent does not take it; then
        spool it."""
        outcome, tries = FAILED, 0
        for pause in (0.0, *pauses):
            if pause:
                time.sleep(pause)
            _replayed, agent_ok = self.replay(by=hook)
            if not agent_ok:
                continue   # the agent did not take an older report: nor this one now
            outcome = self.send(hook, body)
            tries += 1
            if outcome != FAILED:
                break
        if outcome == FAILED:
            return "spooled" if self.spool(hook, report_id, body, tries) else "lost"
        if outcome == REJECTED:
            path = self.spool(hook, report_id, body, tries)
            if path is not None:
                self._set_aside(path, "rejected", "the agent refused it as malformed")
        return outcome
