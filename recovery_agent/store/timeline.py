"""The store's timeline: a job's events and the detections with their
evidence (:class:`TimelineQueries`, mixed into the store)."""
from __future__ import annotations

import json
import time
from typing import Any, Iterable, Iterator

from sqlite_utils import Database


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)



class TimelineQueries:
    """Mixed into :class:`~recovery_agent.store.Store`."""

    db: Database

    # -- the timeline ------------------------------------------------------
    def add_event(self, job_pk: int | None, kind: str, message: str, attempt: int | None = None,
                  source: str = "", data: Any = None, ts: float | None = None,
                  detection: int | None = None) -> int:
        """One event on a job's timeline; ``detection``: the row id of the
        detection a ``detected`` event announces (its evidence is that row's)."""
        return self.db["events"].insert({
            "job": job_pk, "attempt": attempt, "ts": ts or time.time(), "kind": kind,
            "source": source, "message": message, "data": _dumps(data) if data else None,
            "detection": detection,
        }).last_pk

    def note_invalid_spec(self, job_pk: int, raw: str, problem: str, attempt: int | None,
                          source: str) -> bool:
        """Put a job's invalid recovery spec on its timeline, once per job (every
        hook report and the poll see the same spec); True when written now."""
        if self.db["events"].count_where("job = ? and kind = 'spec_invalid'", [job_pk]):
            return False
        self.add_event(job_pk, "spec_invalid", f"invalid recovery spec {raw[:80]!r}: "
                       f"{problem}; monitoring only", attempt=attempt, source=source)
        return True

    def note_unknown_env(self, job_pk: int, env: str, known: Iterable[str], mode: str,
                         source: str = "agent") -> bool:
        """Put on a job's timeline, once per job, that its directive names an
        environment the config lacks (a typo such as ``dmeo``), and what its
        decisions use instead; True when written now."""
        if self.db["events"].count_where("job = ? and kind = 'env_unknown'", [job_pk]):
            return False
        self.add_event(job_pk, "env_unknown",
                       f"environment {env[:64]!r} is not configured (known: "
                       f"{', '.join(sorted(known))}); decisions use [environments.default], "
                       f"mode {mode}", source=source)
        return True

    def timeline(self, job_pk: int) -> Iterator[dict]:
        for row in self.db["events"].rows_where("job = ?", [job_pk], order_by="ts, id"):
            row["data"] = json.loads(row["data"]) if row["data"] else None
            yield row

    # -- detections ----------------------------------------------------------
    def record_detection(self, job_pk: int | None, attempt: int | None, detection,
                         ts: float | None = None) -> int:
        """Store one :class:`~recovery_agent.detect.model.Detection` with its evidence."""
        evidence = [{"text": e.text, "source": e.source, "line": e.line, "time": e.time}
                    for e in detection.evidence]
        return self.db["detections"].insert({
            "job": job_pk, "attempt": attempt, "ts": ts or time.time(),
            "category": detection.category, "pattern_id": detection.rule,
            "severity": detection.severity, "node": detection.host,
            "gpu": detection.gpu, "rank": detection.rank,
            "source": evidence[0]["source"] if evidence else "",
            "evidence": _dumps({"lines": evidence, "detail": detection.detail,
                                "action_hint": detection.action_hint, "pci": detection.pci,
                                "xid": detection.xid}),
        }).last_pk

    def detections(self, job_pk: int) -> list[dict]:
        rows = list(self.db["detections"].rows_where("job = ?", [job_pk], order_by="ts, id"))
        for row in rows:
            row["evidence"] = json.loads(row["evidence"] or "{}")
        return rows
