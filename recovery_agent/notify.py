"""Telling people that recovery stopped: the job's ``notify=mail`` or
``notify=URL``, and an environment's ``notify`` list, which may also name
``slack:URL``.

Mail goes through the local MTA (``sendmail -t``) to the job's user; a URL gets
a JSON POST; a Slack-compatible incoming webhook (Slack, Mattermost, Rocket.Chat)
gets ``{"text": ...}``. All are bounded by a timeout and never raise: a
notification that cannot be sent is recorded as such, and the recovery goes on.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass

TIMEOUT = 5.0
SENDMAIL_PATHS = ("/usr/sbin/sendmail", "/usr/lib/sendmail")


@dataclass(frozen=True)
class Sent:
    ok: bool
    detail: str


def message(rec: dict) -> dict:
    return {"recommendation": rec["id"], "job": rec["job_id"], "attempt": rec["attempt"],
            "action": rec["action"], "rule": rec["rule"], "reason": rec["reason"],
            "user": rec.get("user") or "", "workload": rec.get("workload") or ""}


def targets(job_notify: str | None, env_notify: str) -> list[str]:
    """Every place to notify, the job's own first, each once."""
    out = []
    for target in [job_notify or "", *env_notify.split(",")]:
        target = target.strip()
        if target and target != "none" and target not in out:
            out.append(target)
    return out


def text(body: dict) -> str:
    return (f"slurm-recovery stopped retrying job {body['job']} (attempt {body['attempt']}): "
            f"{body['reason']} [rule {body['rule']}, recommendation #{body['recommendation']}]")


def notify(target: str, rec: dict) -> Sent:
    body = message(rec)
    if target.startswith("slack:"):
        import requests
        url = target[len("slack:"):]
        try:
            resp = requests.post(url, json={"text": text(body)}, timeout=TIMEOUT)
        except requests.RequestException as exc:
            return Sent(False, f"slack {url}: {exc.__class__.__name__}")
        return Sent(resp.ok, f"slack {url}: HTTP {resp.status_code}")
    if target.startswith(("http://", "https://")):
        import requests
        try:
            resp = requests.post(target, json=body, timeout=TIMEOUT)
        except requests.RequestException as exc:
            return Sent(False, f"POST {target}: {exc.__class__.__name__}")
        return Sent(resp.ok, f"POST {target}: HTTP {resp.status_code}")
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
