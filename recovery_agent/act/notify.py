"""Telling people that recovery stopped: the job's ``notify=mail`` or
``notify=URL``, and an environment's ``notify`` list, which may also name
``slack:URL``.

Mail goes through the local MTA (``sendmail -t``) to the job's user; a URL gets
a JSON POST; a Slack-compatible incoming webhook (Slack, Mattermost, Rocket.Chat)
gets ``{"text": ...}``. All are bounded by a timeout and never raise: a
notification that cannot be sent is recorded as such, and the recovery goes on.
A URL the job itself gave goes only to a host its environment's
``notify_allow`` lists (:func:`allowed`); redirects are never followed.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..store.records import Recommendation

import requests

TIMEOUT = 5.0
SENDMAIL_PATHS = ("/usr/sbin/sendmail", "/usr/lib/sendmail")


@dataclass(frozen=True)
class Sent:
    ok: bool
    detail: str


def message(rec: Recommendation) -> dict:
    return {"recommendation": rec.id, "job": rec.job_id, "attempt": rec.attempt,
            "action": rec.action, "rule": rec.rule, "reason": rec.reason,
            "user": rec.user or "", "workload": rec.workload or ""}


def targets(job_notify: str | None, env_notify: str) -> list[str]:
    """Every place to notify, the job's own first, each once."""
    out = []
    for target in [job_notify or "", *env_notify.split(",")]:
        target = target.strip()
        if target and target != "none" and target not in out:
            out.append(target)
    return out


_DEFAULT_PORTS = {"http": 80, "https": 443}


def allowed(target: str, allow: str) -> str:
    """Why a user-given notify target may not be used ("" when it may). The agent
    posts as root from its own host: a URL is used only when its host is one an
    admin listed in the environment's ``notify_allow`` (``host``, ``host:port``,
    ``*.domain``; a bare entry allows the scheme's default port only). A URL
    whose host could be read two ways (user info, backslashes, spaces or
    control characters, a numeric or bracketed host against a name) is refused."""
    if target == "mail":
        return ""
    url = target[len("slack:"):] if target.startswith("slack:") else target
    if any(c in url for c in "\\@ ") or any(ord(c) < 0x20 or ord(c) == 0x7F for c in url):
        return f"{_short(url)}: refused (user info, backslashes or spaces in the URL)"
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port or _DEFAULT_PORTS.get(parts.scheme)
    except ValueError:
        return f"{_short(url)}: not a URL"
    host = (parts.hostname or "").lower().rstrip(".")
    if parts.scheme not in _DEFAULT_PORTS or not host:
        return f"{_short(url)}: only http(s) URLs with a host"
    for entry in filter(None, (e.strip().lower() for e in allow.split(","))):
        name, _, want = entry.partition(":")
        if want and int(want) != port or not want and port != _DEFAULT_PORTS[parts.scheme]:
            continue
        if host == name or name.startswith("*.") and host.endswith(name[1:]):
            return ""
    return (f"{_short(url)}: host {host} (port {port}) is not in this environment's "
            "notify_allow")


def _short(url: str) -> str:
    return url if len(url) <= 80 else url[:77] + "..."


def text(body: dict) -> str:
    return (f"slurm-recovery stopped retrying job {body['job']} (attempt {body['attempt']}): "
            f"{body['reason']} [rule {body['rule']}, recommendation #{body['recommendation']}]")


def notify(target: str, rec: Recommendation) -> Sent:
    body = message(rec)
    if target.startswith("slack:"):
        url = target[len("slack:"):]
        try:
            resp = requests.post(url, json={"text": text(body)}, timeout=TIMEOUT,
                                 allow_redirects=False)
        except requests.RequestException as exc:
            return Sent(False, f"slack {url}: {exc.__class__.__name__}")
        return Sent(200 <= resp.status_code < 300, f"slack {url}: HTTP {resp.status_code}")
    if target.startswith(("http://", "https://")):
        try:
            # a redirect could lead anywhere, past notify_allow: never followed
            resp = requests.post(target, json=body, timeout=TIMEOUT, allow_redirects=False)
        except requests.RequestException as exc:
            return Sent(False, f"POST {target}: {exc.__class__.__name__}")
        # a redirect is not a delivery (and is not followed)
        return Sent(200 <= resp.status_code < 300, f"POST {target}: HTTP {resp.status_code}")
    if target == "mail":
        return _mail(body)
    return Sent(False, f"unknown notify target {target!r}")


def _mail(body: dict) -> Sent:
    sendmail = next((p for p in SENDMAIL_PATHS if shutil.which(p)), None)
    if not body["user"]:
        return Sent(False, "mail: the job's user is unknown")
    if sendmail is None:
        return Sent(False, "mail: no sendmail on this host")
    text = (f"To: {body['user']}\nSubject: slurm-recovery stopped retrying job {body['job']}"
            f"\n\nslurm-recovery will not restart job {body['job']} again.\n"
            f"Reason: {body['reason']}\n\n{json.dumps(body, indent=1)}\n")
    try:
        proc = subprocess.run([sendmail, "-t"], input=text, text=True, capture_output=True,
                              timeout=TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Sent(False, f"mail: {exc}")
    return Sent(proc.returncode == 0, f"mail to {body['user']}: exit {proc.returncode}")
