"""The store's nodes: the strikes blamed on them, their rows (our drains, the
operator's exclusions), and the node hooks' reports with their XIDs
(:class:`NodeQueries`, mixed into the store); the verdict's wait for node
evidence has its own queries in :mod:`.reports`."""
from __future__ import annotations

import json
import time
from typing import Any, Mapping

from sqlite_utils import Database

from .recs import decode_rec
from .records import Recommendation


class NodeQueries:
    """Mixed into :class:`~recovery_agent.store.Store`."""

    db: Database

    # -- nodes: strikes, our drains --------------------------------------
    def add_strike(self, node: str, category: str, weight: float, job_pk: int | None = None,
                   user: str = "", rec: int | None = None, ts: float | None = None,
                   witnessed: bool = False) -> None:
        """One failure blamed on ``node``; ``witnessed`` when evidence the job
        did not write itself speaks against the node."""
        self.db["strikes"].insert({"node": node, "ts": ts or time.time(), "job": job_pk,
                                   "user": user, "category": category, "weight": weight,
                                   "rec": rec, "witnessed": int(witnessed)})

    def strikes(self, node: str | None = None, since: float = 0.0) -> list[dict]:
        if node is None:
            return list(self.db["strikes"].rows_where("ts >= ?", [since], order_by="ts"))
        return list(self.db["strikes"].rows_where("node = ? and ts >= ?", [node, since],
                                                  order_by="ts"))

    def node(self, name: str) -> dict | None:
        rows = list(self.db["nodes"].rows_where("name = ?", [name], limit=1))
        return rows[0] if rows else None

    def set_node(self, name: str, **values: Any) -> None:
        self.db["nodes"].upsert({"name": name, **values, "updated": time.time()}, pk="name")

    def last_exclusion(self, name: str) -> dict | None:
        """The data of the latest operator exclusion of ``name`` (the API's
        ``api_exclude`` timeline line: uid, user, reason), or None."""
        rows = list(self.db["events"].rows_where(
            "job is null and kind = 'api_exclude' and json_valid(data) "
            "and json_extract(data, '$.node') = ?",
            [name], select="data", order_by="id desc", limit=1))
        return json.loads(rows[0]["data"]) if rows else None

    # -- nodes -----------------------------------------------------------------
    def nodes(self) -> list[dict]:
        """Every node the store knows, by name."""
        return list(self.db["nodes"].rows_where(order_by="name"))

    def drained_nodes(self) -> list[dict]:
        """The nodes the agent drained (``drained_by_us``), in the table's order."""
        return list(self.db["nodes"].rows_where("drained_by_us = 1"))

    def held_back_nodes(self) -> list[dict]:
        """The nodes the agent drained or an operator excluded from retries, in
        the table's order."""
        return list(self.db["nodes"].rows_where(
            "drained_by_us = 1 or excluded_by_operator = 1"))

    # -- the hooks' reports and their XIDs --------------------------------------
    def report_by_id(self, report_id: str) -> dict | None:
        """The stored report with the hook's own ``report_id``, if any."""
        rows = list(self.db["node_reports"].rows_where("report_id = ?", [report_id], limit=1))
        return rows[0] if rows else None

    def add_report(self, row: Mapping[str, Any]) -> int:
        """Insert one node report row; return its row id. The caller holds the
        lock and a transaction with its XIDs."""
        return self.db["node_reports"].insert(dict(row)).last_pk

    def add_xid(self, row: Mapping[str, Any]) -> None:
        """Insert one XID of a report; one already stored (same unique key) is
        left as it is."""
        self.db["xids"].insert(dict(row), ignore=True)

    def node_report(self, pk: int) -> dict:
        """One report row by row id (sqlite-utils' NotFoundError when none)."""
        return self.db["node_reports"].get(pk)

    def reports_since(self, node: str, since: float) -> list[dict]:
        """A node's reports received at or after ``since``, oldest first."""
        return list(self.db["node_reports"].rows_where(
            "node = ? and received >= ?", [node, since], order_by="received"))

    def node_xids_since(self, node: str, since: float) -> dict[int, list[dict]]:
        """The XIDs of a node's reports received at or after ``since``, by
        report id (``xid``, ``kind``, ``pci``)."""
        out: dict[int, list[dict]] = {}
        for row in self.db.query(
                "select x.report, x.xid, x.kind, x.pci from xids x join node_reports r "
                "on r.id = x.report where r.node = ? and r.received >= ? order by x.id",
                [node, since]):
            out.setdefault(row["report"], []).append(
                {"xid": row["xid"], "kind": row["kind"], "pci": row["pci"]})
        return out

    def report_xid_count(self, report_pk: int) -> int:
        """How many XIDs a report carries."""
        return self.db["xids"].count_where("report = ?", [report_pk])

    def job_xids(self, job_pk: int) -> list[dict]:
        """Every XID the hooks reported for a job, by id."""
        return list(self.db["xids"].rows_where("job = ?", [job_pk], order_by="id"))

    def attempt_xids(self, job_pk: int, attempt: int) -> list[dict]:
        """The XIDs the hooks reported for one attempt, in the table's order."""
        return list(self.db["xids"].rows_where("job = ? and attempt = ?", [job_pk, attempt]))

    # -- the degradation score's changes (docs/proactive.md) --------------------
    def add_degradation(self, cluster: str, record: Mapping[str, Any],
                        report_pk: int | None = None) -> int:
        """One change of a GPU's degradation score, as
        :func:`~recovery_agent.detect.degradation.score_change` gave it."""
        return self.db["node_degradation"].insert({
            "ts": record.get("time"), "recorded": time.time(), "cluster": cluster,
            "node": record["node"], "gpu": record["gpu"], "score": record["score"],
            "level": record["level"], "previous_score": record.get("previous_score"),
            "previous_level": record.get("previous_level"),
            "rules": json.dumps([r["rule"] for r in record.get("rules") or ()]),
            "evidence": json.dumps(record, sort_keys=True, default=str), "report": report_pk,
        }).last_pk

    def last_degradation(self, node: str, gpu: str) -> dict | None:
        """The newest degradation record of one GPU (None: never scored above 0)."""
        rows = list(self.db["node_degradation"].rows_where(
            "node = ? and gpu = ?", [node, gpu], order_by="id desc", limit=1))
        return json.loads(rows[0]["evidence"]) if rows else None

    def degradation_after(self, pk: int, limit: int = 500) -> list[dict]:
        """Degradation records stored after the record ``pk`` (id, node, level,
        previous_level), oldest first: what the move planner has not seen."""
        return list(self.db["node_degradation"].rows_where(
            "id > ?", [pk], select="id, node, level, previous_level", order_by="id",
            limit=limit))

    def node_degradation(self, node: str, limit: int = 200) -> list[dict]:
        """A node's degradation records (every GPU), newest first, each the
        evidence record with the row's ``id`` and ``report``."""
        rows = self.db["node_degradation"].rows_where("node = ?", [node], order_by="id desc",
                                                      limit=limit)
        return [{**json.loads(r["evidence"]), "id": r["id"], "report": r["report"]}
                for r in rows]

    def degradation_now(self, node: str | None = None) -> dict[str, dict[str, dict]]:
        """{node: {gpu: its newest degradation record}}, for every node (or
        one), GPUs whose newest record is back at ``ok`` included: the index
        on (node, gpu, id) answers one max(id) per GPU."""
        where, args = ("where node = ?", [node]) if node is not None else ("", [])
        out: dict[str, dict[str, dict]] = {}
        for row in self.db.query(
                "select d.node, d.gpu, d.evidence from node_degradation d join "
                f"(select max(id) as id from node_degradation {where} group by node, gpu) "
                "newest on newest.id = d.id order by d.node, d.gpu", args):
            out.setdefault(row["node"], {})[row["gpu"]] = json.loads(row["evidence"])
        return out

    # -- what a node's page shows ------------------------------------------------
    def node_xids(self, node: str, limit: int = 200) -> list[dict]:
        """The XIDs the hooks reported on ``node``, newest first, each with the
        hook and time of its report and the job (``job_id``, ``user``) it ran
        under, if any."""
        return list(self.db.query(
            "select x.*, r.hook, r.received, j.job_id, j.user from xids x "
            "left join node_reports r on r.id = x.report left join jobs j on j.id = x.job "
            "where x.node = ? order by x.id desc limit ?", [node, limit]))

    def node_drains(self, node: str, limit: int = 200) -> list[Recommendation]:
        """The node recommendations (drains, resumes) naming ``node``, newest
        first."""
        return [decode_rec(r) for r in self.db.query(
            "select * from recommendations where scope = 'node' and exists "
            "(select 1 from json_each(target_nodes) t where t.value = ?) "
            "order by id desc limit ?", [node, limit])]

    def node_operator_events(self, node: str, limit: int = 200) -> list[dict]:
        """Operators' exclusions and inclusions of ``node`` (the API's audit
        events, with who and why in their data), newest first."""
        rows = list(self.db.query(
            "select * from events where kind in ('api_exclude', 'api_include') "
            "and json_extract(data, '$.node') = ? order by id desc limit ?", [node, limit]))
        for row in rows:
            row["data"] = json.loads(row["data"]) if row["data"] else None
        return rows

    def node_jobs(self, cluster: str, node: str, limit: int = 200) -> list[dict]:
        """The attempts that ran on ``node`` (one of their nodes), newest first:
        the job's row id, ``job_id``, ``name``, ``user`` and ``state``, with the
        attempt's number, state and times."""
        return list(self.db.query(
            "select j.id as job, j.job_id, j.name, j.user, j.state, a.attempt, "
            "a.state as attempt_state, a.start_time, a.end_time from attempts a "
            "join jobs j on j.id = a.job where j.cluster = ? and exists "
            "(select 1 from json_each(a.nodes) n where n.value = ?) "
            "order by a.id desc limit ?", [cluster, node, limit]))
