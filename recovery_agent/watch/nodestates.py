"""Node states as the watch loop sees them, kept as a history of changes.

Every ``agent.node_poll_interval`` the loop lists the nodes and records each
node whose availability changed since its last recorded state: down or up,
drained or not, the drain's reason, the user who set it and its time, and
whether that drain was ours then (the store's record of our drain matched
it, :func:`~recovery_agent.decide.policy.our_drain`). Allocation (idle, mixed,
allocated) is not availability and is left out, so a busy cluster does not
write a row per job. ``recovery-ctl report`` scores monitor mode against this
history (:mod:`recovery_agent.interfaces.report`), so a human drain lifted
before the report ran still counts.

A listing that fails, or that names no node, records nothing: a node missing
from it has not changed, it is only not seen.
"""
from __future__ import annotations

import logging
from typing import Iterable, Mapping

from ..decide.policy import our_drain
from ..errors import SchedulerError
from ..scheduler.base import UNAVAILABLE_NODE_FLAGS, Node

log = logging.getLogger("recovery_agent.watch")
# base states a node takes while it runs work: all of them are "up"
_RUNNING = frozenset({"IDLE", "MIXED", "ALLOCATED", "ALLOC", "MIX", "COMPLETING", "PLANNED"})
# a drain, whether its jobs are still running on it (DRAINING) or not (DRAINED)
_DRAIN = frozenset({"DRAIN", "DRAINING", "DRAINED"})
def availability(node: Node) -> str:
    """A node's state as availability: ``UP`` for any state that runs work,
    else Slurm's base state, then the flags that keep work off it (every
    drain flag read as ``DRAIN``), e.g. ``UP+DRAIN``, ``DOWN+NOT_RESPONDING``."""
    base = "UP" if node.state.upper() in _RUNNING else node.state.upper()
    flags = {("DRAIN" if f in _DRAIN else f) for f in node.flags if f in UNAVAILABLE_NODE_FLAGS}
    return "+".join([base, *sorted(flags - {base})])


def seen(node: Node, ours: bool) -> dict:
    """The state of ``node`` as a history row would hold it."""
    drained = node.drained
    return {"node": node.name, "state": availability(node), "drained": drained,
            "reason": node.reason or None, "reason_user": node.reason_user or None,
            "reason_time": node.reason_time, "ours": bool(ours and drained)}


def _compared(row: Mapping) -> tuple:
    """What tells two states of a node apart (a stored flag is 0/1)."""
    return (row.get("state"), bool(row.get("drained")), row.get("reason") or None,
            row.get("reason_user") or None, row.get("reason_time"), bool(row.get("ours")))


def changed(last: Mapping[str, Mapping], now: Iterable[Mapping]) -> list[dict]:
    """The states of ``now`` that differ from the last recorded one of
    their node (``last``, by name), or whose node has none yet."""
    return [dict(row) for row in now
            if row["node"] not in last or _compared(last[row["node"]]) != _compared(row)]


class NodeStates:
    """The loop's part that records node state changes (a helper object:
    the store, the scheduler and the clock are the loop's)."""

    def __init__(self, cfg, store, scheduler) -> None:
        self.cfg, self.store, self.scheduler = cfg, store, scheduler
        self._last: dict[str, Mapping] | None = None   # read from the store when first needed
        self._polled = float("-inf")
        self.listing: tuple[float, list[Node]] | None = None   # the last one, with its time

    def poll(self, now: float) -> int:
        """List the nodes when due and record those that changed; how many.
        Store errors are raised (the loop reports them); a listing that
        fails is logged and waits for the next turn."""
        every = self.cfg.agent.node_poll_interval
        if every <= 0 or now - self._polled < every:
            return 0
        self._polled = now
        try:
            nodes = self.scheduler.list_nodes()
        except SchedulerError as exc:
            log.warning("cannot list nodes to record their states: %s", exc)
            return 0
        if not nodes:
            return 0
        self.listing = (now, nodes)
        cluster = self.cfg.agent.cluster
        if self._last is None:
            self._last = self.store.latest_node_states(cluster)
        ours = {row["name"]: row for row in self.store.nodes()}
        rows = changed(self._last, (seen(n, our_drain(ours.get(n.name), n)) for n in nodes))
        if rows:
            with self.store.transaction():
                self.store.add_node_states(cluster, rows, ts=now)
            for row in rows:
                self._last[row["node"]] = row
        return len(rows)
