"""The audit unit as a type: a :class:`Recommendation` and its :class:`Status`.

A recommendation is stored before anything acts on it and then moves through
its lifecycle (DESIGN.md)::

    proposed -> executing -> done | failed | expired | released_by_watchdog
                                   | cancelled  (| proposed again: a claim ran out)

``would_have`` (monitor mode) and ``blocked_by_budget`` are final from the start.
A record is frozen: each move is a method that returns the new record, or
raises :class:`IllegalMove` for a move the lifecycle does not have. The store
(and only the store) turns rows into records and back (its JSON columns).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from enum import Enum
from typing import Any, Mapping


class Status(str, Enum):
    """A recommendation's status; a ``str``, so ``status == "done"`` holds and
    it formats (and is stored) as its value."""

    PROPOSED = "proposed"
    EXECUTING = "executing"
    DONE = "done"
    FAILED = "failed"
    EXPIRED = "expired"
    WOULD_HAVE = "would_have"
    BLOCKED_BY_BUDGET = "blocked_by_budget"
    RELEASED_BY_WATCHDOG = "released_by_watchdog"
    CANCELLED = "cancelled"

    __str__ = str.__str__
    __format__ = str.__format__

    @property
    def is_open(self) -> bool:
        """Still to be acted on (or being acted on)."""
        return self in OPEN_STATUSES

    @property
    def is_final(self) -> bool:
        """Ended: nothing moves it again."""
        return self in FINAL_STATUSES


# the one definition of open and final (in the order the API lists them)
OPEN_STATUSES: tuple[Status, ...] = (Status.PROPOSED, Status.EXECUTING)
FINAL_STATUSES: tuple[Status, ...] = tuple(s for s in Status if s not in OPEN_STATUSES)

# the moves that happen: the actuator's and the Advisor API's (the ends an open
# one can reach whether or not it began; only one that began is ever done)
_ENDED_EARLY = (Status.FAILED, Status.EXPIRED, Status.RELEASED_BY_WATCHDOG, Status.CANCELLED)
MOVES: dict[Status, frozenset[Status]] = {
    # claimed (actuator, ack); ended before any step (no node, job gone, stale,
    # watchdog, cancel)
    Status.PROPOSED: frozenset((Status.EXECUTING, *_ENDED_EARLY)),
    # finished; an external claim that ran out is offered again
    Status.EXECUTING: frozenset((Status.DONE, *_ENDED_EARLY, Status.PROPOSED)),
}

JSON_LISTS = ("target_nodes", "pattern_ids", "exclude")   # stored as JSON lists
JSON_OBJECTS = ("evidence", "attribution")                # JSON, {} when empty
JSON_COLUMNS = ("target_nodes", "evidence", "attribution", "pattern_ids", "exclude")


class IllegalMove(ValueError):
    """A status change the lifecycle does not have."""


@dataclass(frozen=True)
class Recommendation:
    """One row of ``recommendations``, its fields in the table's column order
    (so :meth:`to_dict` is the API's JSON, key for key)."""

    id: int
    job: int | None
    attempt: int | None
    action: str
    target_nodes: tuple[str, ...]
    reason_category: str | None
    evidence: Any                  # decoded JSON: the verdict's evidence list, or {}
    mode: str
    status: Status
    created: float
    updated: float | None
    error: str | None
    actor: str | None
    job_id: str | None
    cluster: str | None
    env: str | None
    scope: str | None              # "job" or "node"
    rule: str | None
    reason: str | None
    trigger: str | None
    attribution: dict
    pattern_ids: tuple[str, ...]
    exclude: tuple[str, ...]
    restart_at: int | None
    submit_time: int | None
    parent: int | None
    tries: int | None
    next_try: float | None
    held_at: float | None
    failure_at: float | None
    detected_at: float | None
    done_at: float | None
    running_again_at: float | None
    workload: str | None
    user: str | None
    claimed_by: str | None
    claim_expires: float | None
    run_start: int | None = None   # Slurm's start time of the run it decides

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Recommendation:
        """A record from a row whose JSON columns are decoded already (the
        store's business)."""
        values = {f.name: row.get(f.name) for f in fields(cls)}
        for key in JSON_LISTS:
            values[key] = tuple(values[key] or ())
        for key in JSON_OBJECTS:
            if values[key] is None:
                values[key] = {}
        values["status"] = Status(values["status"])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The row as the API shows it: plain strings, lists, column order."""
        out = asdict(self)
        out["status"] = self.status.value
        for key in JSON_LISTS:
            out[key] = list(out[key])
        return out

    # -- the lifecycle ---------------------------------------------------------
    def _move(self, status: Status, **values: Any) -> Recommendation:
        status = Status(status)
        if status not in MOVES.get(self.status, ()):
            raise IllegalMove(f"recommendation {self.id} cannot go from {self.status} "
                              f"to {status}")
        return replace(self, status=status, **values)

    def executing(self, claimed_by: str | None = None,
                  claim_expires: float | None = None) -> Recommendation:
        """proposed -> executing: the actuator begins, or a site controller
        claims it (``claimed_by`` until ``claim_expires``)."""
        if claimed_by is None:
            return self._move(Status.EXECUTING)
        return self._move(Status.EXECUTING, claimed_by=claimed_by, claim_expires=claim_expires)

    def finished(self, status: Status, error: str | None = None,
                 done_at: float | None = None, **values: Any) -> Recommendation:
        """An open one ends: ``done`` only once executing; ``failed``,
        ``expired``, ``released_by_watchdog`` or ``cancelled`` from either open
        status. ``values``: other columns that change with it (``next_try``,
        ``held_at``)."""
        if not Status(status).is_final:
            raise IllegalMove(f"recommendation {self.id}: {status} is not a final status")
        return self._move(status, error=error, done_at=done_at, **values)

    def claim_expired(self) -> Recommendation:
        """executing -> proposed: an external claim ran out; offered again."""
        return self._move(Status.PROPOSED, claimed_by=None, claim_expires=None)

    def retrying(self, tries: int, next_try: float | None = None) -> Recommendation:
        """A failed try of an open one: counted, and when to try next."""
        self._must_be_open("count a try")
        return replace(self, tries=tries, next_try=next_try)

    def held(self, at: float) -> Recommendation:
        """Our requeue-hold holds its job since ``at``."""
        self._must_be_open("hold its job")
        return replace(self, held_at=at)

    def hold_lifted(self) -> Recommendation:
        """The job it held is released (any status: a release can come late)."""
        return replace(self, held_at=None)

    def _must_be_open(self, what: str) -> None:
        if not self.status.is_open:
            raise IllegalMove(f"recommendation {self.id} is {self.status}: cannot {what}")
