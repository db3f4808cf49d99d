"""The store's record of operators' changes (``recovery-ctl mode``, ``exclude``,
``include``, ``ack``, ``complete``, ``cancel`` and their API calls), one row
each, and the node states the watch loop saw (:class:`OperatorQueries`,
mixed into the store). What a row means, and who may read it, is decided
outside: :mod:`recovery_agent.interfaces.service`, :mod:`recovery_agent.watch.nodestates`."""
from __future__ import annotations

import json
import time
from typing import Any, Iterable, Mapping

from sqlite_utils import Database

from .timeline import _dumps

OPERATOR_COLUMNS = ("ts", "action", "actor", "actor_uid", "role", "via", "target", "env",
                    "node", "rec", "job", "job_id", "job_user", "before", "after", "reason")
NODE_STATE_COLUMNS = ("node", "state", "drained", "reason", "reason_user", "reason_time",
                      "ours")


def _decoded(row: dict) -> dict:
    row["data"] = json.loads(row["data"]) if row.get("data") else {}
    return row


class OperatorQueries:
    """Mixed into :class:`~recovery_agent.store.Store`."""

    db: Database

    # -- operators' changes ------------------------------------------------------
    def add_operator_action(self, row: Mapping[str, Any], data: Any = None) -> int:
        """One operator change (columns of :data:`OPERATOR_COLUMNS`; ``data``:
        whatever else the verb carries, kept as JSON). Call it inside the
        transaction that makes the change, so the record and the change are
        one."""
        values = {key: row.get(key) for key in OPERATOR_COLUMNS}
        values["ts"] = values["ts"] or time.time()
        values["data"] = _dumps(data) if data else None
        return self.db["operator_actions"].insert(values).last_pk

    def operator_actions(self, since: float | None = None, until: float | None = None,
                         job_pk: int | None = None, limit: int | None = None) -> list[dict]:
        """Operator changes in time order, within ``since``..``until`` (either
        open), only those about the job ``job_pk`` when given; the newest
        ``limit`` of them when given."""
        where, args = ["1 = 1"], []
        if since is not None:
            where.append("ts >= ?")
            args.append(since)
        if until is not None:
            where.append("ts <= ?")
            args.append(until)
        if job_pk is not None:
            where.append("job = ?")
            args.append(job_pk)
        sql = (f"select * from operator_actions where {' and '.join(where)} "
               "order by ts desc, id desc")
        if limit is not None:
            sql += " limit ?"
            args.append(limit)
        return [_decoded(dict(r)) for r in self.db.query(sql, args)][::-1]

    def last_operator_action(self, actions: Iterable[str], target: str) -> dict | None:
        """The newest change by one of ``actions`` of ``target`` (an
        environment, a node, ``#12``), or None."""
        names = list(actions)
        marks = ",".join("?" * len(names))
        rows = list(self.db.query(
            f"select * from operator_actions where action in ({marks}) and target = ? "
            "order by id desc limit 1", [*names, target]))
        return _decoded(dict(rows[0])) if rows else None

    # -- node states as the watch loop saw them ------------------------------------
    def add_node_states(self, cluster: str, rows: Iterable[Mapping[str, Any]],
                        ts: float | None = None) -> int:
        """Append node states (columns of :data:`NODE_STATE_COLUMNS`), seen at
        ``ts``; how many."""
        now = ts or time.time()
        values = [{"ts": now, "cluster": cluster,
                   **{key: row.get(key) for key in NODE_STATE_COLUMNS}} for row in rows]
        for value in values:
            value["drained"] = int(bool(value["drained"]))
            value["ours"] = int(bool(value["ours"]))
        if values:
            self.db["node_states"].insert_all(values)
        return len(values)

    def latest_node_states(self, cluster: str) -> dict[str, dict]:
        """Each node's newest recorded state, by name."""
        return {r["node"]: dict(r) for r in self.db.query(
            "select s.* from node_states s join (select node, max(id) as id from node_states "
            "where cluster = ? group by node) last on last.id = s.id", [cluster])}

    def drain_states(self, cluster: str | None, since: float, until: float) -> list[dict]:
        """The recorded states that showed a node drained by a drain set
        within ``since``..``until`` (Slurm's reason time), oldest first, of
        ``cluster`` (None: any): each drain once per change seen of it."""
        where = "drained = 1 and reason_time between ? and ?"
        args: list = [since, until]
        if cluster is not None:
            where += " and cluster = ?"
            args.append(cluster)
        return [dict(r) for r in self.db.query(
            f"select * from node_states where {where} order by id", args)]
