"""The store's figures for ``GET /metrics`` (read at scrape time)."""
from __future__ import annotations

import threading
from typing import Iterable

from sqlite_utils import Database


class CountQueries:
    """Mixed into :class:`~recovery_agent.store.Store`."""

    db: Database
    lock: threading.RLock

    def figures(self, finished: Iterable[str]) -> dict:
        """Counts for the metrics, read together holding the store lock:
        ``detections`` [(category, n)], ``recs`` [(action, status, n)],
        ``latencies`` [(detection latency, action latency)] of job
        recommendations, ``tracked`` (jobs in none of the ``finished`` states
        nor GONE), ``drained`` and ``excluded`` nodes, ``reports`` [(hook, n)]
        and ``replays`` (reports received over 5 s after they were made),
        ``xids`` [(kind, code, n)] (the XIDs and SXids of node reports) and
        ``blocked`` (recommendations blocked by the drain budget; the status is
        final from the start, so the count only grows)."""
        db = self.db
        states = ", ".join(f"'{s}'" for s in sorted(finished))
        with self.lock:
            return {
                "detections": list(db.execute(
                    "select category, count(*) from detections group by category")),
                "recs": list(db.execute("select action, status, count(*) from "
                                        "recommendations group by action, status")),
                "latencies": list(db.execute(
                    "select detected_at - failure_at, done_at - detected_at from "
                    "recommendations where scope = 'job' and detected_at is not null")),
                "tracked": db.execute(f"select count(*) from jobs where state not in "
                                      f"({states}, 'GONE')").fetchone()[0],
                "drained": db.execute("select count(*) from nodes where drained_by_us = 1"
                                      ).fetchone()[0],
                "excluded": db.execute("select count(*) from nodes where "
                                       "excluded_by_operator = 1").fetchone()[0],
                "reports": list(db.execute(
                    "select hook, count(*) from node_reports group by hook")),
                "replays": db.execute("select count(*) from node_reports where "
                                      "received - created > 5").fetchone()[0],
                "xids": list(db.execute(
                    "select kind, xid, count(*) from xids group by kind, xid")),
                "blocked": db.execute("select count(*) from recommendations where "
                                      "status = 'blocked_by_budget'").fetchone()[0],
            }
