"""Site attribution providers: a site's own service may overrule our verdict.

Some sites already know more than the logs say (a hardware ticket queue, a
fabric manager, a burn-in database). An attribution provider receives the
evidence bundle of an ended attempt, with our own verdict, and answers with
its verdict: who is to blame (``hardware``, ``system_software`` or
``application``) and which of the job's nodes. Two kinds:

* an HTTP webhook (``[attribution] webhook_url``): a JSON POST of the bundle,
  answered with a JSON verdict, within ``webhook_timeout``;
* a Python entry point in the ``slurm_recovery.attribution`` group
  (``[attribution] entry_point``): a callable taking the bundle (a dict) and
  returning the same dict shape, or None to keep ours.

Whatever happens (timeout, refused connection, an answer that is not a
verdict, nodes that are not the job's), the built-in verdict is used. The
outcome is recorded with the verdict, so the audit trail says whose verdict
acted. No I/O happens unless a provider is configured.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from importlib.metadata import entry_points
from typing import Any, Callable, Sequence

import requests

from ..detect.model import Detection, Verdict

log = logging.getLogger(__name__)
GROUP = "slurm_recovery.attribution"

# what a provider's "blame" means for us: (blame, category, action)
BLAMES = {
    "hardware": ("node", "gpu_hardware", "requeue_exclude"),
    "system_software": ("node", "system_software", "requeue_exclude"),
    "application": ("application", "application", "stop"),
}


@dataclass(frozen=True)
class Consulted:
    """The verdict to act on and what the provider did (for the audit row)."""

    verdict: Verdict
    provider: str           # "webhook <url>", "entry point <name>"
    outcome: str            # "used", "agreed", "kept ours: <why>"


def bundle(job_id: str, attempt: int, nodes: Sequence[str], state: str | None,
           detections: Sequence[Detection], ours: Verdict) -> dict:
    """The evidence bundle a provider receives (JSON-ready)."""
    return {
        "job_id": job_id, "attempt": attempt, "nodes": list(nodes), "state": state,
        "detections": [{"rule": d.rule, "category": d.category, "severity": d.severity,
                        "host": d.host, "gpu": d.gpu, "xid": d.xid, "rank": d.rank,
                        "evidence": [{"text": e.text[:2000], "source": e.source,
                                      "line": e.line, "time": e.time}
                                     for e in d.evidence[:5]]}
                       for d in detections[:200]],
        "builtin_verdict": {"blame": ours.blame, "category": ours.category,
                            "action": ours.action, "nodes": list(ours.nodes),
                            "confidence": ours.confidence, "reason": ours.reason},
    }


def to_verdict(answer: Any, nodes: Sequence[str], ours: Verdict) -> Verdict:
    """A provider's answer as a Verdict; ValueError when it is not one."""
    if answer is None:
        raise ValueError("no verdict")
    if not isinstance(answer, dict):
        raise ValueError("the answer is not a JSON object")
    blame = answer.get("blame")
    if blame not in BLAMES:
        raise ValueError(f"blame must be one of {', '.join(BLAMES)}, got {blame!r}")
    named = answer.get("nodes", [])
    if not isinstance(named, list) or not all(isinstance(n, str) for n in named):
        raise ValueError("nodes must be a list of node names")
    strangers = sorted(set(named) - set(nodes))
    if strangers:
        raise ValueError(f"nodes not in the job: {', '.join(strangers)}")
    ours_blame, category, action = BLAMES[blame]
    if ours_blame == "node" and not named:
        raise ValueError(f"blame {blame} needs the nodes to blame")
    reason = answer.get("reason")
    reason = reason if isinstance(reason, str) else ""
    return Verdict(blame=ours_blame, category=category, action=action,
                   confidence=1.0, nodes=tuple(named) if ours_blame == "node" else (),
                   reason=f"site provider: {reason}".strip()[:500],
                   extra={"provider": True})


class Provider:
    """One configured provider; :meth:`consult` never raises."""

    def __init__(self, name: str, call: Callable[[dict], Any]) -> None:
        self.name, self.call = name, call

    def consult(self, job_id: str, attempt: int, nodes: Sequence[str], state: str | None,
                detections: Sequence[Detection], ours: Verdict) -> Consulted:
        if ours.blame == "unknown" and ours.action == "none":
            return Consulted(ours, self.name, "not asked: no failure")
        try:
            answer = self.call(bundle(job_id, attempt, nodes, state, detections, ours))
            theirs = to_verdict(answer, nodes, ours)
        except Exception as exc:  # noqa: BLE001 - a site's code or service may fail any way
            why = f"kept ours: {type(exc).__name__}: {exc}"[:300]
            log.warning("job=%s attempt=%s attribution %s: %s", job_id, attempt, self.name,
                        why)
            return Consulted(ours, self.name, why)
        if (theirs.blame, theirs.category, set(theirs.nodes)) == \
                (ours.blame, ours.category, set(ours.nodes)):
            return Consulted(ours, self.name, "agreed")
        log.info("job=%s attempt=%s attribution %s overrules: %s -> %s %s", job_id, attempt,
                 self.name, ours.category, theirs.category, ",".join(theirs.nodes))
        return Consulted(replace(theirs, rests_on=ours.rests_on), self.name, "used")


def webhook(url: str, timeout: float, token: str = "") -> Provider:
    def call(body: dict) -> Any:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        resp = requests.post(url, json=body, timeout=timeout, headers=headers)
        resp.raise_for_status()
        return resp.json()
    return Provider(f"webhook {url}", call)


def from_entry_point(name: str) -> Provider:
    """The provider registered under ``name`` in the entry point group; a
    missing one is a ValueError at start, not a surprise at the first failure."""
    found = [ep for ep in entry_points(group=GROUP) if ep.name == name]
    if not found:
        raise ValueError(f"no {GROUP} entry point named {name!r} is installed")
    return Provider(f"entry point {name}", found[0].load())


def from_config(cfg) -> Provider | None:
    """The provider ``[attribution]`` configures, or None."""
    att = cfg.attribution
    if att.entry_point:
        return from_entry_point(att.entry_point)
    if att.webhook_url:
        token = ""
        if att.webhook_token_file:
            with open(att.webhook_token_file) as fh:
                token = fh.read().strip()
        return webhook(att.webhook_url, att.webhook_timeout, token)
    return None
