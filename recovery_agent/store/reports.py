"""Queries on the node hooks' reports that the verdict's wait for node evidence
needs (the reports themselves are written by :mod:`recovery_agent.inputs.ingest`).

A report replayed from a node's spool is *late* (``node_reports.late``); one
stored after its attempt already had its verdict is ``after_verdict``, and its
fatal XIDs are counted against the node once (``counted_at``).
"""
from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from . import Store


def nodes_reporting(store: "Store", job_pk: int, attempt: int, hook: str) -> set[str]:
    """The nodes that sent a ``hook`` report for this attempt."""
    rows = store.db.execute(
        "select distinct node from node_reports where job = ? and attempt = ? and hook = ?",
        [job_pk, attempt, hook]).fetchall()
    return {r[0] for r in rows}


def has_verdict(store: "Store", job_pk: int, attempt: int) -> bool:
    return has_event(store, job_pk, attempt, "verdict")


def has_event(store: "Store", job_pk: int, attempt: int, kind: str) -> bool:
    return bool(store.db["events"].count_where(
        "job = ? and attempt = ? and kind = ?", [job_pk, attempt, kind]))


def uncounted_after_verdict(store: "Store", limit: int = 100) -> list[dict]:
    """Job reports stored after their attempt's verdict whose XIDs have not
    been counted yet, oldest first."""
    rows = store.db["node_reports"].rows_where(
        "after_verdict = 1 and counted_at is null",
        select="id, report_id, hook, node, job, attempt, created, received, spooled_at",
        order_by="id", limit=limit)
    return list(rows)


def report_xids(store: "Store", report_pk: int) -> list[dict]:
    return list(store.db["xids"].rows_where("report = ?", [report_pk], order_by="id"))


def attempt_start(store: "Store", job_pk: int, attempt: int) -> float | None:
    rows = store.db.execute("select start_time from attempts where job = ? and attempt = ?",
                            [job_pk, attempt]).fetchall()
    return float(rows[0][0]) if rows and rows[0][0] else None


def mark_counted(store: "Store", report_pk: int, when: float | None = None) -> None:
    store.db["node_reports"].update(report_pk, {"counted_at": when or time.time()})


def verdict_nodes(store: "Store", job_pk: int, attempt: int) -> set[str]:
    """The nodes this attempt's verdict blamed (none when it has none)."""
    nodes: set[str] = set()
    for row in store.db["events"].rows_where("job = ? and attempt = ? and kind = 'verdict'",
                                             [job_pk, attempt], select="data"):
        try:
            nodes.update(json.loads(row["data"] or "{}").get("nodes") or ())
        except (ValueError, TypeError, AttributeError):
            continue
    return nodes
