"""Queries on the node hooks' reports that the verdict's wait for node evidence
needs (the reports themselves are written by :mod:`recovery_agent.inputs.ingest`).

A report replayed from a node's spool is *late* (``node_reports.late``); one
stored after its attempt already had its verdict is ``after_verdict``, and its
fatal XIDs are counted against the node once (``counted_at``).

Runs: slurmctld may run an attempt again at the same restart count. A verdict
names its run by Slurm's start time (``data.run_start``; none on verdicts made
before runs were told apart, which count for every run of their attempt). A
report names its run by ``node_reports.run_start``: Slurm's start time where
the hook saw it, else the time that node's prolog noted. Node clocks and the
controller's differ a little, so a report belongs to the known run of its
attempt that started closest to its own ``run_start``.
"""
from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from . import Store


def nodes_reporting(store: "Store", job_pk: int, attempt: int, hook: str,
                    run: int | None = None, other_runs: Iterable[int] = ()) -> set[str]:
    """The nodes that sent a ``hook`` report for this attempt; with ``run`` and
    the attempt's ``other_runs`` (their start times), for that run only."""
    rows = store.db.execute(
        "select node, coalesce(run_start, created) from node_reports where job = ? and "
        "attempt = ? and hook = ?", [job_pk, attempt, hook]).fetchall()
    others = [r for r in other_runs if r != run]
    if run is None or not others:
        return {r[0] for r in rows}
    return {node for node, at in rows if at is None or closest_run(at, [run, *others]) == run}


def run_reports(store: "Store", job_pk: int, attempt: int, run: int | None,
                other_runs: Iterable[int] = ()) -> set[int] | None:
    """The row ids of the attempt's reports that belong to ``run`` when the
    attempt has ``other_runs``; None (no filter) when it has one run."""
    others = [r for r in other_runs if r != run]
    if run is None or not others:
        return None
    rows = store.db.execute(
        "select id, coalesce(run_start, created) from node_reports where job = ? and "
        "attempt = ?", [job_pk, attempt]).fetchall()
    return {pk for pk, at in rows if at is None or closest_run(at, [run, *others]) == run}


def closest_run(at: float, runs: Iterable[float]) -> float:
    """Of the runs' start times, the one closest to ``at`` (the later on a tie)."""
    return min(runs, key=lambda start: (abs(start - at), -start))


def verdict_runs(store: "Store", job_pk: int, attempt: int) -> list[int | None]:
    """The runs of this attempt that have their verdict, by Slurm start time
    (None for a verdict made before runs were told apart)."""
    rows = store.db.execute(
        "select json_extract(data, '$.run_start') from events where job = ? and "
        "attempt = ? and kind = 'verdict'", [job_pk, attempt]).fetchall()
    return [r[0] for r in rows]


def has_verdict(store: "Store", job_pk: int, attempt: int, run_start: int | None = None
                ) -> bool:
    """Whether this attempt has its verdict; with ``run_start``, the run of
    it that started then (a verdict without a run counts for every run)."""
    runs = verdict_runs(store, job_pk, attempt)
    if run_start is None:
        return bool(runs)
    return any(r is None or r == run_start for r in runs)


def report_judged(store: "Store", job_pk: int, attempt: int, report_run: float | None) -> bool:
    """Whether the run a report belongs to has its verdict already. While one
    run of the attempt is known, any verdict of the attempt is that run's; once
    the attempt shows a newer run than those judged, the report belongs to the
    run that started closest to its own ``run_start``."""
    runs = verdict_runs(store, job_pk, attempt)
    if not runs:
        return False
    if report_run is None or None in runs:
        return True
    latest = attempt_start(store, job_pk, attempt)
    if latest is None or int(latest) in runs:
        return True
    return closest_run(report_run, [*runs, int(latest)]) in runs


def has_event(store: "Store", job_pk: int, attempt: int, kind: str) -> bool:
    return bool(store.db["events"].count_where(
        "job = ? and attempt = ? and kind = ?", [job_pk, attempt, kind]))


def uncounted_after_verdict(store: "Store", limit: int = 100) -> list[dict]:
    """Job reports stored after their attempt's verdict whose XIDs have not
    been counted yet, oldest first."""
    rows = store.db["node_reports"].rows_where(
        "after_verdict = 1 and counted_at is null",
        select="id, report_id, hook, node, job, attempt, created, received, spooled_at, "
               "run_start",
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
